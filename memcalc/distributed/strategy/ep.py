"""``ep``: expert parallelism as transformers runs it — the model's own ``ep_plan``
(``base_model_ep_plan``: ``grouped_gemm`` on the experts' weights, ``ep_dispatch_experts`` on the
experts module) applied by transformers' ``apply_expert_parallelism`` with its ``AllToAllEP``
(transformers 5.24 ``distributed/expert_parallel.py``) to the meta model over a fake process group,
the step traced on rank 0.

What a rank holds: ``E/ep`` of the ``E`` experts of every MoE layer (``MoEParamShard``: ``Shard(0)``
DTensors), their gradients and optimizer state; the dense rest (attention, router, norms,
embeddings) whole. What it allocates to move tokens, per MoE layer (``AllToAllEP``, ``T`` tokens,
top-``k``): the ``T·k`` rows it sends (``hidden_states[order // k]``), the rows it receives
(``all_to_all_single_autograd``, ``sum(recv_sizes)`` rows of ``d``), its experts' activations on
those rows, the ``T·k`` result rows coming back, and the same again in backward. The receiving side
is data: the split sizes are read to the host (``.tolist()``), and memcalc answers that read from
the routing assumption (:func:`dispatch_rows`, stated in the report): balanced by default; a
capacity factor or the worst case on request.

Every ep rank runs a batch of its own (the dense part is data parallel over them, as in
transformers with ``tp_size=1``), so the global batch counts the ep ranks. With ``dp_shard``
(torchtitan's MoE FSDP) dp_shard's FSDP2 is stacked on this program: each block's experts sharded
over dp_shard (``dp_shard_mod_ep``), the dense part over dp_shard × ep (``dp_shard_cp``); a real
four-process gloo run agrees to the byte. Alone, the dense gradients' synchronisation over the ep
ranks is not modelled (stated); with other dimensions ep is refused by name. The optimizer steps
each DTensor's local shard, which allocates what stepping the DTensors would (tests/test_gloo_ep.py).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import torch
from torch import nn

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.distributed.program import RankProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.tensor_parallel import TensorParallel, _propagation_untraced, _restore_modules, _snapshot
from memcalc.distributed.vocabulary import Routing
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import StorageTracer
from memcalc.stacks.transformers.reads import routing_notes

__all__ = ("ExpertParallel", "ExpertParallelDimension", "dispatch_rows")

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


class ExpertParallel(TensorParallel):
    """Rank ``rank`` of ``degree``-way expert parallelism: transformers' ``apply_expert_parallelism``
    (``ep_implementation="all_to_all"``) over a fake ``(ep, tp=1)`` mesh, the split sizes answered
    by ``routing``. The DTensor machinery (tracing the local ops, the optimizer on local shards,
    the fake group torn down, the functional collectives' outputs counted as communication) is
    tensor parallelism's."""

    def __init__(self, degree: int, *, rank: int = 0, routing: Routing = Routing.BALANCED,
                 capacity_factor: float | None = None, model_name: str = "the model") -> None:
        super().__init__(degree, None, rank=rank, model_name=model_name)
        self.routing = routing
        self.capacity_factor = capacity_factor

    def _parallelize(self, tracer: StorageTracer, module: nn.Module) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        plan = self._plan(module)
        self._fake_mesh()  # the fake process group (and a one-dimensional mesh, unused)
        mesh = DeviceMesh("cpu", torch.arange(self.degree).reshape(self.degree, 1), mesh_dim_names=("ep", "tp"))
        modules = dict(module.named_modules())
        experts = [modules[name] for name, style in plan.items() if style == "ep_dispatch_experts"]
        self._undo.append(functools.partial(_restore_modules, _snapshot(module)))
        saved = [(m, {a: vars(m).get(a, _MISSING) for a in _EXPERTS_ATTRIBUTES}) for m in experts]
        self._undo.append(functools.partial(_restore_attributes, saved))
        try:
            apply_expert_parallelism(module, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
        except ValueError as exc:  # "Cannot evenly shard 8 experts across 3 expert-parallel ranks"
            raise InvalidInputError(f"transformers' expert parallelism refused ep={self.degree} on "
                                    f"{self.model_name}: {exc}",
                                    hint="give an ep degree that divides the number of experts") from exc
        tracer.defer_to = (DTensor,)
        self._undo.append(functools.partial(setattr, tracer, "defer_to", ()))
        self._undo.append(_propagation_untraced())
        previous = tracer.read_values
        tracer.read_values = functools.partial(self._read, previous)
        self._undo.append(functools.partial(setattr, tracer, "read_values", previous))
        local = experts[0].num_experts if experts else 0
        self.notes.append(f"expert parallel by transformers' apply_expert_parallelism (AllToAllEP): {local} of "
                          f"{local * self.degree} experts per MoE layer on rank {self.rank}")

    def _plan(self, module: nn.Module) -> dict[str, str]:
        return expert_plan(module, self.degree, self.model_name)

    def _read(self, previous: Callable[[torch.Tensor], Any] | None, tensor: torch.Tensor) -> Any:
        """The split sizes ``AllToAllEP`` copies to the host, from the routing assumption; any
        other read to whoever answered it before."""
        frame = _frame_of(_DISPATCH)
        if frame is not None and tensor.dim() == 2 and tuple(tensor.shape) == (2, self.degree):
            local = frame.f_locals
            experts = local["self"].num_local_experts * self.degree
            tokens, top_k = local["hidden_states"].shape[0], local["top_k_index"].shape[-1]
            send, recv = dispatch_rows(tokens, top_k, experts, self.degree, self.rank, self.routing,
                                       self.capacity_factor)
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


@register()
class ExpertParallelDimension(RankStrategy):
    """Experts sharded over the ep ranks, tokens dispatched to them by all-to-all."""

    name = "ep"
    mesh_dimension = "ep"
    planned = False  # its all-to-alls are not in plan's cost model yet
    options = frozenset({"routing", "capacity_factor"})

    def refuse_finetune(self, finetune: FineTune) -> None:
        if finetune.is_empty:
            return
        raise InapplicableOptionError(
            "ep with --lora, --freeze or --quant is not estimated: transformers shards the experts' weights as "
            "DTensors, which memcalc models for full training only",
            hint="Estimate full training under ep, or the fine-tuning without ep.")

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        """The model's single-GPU routing note (balanced) left out where ep assumes another: the
        plan's note states the routing of the step."""
        if self.distributed.routing is Routing.BALANCED:
            return resolved
        stale = set(routing_notes(resolved.module))
        return replace(resolved, notes=tuple(note for note in resolved.notes if note not in stale))

    def plan(self, plan: Plan, step: Step) -> Plan:
        mesh = self.distributed.mesh
        others = sorted(set(mesh.used) - {"ep", "dp_shard"}) if mesh is not None else []
        if others and mesh is not None:
            listed = ", ".join(f"{name}={mesh.used[name]}" for name in others)
            raise InapplicableOptionError(
                f"ep={self.degree} with {listed} is not modelled yet: memcalc composes expert parallelism with "
                f"FSDP2 (dp_shard) only, as torchtitan shards its MoE models",
                hint=f"Estimate ep={self.degree} alone or with dp_shard (--mesh dp_shard=N,ep={self.degree}).")
        composed = mesh is not None and mesh.dp_shard > 1
        if not expert_parallelism_available():
            raise InapplicableOptionError(
                f"ep={self.degree} runs transformers' own expert parallelism (transformers.distributed."
                f"expert_parallel), which the installed transformers {_transformers_version()} does not have",
                hint="Install a transformers that has it (5.24 does), or estimate without ep.")
        plan = every_rank(plan, self.distributed)
        routing, factor = self.distributed.routing, self.distributed.capacity_factor
        n = self.degree

        def program(resolved: ResolvedModel) -> RankProgram:
            return ExpertParallel(n, routing=routing, capacity_factor=factor, model_name=resolved.name)

        shards: tuple[Shard, ...]
        if composed:  # dp_shard's FSDP2 shards the dense part over these ranks too
            shards = (Shard(("experts", "dense model states", "batch"), self.name, n),)
            dense = (f"the dense part sharded by FSDP2 over dp_shard x ep = {mesh.dp_shard * n} ranks (torchtitan's "
                     f"dp_shard_cp mesh), each block's experts over the {mesh.dp_shard} dp_shard ranks that hold the "
                     f"same experts (its dp_shard_mod_ep mesh)" if mesh is not None else "")
        else:
            shards = (Shard(("experts",), self.name, n), Shard(("batch",), self.name, n))
            dense = "the dense part whole; the dense gradients' synchronisation over the ep ranks is not modelled"
        roles = tuple(replace(role, program=program, sharding=sharding(role.sharding, *shards)) for role in plan.roles)
        notes = (f"expert parallelism over {n} ranks: each holds 1/{n} of every MoE layer's experts (their "
                 f"gradients and optimizer state) and a batch of its own; tokens move by all-to-all under "
                 f"{routing_text(routing, factor)}; rank 0 traced (it holds the most, if any differ); {dense}",)
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))



def _transformers_version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # not installed: the refusal says so
        return "(not installed)"
