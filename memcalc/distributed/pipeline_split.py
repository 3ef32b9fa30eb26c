"""Splitting a model into pipeline stages: which blocks each stage holds, and the stage's module.

torchtitan's pipeline split deep-copies the model for each stage and deletes the layers the
stage does not hold; the model's forward then skips what is gone (``if self.tok_embeddings``).
Most models' forwards do not skip (a zoo or Hugging Face forward calls its embedding and passes
rotary tables to every layer), so memcalc keeps the model's own forward and cuts it instead:

* a stage holds the blocks of :attr:`ResolvedModel.block_containers` from its first split
  point to the next (torch's ``SplitPoint.BEGINNING`` convention: ``"layers.4"`` starts a
  stage); blocks of other stages are replaced by parameter-free pass-throughs;
* the modules with parameters that run before the first block (the embedding) stay on the
  first stage only; elsewhere they are parameter-free stand-ins whose output, a zero-stride
  expansion of one element, has the shape the real one had, and the stage's first block is
  handed the activation received from the previous stage instead;
* the modules after the last block (final norm, head) stay on the last stage only; the other
  stages stop the forward when their last block returns, and send that block's output.

What the model's forward computes outside its modules (a mask, rotary tables) runs on every
stage, as it does in torchtitan's stages.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.engine.losses import primary_tensor
from memcalc.engine.model import ModelInputs
from memcalc.targets.grouped_mm import grouped_mm_on_meta

__all__ = ("ModelLayout", "StageModule", "block_containers_of", "layout_of", "stage_blocks")


@dataclass(frozen=True)
class ModelLayout:
    """What a dry run of the model on meta found: its blocks in call order, the modules with
    parameters before and after them, and the shape of what flows between blocks.

    Attributes:
        containers: the paths of the containers of blocks.
        blocks: every block's name (``"layers.0"``), in model order.
        before: the outer modules with parameters called before the first block.
        after: those called after the last block (or never called).
        activation: shape and dtype of a block's input at one microbatch.
        stand_ins: per module of ``before``, the shape and dtype of its output.
    """

    containers: tuple[str, ...]
    blocks: tuple[str, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    activation: tuple[tuple[int, ...], torch.dtype]
    stand_ins: dict[str, tuple[tuple[int, ...], torch.dtype]]


def block_containers_of(module: nn.Module, known: Sequence[str]) -> tuple[str, ...]:
    """The containers of the model's blocks: ``known`` (a zoo or Hugging Face model's), else its
    outermost ``nn.ModuleList``s with parameters (FSDP's units use the same rule,
    :func:`memcalc.distributed.fsdp.fsdp_units`)."""
    if known:
        return tuple(known)
    found: list[str] = []
    for name, sub in module.named_modules():
        if (isinstance(sub, nn.ModuleList) and not any(name.startswith(f + ".") for f in found)
                and next(sub.parameters(), None) is not None):
            found.append(name)
    return tuple(found)


def layout_of(module: nn.Module, inputs: ModelInputs, containers: Sequence[str], name: str) -> ModelLayout:
    """Run ``module`` once on ``inputs`` (meta, one microbatch) and record its layout.

    Raises:
        InapplicableOptionError: the model has no repeated blocks memcalc knows, or they are not
            a chain (a block's input is not shaped as its output).
    """
    blocks = [f"{path}.{child}" if path else child for path in containers
              for child, _ in module.get_submodule(path).named_children()]
    if not blocks:
        raise InapplicableOptionError(
            f"{name} has no repeated blocks that memcalc knows how to split into pipeline stages",
            hint="Pipeline parallelism splits the blocks of zoo and Hugging Face transformers (their layers).")
    outer = _outer_modules(module, blocks)
    order: list[str] = []
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    block_io: dict[str, tuple[Any, Any]] = {}
    handles = []
    # the blocks after the first are pass-throughs for the dry run (they are a chain: the first
    # block's output is shaped as its input, checked below): the layout is the first block's
    # input and the order of the calls, and a model of 126 blocks runs one block, not all
    swapped: list[tuple[str, nn.Module]] = []
    try:
        for block in blocks[1:]:
            swapped.append((block, _swap(module, block, _PassThrough())))
        for mod_name in [*blocks, *outer]:
            sub = module.get_submodule(mod_name)

            def pre(_m: nn.Module, args: Any, kwargs: Any, mod_name: str = mod_name) -> None:
                order.append(mod_name)

            def post(_m: nn.Module, args: Any, kwargs: Any, output: Any, mod_name: str = mod_name) -> None:
                first = _first_tensor(output)
                if first is not None:
                    shapes.setdefault(mod_name, (tuple(first.shape), first.dtype))
                if mod_name in blocks:
                    block_io.setdefault(mod_name, (_block_input(args, kwargs), first))

            handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(sub.register_forward_hook(post, with_kwargs=True))
        # outside the step's backend: a mixture of experts' grouped matmuls need its meta kernel
        # here too (torch's own asks for bf16 operands, as CUDA's kernel does)
        with torch.no_grad(), grouped_mm_on_meta():
            inputs.call(module)
    finally:
        for handle in handles:
            handle.remove()
        for block, original in reversed(swapped):
            _swap(module, block, original)
    block_calls = [i for i, n in enumerate(order) if n in blocks]
    if not block_calls:
        raise InapplicableOptionError(f"{name}'s forward calls none of its blocks ({', '.join(blocks[:3])}, ...)")
    first_call = block_calls[0]
    seen_before = {n for n in order[:first_call] if n in outer}
    before = tuple(n for n in outer if n in seen_before)
    after = tuple(n for n in outer if n not in seen_before)
    x_in, x_out = block_io[blocks[0]]
    if x_in is None or x_out is None or tuple(x_in.shape) != tuple(x_out.shape):
        raise InapplicableOptionError(
            f"{name}'s blocks are not a chain of one activation (block {blocks[0]} takes "
            f"{_shape(x_in)} and returns {_shape(x_out)})",
            hint="Pipeline stages send one activation from block to block, as transformer layers do.")
    return ModelLayout(tuple(containers), tuple(blocks), before, after, (tuple(x_in.shape), x_in.dtype),
                       {n: shapes[n] for n in before if n in shapes})


def stage_blocks(blocks: Sequence[str], stages: int, split_points: Sequence[str] | None) -> list[tuple[str, ...]]:
    """The blocks of each of ``stages`` stages: even by default (the first stages take one more
    when they do not divide), or starting at each of the user's ``split_points``.

    Raises:
        InvalidInputError: more stages than blocks, or split points that are not blocks in
            increasing order, or not ``stages - 1`` of them.
    """
    n = len(blocks)
    if split_points is None:
        if stages > n:
            raise InvalidInputError(f"{stages} pipeline stages need at least {stages} blocks; the model has {n}",
                                    hint="Use fewer pipeline stages (pp) or fewer stages per rank.")
        per, extra = divmod(n, stages)
        sizes = [per + (1 if s < extra else 0) for s in range(stages)]
        starts = [sum(sizes[:s]) for s in range(stages)]
    else:
        if len(split_points) != stages - 1:
            raise InvalidInputError(f"{stages} pipeline stages take {stages - 1} split points; got {len(split_points)}",
                                    hint="Name the block each stage after the first begins with, e.g. layers.4.")
        unknown = [p for p in split_points if p not in blocks]
        if unknown:
            raise InvalidInputError(f"split points {', '.join(unknown)} are not blocks of the model",
                                    hint=f"Blocks are named {blocks[0]} ... {blocks[-1]}.")
        starts = [0, *(blocks.index(p) for p in split_points)]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise InvalidInputError(f"split points must name blocks in increasing order: {', '.join(split_points)}")
    ends = [*starts[1:], n]
    return [tuple(blocks[a:b]) for a, b in zip(starts, ends, strict=True)]


class _StageExit(Exception):
    """Carries a non-last stage's output out of the model's forward."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class _PassThrough(nn.Module):
    """A block of another stage: returns the activation it is given."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _block_input(args, kwargs)


class _StandIn(nn.Module):
    """A module of the first stage on a later stage: an output of the right shape, one element."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        return _stand_in(self.shape, self.dtype, device)


class StageModule(nn.Module):
    """One pipeline stage of a model: ``forward(*inputs)`` on the first stage,
    ``forward(activation)`` on the others; returns the model's output on the last stage, the
    activation to send on the others.

    Args:
        model: the model (a deep copy is cut; ``model`` is left as it was).
        layout: its :func:`layout_of`.
        blocks: the blocks of this stage.
        first, last: whether the stage is the first or the last.
        inputs: the model's inputs at one microbatch (later stages call the forward with
            zero-stride stand-ins of their shapes).
    """

    def __init__(self, model: nn.Module, layout: ModelLayout, blocks: Sequence[str], *, first: bool, last: bool,
                 inputs: ModelInputs) -> None:
        super().__init__()
        held = set(blocks)
        replaced: dict[str, nn.Module] = {name: _PassThrough() for name in layout.blocks if name not in held}
        if not first:
            replaced.update((name, _StandIn(*layout.stand_ins[name])) for name in layout.before)
        if not last:
            replaced.update((name, nn.Identity()) for name in layout.after)
        # deepcopy's memo hands back the replacement for each module left out: only what the
        # stage keeps is copied (two of a 126-layer model's blocks, not all of them)
        memo: dict[int, Any] = {id(model.get_submodule(name)): new for name, new in replaced.items()}
        cut = copy.deepcopy(model, memo)
        self.model = cut
        self.first, self.last = first, last
        self.block_names = tuple(blocks)
        self._input_layout = inputs
        self._activation: torch.Tensor | None = None
        head, tail = cut.get_submodule(blocks[0]), cut.get_submodule(blocks[-1])
        if not first:
            head.register_forward_pre_hook(self._inject, with_kwargs=True)
        if not last:
            tail.register_forward_hook(self._exit)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.first:
            call = ModelInputs(args, kwargs)
        else:
            self._activation = args[0]
            device = self._activation.device
            call = self._input_layout.map(lambda t: _stand_in(t.shape, t.dtype, device))
        try:
            output = call.call(self.model)
        except _StageExit as exit_:
            return exit_.output
        finally:
            self._activation = None
        # the pipeline's loss takes the last stage's tensors: a Hugging Face ModelOutput's logits
        return output if isinstance(output, (torch.Tensor, tuple, list)) else primary_tensor(output)

    def _inject(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (self._activation, *args[1:]), kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: self._activation}

    @staticmethod
    def _exit(_module: nn.Module, _args: Any, output: Any) -> None:
        raise _StageExit(_first_tensor(output))


def _stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """A zero-stride expansion of one element in place of a tensor a later stage does not hold (the
    model's inputs, the first stage's modules' outputs), made with the dispatch modes set aside so that
    the trace does not count it: a real later stage receives its activation and allocates none of them.
    (Counted, the 8 B of an ``input_ids`` stand-in were the last stage's only excess over real gloo
    runs of pp x tp and pp x tp x ep, alive through its forward: tests/test_gloo_pipeline_tp.py.) An op
    that views one makes the tracer count it from then on, as before."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def _outer_modules(module: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The largest modules with parameters that are neither a block, inside one, nor hold one."""
    block_set = set(blocks)
    holders = {""} | {b.rsplit(".", 1)[0] if "." in b else "" for b in blocks}
    for b in blocks:  # every ancestor of a block holds it
        parts = b.split(".")
        holders.update(".".join(parts[:i]) for i in range(1, len(parts)))
    outer: list[str] = []
    for name, sub in module.named_modules():
        if not name or name in block_set or name in holders:
            continue
        if any(name.startswith(b + ".") for b in block_set):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent in holders and any(True for _ in sub.parameters()):
            outer.append(name)
    return outer


def _swap(module: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` in place of the submodule ``name`` of ``module``; returns the one it replaced."""
    parent, _, child = name.rpartition(".")
    holder = module.get_submodule(parent)
    old = holder.get_submodule(child)
    setattr(holder, child, new)
    return old


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)


def _block_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in value if isinstance(t, torch.Tensor)), None)
    if isinstance(value, dict):
        return next((t for t in value.values() if isinstance(t, torch.Tensor)), None)
    return None
