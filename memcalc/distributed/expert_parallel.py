"""The expert-parallel rank program: transformers' ``apply_expert_parallelism`` with its
``AllToAllEP`` (transformers 5.24 ``distributed/expert_parallel.py``) applied to the meta model over a
fake process group (or a pipeline rank's, :mod:`memcalc.distributed.ep_stages`), the split sizes it
reads to the host answered from the routing assumption (:func:`dispatch_rows`). The ``ep`` mesh
dimension (:mod:`memcalc.distributed.strategy.ep`) gives it to its ranks.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.loop import OptimizerImpl
from memcalc.distributed.dtensor_upkeep import (
    clear_dtensor_caches,
    propagation_untraced,
    restore_modules,
    snapshot_modules,
)
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.tensor_parallel import TensorParallel
from memcalc.distributed.vocabulary import Routing
from memcalc.engine.trace import StorageTracer

__all__ = ("ExpertParallel", "dispatch_rows", "expert_modules", "expert_notes", "expert_parallelism_available",
           "expert_plan", "expert_tensor_parallel", "routing_text", "split_sizes")

def expert_parallelism_available() -> bool:
    """Whether the installed transformers has the expert parallelism ``ep`` runs
    (``transformers.distributed.expert_parallel``, in 5.24; transformers 5.17 has none)."""
    try:
        return importlib.util.find_spec("transformers.distributed.expert_parallel") is not None
    except ImportError:  # transformers, or its distributed package, is not installed
        return False


#: The function of transformers' ``AllToAllEP`` that reads the split sizes to the host.
_DISPATCH = "AllToAllEP._dispatch_tokens"
#: What ``apply_expert_parallelism`` sets on an experts module (and memcalc puts back).
_EXPERTS_ATTRIBUTES = ("forward", "num_experts", "_is_expert_parallel", "_is_hooked")
_MISSING = object()


def dispatch_rows(tokens: int, top_k: int, experts: int, ep: int, rank: int, routing: Routing,
                  capacity_factor: float | None = None) -> tuple[list[int], list[int]]:
    """The rows rank ``rank`` sends to each ep rank and receives from each, for one MoE layer of
    ``tokens`` tokens per rank: ``AllToAllEP``'s ``send_sizes`` and ``recv_sizes``.

    Each rank routes ``P = tokens · top_k`` pairs; rank ``j`` owns experts ``j·E/ep`` to ``(j+1)·E/ep - 1``.

    - balanced: expert ``e`` gets ``P // E`` pairs of every rank, one more for the first ``P % E``
      (as :class:`~memcalc.stacks.transformers.reads.BalancedRouting`); every rank sends alike, so
      rank ``r`` receives from each what it sends itself.
    - capacity: each of rank ``r``'s experts gets ``ceil(factor · P / E)`` pairs from every rank.
    - worst: every rank sends rank ``r``'s experts all it can.

    Under capacity and worst, a rank sends at most ``tokens · min(top_k, E/ep)`` pairs to one rank
    (a token picks distinct experts), and ``r``'s own remaining pairs go evenly to the others.
    """
    local = experts // ep
    pairs = tokens * top_k
    if routing is Routing.BALANCED:
        per_expert = [pairs // experts + (1 if e < pairs % experts else 0) for e in range(experts)]
        send = [sum(per_expert[j * local:(j + 1) * local]) for j in range(ep)]
        return send, [send[rank]] * ep
    most = tokens * min(top_k, local)
    if routing is Routing.CAPACITY:
        assert capacity_factor is not None
        received = min(most, local * math.ceil(capacity_factor * pairs / experts))
    else:
        received = most
    rest = pairs - received
    others = [rest // (ep - 1) + (1 if i < rest % (ep - 1) else 0) for i in range(ep - 1)] if ep > 1 else []
    send = [*others[:rank], received, *others[rank:]]
    return send, [received] * ep


def routing_text(routing: Routing, capacity_factor: float | None) -> str:
    """The report's words for the routing assumption."""
    if routing is Routing.CAPACITY:
        return (f"routing at capacity factor {capacity_factor:g}: this rank's experts each receive "
                f"ceil({capacity_factor:g} · tokens · top_k / experts) pairs from every rank")
    if routing is Routing.WORST:
        return "worst-case routing: every rank sends this rank's experts every pair it can"
    return "balanced routing: every expert receives tokens · top_k / experts pairs from every rank"


def expert_notes(degree: int, routing: Routing, capacity_factor: float | None, dp_shard: int = 1, tp: int = 1) -> str:
    """The report's note on ``degree``-way expert parallelism inside pipeline stages (with
    ``dp_shard``-way FSDP2 around it, or ``tp``-way tensor parallelism beside it)."""
    dense = ("the dense part whole, its gradients' synchronisation over the ep ranks not modelled" if dp_shard == 1
             else f"FSDP2 of each stage as torchtitan shards MoE models: each block's experts over the {dp_shard} "
                  f"dp_shard ranks that hold the same experts, the dense part over dp_shard x ep = {dp_shard * degree}")
    if tp > 1:
        synced = ("the dense gradients' synchronisation over the ep ranks not modelled" if dp_shard == 1 else
                  f"then FSDP2 of each stage: each block's experts over the {dp_shard} dp_shard ranks that hold the "
                  f"same experts, the dense part over dp_shard x ep = {dp_shard * degree}")
        dense = (f"the dense part under tp's plan over the {tp} tp ranks that share a batch, the experts over all ep x "
                 f"tp = {degree * tp} ranks (transformers' ep_size = fsdp_size x tp_size, torchtitan's etp=1); "
                 f"{synced}")
    return (f"expert parallelism over {degree} ranks inside every stage: each holds 1/{degree * tp} of the stage's "
            f"MoE layers' experts (their gradients and optimizer state) and a batch of its own; tokens move by "
            f"all-to-all under {routing_text(routing, capacity_factor)}; ep rank 0 traced; {dense}")


class ExpertParallel(TensorParallel):
    """Rank ``rank`` of ``degree``-way expert parallelism: transformers' ``apply_expert_parallelism``
    (``ep_implementation="all_to_all"``) over a fake ``(ep, tp=1)`` mesh, the split sizes answered
    by ``routing``. The DTensor machinery (tracing the local ops, the optimizer on local shards,
    the fake group torn down, the functional collectives' outputs counted as communication) is
    tensor parallelism's.

    ``meshes``: the ``(ep, tp)`` sub-meshes of a process group someone else made (a pipeline
    rank's, :mod:`memcalc.distributed.ep_stages`), called at install; None: a fake group of
    ``degree`` ranks of the program's own. ``plan``: the expanded plan to apply (a stage's part of
    the model's); None: the model's own.

    ``tp``: the tensor-parallel ranks among the ``degree`` (the inner dimension of the fake group's
    ``(dp, tp)`` mesh, each tp group sharing one batch): the expert-parallel group is all ``degree``
    ranks, as transformers' ``AllToAllEP`` and torchtitan's ``etp=1`` borrow the tp ranks for the
    experts, each tp rank dispatching its ``1/tp`` of the shared batch's tokens. The tp sub-mesh is
    :attr:`tp_mesh` once installed (tensor parallelism's program runs its plan on it,
    :func:`expert_tensor_parallel`)."""

    def __init__(self, degree: int, *, rank: int = 0, routing: Routing = Routing.BALANCED,
                 capacity_factor: float | None = None, model_name: str = "the model",
                 meshes: Callable[[], tuple[Any, Any]] | None = None, plan: dict[str, str] | None = None,
                 tp: int = 1) -> None:
        super().__init__(degree, None, rank=rank, model_name=model_name)
        self.routing = routing
        self.capacity_factor = capacity_factor
        self.meshes = meshes
        self.expert_styles = plan
        self.tp = tp
        self.tp_mesh: Any = None

    def _parallelize(self, tracer: StorageTracer, module: nn.Module) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        plan = self._plan(module)
        if self.meshes is None:
            self._fake_mesh()  # the fake process group (and a one-dimensional mesh, unused)
            if self.tp == 1:
                mesh = DeviceMesh("cpu", torch.arange(self.degree).reshape(self.degree, 1),
                                  mesh_dim_names=("ep", "tp"))
                ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
            else:  # the dense view (dp, tp); the experts over all of it (transformers' ep = dp x tp)
                mesh = DeviceMesh("cpu", torch.arange(self.degree).reshape(self.degree // self.tp, self.tp),
                                  mesh_dim_names=("dp", "tp"))
                ep_mesh, tp_mesh = mesh._flatten("ep"), mesh["tp"]
        else:
            clear_dtensor_caches()
            self._undo.append(clear_dtensor_caches)
            ep_mesh, tp_mesh = self.meshes()
        self.tp_mesh = tp_mesh
        modules = dict(module.named_modules())
        experts = [modules[name] for name, style in plan.items() if style == "ep_dispatch_experts"]
        self._undo.append(functools.partial(restore_modules, snapshot_modules(module)))
        saved = [(m, {a: vars(m).get(a, _MISSING) for a in _EXPERTS_ATTRIBUTES}) for m in experts]
        self._undo.append(functools.partial(_restore_attributes, saved))
        try:
            apply_expert_parallelism(module, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
        except ValueError as exc:  # "Cannot evenly shard 8 experts across 3 expert-parallel ranks"
            ranks = f"ep={self.degree}" if self.tp == 1 else f"ep x tp = {self.degree} ranks"
            raise InvalidInputError(f"transformers' expert parallelism refused {ranks} on {self.model_name}: {exc}",
                                    hint="give an ep degree (times tp) that divides the number of experts") from exc
        tracer.defer_to = (DTensor,)
        self._undo.append(functools.partial(setattr, tracer, "defer_to", ()))
        self._undo.append(propagation_untraced())
        previous = tracer.read_values
        tracer.read_values = functools.partial(self._read, previous)
        self._undo.append(functools.partial(setattr, tracer, "read_values", previous))
        local = experts[0].num_experts if experts else 0
        self.notes.append(f"expert parallel by transformers' apply_expert_parallelism (AllToAllEP): {local} of "
                          f"{local * self.degree} experts per MoE layer on rank {self.rank}")

    def _plan(self, module: nn.Module) -> dict[str, str]:
        if self.expert_styles is not None:
            return self.expert_styles
        return expert_plan(module, self.degree, self.model_name)

    def _read(self, previous: Callable[[torch.Tensor], Any] | None, tensor: torch.Tensor) -> Any:
        """The split sizes ``AllToAllEP`` copies to the host, from the routing assumption; any
        other read to whoever answered it before."""
        return split_sizes(tensor, self.degree, self.rank, self.routing, self.capacity_factor, previous)


def expert_tensor_parallel(ep: int, tp: int, plan: dict[str, str] | None, *, routing: Routing,
                           capacity_factor: float | None, model_name: str,
                           optimizer_impl: OptimizerImpl | None = None) -> RankProgram:
    """Rank 0 of ``tp × ep`` (``ep · tp`` ranks): the dense part under the tensor-parallel ``plan``
    (None: the model's own) on the tp sub-mesh, each tp group one batch, the ep groups batches of
    their own; the experts over all ``ep · tp`` ranks (:class:`ExpertParallel` with ``tp``), as
    transformers composes ``tp_size`` with ``ep_size = fsdp_size × tp_size`` and torchtitan with
    ``etp=1``. Expert parallelism makes the fake group and the meshes, then ``parallelize_module``
    runs on its tp sub-mesh; one optimizer wrapper (expert parallelism's) steps every DTensor's
    local shard."""
    experts = ExpertParallel(ep * tp, routing=routing, capacity_factor=capacity_factor, model_name=model_name,
                             tp=tp)
    dense = TensorParallel(tp, plan, model_name=model_name, optimizer_impl=optimizer_impl, local_step=False,
                           mesh=lambda: experts.tp_mesh, expert_parallel=True)
    return StackedProgram(experts, dense)


def split_sizes(tensor: torch.Tensor, degree: int, rank: int, routing: Routing, capacity_factor: float | None,
                previous: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """The ``[send, recv]`` split sizes ``AllToAllEP._dispatch_tokens`` reads to the host on ep rank
    ``rank`` of ``degree``, from the routing assumption (:func:`dispatch_rows`); any other read to
    ``previous``."""
    frame = _frame_of(_DISPATCH)
    if frame is not None and tensor.dim() == 2 and tuple(tensor.shape) == (2, degree):
        local = frame.f_locals
        experts = local["self"].num_local_experts * degree
        tokens, top_k = local["hidden_states"].shape[0], local["top_k_index"].shape[-1]
        send, recv = dispatch_rows(tokens, top_k, experts, degree, rank, routing, capacity_factor)
        return torch.tensor([send, recv], dtype=tensor.dtype)
    return previous(tensor) if previous is not None else None


def expert_plan(module: nn.Module, degree: int, model_name: str) -> dict[str, str]:
    """The model's own expert-parallel plan, its ``*`` expanded to the layers (transformers'
    ``_expand_parallel_plan``).

    Raises:
        InapplicableOptionError: the model has none, or it dispatches no tokens.
    """
    plan = getattr(module, "ep_plan", None)
    expand = getattr(module, "_expand_parallel_plan", None)
    if not isinstance(plan, dict) or not plan or expand is None:
        raise InapplicableOptionError(
            f"ep={degree}: {model_name} has no expert-parallel plan (a transformers model's "
            f"config.base_model_ep_plan), so its experts cannot be sharded as transformers shards them",
            hint="Expert parallelism is estimated for transformers' mixture-of-experts models (Mixtral, "
                 "Qwen3-MoE, DeepSeek-V3, gpt-oss); estimate this model without ep.")
    expanded: dict[str, str] = expand(dict(plan))
    if "ep_dispatch_experts" not in expanded.values():
        raise InapplicableOptionError(f"ep={degree}: the expert-parallel plan of {model_name} "
                                      f"dispatches no tokens (no ep_dispatch_experts module)")
    return expanded


def expert_modules(module: nn.Module, degree: int, model_name: str) -> list[str]:
    """The paths of the modules whose experts ``ep`` shards (``ep_dispatch_experts``)."""
    return [name for name, style in expert_plan(module, degree, model_name).items()
            if style == "ep_dispatch_experts"]


def _restore_attributes(saved: list[tuple[nn.Module, dict[str, object]]]) -> None:
    for module, attributes in saved:
        for name, value in attributes.items():
            if value is _MISSING:
                vars(module).pop(name, None)
            else:
                setattr(module, name, value)


def _frame_of(qualname: str) -> FrameType | None:
    """The innermost frame on the stack running the function ``qualname``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if getattr(frame.f_code, "co_qualname", "") == qualname:
            return frame
        frame = frame.f_back
    return None
