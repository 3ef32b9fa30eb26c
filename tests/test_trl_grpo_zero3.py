"""TRL's ``GRPOTrainer`` under DeepSpeed ZeRO-3 (``--loop trl-grpo --strategy zero3``).

Each step generates through TRL's ``unwrap_model_for_generation``: with ``ds3_gather_for_generation``
(its default) ``GatheredParameters(model.parameters())`` gathers every parameter of the policy for
the whole ``generate()`` with DeepSpeed's module hooks taken off, and ``add_hooks`` invalidates the
coordinator's trace after it; without it ``generate()`` runs on DeepSpeed's per-module gathers. Then
the reference engine scores (``beta != 0``) and the policy's engine trains. Checked against real
DeepSpeed 0.19.8 on the CPU running TRL's own generation context, models and reference engine
(tests/deepspeed_reference/zero3_grpo_reference.py, recorded in tests/data/deepspeed_zero3_grpo.json):
which parameters of the policy and of the reference are gathered at every module's hooks (the
generation's forwards too), after generation, after backward and after each step, with the old
policy's scoring and with LoRA too; and by hand-worked bytes: the whole policy gathered during
generation. The one setting real DeepSpeed fails on is refused, naming its error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from trl_llama import CONFIG, HIDDEN, LAYERS, VOCAB, P
from zero3_probe import KEYS, PLAIN, hook_gathers, record_steps, write_hf_config

import memcalc
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero import ZeroProgram
from memcalc.stacks.trl.grpo import GrpoStepModule

pytest.importorskip("transformers")
pytest.importorskip("trl")

RECORDED = json.loads((Path(__file__).parent / "data" / "deepspeed_zero3_grpo.json").read_text())



def _estimate(model: str, stage3: ZeroStage3 = PLAIN, *, gather: bool = True, beta: float = 0.0, batch: int = 4,
              generations: int = 2, prompt: int = 8, completion: int = 3, per_generation: int = 1,
              lora: int | None = None) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": batch, "num_generations": generations, "max_completion_length": completion,
            "beta": beta, "ds3_gather_for_generation": gather, "steps_per_generation": per_generation, "bf16": False,
            "gradient_checkpointing": False}
    return memcalc.estimate(model, loop="trl-grpo", trainer_args=args, seq_len=prompt, gpu="cpu",
                            finetune=memcalc.FineTune(lora=memcalc.LoRA(lora)) if lora else memcalc.FineTune(),
                            distributed=memcalc.Distributed("zero3", world_size=2, reduce_bucket_size=1000,
                                                            stage3=stage3))


def _events(monkeypatch: pytest.MonkeyPatch, model: str, stage3: ZeroStage3,
            recorded: dict[str, Any]) -> list[list[str]]:
    """memcalc's two steps of GRPO, with the gathered parameters of each engine (the policy's, and the
    reference's when ``beta != 0`` without LoRA) read where the real run read them."""
    gather, beta, lora = recorded["ds3_gather_for_generation"], recorded["beta"], recorded.get("lora")
    keys = ("policy", "reference") if beta and not lora else ("policy",)
    events: list[list[str]] = []
    install = ZeroProgram.install

    def probe(self: ZeroProgram, tracer: Any, module: nn.Module) -> None:
        assert isinstance(module, GrpoStepModule)
        _coordinators, gathered = hook_gathers(self, tracer, module, keys, events, install)
        generating = module._generating

        def generating_then_record() -> Any:
            from contextlib import contextmanager

            @contextmanager
            def context() -> Any:
                with generating():
                    yield
                events.append([f"generated {sum(e[0].startswith('step') for e in events)}", gathered()])
            return context()

        module._generating = generating_then_record  # type: ignore[method-assign]
        record_steps(self, events, gathered, lambda: f"backward {sum(e[0].startswith('step') for e in events)}")

    monkeypatch.setattr(ZeroProgram, "install", probe)
    _estimate(model, stage3, gather=gather, beta=beta, batch=RECORDED["batch"],
              generations=RECORDED["num_generations"], prompt=RECORDED["prompt"], completion=RECORDED["completion"],
              per_generation=recorded.get("steps_per_generation", 1), lora=lora)
    return events


# quick: generation gathering the whole policy with prefetch, persistence, the reference engine and
# two steps per generation; per-module gathers with LoRA; the refused setting. The full suite runs all.
@pytest.mark.quick_cases("gather-old-logps-beta", "lora-layerwise-no-prefetch-beta", "layerwise-prefetch-beta")
@pytest.mark.parametrize("case", sorted(RECORDED["cases"]))
def test_gathers_are_deepspeeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str) -> None:
    """Real DeepSpeed's engines under TRL's generation context (both ``ds3_gather_for_generation``
    values), TRL's fused head and ``prepare_deepspeed``: memcalc gathers what they gather at every
    module's hooks, in every forward of generate() too, after generation, backward and each step."""
    recorded = RECORDED["cases"][case]
    settings = ZeroStage3(**{KEYS[k]: v for k, v in recorded["settings"].items()})
    real = recorded["events"]
    model, gather = write_hf_config(tmp_path, RECORDED["config"]), recorded["ds3_gather_for_generation"]
    if "error" in recorded:  # the real run failed: memcalc refuses the setting, naming DeepSpeed's error
        assert not gather and settings.prefetch_bucket_size > 0
        assert [e for e, _ in real if not e.startswith(("pre", "post"))] == ["generated 0"]  # in the first forward
        with pytest.raises(InapplicableOptionError, match=recorded["error"]):
            _estimate(model, settings, gather=gather, beta=recorded["beta"])
        return
    if recorded.get("steps_per_generation", 1) == 1:
        per_step = len(real) // 3
        # DeepSpeed's third step repeats its second (two traced steps are the whole story), but for the
        # reference engine's persistent parameters: whole from its trace's completion on, never released
        persistent = int(real[-1][1].split()[1], 16) if len(real[-1][1].split()) > 1 else 0
        assert [[e.replace(" 1", " 2"), " ".join([*g.split()[:1], *(hex(int(r, 16) | persistent)
                                                                      for r in g.split()[1:])])]
                for e, g in real[per_step:2 * per_step]] == real[2 * per_step:]
    events = _events(monkeypatch, model, settings, recorded)
    assert events[-1][0] == "step 1" and events == real[:len(events)]


def test_generation_gathers_the_whole_policy(tmp_path: Path) -> None:
    """``ds3_gather_for_generation`` (the default), no persistence, no prefetch: in each traced step the
    generation first all-gathers every one of the policy's 21 parameters into its own buffer, P bytes in
    all (fp32; the tiny Llama's P = 9,570,816 B, every count even: no padding over 2 ranks), frees none
    of them while generate() runs (DeepSpeed's module hooks are off), and partitions all 21 at the end.
    Without it, generate() gathers module by module: never more than the embedding and the LM head
    (2·V·H·4 B), the head kept by the root as the real run keeps it."""
    def generation(gather: bool) -> list[list[int]]:
        t = _estimate(write_hf_config(tmp_path, CONFIG), gather=gather).timeline()
        steps: list[list[int]] = []
        previous = None
        for i in range(1, t.num_events):
            inside = t.phase[i] in (Phase.PREFILL, Phase.DECODE)
            if inside and previous is not True:
                steps.append([])
            previous = inside
            if inside and t.category[i] is Category.PARAMETERS and t.allocated[i] != t.allocated[i - 1]:
                steps[-1].append(int(t.allocated[i] - t.allocated[i - 1]))
        return [deltas for deltas in steps if deltas]

    params = 2 + LAYERS * 9 + 1  # embedding and head; q, k, v, o, gate, up, down and two norms a layer; the norm
    whole = generation(True)
    assert len(whole) == 2
    for deltas in whole:
        assert len(deltas) == 2 * params and all(d > 0 for d in deltas[:params]) and all(d < 0 for d in deltas[params:])
        assert sum(deltas[:params]) == -sum(deltas[params:]) == P == 9_570_816
    for deltas in generation(False):
        live = [sum(deltas[:i + 1]) for i in range(len(deltas))]
        assert max(live) <= 2 * 4 * VOCAB * HIDDEN < P


def test_recorded_cases_differ() -> None:
    runs = {json.dumps(case["events"]) for case in RECORDED["cases"].values()}
    assert len(runs) == len(RECORDED["cases"]) and RECORDED["world_size"] == 2
