"""Progress on long work (issue 32: ``--mode generate --new-tokens 100000`` ran past 90 s with no
output): the seam (:mod:`memcalc.core.progress`) is told the right counts by a generation, a
sweep and a fit; the command line's bar (:mod:`memcalc.cli.progress`) draws them on a terminal
only, and never prints into a pipe or a test's captured output."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.cli import main
from memcalc.cli import progress as cli_progress
from memcalc.cli.progress import BAR_WIDTH, TerminalProgress
from memcalc.core.progress import progress_to, report_progress, reported
from memcalc.engine import run as engine_run
from memcalc.engine.generation import GENERATING
from memcalc.search.fit import FITTING
from memcalc.search.sweep import SWEEPING

Told = list[tuple[str, int, "int | None"]]


def _listening() -> tuple[Told, object]:
    told: Told = []
    return told, lambda task, done, total: told.append((task, done, total))


# ---- the seam: what the work tells ---------------------------------------------------------


def test_a_generation_tells_every_new_token(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    told, listener = _listening()
    with progress_to(listener):  # type: ignore[arg-type]
        report = memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=8,
                                  mode="generate", new_tokens=6, gpu="cpu")
    # 6 new tokens: 0 before the prefill, one more as each of the 5 decode forwards begins, 6 at the end
    assert told == [(GENERATING, done, 6) for done in range(7)]
    assert report.new_tokens == 6


def test_a_long_replay_tells_its_events_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(engine_run, "REPLAY_PROGRESS_FROM", 1)  # every replay is long
    told, listener = _listening()
    with progress_to(listener):  # type: ignore[arg-type]
        memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=8, mode="generate",
                         new_tokens=6, gpu="cpu")
    replay = [(done, total) for task, done, total in told if task == engine_run.REPLAYING]
    events = replay[-1][1]
    assert events > 0 and replay == [(0, events), (events, events)]  # fewer events than a chunk: two tellings
    assert [task for task, _, _ in told].index(engine_run.REPLAYING) > 6  # after the generation's 7


def test_reported_tells_once_per_chunk_and_ends_the_task() -> None:
    told, listener = _listening()
    with progress_to(listener):  # type: ignore[arg-type]
        assert list(reported("t", iter(range(5)), 5, every=2)) == [0, 1, 2, 3, 4]
        assert list(reported("u", [], 3)) == []  # fewer items than told: the task still ends
    assert told == [("t", 0, 5), ("t", 2, 5), ("t", 4, 5), ("t", 5, 5), ("u", 0, 3), ("u", 3, 3)]


def test_a_sweep_tells_every_configuration() -> None:
    told, listener = _listening()
    with progress_to(listener):  # type: ignore[arg-type]
        points = memcalc.sweep("mlp", batch_sizes=[1, 2], optimizers=["sgd", "adam"])
    assert len(points) == 4
    assert told == [(SWEEPING, done, 4) for done in range(5)]


def test_a_fit_tells_every_estimate_it_makes() -> None:
    told, listener = _listening()
    with progress_to(listener):  # type: ignore[arg-type]
        memcalc.max_batch_size("mlp", budget="256MiB")
    # a search does not know ahead how many estimates it takes: no total, one more each time
    assert {task for task, _, _ in told} == {FITTING} and {total for _, _, total in told} == {None}
    assert [done for _, done, _ in told] == list(range(len(told))) and len(told) >= 3


def test_nothing_is_told_without_a_listener_nor_to_another_threads() -> None:
    told, listener = _listening()
    report_progress("before", 0, 1)
    with progress_to(listener):  # type: ignore[arg-type]
        other = threading.Thread(target=report_progress, args=("other thread", 1, 1))
        other.start()
        other.join()
        report_progress("inside", 1, 2)
        with progress_to(None):
            report_progress("hidden", 1, 2)
    report_progress("after", 2, 2)
    assert told == [("inside", 1, 2)]


# ---- the command line's bar ------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_quick_work_draws_nothing() -> None:
    stream, clock = io.StringIO(), _Clock()
    bar = TerminalProgress(stream, clock=clock)
    for done in range(11):
        clock.now = done * 0.05  # all of it within the first second
        bar(GENERATING, done, 10)
    bar.close()
    assert stream.getvalue() == ""


def test_long_work_draws_one_line_redrawn_and_ended() -> None:
    stream, clock = io.StringIO(), _Clock()
    bar = TerminalProgress(stream, clock=clock)
    bar(GENERATING, 0, 4)
    clock.now = 1.5
    bar(GENERATING, 1, 4)
    bar(GENERATING, 2, 4)  # at the same moment: not redrawn
    bar("a task inside it", 1, 1)  # left out while the generation holds the line
    clock.now = 3.0
    bar(GENERATING, 4, 4)
    quarter, whole = "#" * (BAR_WIDTH // 4) + "-" * (BAR_WIDTH - BAR_WIDTH // 4), "#" * BAR_WIDTH
    assert stream.getvalue() == (f"\r{GENERATING}  [{quarter}]  1/4  2 s"
                                 f"\r{GENERATING}  [{whole}]  4/4  3 s\n")
    bar.close()  # the line is ended once
    assert stream.getvalue().count("\n") == 1


def test_a_search_without_a_total_shows_a_count() -> None:
    stream, clock = io.StringIO(), _Clock()
    bar = TerminalProgress(stream, clock=clock, show_after_s=0.0)
    bar(FITTING, 0, None)
    clock.now = 12.0
    bar(FITTING, 12, None)
    bar.close()
    assert stream.getvalue() == f"\r{FITTING}  0 done  0 s\r{FITTING}  12 done  12 s\n"


def test_the_cli_draws_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    source = hf_config_source(tmp_path, SMALL_LLAMA)
    args = [source, "--mode", "generate", "--new-tokens", "5", "--seq-len", "8", "--gpu", "cpu", "--depth", "0"]
    monkeypatch.setattr(cli_progress, "SHOW_AFTER_S", 0.0)  # as if the generation took a while
    piped = CliRunner().invoke(main, args)  # CliRunner's stderr is not a terminal, as a pipe is not
    assert piped.exit_code == 0, piped.output
    assert GENERATING not in piped.output and "\r" not in piped.output
    monkeypatch.setattr(cli_progress, "is_terminal", lambda stream: True)
    shown = CliRunner().invoke(main, args)
    assert shown.exit_code == 0, shown.output
    assert f"\r{GENERATING}  [{'#' * BAR_WIDTH}]  5/5  " in shown.stderr and shown.stderr.endswith(" s\n")
    assert shown.stdout == piped.stdout  # the report itself is the same
    # (--format json draws no bar: tests/test_cli_fit.py, on a sweep)


def test_the_line_is_ended_before_an_error_is_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr(cli_progress, "is_terminal", lambda stream: True)
    monkeypatch.setattr(cli_progress, "SHOW_AFTER_S", 0.0)
    with pytest.raises(RuntimeError), cli_progress.progress_on_terminal("simple"):
        report_progress(SWEEPING, 0, 3)
        raise RuntimeError("the second configuration failed")
    assert stderr.getvalue() == f"\r{SWEEPING}  [{'-' * BAR_WIDTH}]  0/3  0 s\n"
    report_progress(SWEEPING, 1, 3)  # the listener is gone with the block
    assert stderr.getvalue().count("\r") == 1
