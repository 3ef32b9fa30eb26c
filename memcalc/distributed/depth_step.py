"""A deep model's traced step from three shallow ones: depth extrapolation for the rank programs.

Tracing 80 identical decoder layers through DTensor and FSDP2 is most of a distributed estimate of
a deep model. :func:`traced_by_depth` traces the step with 2, 3 and 4 blocks instead, composes the
4-block step from the 2- and 3-block ones (:mod:`depth_compose`) and compares it with the traced
one, field by field (every event, storage, name, category, communication buffer, note, module
row, kernel cost record); only if they are equal does it compose the full depth from the 3- and
4-block steps. Anything it cannot follow (a loop traced whole, a pre-existing storage freed, notes
that change with the depth otherwise than by naming it) makes it decline, and the caller traces
the whole model. tests/test_depth_step.py compares whole reports, byte for byte, with the full
trace.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from memcalc.core.categories import Mode
from memcalc.core.checkpointing import CheckpointKind
from memcalc.core.finetune import FineTune
from memcalc.distributed.depth_chunks import index_of, pattern_of
from memcalc.distributed.depth_compose import compose_depth
from memcalc.distributed.pipeline_share import block_fingerprint
from memcalc.engine.model import ResolvedModel
from memcalc.engine.run import TracedStep
from memcalc.engine.step_spec import Step

if TYPE_CHECKING:  # the FLOP recorder is imported only where --time asks for it (tests/test_startup.py)
    from memcalc.timing.flops import OpCost

__all__ = ("RoleTrace", "cut_blocks", "extrapolated_depth", "traced_by_depth")

#: The depths traced: the first block differs from the others (a cuBLAS handle's workspace made
#: once, nothing to prefetch before it), the last too (nothing after it), so the two steps a
#: composition learns from have a steady block between them.
_TRACED: tuple[int, int, int] = (2, 3, 4)
_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class RoleTrace:
    """A role's traced step and the uids of its rank program's communication buffers."""

    traced: TracedStep
    communication: frozenset[int]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.traced, self.communication))


#: Checkpointing that treats every block alike (``every:N`` does not: a period of N blocks).
_UNIFORM = frozenset({CheckpointKind.OFF, CheckpointKind.FULL, CheckpointKind.SELECTIVE_OP})


def extrapolated_depth(resolved: ResolvedModel, step: Step) -> int | None:
    """The blocks per container of a model whose step may be composed from shallow ones: one
    container (a ``ModuleList``) of more than five blocks alike in everything a step runs
    (:func:`memcalc.distributed.pipeline_share.block_fingerprint`), a plain training step of them
    (no fine-tuning, compile, float8 or trainer loop) checkpointing every block alike; None: none."""
    if len(resolved.block_containers) != 1 or step.mode is not Mode.TRAIN or step.compile:
        return None
    trainer = step.loop.preset is not None and step.loop.preset.is_trainer  # the Trainer's loop, TRL's too
    if step.float8 is not None or step.finetune != FineTune() or trainer:
        return None
    if step.checkpoint.kind not in _UNIFORM:
        return None
    blocks = resolved.module.get_submodule(resolved.block_containers[0])
    if not isinstance(blocks, nn.ModuleList) or len(blocks) <= _TRACED[-1] + 1:
        return None
    first = block_fingerprint(blocks[0])
    return len(blocks) if all(block_fingerprint(b) == first for b in blocks) else None


def cut_blocks(resolved: ResolvedModel, depth: int) -> None:
    """``resolved`` with its first ``depth`` blocks only, as if built with that many (a Hugging
    Face config's ``num_hidden_layers``, which its forward slices the layers by, too)."""
    blocks = resolved.module.get_submodule(resolved.block_containers[0])
    assert isinstance(blocks, nn.ModuleList)
    del blocks[depth:]
    config = getattr(resolved.module, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = depth
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:depth]


def traced_by_depth(trace_at: Callable[[int], RoleTrace], depth: int, containers: Sequence[str]) -> RoleTrace | None:
    """The step at ``depth`` blocks composed from ``trace_at`` 2, 3 and 4 blocks, checked as the
    module docstring says; None: declined (the caller traces ``depth`` blocks)."""
    if depth <= _TRACED[-1] + 1:
        return None
    a, b, c = _TRACED
    first = trace_at(a)
    if not _composable(first.traced):
        return None
    second, third = trace_at(b), trace_at(c)
    check = _compose(first, second, b, c, containers)
    if check is None or not _same(check, third):
        return None
    return _compose(second, third, c, depth, containers)


def _composable(traced: TracedStep) -> bool:
    return (_records(traced) is not None and traced.iteration_starts is None and not traced.successors
            and traced.paged_optimizer_state == 0)


def _records(traced: TracedStep) -> list[OpCost] | None:
    """The step's kernel cost records ([] where none were recorded); None: costs kept otherwise
    than as :class:`OpCost` records (not followed)."""
    if traced.costs is None:
        return []
    from memcalc.timing.flops import OpCost as Recorded  # costs were recorded: the recorder is loaded already

    records = getattr(traced.costs, "records", None)
    if not isinstance(records, list) or not all(isinstance(r, Recorded) for r in records):
        return None
    return records


def _compose(shallow: RoleTrace, deep: RoleTrace, deep_depth: int, depth: int,
             containers: Sequence[str]) -> RoleTrace | None:
    s, d = shallow.traced, deep.traced
    if not (_composable(s) and _composable(d)):
        return None
    composed = compose_depth(s.trace, s.categories, d.trace, d.categories, set(deep.communication), deep_depth,
                             depth, containers, None if d.costs is None else (_records(s) or [], _records(d) or []))
    if composed is None:
        return None
    order = _module_order(s.module_order, d.module_order, depth - deep_depth, pattern_of(containers))
    notes = _notes(s.notes, d.notes, deep_depth, depth)
    if order is None or notes is None:
        return None
    extra = depth - deep_depth
    traced = copy.copy(d)
    traced.trace = composed.trace
    traced.categories = composed.categories
    traced.module_order = [name for name, _ in order]
    traced.output_shapes = {name: d.output_shapes[old] for name, old in order if old in d.output_shapes}
    traced.notes = notes
    traced.attention = dict(_affine(Counter(s.attention), Counter(d.attention), extra))
    if d.approximated is not None:  # the backend's own count, on the same line as the op counts
        traced.approximated = dict(_affine(Counter(s.approximated or {}), Counter(d.approximated), extra))
    traced.successors = {}
    if composed.records is not None:
        traced.costs = copy.copy(d.costs)
        traced.costs.records = composed.records  # type: ignore[union-attr]
    return RoleTrace(traced, frozenset(composed.communication))


def _affine(shallow: Counter[str], deep: Counter[str], extra: int) -> Counter[str]:
    return Counter({key: n + extra * (n - shallow.get(key, 0)) for key, n in deep.items()})


def _module_order(shallow: Sequence[str], deep: Sequence[str], extra: int,
                  pattern: re.Pattern[str]) -> list[tuple[str, str]] | None:
    """The modules in first-call order at the composed depth, each with the name it has in ``deep``:
    the modules one more block adds (found as :func:`depth_chunks` finds events) ``extra + 1``
    times, the others once, their block indices moved as the alignment says."""

    def blank(name: str) -> Hashable:
        return pattern.sub(lambda m: f"{m.group(1)}.*", name)

    def moved(name: str, shift: int) -> str:
        return pattern.sub(lambda m: f"{m.group(1)}.{int(m.group(2)) + shift}", name) if shift else name

    matcher = difflib.SequenceMatcher(None, [blank(n) for n in shallow], [blank(n) for n in deep], autojunk=False)
    order: list[tuple[str, str]] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            order.extend((moved(name, s), name) for s in range(extra + 1) for name in deep[j1:j2])
            continue
        if tag != "equal":
            return None
        shifts = {index_of(pattern, new) - index_of(pattern, old)  # type: ignore[operator]
                  for old, new in zip(shallow[i1:i2], deep[j1:j2], strict=True) if index_of(pattern, new) is not None}
        if len(shifts) > 1 or not shifts <= {0, 1}:
            return None
        shift = next(iter(shifts), 0) * extra
        order.extend((moved(name, shift), name) for name in deep[j1:j2])
    names = [name for name, _ in order]
    return order if len(names) == len(set(names)) else None


def _notes(shallow: Sequence[str], deep: Sequence[str], deep_depth: int, depth: int) -> list[str] | None:
    """``deep``'s notes at ``depth``: a number that is each step's depth (``activation checkpointing
    on 4 blocks``) becomes ``depth``; any other difference declines."""
    if len(shallow) != len(deep):
        return None
    notes: list[str] = []
    for old, new in zip(shallow, deep, strict=True):
        a, b = _NUMBER.split(old), _NUMBER.split(new)
        if len(a) != len(b):
            return None
        parts: list[str] = []
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            if x == y:
                parts.append(y)
            elif k % 2 and int(x) == deep_depth - 1 and int(y) == deep_depth:
                parts.append(str(depth))
            else:
                return None
        notes.append("".join(parts))
    return notes


def _same(composed: RoleTrace, traced: RoleTrace) -> bool:
    """Every field the report reads is equal."""
    x, y = composed.traced, traced.traced
    fields = ("nbytes", "phase", "module", "category", "events", "preexisting", "phase_starts", "op_counts", "op",
              "phase_log", "sized", "stream")
    return (all(getattr(x.trace, f) == getattr(y.trace, f) for f in fields)
            and x.categories == y.categories and composed.communication == traced.communication
            and x.module_order == y.module_order and x.output_shapes == y.output_shapes and x.notes == y.notes
            and x.attention == y.attention and x.loss == y.loss and x.optimizer_impl == y.optimizer_impl
            and _records(x) == _records(y) and getattr(x.costs, "failures", None) == getattr(y.costs, "failures", None))
