"""How long does ``memcalc.max_batch_size`` take, in units of one estimate?

The target: a fit in at most four estimates' time (an estimate costs the same at any batch
size: meta tensors). For a batch-affine step the search traces three batches (batch 2, one
jump, the answer: only the answer is reported, the others are judged by replays of their
trace) and replays the batch-affine trace family through the allocator model for the rest:
the search under the budget less the margin, the check that walks down from the boundary it
finds, and the raw boundary under the whole budget. For resnet50 (224×224) and gpt2 (256
tokens), Adam, fp32, on a few catalogue GPUs, with the default margin, this prints the fit
time, the median time of one estimate with the same options (warm, under the same capacity;
both medians of three runs), their ratio, the estimates and replays the fit made, the batch
with and without the margin, the batches the check replayed, and the search's probes.

``--pieces`` splits one fit's CPU time (warm process, best of three) into its pieces, in units
of one estimate, for issue 36 item 6's four cases on an A100 40 GB (resnet50, vit_b_16, gpt2
at 256 tokens with the default margin; vgg16 with ``--margin 0``): the real estimates (the
traces and the answer's report, each counted in brackets), and the replays by what asked for
them — the search itself (the family's probes and the judgement of the traced batches), the
check below the boundary, the raw boundary, the batch with expandable segments. ``floor`` is
what no search that traces its answer can drop: the real estimates, the search's replays and
the check's.

``--decisions`` and ``--symbolic`` weigh two routes to issue 36 item 6 (:func:`decisions`,
:func:`symbolic`; docs/speed.md gives what they found).

    python benchmarks/speed_fit.py [--pieces | --decisions | --symbolic]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc import estimation
from memcalc.api import max_batch_size
from memcalc.engine import allocator
from memcalc.search import affine, fit

CASES = (
    ("resnet50", {}),
    ("gpt2", {"seq_len": 256}),
)
GPUS = ("t4", "a100-40gb", "h100-80gb")
#: Estimates timed per case for the "one estimate" baseline, and fits timed per case (medians
#: taken: a garbage collection of the whole heap now and then adds ~0.1 s to one run).
BASELINE_REPEATS = 3
FIT_REPEATS = 3


def one_estimate_seconds(model: str, batch: int, capacity: int, options: dict) -> float:
    times = []
    for _ in range(BASELINE_REPEATS):
        start = time.perf_counter()
        memcalc.estimate(model, batch_size=batch, capacity=capacity, **options)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    warnings.simplefilter("ignore")  # approximation notes are not what is measured here
    rows = []
    for model, options in CASES:
        memcalc.estimate(model, batch_size=1, **options)  # warm-up: imports, first-call caches
        for gpu in GPUS:
            times = []
            for _ in range(FIT_REPEATS):
                start = time.perf_counter()
                result = max_batch_size(model, gpu=gpu, **options)
                times.append(time.perf_counter() - start)
            fit_seconds = statistics.median(times)
            baseline = one_estimate_seconds(model, result.batch_size, result.budget_bytes,
                                            {**options, "gpu": gpu})
            rows.append([model, gpu, result.batch_size, result.raw_batch_size, f"{fit_seconds:.2f}",
                         f"{baseline:.2f}", f"{fit_seconds / baseline:.1f}", result.num_estimates, result.replays,
                         f"{result.checked_from}–{result.batch_size}",
                         " ".join(f"{'~' if p.synthetic else ''}{p.batch_size}{'' if p.fits else '✗'}"
                                  for p in result.probes)])
    print(tabulate(rows, headers=["model", "gpu", "batch", "raw", "fit s", "1 estimate s", "fit / estimate",
                                  "estimates", "replays", "checked", "probes (✗: does not fit; ~: replay)"],
                   colalign=("left", "left", "right", "right", "right", "right", "right", "right", "right", "left",
                             "left"),
                   disable_numparse=True))


#: Issue 36 item 6's cases: (model, estimate options, fit options), on an A100 40 GB.
ITEM_6: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("resnet50", {}, {}), ("vit_b_16", {}, {}), ("gpt2", {"seq_len": 256}, {}), ("vgg16", {}, {"margin": 0}))
#: The fit's functions whose replays are counted apart, by piece.
PIECES = {"_check_below": "check", "_raw_boundary": "raw", "_with_expandable_segments": "expandable"}


def pieces() -> None:
    """One fit per case, its CPU time split by piece (see the module docstring)."""
    warnings.simplefilter("ignore")
    seconds: defaultdict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    inside: list[str] = []

    def timed(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return func(*args, **kwargs)
            finally:
                piece = name if name == "estimates" else (inside[-1] if inside else "search")
                seconds[piece] += time.process_time() - start
                counts[piece] += 1
        return wrapper

    def scoped(piece: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            inside.append(piece)
            try:
                return func(*args, **kwargs)
            finally:
                inside.pop()
        return wrapper

    # the real estimates; the replays: the jump's judgement (replay_under) and the family's probes
    timed_calls: tuple[tuple[object, str, str], ...] = (
        (fit, "run_estimate", "estimates"), (fit, "replay_under", "replays"), (affine.AffineFamily, "probe", "replays"),
        # since the batches the search traces are judged off their traces: the traces, the answer's
        # report, and the replays without a limit that judge the others
        *(((fit, "trace_estimate", "estimates"), (estimation.TracedEstimate, "report", "estimates"),
           (fit, "replay_stats", "replays")) if hasattr(fit, "trace_estimate") else ()))
    for owner, attribute, label in timed_calls:
        setattr(owner, attribute, timed(label, getattr(owner, attribute)))
    for name, piece in PIECES.items():
        setattr(fit, name, scoped(piece, getattr(fit, name)))
    rows = []
    for model, options, fit_options in ITEM_6:
        memcalc.estimate(model, batch_size=2, **options)  # warm-up
        best: tuple[float, dict[str, float], Counter[str]] | None = None
        for _ in range(FIT_REPEATS):
            seconds.clear()
            counts.clear()
            start = time.process_time()
            result = max_batch_size(model, gpu="a100-40gb", **options, **fit_options)
            total = time.process_time() - start
            if best is None or total < best[0]:
                best = (total, dict(seconds), counts.copy())
        estimates = []
        for _ in range(BASELINE_REPEATS):
            start = time.process_time()
            memcalc.estimate(model, batch_size=result.batch_size, gpu="a100-40gb", capacity=result.budget_bytes,
                             **options)
            estimates.append(time.process_time() - start)
        estimate = min(estimates)
        assert best is not None
        total, spent, made = best
        units = {piece: spent.get(piece, 0.0) / estimate
                 for piece in ("estimates", "search", "check", "raw", "expandable")}
        rest = total / estimate - sum(units.values())
        floor = units["estimates"] + units["search"] + units["check"]
        rows.append([model + (" margin 0" if fit_options else ""), f"{estimate:.3f}", f"{total / estimate:.2f}",
                     *(f"{units[piece]:.2f} ({made[piece]})" for piece in units), f"{rest:.2f}", f"{floor:.2f}"])
    print(tabulate(rows, headers=["case", "1 estimate s", "fit / estimate", "estimates", "search replays",
                                  "check replays", "raw replays", "expandable replays", "rest", "floor"],
                   disable_numparse=True))


class _Deciding(allocator.CachingAllocatorModel):
    """The allocator model, logging its decisions in terms that do not name a size or an address:
    two replays with equal logs made the same choice at every request."""

    def __init__(self, capacity: int | None) -> None:
        super().__init__(capacity)
        self.log: list[tuple[str, object]] = []
        self._numbers: dict[int, int] = {}  # id(block) -> the order it was made in
        self._made: list[object] = []  # every block made, kept alive so that no id is reused

    def _number(self, block: Any) -> None:
        self._numbers[id(block)] = len(self._made)
        self._made.append(block)

    def _get_free_block(self, pool: Any, size: int) -> Any:
        block = super()._get_free_block(pool, size)
        self.log.append(("cached", None if block is None else self._numbers[id(block)]))
        return block

    def _should_split(self, block: Any, size: int) -> bool:
        split = super()._should_split(block, size)
        self.log.append(("split", split))
        return split

    def _split(self, block: Any, size: int) -> Any:  # type: ignore[override]  # the parent's is static
        front = allocator.CachingAllocatorModel._split(block, size)
        self._number(front)
        return front

    def _alloc_block(self, pool: Any, alloc_size: int, force: bool = False, size: int = 0) -> Any:
        block = super()._alloc_block(pool, alloc_size, force, size)
        self.log.append(("segment", block is not None))
        if block is not None:
            self._number(block)
        return block

    def _release_block(self, block: Any) -> None:
        self.log.append(("released", self._numbers[id(block)]))
        super()._release_block(block)


def _decisions(family: affine.AffineFamily, batch: int, capacity: int | None) -> tuple[tuple[str, object], ...]:
    model = _Deciding(capacity)
    sizes = family.nbytes(batch) * 2  # the second iteration's keys are uid + N
    for event in family.program.events:
        if event >= 0:
            model.malloc(event, sizes[event])
        else:
            model.free(~event)
    return tuple(model.log)


def decisions() -> None:
    """Whether replays at neighbouring batches could share their work (ideas (b) and (c)): for each
    case (and vgg16 SGD amp-bf16 in 24 GiB with ``--margin 0``, the 169-replay fit) the family is
    replayed at every batch of the checked range and a few above, without a limit and under the
    search's, each allocator decision logged (:class:`_Deciding`); printed: how many neighbouring
    batches make the same decisions, where (as a fraction of the log) their first difference lies,
    and the largest floor (``AffineFamily.least_peak``) over the checked range against the limit —
    a replay the floor could skip has its floor over the limit."""
    warnings.simplefilter("ignore")
    families: list[affine.AffineFamily] = []
    from_traces = affine.AffineFamily.from_traces.__func__  # type: ignore[attr-defined]

    def kept(cls: type[affine.AffineFamily], *args: Any) -> affine.AffineFamily | None:
        family = from_traces(cls, *args)
        if family is not None:
            families.append(family)
        return family

    affine.AffineFamily.from_traces = classmethod(kept)  # type: ignore[method-assign, assignment]
    cases = (*((model, {"gpu": "a100-40gb", **options, **fit_options}) for model, options, fit_options in ITEM_6),
             ("vgg16", {"budget": "24GiB", "optimizer": "sgd", "precision": "amp-bf16", "margin": 0}))
    rows = []
    for model, options in cases:
        families.clear()
        result = max_batch_size(model, **options)
        family = families[-1]
        limit = result.margin_budget_bytes
        batches = range(max(1, result.checked_from - 2), result.batch_size + 6)
        floor = max(family.least_peak(batch) for batch in range(result.checked_from, result.batch_size + 1))
        for capacity, label in ((None, "none"), (limit, "the search's")):
            logs = [_decisions(family, batch, capacity) for batch in batches]
            pairs = list(itertools.pairwise(logs))
            same = sum(one == other for one, other in pairs)
            first = sorted(next((i for i, (a, b) in enumerate(zip(one, other, strict=False)) if a != b),
                                min(len(one), len(other))) / max(len(one), 1) for one, other in pairs)
            rows.append([model, ", ".join(f"{k}={v}" for k, v in options.items() if k != "gpu"), label,
                         f"{batches.start}–{batches.stop - 1}", len(logs[0]), f"{same}/{len(pairs)}",
                         f"{first[0]:.2f}–{first[-1]:.2f} (median {first[len(first) // 2]:.2f})",
                         f"{floor / limit:.2f}"])
    print(tabulate(rows, headers=["model", "options", "limit", "batches", "decisions", "neighbours equal",
                                  "first difference", "floor / limit"], disable_numparse=True))


def _fake_step_seconds(name: str, batch: int, symbolic: bool) -> tuple[float, int, int, list[str]]:
    """One forward and backward of zoo model ``name`` under ``FakeTensorMode``: CPU seconds, the
    outputs' storages, how many of them have symbolic bytes, and the shape environment's guards."""
    import torch
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.utils._python_dispatch import TorchDispatchMode

    import models_zoo

    entry = models_zoo.get(name)
    assert entry is not None and entry.builder is not None
    with torch.device("meta"):
        model = entry.builder(entry.default_shape)
    env = ShapeEnv() if symbolic else None
    mode = FakeTensorMode(shape_env=env)

    def fake(tensor: torch.Tensor, source: str, dynamic: bool = False) -> torch.Tensor:
        if env is None:
            return mode.from_tensor(tensor)
        sizes = [DimDynamic.DYNAMIC if dynamic and i == 0 else DimDynamic.STATIC for i in range(tensor.dim())]
        return mode.from_tensor(tensor, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes),
                                source=ConstantSource(source))

    state = {n: torch.nn.Parameter(fake(torch.empty(p.shape), n)) for n, p in model.named_parameters()}
    state |= {n: fake(torch.zeros(b.shape, dtype=b.dtype), n) for n, b in model.named_buffers()}
    inputs = fake(torch.empty(batch, *entry.default_shape), "batch", dynamic=True)
    outputs: list[object] = []

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            outputs.extend(t.untyped_storage().nbytes() for t in (out if isinstance(out, (tuple, list)) else (out,))
                           if isinstance(t, torch.Tensor))
            return out

    start = time.process_time()
    with mode, Storages():
        torch.func.functional_call(model, state, (inputs,)).sum().backward()
    seconds = time.process_time() - start
    guards = [str(guard.expr) for guard in env.guards] if env is not None else []
    return seconds, len(outputs), sum(not isinstance(n, int) for n in outputs), guards


def symbolic() -> None:
    """Idea (d), one trace with a symbolic batch: resnet50's and vgg16's forward and backward at
    batch 64 under torch's ``FakeTensorMode``, once with every size concrete and once with the batch
    a ``ShapeEnv`` symbol (the parameters static), both warm (the second of two runs), against one
    warm ``memcalc.estimate`` of the same model and batch; with the storages whose bytes are symbolic
    and the guards the trace left on the batch (where its sizes hold)."""
    warnings.simplefilter("ignore")
    rows = []
    for name in ("resnet50", "vgg16"):
        batch = 64
        memcalc.estimate(name, batch_size=batch, gpu="a100-40gb")
        start = time.process_time()
        memcalc.estimate(name, batch_size=batch, gpu="a100-40gb")
        estimate = time.process_time() - start
        for is_symbolic in (False, True):
            _fake_step_seconds(name, batch, is_symbolic)  # warm-up: FakeTensor's dispatch cache
            seconds, storages, symbols, guards = _fake_step_seconds(name, batch, is_symbolic)
            rows.append([name, "symbolic" if is_symbolic else "concrete", f"{seconds:.3f}", f"{estimate:.3f}",
                         f"{seconds / estimate:.1f}", f"{symbols}/{storages}", "; ".join(guards) or "-"])
    print(tabulate(rows, headers=["model", "batch", "fake fwd+bwd s", "1 estimate s", "/ estimate",
                                  "symbolic storages", "guards"], disable_numparse=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", action="store_true", help="issue 36 item 6: one fit's time by piece")
    parser.add_argument("--decisions", action="store_true",
                        help="issue 36 item 6: do replays at neighbouring batches make the same decisions?")
    parser.add_argument("--symbolic", action="store_true",
                        help="issue 36 item 6: what one trace with a symbolic batch costs")
    arguments = parser.parse_args()
    (pieces if arguments.pieces else decisions if arguments.decisions else symbolic if arguments.symbolic
     else main)()
