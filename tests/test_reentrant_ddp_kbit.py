"""QLoRA's own loop under DDP checkpoints as PEFT set it up: reentrant (tests/test_kbit_reentrant.py
on one GPU; PEFT passes transformers no ``use_reentrant`` and torch 2.13 runs ``CheckpointFunction``).
Each DDP rank runs the same model and loop, so its estimate follows the same kind: the role's model is
read after ``prepare_model_for_kbit_training`` (memcalc.stacks.kbit.kbit_checkpointing), as on one GPU.
DDP with reentrant checkpointing is checked against real gloo runs in tests/test_reentrant_ddp.py.
"""

from __future__ import annotations

import pytest

import memcalc
from memcalc.core.checkpointing import FULL, Checkpointing, CheckpointKind

pytest.importorskip("transformers")
pytest.importorskip("peft")

QLORA = memcalc.FineTune(lora=memcalc.LoRA(8), quant="nf4")
DDP = memcalc.Distributed("ddp", world_size=2)


def _estimate(checkpoint: Checkpointing) -> memcalc.MemoryReport:
    return memcalc.estimate("llama-tiny", batch_size=1, seq_len=32, optimizer="sgd", finetune=QLORA,
                            checkpoint=checkpoint, distributed=DDP)


def test_the_own_loop_under_ddp_keeps_the_reentrant_checkpoint_peft_set_up() -> None:
    report = _estimate(FULL)
    notes = [note for note in report.notes if "reentrant" in note]
    assert any("prepare_model_for_kbit_training set up is reentrant" in note for note in notes), notes
    assert any("(reentrant: torch's CheckpointFunction" in note for note in notes), notes
    # the same trace as asking for the reentrant checkpoint outright (now modelled under DDP)
    explicit = _estimate(Checkpointing(CheckpointKind.FULL, reentrant=True))
    assert report.peak_requested == explicit.peak_requested

