"""Sweeps: one estimate per (batch size, optimizer, precision), for tables and plots."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from memcalc.core.choices import parse_choice
from memcalc.core.counts import as_integer, fits_int64
from memcalc.core.errors import InvalidInputError
from memcalc.core.precision import Precision
from memcalc.core.progress import report_progress
from memcalc.core.report import MemoryReport
from memcalc.distributed.setting import Distributed
from memcalc.engine.optimizers import DEFAULT_OPTIMIZER, Optimizer, spec_for
from memcalc.engine.step_spec import Step
from memcalc.estimation import SINGLE, run_estimate

__all__ = ("SWEEPING", "SweepPoint", "sweep_configurations", "sweep_requests")

#: The progress task of a sweep: its units are the configurations estimated.
SWEEPING = "estimating configurations"


@dataclass(frozen=True)
class SweepPoint:
    """One configuration of a sweep and its estimate (``fits`` is None without a budget)."""

    batch_size: int
    optimizer: str
    precision: str | None
    report: MemoryReport

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the sweep's budget (None without a budget)."""
        return self.report.fits

    @property
    def series(self) -> str:
        """The configuration without the batch: one line of a plot."""
        return self.optimizer if self.precision is None else f"{self.optimizer}, {self.precision}"

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc sweep --format json`` row: the configuration, ``fits`` and the estimate JSON."""
        return {"batch_size": self.batch_size, "optimizer": self.optimizer, "precision": self.precision,
                "fits": self.fits, "report": self.report.to_dict()}


def sweep_configurations(
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] = (DEFAULT_OPTIMIZER,),
    precisions: Sequence[Precision | str | None] = (None,),
) -> list[tuple[int, str, str | None]]:
    """Every ``(batch, optimizer, precision)`` in sweep order (by series, then batch);
    raises :class:`InvalidInputError` naming the first invalid item."""
    batches = [_check_batch(b) for b in _items(batch_sizes, "batch_sizes", "[1, 16, 64]")]
    optims = [_check_optimizer(o) for o in _items(optimizers, "optimizers", '["sgd", "adam"]')]
    precs = [_check_precision(p) for p in _items(precisions, "precisions", '["fp32", "amp-bf16"]')]
    if not batches or not optims or not precs:
        raise InvalidInputError("a sweep needs at least one batch size, optimizer and precision")
    return [(b, o, p) for o, p in itertools.product(optims, precs) for b in sorted(set(batches))]


def sweep_requests(step: Step, configs: Sequence[tuple[int, str, str | None]], *,
                   distributed: Distributed = SINGLE) -> Iterator[SweepPoint]:
    """Estimate ``step`` at every ``(batch, optimizer, precision)`` of ``configs`` (from
    :func:`sweep_configurations`, which checked every item; precision None keeps the step's),
    yielding each point (and telling the progress listener, as :data:`SWEEPING`)."""
    report_progress(SWEEPING, 0, len(configs))
    for done, (batch, optimizer, precision) in enumerate(configs, start=1):
        point = replace(step, batch_size=batch, optimizer=spec_for(optimizer))
        if precision is not None:
            point = replace(point, precision=Precision(precision))
        estimated = SweepPoint(batch, optimizer, precision, run_estimate(point, distributed))
        report_progress(SWEEPING, done, len(configs))
        yield estimated


def _items(values: object, name: str, example: str) -> list[Any]:
    """``values`` as a list; a single value or a string (which would be read letter by letter)
    is refused, naming the argument."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidInputError(f"{name} must be a list, got {type(values).__name__} {values!r}",
                                hint=f"e.g. {name}={example}")
    return list(values)


def _check_batch(value: object) -> int:
    """A batch size: an integer (NumPy's included) from 1 to 2**63 - 1."""
    batch = as_integer(value)
    if batch is None or batch < 1 or not fits_int64(batch):
        raise InvalidInputError(f"batch_sizes: {value!r} is not a positive integer batch size (at most 2**63 - 1)")
    return batch


def _check_optimizer(value: Optimizer | str) -> str:
    try:
        return spec_for(value).name
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def _check_precision(value: Precision | str | None) -> str | None:
    return None if value is None else parse_choice(Precision, value, "precision").value
