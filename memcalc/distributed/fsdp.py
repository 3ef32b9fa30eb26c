"""Sharded parameters: one rank of FSDP2 (``fully_shard``) or of DeepSpeed ZeRO-3, whose
parameters are this rank's shards and are all-gathered unit by unit around each forward and
backward, their gradients reduce-scattered back to shards. ZeRO-3's partitioned optimizer is
:class:`~memcalc.distributed.zero.ZeroProgram`, which runs over this program.

Over tensor parallelism (``--mesh dp_shard=N,tp=M``) the parameters are DTensors: FSDP2 shards,
gathers and reduce-scatters each one's local tensor, and its sharded and unsharded parameters and
sharded gradients are DTensors of the tp spec over those local tensors (:func:`_local`,
:func:`_like`), as ``FSDPParam`` keeps them (``_from_local_no_grad`` with its ``_tp_spec``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from memcalc.core.categories import Category
from memcalc.core.streams import Stream
from memcalc.distributed.program import RankProgram, map_output
from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero3_coordinator import ParamCoordinator, persistent_flags
from memcalc.engine.trace import StorageTracer, tensors_of
from memcalc.targets.cpu.scalars import wrapped_number_bytes

#: The reduce dtypes for which FSDP2 reduce-scatters with ``ReduceOp.AVG`` (no overflow risk:
#: ``_get_gradient_divide_factors``, torch 2.13); float16 pre- and post-divides around a sum.
_AVERAGED_DTYPES = (torch.float32, torch.bfloat16)
#: What gloo divides an average by: the group's size, a Python int (its value does not matter here).
_GROUP_SIZE = 2

__all__ = (
    "ShardedProgram",
    "Unit",
    "fsdp_units",
    "module_units",
)


@dataclass(frozen=True)
class Unit:
    """A group of parameters gathered together: an FSDP-wrapped module (the modules of its
    subtree that no inner unit claims) or, for ZeRO-3, one module's own parameters."""

    name: str
    module: nn.Module
    members: tuple[nn.Module, ...]  # modules whose own (recurse=False) parameters it gathers
    #: A frozen model sharded on its own (``fully_shard`` on its root alone, as TRL's ``prepare_fsdp``
    #: shards the reference), run outside the trained model's backward: its own FSDP root frees its
    #: all-gather output after its forward, and the trained model's backward neither prefetches nor
    #: visits it.
    own_root: bool = False
    #: The trained model's root sharded with ``reshard_after_forward`` given explicitly (an accelerate
    #: before 1.16: ``fully_shard(model, reshard_after_forward=True)``): torch then reshards it after each forward
    #: too, where a root left to its default stays unsharded until backward.
    reshards_as_given: bool = False
    #: The ranks this unit is sharded over; None: the program's. An expert-parallel model's experts
    #: (``--mesh dp_shard=N,ep=E``) are sharded over the dp_shard ranks that hold the same experts,
    #: the rest over all ``N × E`` (torchtitan's ``dp_shard_mod_ep`` and ``dp_shard_cp`` meshes).
    world_size: int | None = None
    #: The modules of one ``fully_shard([a, b])`` call (``module`` among them), whose forward hooks act
    #: as one (torch's ``_register_group_forward_hooks``): the first of them to run gathers the unit and
    #: registers its post-backward on its inputs, the last to finish runs the post-forward; empty:
    #: ``module`` alone.
    group: tuple[nn.Module, ...] = ()
    #: ``reshard_after_forward`` as given to this unit's ``fully_shard`` (accelerate gives its tail
    #: False); None: the program's.
    reshard_after_forward: bool | None = None


def fsdp_units(module: nn.Module, containers: Sequence[str], separate: Sequence[str] = (),
               root: str | None = None, inner: Mapping[str, int] | None = None) -> list[Unit]:
    """``fully_shard`` on every block of ``containers`` (a zoo model's transformer layers or
    ResNet blocks) and on the root. Without containers: on the items of the model's
    outermost ``nn.ModuleList``s (how transformer layers are held), else on every direct
    child that has parameters. ``separate``: submodules sharded as models of their own, one unit
    each (:attr:`Unit.own_root`). ``root``: the submodule that is the trained model's FSDP root,
    sharded as an older accelerate shards it (:attr:`Unit.reshards_as_given`), for a module whose forward
    calls it several times (TRL's GRPO step: every generate() step, the scoring and the training
    forward); None: ``module`` itself. ``inner``: submodules (a block's experts) ``fully_shard``-ed
    before their block, each over the given number of ranks (:attr:`Unit.world_size`)."""
    paths = list(containers) or _module_lists(module)
    blocks: list[tuple[str, nn.Module]] = []
    for path in paths:
        container = module.get_submodule(path)
        blocks.extend((f"{path}.{name}", child) for name, child in container.named_children())
    if not paths:
        blocks = [(name, child) for name, child in module.named_children()
                  if next(child.parameters(), None) is not None]
    claimed: set[int] = set()
    units: list[Unit] = []
    for path in separate:
        model = module.get_submodule(path)
        members = tuple(model.modules())
        claimed.update(id(m) for m in members)
        units.append(Unit(path, model, members, own_root=True))
    inner_left = dict(inner or {})
    for name, block in blocks:
        if id(block) in claimed:  # a block of a separate model, which is one unit
            continue
        for path in [p for p in inner_left if p.startswith(f"{name}.")]:
            sub = module.get_submodule(path)
            members = tuple(m for m in sub.modules() if id(m) not in claimed)
            claimed.update(id(m) for m in members)
            units.append(Unit(path, sub, members, world_size=inner_left.pop(path)))
        members = tuple(m for m in block.modules() if id(m) not in claimed)
        claimed.update(id(m) for m in members)
        units.append(Unit(name, block, members))
    if inner_left:
        raise ValueError(f"inner units outside every block: {', '.join(inner_left)}")
    root_members = tuple(m for m in module.modules() if id(m) not in claimed)
    if root is not None:
        units.append(Unit(root, module.get_submodule(root), root_members, reshards_as_given=True))
    else:
        units.append(Unit("(root)", module, root_members))
    return units


def _alone(params: Sequence[_Param]) -> bool:
    """Whether ``params`` (one unit's) are sharded over one rank, where FSDP2 runs no collective."""
    return params[0].world_size == 1


def _module_lists(module: nn.Module) -> list[str]:
    found: list[str] = []
    for name, sub in module.named_modules():
        if (isinstance(sub, nn.ModuleList) and not any(name.startswith(f + ".") for f in found)
                and next(sub.parameters(), None) is not None):
            found.append(name)
    return found


def module_units(module: nn.Module, prefix: str = "") -> list[Unit]:
    """DeepSpeed ZeRO-3's granularity: each module gathers its own parameters in its forward
    pre-hook (``fetch_sub_module``) and releases them after. Every module is hooked
    (``_register_deepspeed_module``), those without parameters too: each fetch is a step of the
    coordinator's trace and a chance to prefetch. ``prefix``: the path of ``module`` in the traced
    model, when it is one engine's module among several."""
    return [Unit(".".join(n for n in (prefix, name) if n) or "(root)", m, (m,)) for name, m in module.named_modules()]


@dataclass(eq=False)
class _Param:
    original: nn.Parameter
    sharded: nn.Parameter
    shard_numel: int
    world_size: int
    gather_dtype: torch.dtype
    owner: _UnitState | None = None
    unsharded: nn.Parameter | None = None
    holders: int = 0
    accumulated: torch.Tensor | None = None  # FSDPParam.unsharded_accumulated_grad (reduce_dtype)
    #: torchao's ``WeightWithDynamicFloat8CastTensor`` (``enable_fsdp_float8_all_gather``): the
    #: parameter's own all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``)
    float8: Any = None
    float8_inputs: tuple[torch.Tensor, ...] = ()  # what fsdp_pre_all_gather returned, until the copy-in
    float8_scale: tuple[torch.Tensor, ...] = ()  # its metadata (the scale), until fsdp_post_all_gather
    float8_data: torch.Tensor | None = None  # the unsharded float8 data (FSDPParam.all_gather_outputs)
    persistent: bool = False  # ZeRO-3's ds_persist
    gather: _Gather | None = None  # ZeRO-3: the coalesced all-gather it is in flight in

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def all_gather_dtype(self) -> torch.dtype:
        """The dtype all-gathered: the float8 of torchao's extension, else the parameter dtype."""
        return self.float8._dtype if self.float8 is not None else self.gather_dtype

    @property
    def ds_numel(self) -> int:
        return _local(self.original).numel()

    @property
    def requires_grad(self) -> bool:
        return self.original.requires_grad


@dataclass(eq=False)
class _Gather:
    """One of ZeRO-3's coalesced all-gathers (``AllGatherCoalescedHandle``): its flat output lives
    until every parameter in it has been waited on; the first wait copies them all out."""

    flat: torch.Tensor | None
    pending: set[int]
    members: list[_Param]
    copied: bool = False


@dataclass(eq=False)
class _UnitState:
    unit: Unit
    params: list[_Param]  # every parameter it gathers
    owned: list[_Param]  # those whose gradient it reduces
    locations: list[tuple[nn.Module, str, _Param]]
    reshard_after_forward: bool
    gathered: bool = False
    prefetched: torch.Tensor | None = None  # an all-gather output issued by a prefetch
    backward_started: bool = False
    reduced: bool = False
    grads_remaining: int = 0  # DeepSpeed's ds_grads_remaining (ShardedProgram._deepspeed_post_backward)


class ShardedProgram(RankProgram):
    """One rank of FSDP2 (``style="fsdp2"``) or DeepSpeed ZeRO-3 (``style="deepspeed"``).

    The model's parameters are replaced by this rank's shards for the whole step (what the
    optimizer sees); a unit's pre-forward hook all-gathers its parameters — real meta
    tensors of the full size that the module then uses — and resharding frees them with
    :meth:`StorageTracer.free_storage` (FSDP's ``resize_(0)``: autograd keeps referencing
    them), backward gathers them again (:meth:`StorageTracer.alloc_storage`).

    FSDP2 (``torch/distributed/fsdp/_fully_shard``): shards are dim-0 chunks padded to a
    multiple of the world size; an all-gather output of ``world_size × shard`` elements
    (under mixed precision, from a cast copy of the shards; bytes when a unit's parameters
    have several dtypes, e.g. float32 LoRA adapters in a bf16 model) is copied out into
    per-parameter unsharded storages; in forward the output lives until the next unit's
    copy-out is done (``comm_ctx.all_gather_state``), in backward it goes at once; the root is
    not resharded after forward and casts the forward inputs to ``param_dtype``; backward
    prefetches the next unit's all-gather; post-backward (when the gradients of the unit's
    inputs are done, else the final callback: the root, then the others in model order)
    reshards, releases the previous unit's reduce-scatter input
    (``reduce_scatter_max_input_buffers=1``), allocates a reduce-scatter input of the padded
    unit in ``reduce_dtype``, frees the unsharded gradients but the last (a local keeps it
    until ``foreach_reduce`` returns) and allocates the reduce-scatter output (this rank's
    sharded ``.grad``, cast to the shard's dtype if it differs). Frozen parameters
    (``requires_grad=False``: ``--freeze``, a LoRA base) are sharded and gathered like the
    others; they have no gradient to reduce, and a unit of frozen parameters only
    reshards. The all-gather output and the cast inputs it is copied from are allocated on
    FSDP2's all-gather copy-in stream, the reduce-scatter output (the sharded gradients) on its
    reduce-scatter stream (:class:`~memcalc.core.streams.Stream`): the allocator caches them in
    those streams' pools when they are freed, where the compute stream cannot reuse them (the
    streams real ``fully_shard`` allocates them on: tests/test_allocator_streams.py). On the CPU
    target the collectives are gloo's, which copy what they all-gather and reduce-scatter
    (:meth:`_gloo_copy`). Against real ``fully_shard`` on the CPU this
    agrees to the byte (less Adam's CPU step counters) over a fake process group, without
    gloo's copies (tests/test_strategies.py, tests/test_strategies_finetune.py), and within
    0.02% on every rank of real two-process runs over gloo (tests/test_gloo_runs.py).

    A weight with an all-gather extension of its own (torchao's ``WeightWithDynamicFloat8CastTensor``,
    ``enable_fsdp_float8_all_gather``) is gathered as ``FSDPParam`` gathers it: torchao's
    ``fsdp_pre_all_gather`` runs on the shard (its float8 cast, traced: no flat ``param_dtype`` copy for
    it), the all-gather carries its float8 bytes (as bytes beside the unit's other dtypes), and
    ``fsdp_post_all_gather`` wraps the gathered data in the ``Float8TrainingTensor`` that the module then
    uses; resharding frees that data. Within 0.003% of every rank of a real gloo run
    (tests/test_gloo_float8.py).

    DeepSpeed ZeRO-3 (``deepspeed/runtime/zero/stage3.py``, ``partition_parameters.py``):
    each parameter is a flat partition of ``ceil(numel / world_size)`` elements; what is gathered,
    prefetched and released when is DeepSpeed's coordinator's
    (:class:`~memcalc.distributed.zero3_coordinator.ParamCoordinator`, every module a unit), the
    all-gathers as :meth:`_ds_gather` says; each gradient is copied into the persistent reduce
    bucket as soon as autograd produces it and freed (``reduce_partition_and_remove_grads``), its partition landing in
    the persistent ``grad_partitions_flat_buffer`` (the trainable parameters' partitions:
    frozen ones are partitioned and gathered, never reduced); the step runs in
    :class:`ZeroOptimizer`.
    """

    def __init__(self, units: Sequence[Unit], world_size: int, *, style: str, reshard_after_forward: bool,
                 sharded_dtype: torch.dtype | None, gather_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, training: bool, reduce_bucket_size: int = 0,
                 cpu: bool = False, accumulate: bool = False, stage3: ZeroStage3 | None = None,
                 host_gradients: bool = False, engines: Sequence[str] = ("",)):
        super().__init__()
        if style not in ("fsdp2", "deepspeed"):
            raise ValueError(style)
        self.units = list(units)
        self.world_size = world_size
        self.style = style
        self.reshard_after_forward = reshard_after_forward
        self.sharded_dtype = sharded_dtype
        self.gather_dtype = gather_dtype
        self.reduce_dtype = reduce_dtype
        self.training = training
        self.reduce_bucket_size = reduce_bucket_size
        self.cpu = cpu  # the CPU kernels (target="cpu"), to compare with a real CPU run
        # under a pipeline schedule (torch's PipelineStage.backward_maybe_with_nosync): each
        # microbatch's backward neither reshards nor reduce-scatters; reduce_accumulated() does both
        self.accumulate = accumulate
        self._reducing = False
        self.states: list[_UnitState] = []
        self.params: list[_Param] = []
        self.grad_partition: torch.Tensor | None = None
        self._pending_all_gather: torch.Tensor | None = None
        self._reduce_scatter_inputs: list[torch.Tensor] = []
        self._forward_order: list[_UnitState] = []
        self._in_backward = False
        #: ZeRO-3's settings and its parameter coordinator (made at install)
        self.stage3 = stage3 or ZeroStage3()
        self.host_gradients = host_gradients  # ZeRO-3 offload_optimizer: the gradient partitions on the host
        #: ZeRO-3: the paths of the modules that are each a DeepSpeed engine's, with a coordinator of its
        #: own (TRL's DPO reference is a second engine: ``prepare_deepspeed``); the first is trained
        self.engines = tuple(engines)
        self.coordinators: list[ParamCoordinator[_Param]] = []
        self._coordinator_of: dict[int, ParamCoordinator[_Param]] = {}  # id(_Param) -> its engine's
        self._forward_stack: list[_UnitState] = []  # ZeRO-3: the modules whose forward runs (FWD_MODULE_STACK)
        self._places: dict[int, list[tuple[nn.Module, str]]] = {}
        self._unhooked: set[int] = set()  # ZeRO-3: the coordinators whose engine's module hooks are off
        self._by_sharded: dict[int, _Param] = {}  # ZeRO-3: id(partition) -> its parameter (_read)
        self._in_forward: set[int] = set()  # ZeRO-3: the coordinators whose engine's root forward runs

    #: Whether the CPU target's collectives make gloo's copies (:meth:`_gloo_copy`): a real CPU
    #: process group is gloo's. torch's fake process group, over which tests/test_strategies.py
    #: runs the real ``fully_shard``, allocates nothing; its tests turn this off.
    gloo_copies: ClassVar[bool] = True

    @property
    def coordinator(self) -> ParamCoordinator[_Param] | None:
        """ZeRO-3: the trained engine's coordinator (the optimizer step releases its parameters)."""
        return self.coordinators[0] if self.coordinators else None

    def _coordinator(self, state: _UnitState) -> ParamCoordinator[_Param]:
        return self._coordinator_of[id(state)]

    @property
    def fsdp2(self) -> bool:
        return self.style == "fsdp2"

    @property
    def gloo(self) -> bool:
        """FSDP2 on the CPU target, whose process group is gloo's."""
        return self.fsdp2 and self.cpu and self.gloo_copies

    @property
    def forward_parameter_dtype(self) -> torch.dtype | None:
        """The dtype the blocks' unsharded parameters have in forward (FSDP2's
        ``MixedPrecisionPolicy.param_dtype``): what a block compiled on its own sees."""
        return self.gather_dtype if self.fsdp2 else None

    @property
    def trainable_shard_numel(self) -> int:
        """Elements of this rank's shards of the parameters that train."""
        return sum(p.shard_numel for p in self.params if p.sharded.requires_grad)

    # ---- install / remove -----------------------------------------------------------------
    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        by_param: dict[int, _Param] = {}
        root = self.units[-1].module if self.fsdp2 else module
        persist: set[int] = set()
        engine_params: list[set[int]] = []  # each engine's parameters (before they are replaced by shards)
        for path in () if self.fsdp2 else self.engines:  # each engine's mark_persistent_parameters
            named = [p for _name, p in module.get_submodule(path).named_parameters()]
            engine_params.append({id(p) for p in named})
            persist |= {id(p) for p, flag in zip(named, persistent_flags([p.numel() for p in named], self.stage3),
                                                   strict=True) if flag}
        if not self.fsdp2:  # DeepSpeed's ZeROOrderedDict on every module's _parameters (restored last)
            for member in dict.fromkeys(m for unit in self.units for m in unit.members):
                self._watch_reads(member)
        for unit in self.units:
            state = _UnitState(unit, [], [], [], self._unit_reshards(unit, root))
            for member in unit.members:
                for name, original in list(member._parameters.items()):
                    if original is None:
                        continue
                    param = by_param.get(id(original))
                    if param is None:
                        param = by_param[id(original)] = self._shard(original, unit.world_size or self.world_size,
                                                                     id(original) in persist)
                        self.params.append(param)
                        self._by_sharded[id(param.sharded)] = param
                    if param.owner is None:
                        param.owner = state
                        state.owned.append(param)
                    if param not in state.params:
                        state.params.append(param)
                    state.locations.append((member, name, param))
                    self._places.setdefault(id(param), []).append((member, name))
                    self._set(member, name, param.sharded)
                    self._undo.append(functools.partial(self._set, member, name, original))
            self.states.append(state)
        for path, ids in zip(() if self.fsdp2 else self.engines, engine_params, strict=True):
            root_module = module.get_submodule(path)
            params = [p for p in self.params if id(p.original) in ids]
            coordinator = ParamCoordinator(self.stage3, params, self._ds_gather, self._ds_wait, self._ds_free)
            self.coordinators.append(coordinator)
            self._coordinator_of.update((id(p), coordinator) for p in params)
            members = {id(m) for m in root_module.modules()}
            self._coordinator_of.update((id(s), coordinator) for s in self.states if id(s.unit.module) in members)
            self._handles.append(root_module.register_forward_pre_hook(
                lambda m, args, c=coordinator: c.reset_step(), prepend=True))
            # the engine's _forward_prologue / _forward_epilogue, hooks of its root module: while they bracket
            # a forward, ZeROOrderedDict gathers and registers a parameter read outside its module (_read)
            self._handles.append(root_module.register_forward_pre_hook(
                lambda m, args, c=coordinator: self._in_forward.add(id(c))))
            self._handles.append(root_module.register_forward_hook(
                lambda m, args, out, c=coordinator: self._in_forward.discard(id(c))))
        for state in self.states:
            if state.unit.group:
                self._hook_group(state)
                continue
            self._handles.append(state.unit.module.register_forward_pre_hook(
                lambda m, args, s=state: self._pre_forward(s, args)))
            self._handles.append(state.unit.module.register_forward_hook(
                lambda m, args, out, s=state: self._post_forward(s, out)))
        trainable = [p for p in self.params if p.sharded.requires_grad]
        if self.training and not self.fsdp2 and trainable:
            dtype = trainable[0].sharded.dtype
            # stage3.py _setup_for_real_optimizer: grad_partitions_flat_buffer (this rank's gradient
            # partitions) over fp16_groups, which _get_trainable_parameter_groups fills with the params
            # that require grad; on self.device, the host under offload_optimizer
            if not self.host_gradients:
                self.grad_partition = self._buffer(self.trainable_shard_numel, dtype, Category.GRADIENTS,
                                                   preexisting=True, communication=False)
            # stage3.py __init__ (contiguous_gradients): __ipg_bucket_flat_buffer
            self._buffer(self.reduce_bucket_size, dtype, Category.WORKSPACE, preexisting=True)

    def _hook_group(self, state: _UnitState) -> None:
        """The forward hooks of a ``fully_shard([a, b])`` unit (:attr:`Unit.group`), as torch's
        ``_register_group_forward_hooks`` gates them: every member's pre-forward gathers (once), the
        first to run registers the post-backward on its inputs (``FSDPParamGroup.pre_forward``,
        ``entering_forward_pass``), and the post-forward runs when the last of them has run."""
        to_run: set[int] = set()
        members = {id(m) for m in state.unit.group}

        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            entering = not to_run
            if entering:
                to_run.update(members)
            return self._pre_forward(state, args, register=entering)

        def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if id(module) in to_run:
                to_run.discard(id(module))
                if not to_run:
                    return self._post_forward(state, out)
            return None

        for module in state.unit.group:
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))

    def _unit_reshards(self, unit: Unit, root: nn.Module) -> bool:
        if self.fsdp2 and unit.reshard_after_forward is not None:
            return unit.reshard_after_forward
        if self.fsdp2 and unit.module is root and not unit.reshards_as_given:
            return False  # FSDP2's lazy init: the root is not resharded after forward
        return self.reshard_after_forward

    def _shard(self, original: nn.Parameter, n: int, persistent: bool = False) -> _Param:
        dtype = self.sharded_dtype or original.dtype
        local = _local(original)  # a tensor-parallel DTensor: FSDP2 shards the rank's local shard
        if self.fsdp2:  # dim-0 chunks, padded (FSDPParam._init_sharded_param)
            dim0 = local.shape[0] if local.dim() else 1
            shape = (math.ceil(dim0 / n), *local.shape[1:])
        else:  # a flat partition (ds_tensor)
            shape = (math.ceil(local.numel() / n),)
        numel = math.prod(shape)
        if not self.fsdp2 and self.stage3.offload_param and (original.requires_grad or not persistent):
            # offload_param: the partitions of the trained parameters are moved to a flat host buffer
            # (stage3.py _create_fp16_partitions_with_defragmentation); a frozen one is partitioned on
            # the host (Init's remote_device) unless it persists (_partition_param: local_device)
            shape = (0,)
        shard = torch.empty(shape, dtype=dtype, device="meta")
        sharded = nn.Parameter(_like(original, shard), requires_grad=original.requires_grad)
        # the shard stays a plain tensor (the optimizer's ops on torchao's wrapper are those on its inner tensor)
        extension = local if self.fsdp2 and hasattr(local, "fsdp_pre_all_gather") else None
        return _Param(original, sharded, numel, n, self.gather_dtype or original.dtype, float8=extension,
                      persistent=persistent)

    @staticmethod
    def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        # FSDP's unsafe_setattr_param: no Parameter check, no hooks
        module._parameters[name] = tensor  # type: ignore[assignment]

    # ---- gather and reshard ---------------------------------------------------------------
    def _gather(self, state: _UnitState, *, forward: bool) -> None:
        if state.gathered:
            return
        missing = [p for p in state.params if p.holders == 0]
        all_gather = None
        alone = self.fsdp2 and bool(missing) and _alone(missing)
        if alone:
            # FSDPParamGroup.unshard over a one-rank shard group (ep's HSDP, dp_shard_mod_ep = 1) all-gathers
            # nothing; wait_for_unshard copies each shard into its unsharded parameter, and in forward first
            # frees the previous unit's all-gather output (its implicit-prefetch branch)
            if forward:
                self._pending_all_gather = None
        elif self.fsdp2 and missing:
            all_gather = state.prefetched if state.prefetched is not None else self._all_gather_output(missing)
            state.prefetched = None
        cast = None
        for p in state.params:  # the copy-out into the unsharded parameters
            if p.holders == 0:
                if alone and p.float8 is None and p.sharded.dtype != p.gather_dtype:
                    # one rank, mixed precision: wait_for_unshard's all_gather_inputs[0] is the shard cast to
                    # param_dtype, bound until the next parameter's replaces it (from torch 2.13's source; the
                    # gloo runs are fp32)
                    cast = self._buffer(p.shard_numel, p.gather_dtype, Category.WORKSPACE)
                self._allocate_unsharded(p)
            p.holders += 1
        del cast
        state.gathered = True
        if forward and all_gather is not None:
            # wait_for_unshard drops the previous unit's output, but its local reference
            # keeps it until the copy-out is done; this unit's waits for the next one
            self._pending_all_gather = all_gather
        del all_gather

    def _all_gather_output(self, params: Sequence[_Param]) -> torch.Tensor:
        # foreach_all_gather allocates both on the all-gather copy-in stream (forward and
        # pre-backward all-gathers, the only ones here: FSDPCommContext.get_all_gather_streams)
        with self._tracer.on_stream(Stream.ALL_GATHER_COPY_IN):
            for p in params:  # _get_param_all_gather_inputs: the extensions first, in parameter order
                if p.float8 is not None:
                    self._float8_pre_all_gather(p)
            cast = None
            casting = [p for p in params if p.float8 is None and p.sharded.dtype != p.gather_dtype]
            if casting:  # mixed precision: the all-gather input of these is one flat cast copy
                cast = self._buffer(sum(p.shard_numel for p in casting), casting[0].gather_dtype, Category.WORKSPACE)
            dtypes = {p.all_gather_dtype for p in params}
            if len(dtypes) == 1:
                output = self._buffer(sum(p.padded_numel for p in params), dtypes.pop(), Category.WORKSPACE)
            else:  # _get_all_gather_input_metadatas: inputs of several dtypes are all-gathered as bytes
                nbytes = sum(p.padded_numel * p.all_gather_dtype.itemsize for p in params)
                output = self._buffer(nbytes, torch.uint8, Category.WORKSPACE)
            for p in params:  # foreach_all_gather drops the inputs once they are copied in
                p.float8_inputs = ()
        if self.gloo:
            self._gloo_copy(output)  # gloo's AsyncAllgatherWork gathers into a flat tensor of its own
        del cast  # all_gather_copy_in has copied it into the output
        return output

    def _float8_pre_all_gather(self, p: _Param) -> None:
        """torchao's own ``fsdp_pre_all_gather`` on this rank's shard (FSDPParam.all_gather_inputs): the
        dynamic float8 cast (``abs``, ``max``, the scale, ``x.to(float32) * scale``, ``clamp``, ``.to(float8)``)
        of the sharded weight, traced op by op. Its amax all-reduce (``reduce_amax=True``, a 4-byte scalar)
        runs only under an initialized process group, which memcalc's FSDP2 trace does not create."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from memcalc.core.errors import InapplicableOptionError

            raise InapplicableOptionError(
                "float8 (--float8) with enable_fsdp_float8_all_gather under a process group already initialized: "
                "torchao's fsdp_pre_all_gather would all-reduce its amax over it",
                hint="Estimate in a process without torch.distributed initialized.")
        wrapper = type(p.float8)(p.sharded.detach(), p.float8._linear_mm_config, p.float8._dtype)
        inputs, metadata = wrapper.fsdp_pre_all_gather(None)
        p.float8_inputs, p.float8_scale = tuple(inputs), tuple(metadata)

    def _gloo_copy(self, tensor: torch.Tensor, *, average: bool = False) -> None:
        """A copy of ``tensor``'s size that gloo makes for a collective and frees when it completes.
        ``average``: the reduce-scatter's ``ReduceOp.AVG``, which FSDP2 asks for a float32 or bfloat16
        reduce dtype (``_get_gradient_divide_factors``) and gloo computes as a sum divided by the
        group's size in place, on its worker thread, while the clone is alive: that size wrapped
        as a CPU tensor and cast to the dtype (:func:`~memcalc.targets.cpu.scalars.wrapped_number_bytes`,
        12 B for float32; a real four-rank run's peak, torch 2.13).

        ``ProcessGroupGloo`` (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) all-gathers into
        a flat output of its own (``AsyncAllgatherWork``: ``newLikeFlat(outputs[0])``, on its
        worker thread) and copies it out into the caller's output; the profiler of a real run
        (torch 2.13) sees two such output-sized blocks one after the other, one in
        ``c10d::_allgather_base_`` and then the worker's, never both alive.
        ``reduce_scatter_tensor_coalesced`` all-reduces a clone of the whole input
        (``inputTensors[i].clone()``) and copies this rank's chunk out of it. Both happen while
        the caller's buffers (the all-gather input and output; the reduce-scatter input and
        output) are alive: real two-process runs over gloo agree with this within 0.02%
        (tests/test_gloo_runs.py).

        Only the CPU target has them: the CUDA target assumes NCCL, which all-gathers and
        reduce-scatters in the caller's buffers. (gloo over CUDA tensors would clone the
        reduce-scatter input on the GPU too and stage the all-gather in pinned host memory;
        memcalc does not model gloo on CUDA.)

        Modelled as alive for the collective alone: the all-gather's staging outlives the call
        when the other rank arrives late, over a backward prefetch even while this unit's
        backward runs; a real run's peak can then be one unit's all-gather output higher than
        the estimate on that rank, by timing alone (not seen in the tests' runs)."""
        divisor = wrapped_number_bytes(_GROUP_SIZE, tensor.dtype) if average else 0
        self._transient(tensor.numel() * tensor.element_size() + divisor)

    def _allocate_unsharded(self, p: _Param) -> None:
        if p.float8 is not None:
            self._float8_post_all_gather(p)
            return
        tracer = self._tracer
        if p.unsharded is None:
            storage = torch.empty(p.padded_numel, dtype=p.gather_dtype, device="meta")
            local = _local(p.original)
            unsharded = nn.Parameter(_like(p.original, storage.narrow(0, 0, local.numel()).view(local.shape)),
                                     requires_grad=p.original.requires_grad)
            self.communication.add(tracer.track(storage, Category.PARAMETERS))
            del storage
            if unsharded.requires_grad and self.training:
                self._handles.append(unsharded.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(self._gradient_ready_hook, p)))
            p.unsharded = unsharded
        else:
            self.communication.add(tracer.alloc_storage(_local(p.unsharded), Category.PARAMETERS))

    def _float8_post_all_gather(self, p: _Param) -> None:
        """The copy-out of a float8 weight into its own all-gather output (``init_all_gather_outputs``:
        ``world_size × shard`` float8 elements), and torchao's ``fsdp_post_all_gather`` on it: the unsharded
        parameter is a ``Float8TrainingTensor`` in the param dtype over that data, which ``Float8Linear``
        multiplies without casting its weight again, in forward and in backward."""
        tracer = self._tracer
        local = _local(p.original)
        if p.float8_data is None:
            storage = torch.empty(p.padded_numel, dtype=p.all_gather_dtype, device="meta")
            self.communication.add(tracer.track(storage, Category.PARAMETERS))
            p.float8_data = storage.narrow(0, 0, local.numel()).view(local.shape)
            del storage
        else:
            self.communication.add(tracer.alloc_storage(p.float8_data, Category.PARAMETERS))
        if p.unsharded is None:
            unsharded, _inner = p.float8.fsdp_post_all_gather((p.float8_data,), p.float8_scale, p.gather_dtype)
            p.unsharded = nn.Parameter(unsharded, requires_grad=p.original.requires_grad)
        else:  # init_unsharded_param after the first all-gather: the new scale into the same parameter
            p.float8.fsdp_post_all_gather((p.float8_data,), p.float8_scale, p.gather_dtype, out=p.unsharded)
        p.float8_scale = ()

    def _reshard(self, state: _UnitState) -> None:
        if not state.gathered:
            return
        for module, name, p in state.locations:
            self._set(module, name, p.sharded)
        for p in state.params:
            p.holders -= 1
            if p.holders == 0 and p.float8_data is not None:  # free_unsharded_param: its all-gather output
                self._tracer.free_storage(p.float8_data)
            elif p.holders == 0 and p.unsharded is not None:
                self._tracer.free_storage(_local(p.unsharded))
        state.gathered = False

    # ---- DeepSpeed ZeRO-3's gathers (driven by its coordinator) ---------------------------
    def _ds_gather(self, params: list[_Param]) -> None:
        """``all_gather_coalesced``: one parameter is gathered straight into its padded buffer
        (``_all_gather_sequential``); several, per dtype, into one flat output whose parameters
        are copied out at the first wait (``AllGatherCoalescedHandle``) — copies of ``ds_numel``
        elements, which memcalc keeps in each parameter's padded storage (less than ``world_size``
        elements apart). Under ``offload_param`` the partitions are first copied to the GPU
        (``ds_tensor.to(device)``), for the all-gather's input."""
        if self.stage3.offload_param:
            self._transient(sum(p.shard_numel * p.gather_dtype.itemsize for p in params))
        if len(params) == 1:
            self._allocate_unsharded(params[0])
            return
        by_dtype: dict[torch.dtype, list[_Param]] = {}
        for p in params:
            by_dtype.setdefault(p.gather_dtype, []).append(p)
        for dtype, group in by_dtype.items():
            flat = self._buffer(sum(p.padded_numel for p in group), dtype, Category.WORKSPACE)
            gather = _Gather(flat, {id(p) for p in group}, group)
            del flat
            for p in group:
                p.gather = gather

    def _ds_wait(self, p: _Param) -> None:
        gather, p.gather = p.gather, None
        if gather is None:
            return
        if not gather.copied:
            gather.copied = True
            for q in gather.members:
                self._allocate_unsharded(q)
        gather.pending.discard(id(p))
        if not gather.pending:
            gather.flat = None  # the handle's last reference: the flat output is freed

    def _ds_free(self, p: _Param) -> None:
        assert p.unsharded is not None
        self._tracer.free_storage(_local(p.unsharded))
        for module, name in self._places[id(p)]:
            self._set(module, name, p.sharded)

    @contextmanager
    def gathered_parameters(self, tensors: Sequence[torch.Tensor | None]) -> Iterator[list[torch.Tensor | None]]:
        """ZeRO-3's parameters read outside their module's forward: TRL's fused LM head reads
        ``lm_head.weight`` in the model's forward without calling the head, and wraps its use in
        ``maybe_gather_lm_head_ctx`` (``GatheredParameters`` over those not AVAILABLE).

        In an engine's forward DeepSpeed sees the read first (``ZeROOrderedDict.__getitem__``): the
        parameter is all-gathered at once, into its own padded buffer, and registered as an external
        parameter of the module whose forward runs (``FWD_MODULE_STACK[-1]``), with whose fetches and
        releases it goes from then on (real DeepSpeed 0.19.8 with TRL's head: tests/test_trl_zero3.py);
        TRL's context then finds it AVAILABLE and gathers nothing. Outside a forward (a backward whose
        module did not fetch it) ``GatheredParameters`` gathers it and partitions it again on exit.
        Yields the gathered tensors in place of ``tensors`` (memcalc's gathered parameter is a tensor
        apart from its shard; DeepSpeed swaps ``param.data``); a tensor that is none of this program's
        parameters is yielded as it was."""
        found = [None if t is None else next((p for p in self.params if t is p.sharded or t is p.unsharded), None)
                 for t in tensors]
        missing = [p for p in dict.fromkeys(p for p in found if p is not None)
                   if not self._coordinator_of[id(p)].available(p)]
        if self.stage3.offload_param and missing:  # the host partitions copied to the GPU first
            self._transient(sum(p.shard_numel * p.gather_dtype.itemsize for p in missing))
        for p in missing:
            self._allocate_unsharded(p)
        registered = []
        for p in missing:  # DeepSpeed's ZeROOrderedDict saw the read first (_read), in the engine's forward
            running = self._running(self._coordinator_of[id(p)])
            if running is not None:
                self._coordinator_of[id(p)].gathered_on_access(p)
                running.params.append(p)
                registered.append(p)
        missing = [p for p in missing if p not in registered]
        try:
            yield [t if p is None else p.unsharded for t, p in zip(tensors, found, strict=True)]
        finally:
            for p in missing:
                assert p.unsharded is not None
                self._tracer.free_storage(_local(p.unsharded))

    @contextmanager
    def gathered_for_generation(self, path: str) -> Iterator[None]:
        """TRL's ``unwrap_model_for_generation`` under ZeRO-3 with ``ds3_gather_for_generation`` (its
        default), around ``generate()``: ``GatheredParameters(model.parameters())`` all-gathers every
        parameter of the engine at ``path`` not yet whole, each into its own padded buffer
        (``_allgather_params_coalesced``); ``remove_hooks`` takes the engine's module hooks off, so the
        forwards of ``generate()`` fetch and release nothing (the root's ``_start_of_forward_hook``
        stays: each forward still resets the coordinator's step); ``add_hooks`` invalidates the trace;
        the context's exit partitions every parameter, persistent ones too. The next forward records
        the trace again: nothing prefetched, nothing kept, until the one after."""
        coordinator = self.coordinators[self.engines.index(path)]
        for p in coordinator.gathered_whole():
            self._allocate_unsharded(p)
        for p in coordinator.params:
            for module, name in self._places[id(p)]:
                assert p.unsharded is not None
                self._set(module, name, p.unsharded)
        self._unhooked.add(id(coordinator))
        try:
            yield
        finally:
            self._unhooked.discard(id(coordinator))
            coordinator.invalidate()
            coordinator.release_and_reset_all()

    def _watch_reads(self, member: nn.Module) -> None:
        """``member._parameters`` as DeepSpeed's ``ZeROOrderedDict`` (:class:`_ZeroParameters`); restored,
        with what the other undos wrote into it, after them."""
        original = member._parameters
        member._parameters = _ZeroParameters(self, original)

        def restore() -> None:
            original.clear()
            original.update(dict.items(member._parameters))
            member._parameters = original
        self._undo.append(restore)

    def _read(self, value: Any) -> Any:
        """A parameter read from a module's ``_parameters`` (``ZeROOrderedDict.__getitem__``): one not
        gathered, read in a forward outside its own module's (PEFT's LoRA layer reads ``lora_A.weight.dtype``;
        TRL's fused head ``lm_head.weight``), is all-gathered at once into its own buffer and registered as an
        external parameter of the module whose forward runs, fetched and released with it from then on (real
        DeepSpeed 0.19.8: tests/test_trl_grpo_zero3.py). A gathered one reads as its gathered tensor."""
        p = self._by_sharded.get(id(value))
        if p is None:
            return value
        coordinator = self._coordinator_of[id(p)]
        if not coordinator.available(p):
            running = self._running(coordinator)
            if running is None:
                return value
            self._allocate_unsharded(p)
            coordinator.gathered_on_access(p)
            running.params.append(p)
        return p.unsharded if coordinator.whole(p) and p.unsharded is not None else value

    def _running(self, coordinator: ParamCoordinator[_Param]) -> _UnitState | None:
        """The module whose forward runs (DeepSpeed's ``FWD_MODULE_STACK[-1]``), when a parameter of
        ``coordinator``'s engine read now is discovered as external: inside that engine's root forward
        (``_in_forward``: a call of the root, through the engine or not; ``PeftModel.generate`` calls the
        base model and is not one), outside backward, with the engine's hooks on."""
        if id(coordinator) not in self._in_forward or not self._forward_stack or self._in_backward:
            return None
        running = self._forward_stack[-1]
        return running if self._hooked(running) else None

    def _hooked(self, state: _UnitState) -> bool:
        """Whether DeepSpeed's module hooks of the state's engine are on (:meth:`gathered_for_generation`)."""
        return id(self._coordinator(state)) not in self._unhooked

    def _swap_in(self, state: _UnitState) -> None:
        for module, name, p in state.locations:
            assert p.unsharded is not None, "gathered before use"
            self._set(module, name, p.unsharded)

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, state: _UnitState, args: tuple[Any, ...], register: bool = True) -> tuple[Any, ...] | None:
        """A unit's forward begins: gather it; ``register``: wrap its inputs for its post-backward
        (False: another module of its group began this forward pass)."""
        if self.coordinators and not self._hooked(state):
            return None
        if self.coordinators:  # DeepSpeed: fetch_sub_module (a recomputation too)
            self._forward_stack.append(state)
            # a forward inside a backward (the autograd engine's graph task running) is a recomputation
            self._coordinator(state).fetch(state, state.params, forward=True,
                                           recomputing=torch._C._current_graph_task_id() != -1)
            self._swap_in(state)
            if self._in_backward:
                return None
            # _post_backward_module_hook: every forward, under no_grad too, sets ds_grads_remaining to 0,
            # then counts this call's inputs that require grad
            state.grads_remaining = 0
            if self.training and torch.is_grad_enabled():
                count = sum(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                state.grads_remaining = count
                return _wrap_inputs(args, lambda: self._deepspeed_post_backward(state, count)) or args
            return None
        if self._in_backward:  # recomputation (activation checkpointing) inside backward
            self._gather(state, forward=False)
            self._swap_in(state)
            return None
        if self.fsdp2 and state is self.states[-1] and self.gather_dtype is not None:
            args = map_output(args, self._cast_input)  # FSDP2's root casts forward inputs
        if self.fsdp2 and state.unit.own_root:
            self._trained_forward_over()
        self._gather(state, forward=True)
        self._swap_in(state)
        if register and self.training and torch.is_grad_enabled():
            return _wrap_inputs(args, lambda: self._post_backward(state)) or args
        return args

    def _trained_forward_over(self) -> None:
        """A separate model's forward runs after the trained model's (TRL's reference after the policy),
        whose own FSDP root ends at the trained model's post-forward — memcalc's root unit is the wrapper
        around both: the last all-gather output is freed there, and the root's parameters are resharded
        where ``reshard_after_forward=True`` was passed to its ``fully_shard`` explicitly (an older
        accelerate's; torch then reshards a root after its forward too; the backward gathers them again).
        accelerate 1.16 leaves the root to torch's default (:attr:`Unit.reshard_after_forward` False,
        :mod:`memcalc.distributed.accelerate_fsdp`): it stays gathered until its backward."""
        self._pending_all_gather = None
        root = self.states[-1]
        if (self.reshard_after_forward and root.unit.reshard_after_forward is None and root.gathered
                and not root.backward_started):
            self._reshard(root)

    def _cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and self.gather_dtype is not None and tensor.dtype != self.gather_dtype:
            return tensor.to(self.gather_dtype)
        return tensor

    def _post_forward(self, state: _UnitState, output: Any) -> Any:
        if self.coordinators and not self._hooked(state):
            return None
        if self.coordinators:  # DeepSpeed: release_sub_module (a recomputation too)
            if self._forward_stack and self._forward_stack[-1] is state:
                self._forward_stack.pop()
            self._coordinator(state).release(state, state.params, forward=True)
            if self._in_backward or not (self.training and torch.is_grad_enabled()):
                return None
            # _pre_backward_module_hook: each output through an identity function whose backward
            # fetches, so that an outer module's output (the same tensor) is fetched first
            return map_output(output, lambda t: _PreBackward.apply(  # type: ignore[no-untyped-call]
                lambda: self._pre_backward(state), t) if t.requires_grad else t)
        if self._in_backward:
            return
        if state not in self._forward_order and not state.unit.own_root:
            self._forward_order.append(state)
        if self.training and torch.is_grad_enabled():
            for tensor in tensors_of(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda _g, s=state: self._pre_backward(s))  # type: ignore[no-untyped-call]
        if state.reshard_after_forward:
            self._reshard(state)
        if self.fsdp2 and (state is self.states[-1] or state.unit.own_root):
            self._pending_all_gather = None  # FSDPState._post_forward of the root

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, state: _UnitState) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if state.backward_started:
            return
        state.backward_started = True
        if self.coordinators:  # DeepSpeed: fetch_sub_module, which prefetches
            self._coordinator(state).fetch(state, state.params, forward=False)
            self._swap_in(state)
            return
        self._gather(state, forward=False)
        self._swap_in(state)
        following = self._next_in_backward(state)
        if following is not None and not following.gathered and following.prefetched is None:
            if self.fsdp2:
                missing = [p for p in following.params if p.holders == 0]
                if missing and not _alone(missing):
                    following.prefetched = self._all_gather_output(missing)
            else:
                self._gather(following, forward=False)

    def _next_in_backward(self, state: _UnitState) -> _UnitState | None:
        if state not in self._forward_order:
            return None
        index = self._forward_order.index(state)
        for candidate in reversed(self._forward_order[:index]):
            if not candidate.backward_started:
                return candidate
        return None

    def _gradient_ready_hook(self, p: _Param, _tensor: torch.Tensor) -> None:
        self._gradient_ready(p)

    def _gradient_ready(self, p: _Param) -> None:
        if self.fsdp2 or p.unsharded is None or p.unsharded.grad is None:
            return
        # DeepSpeed: copied into the reduce bucket, reduce-scattered into the partition buffer
        self._tracer.track(p.unsharded.grad, Category.GRADIENTS)
        p.unsharded.grad = None

    def _deepspeed_post_backward(self, state: _UnitState, count: int) -> None:
        """DeepSpeed's ``PostBackwardFunctionModule``, one per input: each backward takes one off the
        module's ``ds_grads_remaining`` and releases the module where that reaches 0. A forward of the
        module after this one (TRL's DPO reference under LoRA: the policy with its adapters disabled,
        under no_grad) set it to 0 again, so it only goes below: nothing is released then, until
        ``release_backward_leftovers`` releases the non-persistent parameters at the end of backward."""
        before = state.grads_remaining
        state.grads_remaining -= count
        if 1 <= before <= count:
            self._post_backward(state)

    def _post_backward(self, state: _UnitState) -> None:
        if state.reduced:
            return
        state.reduced = True
        if self.coordinators:  # DeepSpeed: the gradients went at once (_gradient_ready)
            self._coordinator(state).release(state, state.params, forward=False)
            return
        if self.accumulate and not self._reducing:
            self._accumulate(state)
            return
        grads: list[tuple[_Param, torch.Tensor]] = []
        for p in state.owned:
            if p.accumulated is not None:  # a backward before left it in the reduce dtype
                grads.append((p, p.accumulated))
                p.accumulated = None
            elif p.unsharded is not None and p.unsharded.grad is not None:
                self._tracer.track(p.unsharded.grad, Category.GRADIENTS)
                grads.append((p, p.unsharded.grad))
                p.unsharded.grad = None
        self._reshard(state)
        if self.fsdp2 and state.params:
            # FSDPParamGroup.post_backward: the previous unit's reduce-scatter input goes
            # (reduce_scatter_max_input_buffers = 1) before it asks whether any gradient is
            # there to reduce — a unit of frozen parameters releases it too
            self._reduce_scatter_inputs.clear()
            if grads:
                self._reduce_scatter(grads)
        grads.clear()

    def _reduce_scatter(self, grads: list[tuple[_Param, torch.Tensor]]) -> None:
        params = [p for p, _ in grads]
        reduce_dtype = self.reduce_dtype or grads[0][1].dtype
        rs_input = self._buffer(sum(p.padded_numel for p in params), reduce_dtype, Category.WORKSPACE)
        self._chunk_cat_scratch(params, grads[0][1].dtype, reduce_dtype)
        # foreach_reduce frees the unsharded gradients once they are copied in (unsharded_grads.clear()),
        # all but the last: with more than one rank its loop over (fsdp_param, unsharded_grad) leaves
        # that one bound to a local until the function returns (a real run, torch 2.13, confirms it)
        last = grads[-1][1] if params[0].world_size > 1 else None
        grads.clear()
        # the output and its cast are allocated on the reduce-scatter stream (the post-reduce
        # stream; under HSDP the cast would run on the all-reduce stream, but the parameters'
        # dtype is the reduce dtype under every MixedPrecisionPolicy memcalc builds: no cast there)
        with self._tracer.on_stream(Stream.REDUCE_SCATTER):
            output = torch.empty(sum(p.shard_numel for p in params), dtype=reduce_dtype, device="meta")
            self._tracer.track(output, Category.GRADIENTS)
            if self.gloo and not _alone(params):  # one rank: foreach_reduce copies, no collective
                # gloo reduce-scatters by all-reducing a clone of the input, which it then divides
                self._gloo_copy(rs_input, average=reduce_dtype in _AVERAGED_DTYPES)
            sharded_dtype = params[0].sharded.dtype
            if sharded_dtype != reduce_dtype:
                output = output.to(sharded_dtype)
                self._tracer.track(output, Category.GRADIENTS)
        del last
        offset = 0
        for p in params:
            view = output.narrow(0, offset, p.shard_numel).view(_local(p.sharded).shape)
            offset += p.shard_numel
            if p.sharded.grad is None:
                p.sharded.grad = _like(p.sharded, view)
            else:
                _local(p.sharded.grad).add_(view)  # accumulation over micro-batches
            del view
        del output
        self._reduce_scatter_inputs.append(rs_input)

    def _chunk_cat_scratch(self, params: Sequence[_Param], grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """The scratch memory of ``fsdp.chunk_cat`` copying the unsharded gradients into the
        reduce-scatter input."""
        if not self.cpu:
            if grad_dtype != reduce_dtype and (grad_dtype, reduce_dtype) != (torch.bfloat16, torch.float32):
                # _chunk_cat_out_cuda converts while copying in only in its bf16 -> fp32 kernel;
                # otherwise the generic path concatenates first
                self._transient(sum(p.padded_numel for p in params) * grad_dtype.itemsize)
            return
        # the CPU runs the generic at::native::_chunk_cat_out (a real CPU run, torch 2.13):
        # _pad_chunk copies each gradient whose dim 0 does not divide by the world size into a
        # zero-padded tensor, kept until the concatenation is done; cat_out then casts each
        # one through a temporary of its own dtype (TensorIterator's cast_common_dtype_to_outputs)
        padded = [self._buffer(p.padded_numel, grad_dtype, Category.WORKSPACE)
                  for p in params if p.padded_numel != _local(p.original).numel()]
        if grad_dtype != reduce_dtype:
            for p in params:
                self._transient(p.padded_numel * grad_dtype.itemsize)
        padded.clear()

    def _accumulate(self, state: _UnitState) -> None:
        """``FSDPParamGroup.post_backward`` without gradient sync and without reshard after
        backward (a pipeline's microbatch): the unsharded gradients stay, added up by autograd;
        under a reduce dtype of their own they are kept in it (``accumulate_unsharded_grad_if_needed``,
        ``to_accumulated_grad_if_needed``)."""
        for p in state.owned:
            grad = None if p.unsharded is None else p.unsharded.grad
            if grad is None:
                continue
            if p.accumulated is not None:
                p.accumulated += grad
                assert p.unsharded is not None
                p.unsharded.grad = None
            elif self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
                assert p.unsharded is not None
                p.unsharded.grad = None
                p.accumulated = grad.to(self.reduce_dtype)
                self._tracer.track(p.accumulated, Category.GRADIENTS)
            del grad

    def reduce_accumulated(self) -> None:
        """The end of a pipeline step's backwards (``PipelineStage.perform_reduce_grad``): every
        unit's ``post_backward`` with gradient sync and reshard after backward — root first, then
        the others in model order (``all_states``) — then the final callback."""
        self._reducing = True
        try:
            for state in self.states:
                state.reduced = False
            self._end_of_backward()
        finally:
            self._reducing = False

    def _end_of_backward(self) -> None:
        if self.coordinators:  # DeepSpeed's backward_epilogue
            for coordinator in self.coordinators:
                coordinator.release_backward_leftovers()
            for state in self.states:
                state.backward_started = False
                state.reduced = False
            self._in_backward = False
            return
        if self.accumulate and not self._reducing:
            # the root's final callback of a microbatch: post_backward (no sync) where it did not run
            for state in [self.states[-1], *self.states[:-1]]:
                self._post_backward(state)
            for state in self.states:
                state.prefetched = None
                state.backward_started = False
                state.reduced = False
            self._forward_order.clear()
            self._in_backward = False
            return
        # units whose input gradients never came (the root; a unit after frozen ones): FSDP2's
        # final callback visits the root, then the others in model order (all_states);
        # DeepSpeed's, the units in reverse
        order = [self.states[-1], *self.states[:-1]] if self.fsdp2 else list(reversed(self.states))
        for state in (s for s in order if not s.unit.own_root):  # another root's states are not visited
            self._post_backward(state)
        for state in self.states:
            if not state.unit.own_root:  # kept unsharded under reshard_after_forward=False, as its root keeps it
                self._reshard(state)
            state.prefetched = None
            state.backward_started = False
            state.reduced = False
        self._reduce_scatter_inputs.clear()
        self._forward_order.clear()
        self._in_backward = False


class _ZeroParameters(dict[str, Any]):
    """A module's ``_parameters`` under ZeRO-3 whose reads go through :meth:`ShardedProgram._read`, as
    DeepSpeed's ``ZeROOrderedDict`` (``parameter_offload.py``) makes every module's."""

    def __init__(self, program: ShardedProgram, items: Mapping[str, Any]) -> None:
        super().__init__(items)
        self._program = program

    def __getitem__(self, name: str) -> Any:
        return self._program._read(super().__getitem__(name))


class _PreBackward(torch.autograd.Function):
    """DeepSpeed's ``PreBackwardFunctionForModule``: an identity on a module's output whose
    backward runs when the output's gradient arrives — the module's backward begins."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], tensor: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class _PostBackward(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``: an identity on a unit's inputs whose
    backward runs once the gradients of those inputs are computed — the unit's backward
    is over."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _wrap_inputs(args: tuple[Any, ...], callback: Callable[[], None]) -> tuple[Any, ...] | None:
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not positions:
        return None
    wrapped = _PostBackward.apply(callback, *(args[i] for i in positions))  # type: ignore[no-untyped-call]
    out = list(args)
    for i, tensor in zip(positions, wrapped, strict=True):
        out[i] = tensor
    return tuple(out)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s memory on this rank: a tensor-parallel DTensor's local
    shard (FSDP2 over tensor parallelism shards and gathers that), any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _like(model: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``model`` holds its memory: a DTensor of ``model``'s mesh, placements and
    global shape over ``local`` (FSDP2's ``_from_local_no_grad`` with the tensor-parallel spec:
    its sharded and unsharded parameters, its sharded gradients), or ``local`` itself."""
    if _local(model) is model:
        return local
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = model._spec  # type: ignore[attr-defined]  # a DTensor
    meta = TensorMeta(spec.shape, spec.stride, local.dtype)
    spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]  # untyped in torch
