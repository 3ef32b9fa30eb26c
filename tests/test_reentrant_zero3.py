"""TRL's SFT with LoRA and gradient checkpointing under DeepSpeed ZeRO-3
(``--loop trl-sft --lora R --strategy zero3``, SFTConfig's default ``gradient_checkpointing=True``):
TRL forces reentrant checkpointing there ("PEFT + DeepSpeed ZeRO-3 requires reentrant
checkpointing"), and memcalc traces torch's reentrant ``CheckpointFunction`` under its ZeRO-3 engine.
The recomputation runs each layer's forward again inside the layer's backward, where DeepSpeed's
hooks gather the layer's parameters again.

Checked against real DeepSpeed 0.19.8 running TRL's setup of the same step on two CPU ranks
(tests/deepspeed_reference/zero3_reentrant_reference.py, recorded in
tests/data/deepspeed_zero3_reentrant.json): which parameters of the PeftModel are gathered at every
module's forward hooks (the recomputed forwards included), after backward and after each step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from zero3_probe import KEYS, hook_gathers, record_steps, write_hf_config

import memcalc
from memcalc.core.checkpointing import Checkpointing, CheckpointKind
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero import ZeroProgram

pytest.importorskip("transformers")
pytest.importorskip("trl")

RECORDED = json.loads((Path(__file__).parent / "data" / "deepspeed_zero3_reentrant.json").read_text())



def _estimate(model: str, stage3: ZeroStage3, checkpointing: bool, trl_step: bool = True,
              **more: Any) -> memcalc.MemoryReport:
    """TRL's SFT step (``trl_step``), or memcalc's own loop with the model's loss, on 2 ranks."""
    zero3 = memcalc.Distributed("zero3", world_size=2, reduce_bucket_size=1000, stage3=stage3)
    lora = memcalc.FineTune(lora=memcalc.LoRA(RECORDED["cases"]["reentrant"]["lora"]))
    if not trl_step:
        return memcalc.estimate(model, batch_size=RECORDED["batch"], seq_len=RECORDED["seq_len"], gpu="cpu",
                                optimizer="adam", checkpoint=checkpointing, finetune=lora, distributed=zero3, **more)
    args = {"per_device_train_batch_size": RECORDED["batch"], "bf16": False, "gradient_checkpointing": checkpointing}
    return memcalc.estimate(model, loop="trl-sft", trainer_args=args, seq_len=RECORDED["seq_len"], gpu="cpu",
                            finetune=lora, distributed=zero3, **more)


def _events(monkeypatch: pytest.MonkeyPatch, model: str, stage3: ZeroStage3, checkpointing: bool,
            trl_step: bool) -> list[list[str]]:
    """memcalc's two steps, with the PeftModel's gathered parameters read at the recorded points
    (labelled as the reference labels them: ``policy.`` and the module's name in the PeftModel)."""
    events: list[list[str]] = []
    install = ZeroProgram.install
    key = "policy" if trl_step else ""

    def probe(self: ZeroProgram, tracer: Any, module: nn.Module) -> None:
        _, gathered = hook_gathers(self, tracer, module, (key,), events, install)
        steps = iter(range(10))
        record_steps(self, events, gathered, lambda: f"backward {next(steps)}")

    monkeypatch.setattr(ZeroProgram, "install", probe)
    _estimate(model, stage3, checkpointing, trl_step)
    # memcalc's own loop traces the LoRA-injected model itself (no PeftModel around it): the same modules
    return events if trl_step else [[e.replace(" .", " policy.base_model.model.", 1), g] for e, g in events]


@pytest.mark.parametrize("case", sorted(RECORDED["cases"]))
def test_gathers_are_deepspeeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str) -> None:
    """Real DeepSpeed's gathers at every module's forward hooks (the recomputed forwards inside the
    backward included), after backward and after each step, for memcalc's first two steps (DeepSpeed's
    third repeats its second). In the recomputation the frozen base weights stay gathered after their
    module (attributed to the module whose backward started last), and go with that module's backward."""
    recorded = RECORDED["cases"][case]
    settings = ZeroStage3(**{KEYS[k]: v for k, v in recorded["settings"].items()})
    real = recorded["events"]
    per_step = len(real) // 3
    assert [[e.replace(" 1", " 2"), g] for e, g in real[per_step:2 * per_step]] == real[2 * per_step:]
    events = _events(monkeypatch, write_hf_config(tmp_path, RECORDED["config"]), settings, recorded["checkpointing"],
                     recorded["trl_step"])
    assert [e for e, _ in events] == [e for e, _ in real[:2 * per_step]]
    assert events == real[:2 * per_step]


def test_the_recomputation_runs_the_forward_hooks_again() -> None:
    """What the recorded runs show, so that the comparison above can fail: with checkpointing a step
    runs each layer's 13 parameter-owning modules (two norms, four projections, LoRA's A and B on q and
    v) twice, in the forward and recomputed in the backward; without it, the forward's post-hooks find
    nothing gathered (no prefetch, no persistence), and the recomputed ones up to 10 parameters still
    held (layer 1's frozen weights, attributed to the module whose backward started last)."""
    def per_step(case: str) -> list[list[str]]:
        events = RECORDED["cases"][case]["events"]
        return events[: len(events) // 3]

    def pre(case: str) -> int:
        return sum(e.startswith("pre") for e, _ in per_step(case))

    def most_held_after_a_module(case: str) -> int:
        return max(bin(int(g, 16)).count("1") for e, g in per_step(case) if e.startswith("post"))

    assert pre("reentrant") - pre("no-checkpointing") == 2 * 13 == pre("reentrant-prefetch") - pre("no-checkpointing")
    assert (most_held_after_a_module("no-checkpointing"), most_held_after_a_module("reentrant")) == (0, 10)


def test_trl_forces_reentrance_under_zero3(tmp_path: Path) -> None:
    """``--loop trl-sft --lora R --strategy zero3`` with SFTConfig's default checkpointing: reentrant, as
    SFTTrainer sets it (the report says so); a selective policy, which reentrance cannot take, is refused."""
    model = write_hf_config(tmp_path, RECORDED["config"])
    report = _estimate(model, ZeroStage3(), True)
    assert any("reentrant: torch's CheckpointFunction" in note for note in report.notes)
    assert any("TRL checkpoints a PEFT model with reentrance" in note for note in report.notes)
    with pytest.raises(InapplicableOptionError, match="TRL forces use_reentrant=True there"):
        _estimate(model, ZeroStage3(), True, checkpoint="selective-op")
    # without LoRA, TRL keeps the user's (non-reentrant) checkpointing
    full = memcalc.estimate(model, loop="trl-sft", seq_len=RECORDED["seq_len"], gpu="cpu",
                            trainer_args={"per_device_train_batch_size": 2, "bf16": False},
                            distributed=memcalc.Distributed("zero3", world_size=2))
    assert not any("reentrant" in note for note in full.notes)
    with pytest.raises(InvalidInputError, match="takes no selective policy"):
        Checkpointing(CheckpointKind.POLICY, policy=print, reentrant=True)


def test_the_command_line_recipe_is_estimated(tmp_path: Path) -> None:
    """``--loop trl-sft --lora 8 --strategy zero3`` with SFTConfig's defaults (gradient checkpointing on):
    refused before, estimated now, the notes saying why the checkpoint is reentrant."""
    from click.testing import CliRunner

    from memcalc.cli import main

    model = write_hf_config(tmp_path, RECORDED["config"])
    result = CliRunner().invoke(main, [model, "--loop", "trl-sft", "--lora", "8", "--strategy", "zero3",
                                       "--world-size", "2", "--seq-len", "32", "--gpu", "cpu"])
    assert result.exit_code == 0, result.output
    assert "note: loop trl-sft: TRL checkpoints a PEFT model with reentrance under DeepSpeed ZeRO-3" in result.output
