"""Pipeline ranks that run the same thing share one trace.

A middle pipeline rank (none of its stages holds the embedding or the head) traces the same ops,
storage for storage, as another middle rank when both hold stages of identical blocks at the same
offsets from their first stage, run the same compute actions in the same order (stage-relative:
GPipe's and looped BFS's middle ranks do; 1F1B's and the interleaved schedules' do not, their
warm-up depth grows with the rank: :mod:`pipeline_compose` composes theirs from one rank's calls),
and checkpoint the same blocks of their stages. Such a rank's
traced step is the other's with the names of its modules changed (:func:`renamed_step`): its held
blocks' names, and the pass-throughs its forward runs before its first block (the other stages'
blocks) in place of the other's. Its report is then built from that step as from its own trace.

What decides it (:func:`share_key`) is read from the model, never assumed: each block's module
tree, every parameter's and buffer's shape, dtype and ``requires_grad``, and each module's plain
attributes (a Hugging Face layer's ``attention_type`` or ``sliding_window``), less ``layer_idx``
(its key-value cache slot, unused in training). Anything the renaming cannot account for (a
storage made by a pass-through, a module run between two pass-throughs, a cost recorder without
per-op records) makes :func:`renamed_step` decline, and the rank is traced.
tests/test_pipeline.py compares every byte of every shared rank's report with its own trace.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch
from torch import nn

from memcalc.core.checkpointing import Checkpointing, CheckpointKind
from memcalc.distributed.pipeline_schedules import Action
from memcalc.engine.run import LOGICAL_NUMEL, TracedStep

__all__ = ("block_fingerprint", "renamed_step", "share_key")

#: A module attribute that differs from block to block without changing what a block runs in a
#: training step: Hugging Face's ``layer_idx`` (the layer's slot in a key-value cache).
_PER_BLOCK = frozenset({"layer_idx"})
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
#: Checkpointing whose blocks :meth:`Checkpointing.checkpoints_block` names (``auto`` is chosen later).
_KNOWN_BLOCKS = frozenset({CheckpointKind.OFF, CheckpointKind.FULL, CheckpointKind.EVERY,
                           CheckpointKind.SELECTIVE_OP, CheckpointKind.POLICY})


def share_key(model: nn.Module, all_blocks: Sequence[str], stages: Sequence[int],
              blocks: Sequence[Sequence[str]], total: int, actions: Sequence[Action],
              checkpoint: Checkpointing) -> Hashable | None:
    """What a pipeline rank's trace depends on beyond its module names; two ranks with the same
    key trace the same step. None: the rank holds the first or the last stage, or checkpoints
    blocks chosen later (``auto``), and is traced on its own.

    Args:
        model: the whole model (the blocks are read from it).
        all_blocks: every block of the model, in order (:attr:`ModelLayout.blocks`).
        stages: the stages the rank holds.
        blocks: the blocks of every stage of the model.
        total: the stages of the model.
        actions: the rank's compute actions, in the order it runs them.
        checkpoint: the step's checkpointing.
    """
    if any(s in (0, total - 1) for s in stages) or checkpoint.kind not in _KNOWN_BLOCKS:
        return None
    local = {s: i for i, s in enumerate(stages)}
    index = {name: i for i, name in enumerate(all_blocks)}
    return (
        tuple(s - stages[0] for s in stages),
        tuple((local[a.stage], a.kind, a.microbatch) for a in actions),
        tuple(tuple(block_fingerprint(model.get_submodule(b)) for b in blocks[s]) for s in stages),
        tuple(tuple(checkpoint.checkpoints_block(index[b]) for b in blocks[s]) for s in stages),
    )


def block_fingerprint(block: nn.Module) -> Hashable:
    """Everything of ``block`` that shapes what it runs: its module tree, their types, parameters,
    buffers and plain attributes (less :data:`_PER_BLOCK`)."""
    rows = []
    for name, sub in block.named_modules():
        attributes = tuple(sorted((k, v) for k, v in vars(sub).items()
                                  if not k.startswith("_") and k not in _PER_BLOCK and _plain(v)))
        parameters = tuple((n, tuple(p.shape), p.dtype, p.requires_grad, getattr(p, LOGICAL_NUMEL, None),
                            type(p)) for n, p in sub.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in sub.named_buffers(recurse=False))
        rows.append((name, type(sub), attributes, parameters, buffers))
    return tuple(rows)


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def renamed_step(traced: TracedStep, source: Sequence[Sequence[str]], target: Sequence[Sequence[str]],
                 all_blocks: Sequence[str]) -> TracedStep | None:
    """``traced`` (the step of a rank holding the stages whose blocks are ``source``) as the rank
    holding ``target`` (blocks of the same stages' shapes, one tuple per stage it holds) traces it:
    the held blocks renamed, and the pass-throughs run before the first held block those of
    ``target``. None: the step names its modules in a way the renaming cannot follow.

    A stage's module is ``stages.{i}.model`` of the rank's runner; its forward runs every block
    of the model in order, the other stages' blocks as pass-throughs, and stops after its last
    held block: in first-call order, a stage's modules are ``…, pass-throughs, held blocks and
    their submodules, …``.
    """
    renames: dict[str, str] = {}
    passing: dict[str, int] = {}  # the source's pass-throughs, by stage
    wanted: list[list[str]] = []  # the target's, in call order
    for i, (mine, theirs) in enumerate(zip(source, target, strict=True)):
        prefix = f"stages.{i}.model."
        renames.update((prefix + a, prefix + b) for a, b in zip(mine, theirs, strict=True))
        passing.update((prefix + b, i) for b in all_blocks[:all_blocks.index(mine[0])])
        wanted.append([prefix + b for b in all_blocks[:all_blocks.index(theirs[0])]])
    known = frozenset(all_blocks)
    order = traced.module_order
    shapes = traced.output_shapes
    if list(shapes) != order:
        return None

    memo: dict[str, str] = {}

    def rename(name: str) -> str:
        new = memo.get(name)
        if new is None:
            new = memo[name] = next((after + name[len(old):] for old, after in renames.items()
                                     if name == old or name.startswith(old + ".")), name)
        return new

    new_order: list[str] = []
    new_shapes: dict[str, tuple[int, ...]] = {}
    position = 0
    while position < len(order):
        name = order[position]
        stage = passing.get(name)
        if stage is None:
            if _pass_through_of(name, source, known) is not None:
                return None  # a block of another stage run where the stage's own forward does not
            new = rename(name)
            new_order.append(new)
            new_shapes[new] = shapes[name]
            position += 1
            continue
        # the stage's pass-throughs, one after the other, then its first held block
        run = [n for n in passing if passing[n] == stage]
        if order[position:position + len(run)] != run or len({shapes[n] for n in run}) != 1:
            return None
        after = position + len(run)
        if after >= len(order) or order[after] != f"stages.{stage}.model.{source[stage][0]}":
            return None
        for new in wanted[stage]:
            new_order.append(new)
            new_shapes[new] = shapes[run[0]]
        position = after
    if len(new_order) != len(set(new_order)):
        return None
    trace = traced.trace
    if any(name in passing for name in set(trace.module)):
        return None  # a pass-through made a storage
    modules = [rename(name) for name in trace.module]
    costs = traced.costs
    if costs is not None:
        records = getattr(costs, "records", None)
        if not isinstance(records, list) or not all(hasattr(r, "_replace") for r in records):
            return None
        if any(r.module in passing for r in records):
            return None
        costs = copy.copy(costs)
        costs.records = [r._replace(module=rename(r.module)) if r.module else r for r in records]  # type: ignore[attr-defined]
    shared = copy.copy(traced)
    shared.trace = replace(trace, module=modules)
    shared.module_order = new_order
    shared.output_shapes = new_shapes
    shared.notes = list(traced.notes)
    shared.costs = costs
    return shared


def _pass_through_of(name: str, source: Sequence[Sequence[str]], all_blocks: frozenset[str]) -> int | None:
    """The stage whose forward runs ``name`` as another stage's block after its own first block
    (never, for a non-last stage: it stops after its last); None: ``name`` is not such a block."""
    for i, mine in enumerate(source):
        prefix = f"stages.{i}.model."
        if name.startswith(prefix) and name[len(prefix):] in all_blocks and name[len(prefix):] not in mine:
            return i
    return None

