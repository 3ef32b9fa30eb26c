"""TRL's trainers under DeepSpeed ZeRO-3 (``--loop trl-sft|trl-dpo|trl-reward --strategy zero3``).

The policy is the trainer's engine; DPO's frozen reference is a second engine that TRL builds itself
(``prepare_deepspeed``: the same stage-3 config, no optimizer, eval mode) with a coordinator of its
own; TRL's fused LM head reads ``lm_head.weight`` without calling the module and gathers it with
``GatheredParameters`` around the chunked log-prob forward and again in its backward
(``maybe_gather_lm_head_ctx``). Checked here by hand-worked bytes on a small Llama over 2 ranks, and
against real DeepSpeed 0.19.8 running TRL's own models on the CPU
(tests/deepspeed_reference/zero3_dpo_reference.py, recorded in tests/data/deepspeed_zero3_dpo.json):
which parameters of the policy and of the reference are gathered at every module's hooks, after
backward and after each step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from trl_llama import CONFIG, HIDDEN, LAYER, LAYERS, VOCAB, P
from zero3_probe import KEYS, PLAIN, hook_gathers, record_steps, write_hf_config

import memcalc
from memcalc.core.categories import Category, Phase
from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero import ZeroProgram

pytest.importorskip("transformers")
pytest.importorskip("trl")

RECORDED = json.loads((Path(__file__).parent / "data" / "deepspeed_zero3_dpo.json").read_text())

HEAD = 4 * VOCAB * HIDDEN  # the LM head's (and the embedding's) fp32 bytes: 4 MiB
SEQ = 64



def _estimate(model: str, loop: str, stage3: ZeroStage3 = PLAIN, batch: int = 2, seq_len: int = SEQ,
              finetune: memcalc.FineTune | None = None, **config: Any) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": batch, "bf16": False, "gradient_checkpointing": False, **config}
    return memcalc.estimate(model, loop=loop, trainer_args=args, seq_len=seq_len, gpu="cpu",
                            finetune=finetune or memcalc.FineTune(),
                            distributed=memcalc.Distributed("zero3", world_size=2, reduce_bucket_size=10**6,
                                                            stage3=stage3))


def _head_sized(report: memcalc.MemoryReport) -> list[tuple[Phase, str, int]]:
    """The gathers and releases of V·H-element parameters (the embeddings and LM heads), in order."""
    t = report.timeline()
    return [(t.phase[i], t.module[i].split(".")[0], int(t.allocated[i] - t.allocated[i - 1]))
            for i in range(1, t.num_events)
            if t.category[i] is Category.PARAMETERS and abs(int(t.allocated[i] - t.allocated[i - 1])) == HEAD]


def test_sft_holds_the_head_with_the_model(tmp_path: Path) -> None:
    """With no prefetch, the V·H-element gathers (4 MiB each) of SFT's two traced steps. The first
    forward gathers the embedding in its module (+, −) and the LM head when TRL's fused head reads it
    (+: DeepSpeed's external-parameter discovery registers it with the model's root module), released
    with the root at the end of the forward (−). The backward fetches the root first (the head, +),
    then the embedding (+, −), and releases the root last (−). The second forward fetches the root, the
    head with it, first: the head is whole through the whole forward and the whole backward."""
    assert HEAD == 4_194_304 and HEAD % 512 == 0
    report = _estimate(write_hf_config(tmp_path, CONFIG), "trl-sft")
    F, B = Phase.FORWARD, Phase.BACKWARD
    backward = [(B, HEAD), (B, HEAD), (B, -HEAD), (B, -HEAD)]
    first = [(F, HEAD), (F, -HEAD), (F, HEAD), (F, -HEAD), *backward]
    second = [(F, HEAD), (F, HEAD), (F, -HEAD), (F, -HEAD), *backward]
    assert [(phase, delta) for phase, _, delta in _head_sized(report)] == first + second
    # model states at the step, P/2 each: the parameters' partition, the gradient partition, its flat fp32
    # copy for the step (ZeroOptimizer), the fp32 master partition and Adam's two moments; and Adam's
    # step counter (one fp32 scalar for the one master tensor)
    assert report.roles[0].model_states == 6 * P // 2 + 4


def test_dpo_reference_is_an_engine_of_its_own(tmp_path: Path) -> None:
    """DPO adds the reference engine: its partition (P/2, frozen: no gradient, no optimizer state) and,
    in the forward, its embedding's and head's gathers after the policy's, as the policy's are (the
    head registered with the reference's root, its own coordinator's); the backward gathers the
    policy's alone."""
    model = write_hf_config(tmp_path, CONFIG)
    dpo, precomputed = _estimate(model, "trl-dpo"), _estimate(model, "trl-dpo", precompute_ref_log_probs=True)
    assert dpo.roles[0].model_states - precomputed.roles[0].model_states == P // 2
    F, B = Phase.FORWARD, Phase.BACKWARD
    backward = [(B, HEAD), (B, HEAD), (B, -HEAD), (B, -HEAD)]
    first = [(F, HEAD), (F, -HEAD), (F, HEAD), (F, -HEAD)]
    second = [(F, HEAD), (F, HEAD), (F, -HEAD), (F, -HEAD)]
    sequence = [(phase, delta) for phase, _, delta in _head_sized(dpo)]
    assert sequence == first + first + backward + second + second + backward
    assert [module for _, module, _ in _head_sized(dpo)][4:8] == ["reference"] * 4
    assert any("DPOTrainer.compute_loss" in note for note in dpo.notes)


def test_reward_under_zero3(tmp_path: Path) -> None:
    """The reward model (no fused head: its score head is a module DeepSpeed hooks) runs as a plain
    ZeRO-3 step: every parameter partitioned, P_r/2 per rank, six times over at the step (as SFT's)."""
    config = {**CONFIG, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    report = _estimate(write_hf_config(tmp_path, config), "trl-reward")
    reward = 4 * (VOCAB * HIDDEN + LAYERS * LAYER + HIDDEN + HIDDEN)
    assert report.roles[0].model_states == 6 * reward // 2 + 4
    assert any("RewardTrainer.compute_loss" in note for note in report.notes)


def _events(monkeypatch: pytest.MonkeyPatch, model: str, stage3: ZeroStage3,
            lora: int | None = None) -> tuple[list[list[str]], Any]:
    """memcalc's two steps of DPO, with the gathered parameters of each engine (the policy's, and the
    reference's unless ``lora``) read at the recorded points."""
    keys = ("policy",) if lora else ("policy", "reference")
    events: list[list[str]] = []
    seen: dict[str, Any] = {}
    install = ZeroProgram.install

    def probe(self: ZeroProgram, tracer: Any, module: nn.Module) -> None:
        coordinators, gathered = hook_gathers(self, tracer, module, keys, events, install)
        seen["settings"] = coordinators[keys[-1]].settings
        policy = coordinators["policy"]
        leftovers = policy.release_backward_leftovers

        def release_backward_leftovers() -> None:  # the end of backward, as the reference script records it
            events.append([f"leftovers {sum(e.startswith('backward') for e, _ in events)}", gathered()])
            leftovers()

        policy.release_backward_leftovers = release_backward_leftovers  # type: ignore[method-assign]
        steps = iter(range(10))
        record_steps(self, events, gathered, lambda: f"backward {next(steps)}")

    monkeypatch.setattr(ZeroProgram, "install", probe)
    finetune = memcalc.FineTune(lora=memcalc.LoRA(lora)) if lora else memcalc.FineTune()
    _estimate(model, "trl-dpo", stage3, batch=RECORDED["batch"], seq_len=RECORDED["seq_len"], finetune=finetune)
    return events, seen["settings"]


# quick: without prefetch, and with it and LoRA (prefetch alone runs in the full suite)
@pytest.mark.quick_cases("no-prefetch", "lora-prefetch")
@pytest.mark.parametrize("case", sorted(RECORDED["cases"]))
def test_gathers_are_deepspeeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str) -> None:
    """Real DeepSpeed's policy and reference engines, TRL's models and TRL's prepare_deepspeed: memcalc
    gathers what they gather at every module of both models, after backward and after each step. The
    reference engine runs the config's stage-3 settings (recorded from it)."""
    recorded = RECORDED["cases"][case]
    settings = ZeroStage3(**{KEYS[k]: v for k, v in recorded["settings"].items()})
    real = recorded["events"]
    per_step = len(real) // 3
    # DeepSpeed's third step is its second, but for the reference's persistent parameters: gathered in
    # the second step's reference forward (its trace complete from then on) and never released (its
    # engine has no step), they are whole from the third step's start. The policy's are its second's.
    lora = recorded.get("lora")
    if lora is None:
        persistent = int(real[-1][1].split()[1], 16)
        assert [[e.replace(" 1", " 2"), f"{g.split()[0]} {hex(int(g.split()[1], 16) | persistent)}"]
                for e, g in real[per_step:2 * per_step]] == real[2 * per_step:]
        assert (persistent != 0) == (recorded["settings"]["stage3_param_persistence_threshold"] > 0)
    else:
        assert [[e.replace(" 1", " 2"), g] for e, g in real[per_step:2 * per_step]] == real[2 * per_step:]
    events, reference = _events(monkeypatch, write_hf_config(tmp_path, RECORDED["config"]), settings, lora)
    # LoRA: the reference pass (adapters disabled, under no_grad) breaks the recorded trace each step, and
    # its forward pre-hooks set every module's ds_grads_remaining to 0 again, so no post-backward release
    # runs: the modules fetched in backward stay gathered until release_backward_leftovers, which keeps
    # the persistent norms (ShardedProgram._deepspeed_post_backward). PEFT's LoRA layer reads
    # lora_A.weight in its own forward, which DeepSpeed's ZeROOrderedDict gathers and registers with it.
    assert events == real[:2 * per_step]
    if lora is None:
        assert {k: getattr(reference, k) for k in recorded["reference_engine"]} == recorded["reference_engine"]


def test_recorded_cases_differ() -> None:
    runs = {json.dumps(case["events"]) for case in RECORDED["cases"].values()}
    assert len(runs) == len(RECORDED["cases"]) and RECORDED["world_size"] == 2
