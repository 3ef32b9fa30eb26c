"""The checkpoint kind of a QLoRA model prepared by ``peft.prepare_model_for_kbit_training``.

peft 0.21 enables transformers' checkpointing with empty ``gradient_checkpointing_kwargs``, so
torch's checkpoint gets no ``use_reentrant`` and torch 2.13 runs it reentrant; peft 0.22 passes None,
for which transformers binds ``use_reentrant=False``. A user's own loop keeps PEFT's kind (read off
a real forward: hf_harness.peft_default_reentrant); the Trainer re-enables checkpointing with its
own kwargs. Checked against a real CPU step under the profiler: a 3-layer Llama loaded in 4 bits by
bitsandbytes, prepared by PEFT, LoRA r 8, trained by the user's loop (bf16 autocast, SGD, two
steps), whose reentrant checkpoint keeps one layer's output more than the non-reentrant one
(+1 MiB): memcalc's default loop must pick PEFT's kind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import memcalc
from memcalc.core.checkpointing import FULL, Checkpointing, CheckpointKind
from memcalc.fields import build_step
from memcalc.stacks.kbit import set_up_reentrant

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import (
    TOLERANCE,
    Recipe,
    llama_config,
    model_bytes,
    peft_default_reentrant,
    profiled_peak,
    real_model,
    training_args,
    write_config,
)

pytest.importorskip("transformers")
pytest.importorskip("peft")

#: test_reentrant.py's Llama: the peak is in the backward of its checkpointed layers, where the kinds differ.
CONFIG = {**llama_config(512, hidden=256, layers=3), "intermediate_size": 1024}
BATCH, SEQ, RANK = 2, 512, 8
QLORA = memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4")


def _notes(loop: str | None = None, **more: object) -> list[str]:
    report = memcalc.estimate("llama-tiny", batch_size=1, seq_len=32, optimizer="sgd", finetune=QLORA,
                              loop=loop, **more)  # type: ignore[arg-type]
    return [note for note in report.notes if "reentrant" in note]


def test_the_own_loop_keeps_the_kind_peft_set_up() -> None:
    """Reentrant with peft 0.21 on torch 2.13 (a note says so), non-reentrant with peft 0.22 (no note)."""
    notes = _notes(checkpoint=True)
    reentrant = peft_default_reentrant()
    assert any("prepare_model_for_kbit_training set up is reentrant" in note for note in notes) is reentrant, notes
    assert any("(reentrant: torch's CheckpointFunction" in note for note in notes) is reentrant, notes


def test_the_trainer_reenables_checkpointing_with_its_own_kind() -> None:
    # Trainer.train(): activation_checkpointing_enable(TrainingArguments' kwargs or None) after PEFT's
    assert _notes(loop="trainer", checkpoint=True) == []
    step = build_step("llama-tiny", seq_len=32, finetune=QLORA,
                      trainer_args={"gradient_checkpointing": True})
    assert step.checkpoint == FULL and not step.checkpoint.reentrant


def test_a_selective_policy_and_no_checkpoint_are_left_alone() -> None:
    assert _notes(checkpoint=Checkpointing(CheckpointKind.SELECTIVE_OP)) == []
    assert _notes() == []


def _real_own_loop(reenable: dict[str, bool] | None) -> tuple[int, bool]:
    """The real peak of the user's loop on the QLoRA model (two steps), with transformers'
    checkpointing as PEFT left it, or enabled again with ``reenable`` as its kwargs; and whether
    the real model's checkpoint function is torch's reentrant one (memcalc's probe, on it)."""
    recipe = Recipe(CONFIG, batch=BATCH, seq_len=SEQ, bf16=True, weights=torch.bfloat16, qlora=True, lora=RANK,
                    checkpointing=True)
    model = real_model(recipe)
    if reenable is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reenable)
    model.train()
    ids = torch.randint(0, int(CONFIG["vocab_size"]), (BATCH, SEQ))  # type: ignore[call-overload]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def run() -> None:  # memcalc's minimal loop, as a user writes it: the output dropped after backward
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(input_ids=ids, labels=ids)
            output.loss.backward()
            del output
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return profiled_peak(model_bytes(model, ids), run), set_up_reentrant(model)


@pytest.mark.slow  # two real bf16 QLoRA steps, twice: 30-70 s on two loaded CPU cores
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # torch's use_reentrant, PEFT's names
def test_the_real_own_loop_keeps_the_kind_peft_set_up(tmp_path: Path) -> None:
    """The real loop with PEFT's checkpointing, and again with the other kind forced, against
    memcalc's default loop: the estimate within the CPU bar of the first and outside it of the
    second, so the test fails if memcalc picks the other kind. With torch 2.13 and peft 0.21.2
    PEFT's kind is reentrant: real 38,290,840 B (the non-reentrant 37,242,296 B, -1 MiB: one layer's
    fp32 output), memcalc 38,283,848 B (-0.02%; it was 37,235,272 B, -2.76%, with the non-reentrant
    kind). With peft 0.22.0 it is non-reentrant: real 37,242,296 B, memcalc 37,250,440 B (+0.02%)."""
    pytest.importorskip("bitsandbytes")
    real, reentrant = _real_own_loop(None)
    assert reentrant is peft_default_reentrant()
    other, other_reentrant = _real_own_loop({"use_reentrant": not reentrant})
    assert other_reentrant is not reentrant
    estimate = memcalc.estimate(write_config(tmp_path, CONFIG), batch_size=BATCH, seq_len=SEQ, gpu="cpu",
                                optimizer="sgd", precision="bf16", checkpoint=True, finetune=QLORA)
    row = (f"PEFT's kind (reentrant {reentrant}): real {real:,} B; the other kind {other:,} B; "
           f"memcalc {estimate.peak_requested:,} B")
    print(row)
    assert abs(estimate.peak_requested - real) <= TOLERANCE * real, row
    assert abs(estimate.peak_requested - other) > TOLERANCE * real, row
    assert any("set up is reentrant" in note for note in estimate.notes) is reentrant, estimate.notes


@pytest.mark.slow  # one real Trainer step on the 4-bit model: ~15 s on two CPU cores
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_real_trainer_replaces_pefts_kind(tmp_path: Path) -> None:
    """Which kind wins in the Trainer, read off the real objects: PEFT leaves its function (reentrant
    with peft 0.21 on torch 2.13, non-reentrant with peft 0.22), and ``Trainer.train()`` with
    ``activation_checkpointing`` and no kwargs leaves transformers' non-reentrant one, the kind
    memcalc's Trainer loop runs."""
    pytest.importorskip("bitsandbytes")
    import transformers

    recipe = Recipe(CONFIG, batch=1, seq_len=32, bf16=True, weights=torch.bfloat16, qlora=True, lora=RANK,
                    checkpointing=True)
    model = real_model(recipe)
    peft_kind = set_up_reentrant(model)  # the own-loop test's subject
    assert peft_kind is peft_default_reentrant()
    ids = torch.randint(0, int(CONFIG["vocab_size"]), (recipe.seq_len,))  # type: ignore[call-overload]
    trainer = transformers.Trainer(model=model, args=training_args(recipe, tmp_path),
                                   train_dataset=[{"input_ids": ids, "labels": ids}] * 2)
    trainer.train()
    assert not set_up_reentrant(model), peft_kind
    step = build_step(write_config(tmp_path, CONFIG), seq_len=recipe.seq_len, finetune=QLORA,
                      trainer_args={"gradient_checkpointing": True})
    assert step.checkpoint == FULL and not step.checkpoint.reentrant
