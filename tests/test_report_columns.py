"""The report's passes read one set of int64 arrays made once per report (``run._Columns``,
``Program.keys``; a long generation has millions of events): they must be the trace's events,
sizes and categories, element for element — a training step's synthesised second iteration, a
traced loop and a generation alike — and the categories at the peak the same with the shared
codes as without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import hf_config_source

import memcalc
from memcalc.core.categories import Category
from memcalc.engine import run
from memcalc.engine.timeline import Program, category_totals_at


def _columns(monkeypatch: pytest.MonkeyPatch, source: str, **options: object
             ) -> tuple[run.TracedStep, Program, run._Columns]:
    seen: list[tuple[run.TracedStep, Program, run._Columns]] = []
    original = run._Columns.of

    def spy(traced: run.TracedStep, program: Program) -> run._Columns:
        seen.append((traced, program, original(traced, program)))
        return seen[-1][2]

    monkeypatch.setattr(run._Columns, "of", staticmethod(spy))
    memcalc.estimate(source, **options)  # type: ignore[arg-type]
    return seen[-1]


@pytest.mark.parametrize("options", [
    pytest.param({"batch_size": 2}, id="train-synthesised-second-iteration"),
    pytest.param({"batch_size": 2, "loop": "trainer"}, id="train-traced-loop"),
    pytest.param({"mode": "generate", "optimizer": "none", "batch_size": 1, "seq_len": 8, "new_tokens": 40},
                 id="generate-extrapolated"),
])
def test_columns_are_the_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, object]) -> None:
    pytest.importorskip("transformers")
    traced, program, columns = _columns(monkeypatch, hf_config_source(tmp_path), **options)
    trace = traced.trace
    assert program.keys.tolist() == program.events and not program.keys.flags.writeable
    assert columns.events.tolist() == trace.events
    assert columns.nbytes.tolist() == trace.nbytes
    order = list(Category)
    assert columns.codes.tolist() == [order.index(c) for c in traced.categories]
    # the categories alive after events spread over the program, with the shared codes and without
    for index in np.linspace(0, len(program.events) - 1, 7).astype(int).tolist():
        shared = category_totals_at(program, columns.nbytes, traced.categories, index, codes=columns.codes)
        assert shared == category_totals_at(program, trace.nbytes, traced.categories, index)
        alive: dict[int, int] = {}
        for key in program.events[:index + 1]:  # the definition, event by event
            if key >= 0:
                alive[key] = trace.nbytes[program.storage(key)]
            else:
                del alive[~key]
        walked = {c: 0 for c in Category}
        for key, nbytes in alive.items():
            walked[traced.categories[program.storage(key)]] += nbytes
        assert shared == walked


def test_category_totals_past_float64s_integers_are_exact() -> None:
    """Past 2**53 bytes in all, the categories are summed in int64, not through float64's bincount."""
    big = (1 << 53) + 1  # no float64 holds it
    program = Program(events=[0, 1, 2, ~2], num_storages=3, iterations=1, iteration_starts=(0,))
    nbytes = [big, big, 3]
    categories = [Category.PARAMETERS, Category.PARAMETERS, Category.ACTIVATIONS]
    totals = category_totals_at(program, nbytes, categories, 2)
    assert totals[Category.PARAMETERS] == 2 * big != int(float(2 * big)) and totals[Category.ACTIVATIONS] == 3
    assert category_totals_at(program, nbytes, categories, 3)[Category.ACTIVATIONS] == 0
    small = category_totals_at(program, [5, 7, 3], categories, 2)  # the float64 path: exact too
    assert small[Category.PARAMETERS] == 12 and small[Category.ACTIVATIONS] == 3
