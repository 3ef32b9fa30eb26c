"""What one GPU of a multi-GPU strategy runs, as hooks on the meta model memcalc traces.

PyTorch's own ``DistributedDataParallel`` and ``fully_shard`` (FSDP2) cannot run on meta
tensors (DDP's constructor reads parameter values with ``.item()``; FSDP2 refuses meta
parameters before training, allocates its all-gather buffers on the mesh's device, and frees
unsharded parameters with ``storage.resize_(0)``, which no dispatch mode sees), DataParallel
needs several real devices, and DeepSpeed is not a dependency. So each strategy's *memory
behaviour* is reproduced here with real meta tensors at the moments the real implementation
allocates and frees them; everything else — the model's forward and backward at the rank's
batch, autograd's gradients, ``torch.optim``'s state on the rank's shard — runs for real
under :class:`~memcalc.engine.trace.StorageTracer`, exactly as for one GPU.

A program is handed to :func:`memcalc.api.trace_model` (``hooks=``): ``install`` runs before
the model's storages are registered (so swapped-in shards are what gets registered),
``remove`` runs in its ``finally`` and puts the model back as it was. ``communication``
collects the storages that exist only for the collectives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from memcalc.core.categories import Category
from memcalc.engine.optimizers import OptimizerSpec
from memcalc.engine.trace import StorageTracer, tensors_of

__all__ = (
    "RankProgram",
    "DdpProgram",
    "DataParallelOutputDevice",
    "DataParallelReplica",
    "ShardedProgram",
    "ZeroProgram",
    "Unit",
    "fsdp_units",
    "module_units",
    "COALESCE_BUFFER_BYTES",
)

# torch.nn.parallel.comm.broadcast_coalesced / reduce_add_coalesced: buffer_size=10485760,
# the flat chunk DataParallel broadcasts parameters in and reduces gradients in.
COALESCE_BUFFER_BYTES = 10 * 1024 * 1024
# DistributedDataParallel(broadcast_buffers=True) broadcasts buffers every forward through
# _distributed_broadcast_coalesced(..., self.broadcast_bucket_size) with this bucket size.
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class RankProgram:
    """Base class: hooks, undo actions, and the storages created for collectives."""

    def __init__(self) -> None:
        self.communication: set[int] = set()
        self.notes: list[str] = []
        self.tracer: StorageTracer | None = None
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._persistent: list[torch.Tensor] = []  # buffers that live as long as the model

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        self.tracer = tracer

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        """The optimizer the rank runs (ZeRO wraps the user's in its partitioned one)."""
        return spec

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._persistent.clear()

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def _tracer(self) -> StorageTracer:
        assert self.tracer is not None, "install() first"
        return self.tracer

    def _buffer(self, numel: int, dtype: torch.dtype, category: Category, *, preexisting: bool = False,
                communication: bool = True) -> torch.Tensor:
        """A real meta tensor of ``numel`` elements: allocated now (or before the step)."""
        tensor = torch.empty(int(numel), dtype=dtype, device="meta")
        tracer = self._tracer
        uid = tracer.preexisting(tensor, category) if preexisting else tracer.track(tensor, category)
        if communication:
            self.communication.add(uid)
        if preexisting:
            self._persistent.append(tensor)
        return tensor

    def _transient(self, nbytes: int) -> None:
        """A collective's scratch buffer, allocated and freed at once (a flatten for NCCL)."""
        if nbytes > 0:
            self.communication.add(self._tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False))

    def _at_backward(self, module: nn.Module, start: Callable[[], None] | None,
                     end: Callable[[], None] | None) -> None:
        """Call ``start`` when backward reaches the model's output and ``end`` when the
        autograd engine finishes (the final callback FSDP and DeepSpeed use)."""

        def on_output_grad(_grad: torch.Tensor) -> None:
            if start is not None:
                start()
            if end is not None:
                torch.autograd.Variable._execution_engine.queue_callback(end)

        def forward_hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = next((t for t in tensors_of(output) if t.requires_grad), None)
            if tensor is not None:
                tensor.register_hook(on_output_grad)

        self._handles.append(module.register_forward_hook(forward_hook))


def _model_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _coalesced_chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[int]:
    """Bytes of each flat chunk ``torch._utils._take_tensors`` makes: consecutive tensors
    until a chunk reaches ``limit`` (a larger tensor is a chunk of its own)."""
    chunks: list[int] = []
    current = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if current and current + size > limit:
            chunks.append(current)
            current = 0
        current += size
    if current:
        chunks.append(current)
    return chunks


# ============================================================================================
# DistributedDataParallel
# ============================================================================================


class DdpProgram(RankProgram):
    """One DDP rank (checked against the real class on the CPU, tests/test_strategies.py):
    the whole model, its gradients and optimizer state, plus the Reducer's
    gradient buckets — flat buffers allocated when DDP is constructed, one per
    ``bucket_cap_mb`` of parameters in reverse registration order (as
    ``dist._compute_bucket_assignment_by_size`` assigns them after the first iteration's
    rebuild), held for the life of the model. Each gradient autograd produces is copied into
    its bucket, all-reduced there and copied back: buckets and ``.grad`` both exist. With
    ``gradient_as_bucket_view=True`` the Reducer makes ``.grad`` a view of the bucket
    instead: the buckets *are* the gradients (the tensor autograd allocates after
    ``zero_grad(set_to_none=True)`` lives only until it is copied in)."""

    def __init__(self, bucket_cap_bytes: int, gradient_as_bucket_view: bool, training: bool):
        super().__init__()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.training = training
        self.bucket_bytes: list[int] = []
        self._views: dict[int, torch.Tensor] = {}

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            self._make_buckets(params)
        chunks = _coalesced_chunks(list(module.buffers()), DDP_BROADCAST_BUCKET_BYTES)
        if chunks:
            def broadcast_buffers(_module: nn.Module, _args: Any) -> None:
                for chunk in chunks:
                    self._transient(chunk)

            self._handles.append(module.register_forward_pre_hook(broadcast_buffers))

    def _make_buckets(self, params: list[nn.Parameter]) -> None:
        order: list[torch.Tensor] = list(reversed(params))
        assignment, _limits = dist._compute_bucket_assignment_by_size(order, [self.bucket_cap_bytes])
        category = Category.GRADIENTS if self.gradient_as_bucket_view else Category.WORKSPACE
        for indices in assignment:
            members = [order[i] for i in indices]
            bucket = self._buffer(sum(p.numel() for p in members), members[0].dtype, category,
                                  preexisting=True, communication=not self.gradient_as_bucket_view)
            self.bucket_bytes.append(bucket.numel() * bucket.element_size())
            offset = 0
            for p in members:
                self._views[id(p)] = bucket.narrow(0, offset, p.numel()).view_as(p)
                offset += p.numel()
        if self.gradient_as_bucket_view and self.training:
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._to_bucket_view))

    def _to_bucket_view(self, param: torch.Tensor) -> None:
        view = self._views[id(param)]
        if param.grad is not None and param.grad.untyped_storage() is not view.untyped_storage():
            self._tracer.track(param.grad, Category.GRADIENTS)
            view.copy_(param.grad)
            param.grad = view  # the gradient autograd allocated dies here, as in the Reducer


# ============================================================================================
# DataParallel
# ============================================================================================


class DataParallelOutputDevice(RankProgram):
    """``device_ids[0]`` under ``nn.DataParallel``: the module's own parameters (replica 0
    shares them), its chunk of the batch, and the extra work of the output device —

    * the source of every forward's broadcast (flattened in ``COALESCE_BUFFER_BYTES`` chunks);
    * ``gather``: the outputs of all replicas concatenated into one full-batch output here,
      the loss and its targets on the full batch;
    * the gradient reduction (``ReduceAddCoalesced``, at the end of backward): replica 0's
      gradients, a flat chunk of them, and the summed gradients (flat chunks whose views
      become ``.grad``) exist together until replica 0's are released;
    * the optimizer, which only this device runs.
    """

    def __init__(self, chunk_sizes: Sequence[int], training: bool):
        super().__init__()
        self.chunk_sizes = list(chunk_sizes)
        self.training = training

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        model_bytes = _model_bytes(module)
        self._handles.append(module.register_forward_pre_hook(
            lambda _m, _a: self._transient(min(COALESCE_BUFFER_BYTES, model_bytes))))
        self._handles.append(module.register_forward_hook(self._gather))
        params = [p for p in module.parameters() if p.requires_grad]
        if self.training and params:
            self._at_backward(module, None, lambda: self._reduce(params))
            for p in params:  # what autograd accumulates here is replica 0's gradient
                self._handles.append(p.register_post_accumulate_grad_hook(self._mark_gradient))

    def _gather(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        total = sum(self.chunk_sizes)

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0:  # DataParallel gathers scalars into a vector
                tensor = tensor.unsqueeze(0)
                shape = (len(self.chunk_sizes),)
            else:
                shape = (total, *tensor.shape[1:])
            gathered = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            gathered.narrow(0, 0, tensor.shape[0]).copy_(tensor)  # the other chunks arrive by copy
            return gathered

        return _map_output(output, gather)

    def _mark_gradient(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._tracer.track(param.grad, Category.GRADIENTS)

    def _reduce(self, params: Sequence[nn.Parameter]) -> None:
        with_grad = [p for p in params if p.grad is not None]
        reduced: list[tuple[nn.Parameter, torch.Tensor]] = []
        for chunk in _param_chunks(with_grad, COALESCE_BUFFER_BYTES):
            numel = sum(p.numel() for p in chunk)
            dtype = _grad(chunk[0]).dtype
            replica = self._buffer(numel, dtype, Category.WORKSPACE)  # _flatten_dense_tensors(replica 0's)
            flat = torch.empty(numel, dtype=dtype, device="meta")  # reduce_add's result, beside it
            self._tracer.track(flat, Category.GRADIENTS)
            del replica
            offset = 0
            for p in chunk:
                reduced.append((p, flat.narrow(0, offset, p.numel()).view_as(p)))
                offset += p.numel()
            del flat
        for p, grad in reduced:
            p.grad = grad  # replica 0's gradient is released, the summed one kept


class DataParallelReplica(RankProgram):
    """Any other device under ``nn.DataParallel``: a replica of the parameters and buffers
    (broadcast at every forward; registered as present throughout the step), its chunk of
    the batch, no loss (its output is sent to the output device, and the gradient of that
    output comes back as a new tensor), the replica's gradients until they are reduced onto
    the output device (flattened in chunks), and no optimizer."""

    def __init__(self, training: bool):
        super().__init__()
        self.training = training

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        self._handles.append(module.register_forward_hook(self._send))
        params = [p for p in module.parameters() if p.requires_grad]
        if self.training and params:
            self._at_backward(module, None, lambda: self._flatten_for_reduce(params))

    @staticmethod
    def _send(_module: nn.Module, _args: Any, output: Any) -> Any:
        floating = [t for t in tensors_of(output) if t.is_floating_point() and t.requires_grad]
        return _SendToOutputDevice.apply(*floating) if floating else output

    def _flatten_for_reduce(self, params: Sequence[nn.Parameter]) -> None:
        for chunk in _coalesced_chunks([p.grad for p in params if p.grad is not None], COALESCE_BUFFER_BYTES):
            self._transient(chunk)


class _SendToOutputDevice(torch.autograd.Function):
    """Stands for a replica's output leaving for the output device: a scalar the loss can
    use; backward returns the gradient that ``Gather.backward`` sends back, a new tensor."""

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [(t.shape, t.dtype) for t in outputs]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in ctx.shapes)


def _map_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(_map_output(o, fn) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_map_output(o, fn) for o in output)
    if isinstance(output, dict):
        mapped = {k: _map_output(v, fn) for k, v in output.items()}
        try:
            return type(output)(mapped)
        except TypeError:
            return mapped
    return output


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def _param_chunks(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > limit or _grad(p).dtype != _grad(current[0]).dtype):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks


# ============================================================================================
# Sharded parameters: FSDP2 (fully_shard) and DeepSpeed ZeRO-3
# ============================================================================================


@dataclass(frozen=True)
class Unit:
    """A group of parameters gathered together: an FSDP-wrapped module (the modules of its
    subtree that no inner unit claims) or, for ZeRO-3, one module's own parameters."""

    name: str
    module: nn.Module
    members: tuple[nn.Module, ...]  # modules whose own (recurse=False) parameters it gathers


def fsdp_units(module: nn.Module, containers: Sequence[str]) -> list[Unit]:
    """``fully_shard`` on every block of ``containers`` (a zoo model's transformer layers or
    ResNet blocks) and on the root. Without containers: on the items of the model's
    outermost ``nn.ModuleList``s (how transformer layers are held), else on every direct
    child that has parameters."""
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
    for name, block in blocks:
        members = tuple(m for m in block.modules() if id(m) not in claimed)
        claimed.update(id(m) for m in members)
        units.append(Unit(name, block, members))
    root_members = tuple(m for m in module.modules() if id(m) not in claimed)
    units.append(Unit("(root)", module, root_members))
    return units


def _module_lists(module: nn.Module) -> list[str]:
    found: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and not any(name.startswith(f + ".") for f in found):
            if next(sub.parameters(), None) is not None:
                found.append(name)
    return found


def module_units(module: nn.Module) -> list[Unit]:
    """DeepSpeed ZeRO-3's granularity: each module that owns parameters gathers them in its
    forward pre-hook (``fetch_sub_module``) and releases them after."""
    return [Unit(name or "(root)", m, (m,)) for name, m in module.named_modules()
            if next(m.parameters(recurse=False), None) is not None]


@dataclass(eq=False)
class _Param:
    original: nn.Parameter
    sharded: nn.Parameter
    shard_numel: int
    world_size: int
    gather_dtype: torch.dtype
    owner: "_UnitState | None" = None
    unsharded: nn.Parameter | None = None
    holders: int = 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size


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


class ShardedProgram(RankProgram):
    """One rank of FSDP2 (``style="fsdp2"``) or DeepSpeed ZeRO-3 (``style="deepspeed"``).

    The model's parameters are replaced by this rank's shards for the whole step (what the
    optimizer sees); a unit's pre-forward hook all-gathers its parameters — real meta
    tensors of the full size that the module then uses — and resharding frees them with
    :meth:`StorageTracer.free_storage` (FSDP's ``resize_(0)``: autograd keeps referencing
    them), backward gathers them again (:meth:`StorageTracer.alloc_storage`).

    FSDP2 (``torch/distributed/fsdp/_fully_shard``): shards are dim-0 chunks padded to a
    multiple of the world size; an all-gather output of ``world_size × shard`` elements
    (under mixed precision, from a cast copy of the shards) is copied out into per-parameter
    unsharded storages; in forward the output lives until the next unit's copy-out is done
    (``comm_ctx.all_gather_state``), in backward it goes at once; the root is not resharded
    after forward and casts the forward inputs to ``param_dtype``; backward prefetches the
    next unit's all-gather; post-backward (when the gradients of the unit's inputs are done,
    else the final callback) reshards, allocates a reduce-scatter input of the padded unit in
    ``reduce_dtype`` and the reduce-scatter output (this rank's sharded ``.grad``, cast to the
    shard's dtype if it differs), then frees the unsharded gradients; one reduce-scatter input
    is kept until the next unit's (``reduce_scatter_max_input_buffers=1``). Against real
    ``fully_shard`` on the CPU (fake process group, profiler) this agrees to the byte, less
    Adam's CPU step counters (tests/test_strategies.py).

    DeepSpeed ZeRO-3 (``deepspeed/runtime/zero/stage3.py``, ``partition_parameters.py``):
    each parameter is a flat partition of ``ceil(numel / world_size)`` elements; gathering
    writes straight into the full parameter; the next unit is prefetched in forward and in
    backward; each gradient is copied into the persistent reduce bucket as soon as autograd
    produces it and freed (``reduce_partition_and_remove_grads``), its partition landing in
    the persistent ``grad_partitions_flat_buffer``; the step runs in :class:`ZeroOptimizer`.
    """

    def __init__(self, units: Sequence[Unit], world_size: int, *, style: str, reshard_after_forward: bool,
                 sharded_dtype: torch.dtype | None, gather_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, training: bool, reduce_bucket_size: int = 0,
                 cpu: bool = False):
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
        self.states: list[_UnitState] = []
        self.params: list[_Param] = []
        self.grad_partition: torch.Tensor | None = None
        self._pending_all_gather: torch.Tensor | None = None
        self._reduce_scatter_inputs: list[torch.Tensor] = []
        self._forward_order: list[_UnitState] = []
        self._in_backward = False

    @property
    def fsdp2(self) -> bool:
        return self.style == "fsdp2"

    @property
    def shard_numel(self) -> int:
        return sum(p.shard_numel for p in self.params)

    # ---- install / remove -----------------------------------------------------------------
    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        by_param: dict[int, _Param] = {}
        root = self.units[-1].module if self.fsdp2 else module
        for unit in self.units:
            state = _UnitState(unit, [], [], [], self._unit_reshards(unit, root))
            for member in unit.members:
                for name, original in list(member._parameters.items()):
                    if original is None:
                        continue
                    param = by_param.get(id(original))
                    if param is None:
                        param = by_param[id(original)] = self._shard(original)
                        self.params.append(param)
                    if param.owner is None:
                        param.owner = state
                        state.owned.append(param)
                    if param not in state.params:
                        state.params.append(param)
                    state.locations.append((member, name, param))
                    self._set(member, name, param.sharded)
                    self._undo.append(functools.partial(self._set, member, name, original))
            self.states.append(state)
        for state in self.states:
            self._handles.append(state.unit.module.register_forward_pre_hook(
                lambda m, args, s=state: self._pre_forward(s, args)))
            self._handles.append(state.unit.module.register_forward_hook(
                lambda m, args, out, s=state: self._post_forward(s, out)))
        if self.training and not self.fsdp2 and self.params:
            dtype = self.params[0].sharded.dtype
            # stage3.py __init__: grad_partitions_flat_buffer (this rank's gradient partitions)
            self.grad_partition = self._buffer(self.shard_numel, dtype, Category.GRADIENTS, preexisting=True,
                                               communication=False)
            # stage3.py __init__ (contiguous_gradients): __ipg_bucket_flat_buffer
            self._buffer(self.reduce_bucket_size, dtype, Category.WORKSPACE, preexisting=True)

    def _unit_reshards(self, unit: Unit, root: nn.Module) -> bool:
        if self.fsdp2 and unit.module is root:
            return False  # FSDP2's lazy init: the root is not resharded after forward
        return self.reshard_after_forward

    def _shard(self, original: nn.Parameter) -> _Param:
        n = self.world_size
        dtype = self.sharded_dtype or original.dtype
        if self.fsdp2:  # dim-0 chunks, padded (FSDPParam._init_sharded_param)
            dim0 = original.shape[0] if original.dim() else 1
            shape = (math.ceil(dim0 / n), *original.shape[1:])
        else:  # a flat partition (ds_tensor)
            shape = (math.ceil(original.numel() / n),)
        sharded = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=original.requires_grad)
        return _Param(original, sharded, sharded.numel(), n, self.gather_dtype or original.dtype)

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
        if self.fsdp2 and missing:
            all_gather = state.prefetched if state.prefetched is not None else self._all_gather_output(missing)
            state.prefetched = None
        for p in state.params:  # the copy-out into the unsharded parameters
            if p.holders == 0:
                self._allocate_unsharded(p)
            p.holders += 1
        state.gathered = True
        if forward and all_gather is not None:
            # wait_for_unshard drops the previous unit's output, but its local reference
            # keeps it until the copy-out is done; this unit's waits for the next one
            self._pending_all_gather = all_gather
        del all_gather

    def _all_gather_output(self, params: Sequence[_Param]) -> torch.Tensor:
        dtype = params[0].gather_dtype
        cast = None
        if params[0].sharded.dtype != dtype:  # mixed precision: the all-gather input is a cast copy
            cast = self._buffer(sum(p.shard_numel for p in params), dtype, Category.WORKSPACE)
        output = self._buffer(sum(p.padded_numel for p in params), dtype, Category.WORKSPACE)
        del cast  # all_gather_copy_in has copied it into the output
        return output

    def _allocate_unsharded(self, p: _Param) -> None:
        tracer = self._tracer
        if p.unsharded is None:
            storage = torch.empty(p.padded_numel, dtype=p.gather_dtype, device="meta")
            unsharded = nn.Parameter(storage.narrow(0, 0, p.original.numel()).view(p.original.shape),
                                     requires_grad=p.original.requires_grad)
            self.communication.add(tracer.track(storage, Category.PARAMETERS))
            del storage
            if unsharded.requires_grad and self.training:
                self._handles.append(unsharded.register_post_accumulate_grad_hook(
                    functools.partial(self._gradient_ready_hook, p)))
            p.unsharded = unsharded
        else:
            self.communication.add(tracer.alloc_storage(p.unsharded, Category.PARAMETERS))

    def _reshard(self, state: _UnitState) -> None:
        if not state.gathered:
            return
        for module, name, p in state.locations:
            self._set(module, name, p.sharded)
        for p in state.params:
            p.holders -= 1
            if p.holders == 0 and p.unsharded is not None:
                self._tracer.free_storage(p.unsharded)
        state.gathered = False

    def _swap_in(self, state: _UnitState) -> None:
        for module, name, p in state.locations:
            assert p.unsharded is not None, "gathered before use"
            self._set(module, name, p.unsharded)

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, state: _UnitState, args: tuple) -> tuple | None:
        if self._in_backward:  # recomputation (activation checkpointing) inside backward
            self._gather(state, forward=False)
            self._swap_in(state)
            return None
        if self.fsdp2 and state is self.states[-1] and self.gather_dtype is not None:
            args = _map_output(args, self._cast_input)  # FSDP2's root casts forward inputs
        self._gather(state, forward=True)
        if not self.fsdp2:  # DeepSpeed prefetches the next module in forward too
            following = self._next_in_forward(state)
            if following is not None:
                self._gather(following, forward=False)
        self._swap_in(state)
        if self.training and torch.is_grad_enabled():
            return _wrap_inputs(args, lambda: self._post_backward(state)) or args
        return args

    def _cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and self.gather_dtype is not None and tensor.dtype != self.gather_dtype:
            return tensor.to(self.gather_dtype)
        return tensor

    def _next_in_forward(self, state: _UnitState) -> _UnitState | None:
        index = self.states.index(state)
        return self.states[index + 1] if index + 1 < len(self.states) else None

    def _post_forward(self, state: _UnitState, output: Any) -> None:
        if self._in_backward:
            return
        if state not in self._forward_order:
            self._forward_order.append(state)
        if self.training and torch.is_grad_enabled():
            for tensor in tensors_of(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda _g, s=state: self._pre_backward(s))
        if state.reshard_after_forward:
            self._reshard(state)
        if self.fsdp2 and state is self.states[-1]:
            self._pending_all_gather = None  # FSDPState._post_forward of the root

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, state: _UnitState) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if state.backward_started:
            return
        state.backward_started = True
        self._gather(state, forward=False)
        self._swap_in(state)
        following = self._next_in_backward(state)
        if following is not None and not following.gathered and following.prefetched is None:
            if self.fsdp2:
                missing = [p for p in following.params if p.holders == 0]
                if missing:
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

    def _post_backward(self, state: _UnitState) -> None:
        if state.reduced:
            return
        state.reduced = True
        grads: list[tuple[_Param, torch.Tensor]] = []
        for p in state.owned:
            if p.unsharded is not None and p.unsharded.grad is not None:
                self._tracer.track(p.unsharded.grad, Category.GRADIENTS)
                grads.append((p, p.unsharded.grad))
                p.unsharded.grad = None
        self._reshard(state)
        if self.fsdp2 and grads:
            self._reduce_scatter(grads)
        grads.clear()

    def _reduce_scatter(self, grads: list[tuple[_Param, torch.Tensor]]) -> None:
        while self._reduce_scatter_inputs:  # reduce_scatter_max_input_buffers = 1
            self._reduce_scatter_inputs.pop(0)
        params = [p for p, _ in grads]
        reduce_dtype = self.reduce_dtype or grads[0][1].dtype
        rs_input = self._buffer(sum(p.padded_numel for p in params), reduce_dtype, Category.WORKSPACE)
        grad_dtype = grads[0][1].dtype
        if grad_dtype != reduce_dtype and (self.cpu or (grad_dtype, reduce_dtype) != (torch.bfloat16, torch.float32)):
            # fsdp.chunk_cat converts while copying in only in CUDA's bf16 -> fp32 kernel
            # (_chunk_cat_out_cuda); otherwise the generic path concatenates first
            self._transient(sum(p.padded_numel for p in params) * grads[0][1].element_size())
        output = torch.empty(sum(p.shard_numel for p in params), dtype=reduce_dtype, device="meta")
        self._tracer.track(output, Category.GRADIENTS)
        # The unsharded gradients are copied in, yet a real run (torch 2.13, fake process
        # group, CPU profiler) frees them only after the reduce-scatter output exists.
        grads.clear()
        sharded_dtype = params[0].sharded.dtype
        if sharded_dtype != reduce_dtype:
            output = output.to(sharded_dtype)
            self._tracer.track(output, Category.GRADIENTS)
        offset = 0
        for p in params:
            view = output.narrow(0, offset, p.shard_numel).view(p.sharded.shape)
            offset += p.shard_numel
            if p.sharded.grad is None:
                p.sharded.grad = view
            else:
                p.sharded.grad.add_(view)  # accumulation over micro-batches
            del view
        del output
        self._reduce_scatter_inputs.append(rs_input)

    def _end_of_backward(self) -> None:
        for state in reversed(self.states):
            self._post_backward(state)  # units whose input gradients never came (the root)
        for state in self.states:
            self._reshard(state)
            state.prefetched = None
            state.backward_started = False
            state.reduced = False
        self._reduce_scatter_inputs.clear()
        self._forward_order.clear()
        self._in_backward = False


class _PostBackward(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``: an identity on a unit's inputs whose
    backward runs once the gradients of those inputs are computed — the unit's backward
    is over."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


def _wrap_inputs(args: tuple, callback: Callable[[], None]) -> tuple | None:
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not positions:
        return None
    wrapped = _PostBackward.apply(callback, *(args[i] for i in positions))
    out = list(args)
    for i, tensor in zip(positions, wrapped):
        out[i] = tensor
    return tuple(out)


# ============================================================================================
# DeepSpeed ZeRO stages 1 and 2, and the partitioned optimizer of all three stages
# ============================================================================================


class ZeroOptimizer:
    """DeepSpeed's ZeRO optimizer around a ``torch.optim`` optimizer: the wrapped optimizer
    steps only this rank's fp32 partition (``single_partition_of_fp32_groups`` in
    stage_1_and_2.py, ``fp32_partitioned_groups_flat`` in stage3.py). Before its step the
    16-bit gradient partition is flattened and converted to fp32 (a new tensor, freed after
    the step); afterwards the updated partition is copied back into the 16-bit parameters in
    place and all-gathered in place (no memory)."""

    def __init__(self, inner: torch.optim.Optimizer | None, master: torch.Tensor, params: Sequence[nn.Parameter],
                 tracer: StorageTracer, gradient_dtype: torch.dtype):
        self.inner = inner
        self.master = master
        self.params = list(params)
        self.tracer = tracer
        self.gradient_dtype = gradient_dtype

    @property
    def state(self) -> Any:
        return self.inner.state if self.inner is not None else {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups if self.inner is not None else []

    def step(self) -> None:
        if self.inner is None:
            return
        flat = torch.empty(self.master.numel(), dtype=self.gradient_dtype, device="meta")  # flatten
        fp32 = flat.to(self.master.dtype)
        del flat
        self.tracer.track(fp32, Category.GRADIENTS)
        self.master.grad = fp32
        del fp32
        self.inner.step()
        self.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class ZeroProgram(RankProgram):
    """A rank of DeepSpeed ZeRO stage 1 or 2 (``deepspeed/runtime/zero/stage_1_and_2.py``):
    the 16-bit model is whole on every rank; this rank keeps the fp32 master partition and
    the optimizer state of ``1/world_size`` of the flattened parameters (padded to a multiple
    of ``2 × world_size`` elements). Backward first allocates the contiguous reduce bucket
    (``ipg_buffer``, ``reduce_bucket_size`` elements, freed when backward ends). Stage 1
    keeps every 16-bit gradient until ``zero_grad``; stage 2 copies each gradient into the
    bucket as autograd produces it and frees it, keeping only this rank's partition in a
    persistent 16-bit buffer (``grads_in_partition``).

    For ZeRO-3 the same :class:`ZeroOptimizer` runs over the partitions of
    :class:`ShardedProgram` (``sharded=`` that program)."""

    def __init__(self, stage: int, world_size: int, reduce_bucket_size: int, training: bool,
                 sharded: ShardedProgram | None = None):
        super().__init__()
        if stage not in (1, 2, 3) or (stage == 3) != (sharded is not None):
            raise ValueError("stage 3 takes the ShardedProgram it partitions; stages 1 and 2 none")
        self.stage = stage
        self.world_size = world_size
        self.reduce_bucket_size = reduce_bucket_size
        self.training = training
        self.sharded = sharded
        self.master: torch.Tensor | None = None
        self.partition_numel = 0
        self._bucket: torch.Tensor | None = None
        self._dtype = torch.float32
        self._steps = True  # False when the step has no optimizer (nothing to partition)

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        if self.sharded is not None:
            self.sharded.install(tracer, module)
            self.communication = self.sharded.communication  # one set for both
        super().install(tracer, module)
        params = [p for p in module.parameters() if p.requires_grad]
        if not (self.training and params and self._steps):
            return
        self._dtype = params[0].dtype
        if self.sharded is not None:
            self.partition_numel = sum(p.numel() for p in params)  # the shards themselves
        else:
            total = sum(p.numel() for p in params)
            alignment = 2 * self.world_size  # nccl_start_alignment_factor × world size
            self.partition_numel = math.ceil(total / alignment) * alignment // self.world_size
        self.master = self._buffer(self.partition_numel, torch.float32, Category.OPTIMIZER_STATE,
                                   preexisting=True, communication=False)
        if self.sharded is not None:
            return
        if self.stage == 2:
            self._buffer(self.partition_numel, self._dtype, Category.GRADIENTS, preexisting=True,
                         communication=False)
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._drop_gradient))
        self._at_backward(module, self._allocate_bucket, self._release_bucket)

    def _drop_gradient(self, param: torch.Tensor) -> None:
        # stage 2: copied into the reduce bucket and reduced into this rank's partition
        if param.grad is not None:
            self._tracer.track(param.grad, Category.GRADIENTS)
            param.grad = None

    def _allocate_bucket(self) -> None:
        if self._bucket is None:
            self._bucket = self._buffer(self.reduce_bucket_size, self._dtype, Category.WORKSPACE)

    def _release_bucket(self) -> None:
        self._bucket = None

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        self._steps = spec.factory is not None
        if spec.factory is None:
            return spec
        inner_factory = spec.factory

        def build(params: Any, foreach: bool) -> Any:
            assert self.master is not None
            inner = inner_factory([self.master], foreach)  # type: ignore[list-item]
            return ZeroOptimizer(inner, self.master, list(params), self._tracer, self._dtype)

        return replace(spec, factory=build)

    def remove(self) -> None:
        super().remove()
        if self.sharded is not None:
            self.sharded.remove()
