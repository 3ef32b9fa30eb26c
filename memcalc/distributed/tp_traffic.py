"""What a tensor-parallel plan communicates per micro-batch, read from its styles: the collectives
torch's ``ColwiseParallel`` and ``RowwiseParallel`` run (DTensor's redistributions) on the
modules a Hugging Face plan names, for ``memcalc plan``'s cost model (:mod:`memcalc.distributed.collectives`).

Each style's layouts say it (torch 2.13, ``torch/distributed/tensor/parallel/style.py``):

- a column-wise ``nn.Linear`` takes its input ``Replicate()``: the input's gradient comes back
  ``Partial`` and is all-reduced in backward (one per module: q, k and v each their own); an output
  ``Replicate()`` is all-gathered in forward (``colwise_gather_output``: the logits);
- a row-wise ``nn.Linear`` all-reduces its ``Partial`` output ``Replicate()`` in forward; one that
  takes its input ``Replicate()`` chunks it (no collective) and all-gathers the gradient back;
- an ``nn.Embedding`` takes token ids (no gradient): row-wise it all-reduces its output, column-wise
  it all-gathers it.

Element sizes: a ``Linear``'s output is the compute dtype (autocast's matmul); an ``Embedding``'s
output and a block's residual stream, which every column-wise input is taken from, are in the
dtype the parameters are in during the forward (:meth:`ModelFacts.stream_bytes_under`: float32
under autocast, FSDP2's 16-bit ``param_dtype`` where it casts them). Other layouts (``Shard(1)``:
torchtitan's plan, ``SequenceParallel``, ``PrepareModuleInput``; a row-wise output left sharded)
are not read here: :func:`plan_traffic` says None for such a plan, and tp's closed formula
stands for it.

Checkpointing re-runs a block's forward collectives in backward, but torch's non-reentrant
checkpoint stops its recomputation once the saved tensors are back (``_enable_checkpoint_early_stop``),
so the output collective of the block's last sub-layer, whose result only joins the residual sum,
is not re-run: a traced llama-tiny under tp=2 and full checkpointing runs 66 all-reduces where off
runs 58 (each block's ``o_proj`` again, not its ``down_proj``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from torch import nn

from memcalc.distributed.tp_plans import TpPlan, planned

__all__ = ("Kind", "Transfer", "plan_traffic")


class Kind(str, Enum):
    """The collectives a tensor-parallel style runs."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class Transfer:
    """One collective a planned module runs per micro-batch: its kind, the whole tensor's elements per
    token and whether they are in the residual stream's dtype (else the compute dtype's), whether in
    backward, the block it is in (None: outside the blocks, the embedding or the head), and whether a
    recomputed block runs it again (a forward collective but the block's last)."""

    kind: Kind
    elements: int
    stream: bool
    backward: bool
    block: int | None
    recomputed: bool = False


def plan_traffic(module: nn.Module, plan: TpPlan, blocks: Sequence[str]) -> tuple[Transfer, ...] | None:
    """Every collective ``plan`` makes ``module`` run per micro-batch (module docstring), or None
    where a planned style or module is one these rules do not read. ``blocks``: the blocks' module
    names in order."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: list[Transfer] = []
    final: dict[int, tuple[int, str]] = {}  # per block: its last forward collective (index in out) and sub-layer
    for name, member, style in planned(module, plan):
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            return None
        (given,), (made,) = style.input_layouts, style.output_layouts
        row = isinstance(style, RowwiseParallel)
        last_dim = [isinstance(p, Shard) and p.dim == -1 for p in (given, made)]
        # column-wise: Replicate in, Replicate or Shard(-1) out; row-wise: Replicate or Shard(-1) in, Replicate out
        if not (isinstance(given, Replicate) or (row and last_dim[0])) or not (
                isinstance(made, Replicate) or (not row and last_dim[1])):
            return None
        if isinstance(member, nn.Linear):
            width_in, width_out, out_stream = member.in_features, member.out_features, False
        elif isinstance(member, nn.Embedding):  # token ids in: no input gradient
            width_in, width_out, out_stream = 0, member.embedding_dim, True
        else:
            return None
        block = next((i for i, b in enumerate(blocks) if name.startswith(f"{b}.")), None)
        if isinstance(made, Replicate):  # row-wise: Partial -> Replicate; column-wise: Shard(-1) -> Replicate
            if block is not None:
                final[block] = (len(out), name[len(blocks[block]) + 1:].split(".")[0])
            out.append(Transfer(Kind.ALL_REDUCE if row else Kind.ALL_GATHER, width_out, out_stream, False, block,
                                recomputed=block is not None))
        if width_in and isinstance(given, Replicate):  # the input's gradient back to Replicate
            out.append(Transfer(Kind.ALL_GATHER if row else Kind.ALL_REDUCE, width_in, True, True, block))
    for block, (index, sublayer) in final.items():  # torch's checkpoint stops early (module docstring)
        if sublayer == _last_sublayer(module.get_submodule(blocks[block])):
            out[index] = replace(out[index], recomputed=False)
    return tuple(out)


def _last_sublayer(block: nn.Module) -> str | None:
    """The name of ``block``'s last child (in definition order) that holds a weight matrix (not a
    norm): the sub-layer whose output only joins the residual sum."""
    names = [n for n, child in block.named_children() if any(p.dim() >= 2 for p in child.parameters())]
    return names[-1] if names else None
