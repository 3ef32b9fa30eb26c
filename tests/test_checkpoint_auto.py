"""``--checkpoint auto`` (issue 34, item 4): the setting whose peak fits the budget with the least
recomputation, each candidate traced. Checked against real CPU steps under the profiler: the
chosen setting's real peak is never above the budget."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.checkpointing import AUTO, FULL, OFF, Checkpointing, CheckpointKind, parse_checkpointing
from memcalc.distributed.checkpoint_auto import candidates
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu

LLAMA: dict[str, Any] = dict(batch_size=4, seq_len=128, optimizer="sgd")


def every(n: int) -> Checkpointing:
    return Checkpointing(CheckpointKind.EVERY, n)


def test_auto_is_spelled_auto() -> None:
    assert parse_checkpointing(" Auto ") == AUTO and AUTO.label == "auto"


def test_the_ladder_counts_each_number_of_blocks_once() -> None:
    # 8 blocks: every:8 checkpoints 1 (as every:7, 6, 5 would), every:4 two (as every:3), every:2 four
    assert candidates(8) == [OFF, every(8), every(4), every(2), FULL]
    assert candidates(1) == [OFF, FULL]
    assert candidates(5) == [OFF, every(5), every(2), FULL]


def test_auto_needs_a_budget() -> None:
    with pytest.raises(memcalc.InvalidInputError, match="budget"):
        memcalc.estimate("llama-tiny", gpu="cpu", checkpoint="auto", batch_size=1, seq_len=16)


def test_fit_auto_needs_blocks() -> None:
    with pytest.raises(memcalc.InvalidInputError, match="blocks"):
        memcalc.max_batch_size("mlp", gpu="cpu", budget="1GiB", checkpoint="auto")


@pytest.mark.slow  # six fits of llama-tiny (about a minute) and a real CPU step under the profiler
def test_fit_auto_answer_stays_under_the_budget_in_a_real_cpu_step() -> None:
    # each setting fitted on its own; measured (800 MiB, 1% margin): off 5, every:8 5, every:4 6,
    # every:2 6, full 8, selective-op 7 — full wins with batch 8
    fit = memcalc.max_batch_size("torch:llama-tiny", gpu="cpu", budget="800MiB", seq_len=128, optimizer="sgd",
                                 checkpoint="auto")
    assert fit.report.notes[0].startswith(f"checkpoint auto chose full: the largest batch, {fit.batch_size},")
    assert fit.batch_size == 8
    real = measure_cpu(build_step("torch:llama-tiny", gpu="cpu", checkpoint="full", batch_size=fit.batch_size,
                                  seq_len=128, optimizer="sgd")).peak_allocated
    assert real is not None and real <= fit.margin_budget_bytes


# Peaks of llama-tiny (batch 4, 128 tokens, SGD) on the CPU target, and FLOPs recomputed, as the
# notes list them: off 646.7 MB / 0; every:8 627.6 MB / 2.18 GFLOP; every:4 608.4 / 4.36;
# every:2 570.1 / 8.72; selective-op 543.4 / 8.46; full 506.0 / 17.45. (128 tokens rather than 256:
# the same order of settings, with the real CPU step, the quick case's cost, a quarter cheaper.)
@pytest.mark.parametrize(("budget", "chosen"), [
    (700_000_000, "off"),            # everything fits: nothing recomputed
    (620_000_000, "every:4"),        # every:4 fits (608.4 MB) and recomputes less than selective-op
    (555_000_000, "selective-op"),   # every:2 (570.1 MB) is over; selective-op fits and recomputes less than full
    (520_000_000, "full"),           # only full fits
])
# the quick case: a partial setting chosen over selective-op, its real step the cheapest of the four with a
# choice to make (CPU-s under load, 2026-12-06: every:4 11, off 13, selective-op 15, full 16); selective-op's
# real step stays quick in test_selective_checkpointing.py's torchtitan policy case
@pytest.mark.quick_cases("620000000-every:4")
def test_auto_choice_stays_under_the_budget_in_a_real_cpu_step(budget: int, chosen: str) -> None:
    report = memcalc.estimate("llama-tiny", gpu="cpu", checkpoint="auto", capacity=budget, **LLAMA)
    assert report.notes[0].startswith(f"checkpoint auto chose {chosen}:")
    assert report.peak_requested <= budget
    real = measure_cpu(build_step("llama-tiny", checkpoint=chosen, **LLAMA)).peak_allocated
    assert real is not None and real <= budget
    # the chosen setting's estimate, within issue 34's 1% (measured: selective-op 543,405,320 B estimated,
    # 543,445,768 B real, 0.007%)
    assert abs(real - report.peak_requested) <= 0.01 * real


def test_cli_auto_without_a_budget_is_refused() -> None:
    result = CliRunner().invoke(main, ["llama-tiny", "--batch", "1", "--seq-len", "16", "--gpu", "cpu",
                                       "--checkpoint", "auto"])
    assert result.exit_code == 2 and "budget" in result.output
