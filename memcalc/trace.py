"""Storage-lifetime tracing: a ``TorchDispatchMode`` that sees every op's outputs while a
step runs on meta tensors and records when each *storage* is born and when it dies.

Why storages, not tensors: views, ``.detach()``, in-place results and tied weights share one
storage and one allocation; a CUDA allocator sees storages. Why weak references: the tracer
must never keep a tensor alive, and a storage's death is exactly the moment the real caching
allocator gets the block back (autograd frees saved tensors from C++ during backward; the
Python storage object is preserved with its ``StorageImpl``, so its weakref callback fires
then).

The tracer records raw facts only — sizes, birth phase and module, the alloc/free order.
Categories and peaks are computed afterwards by :mod:`memcalc.timeline`, when it is known
which storages ended up as gradients or optimizer state.
"""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .categories import Category, Phase
from .errors import SymbolicExecutionError

__all__ = ("StorageTracer", "StepTrace", "ModuleTracker")


@dataclass
class StepTrace:
    """What the tracer saw. Storage ``uid`` indexes the per-storage lists.

    ``events`` is the alloc/free order: ``uid`` (≥ 0) for a birth, ``~uid`` (< 0) for a death.
    Pre-existing storages (parameters, buffers, inputs, targets) are listed in ``preexisting``
    and never appear as births in ``events``.
    """

    nbytes: list[int] = field(default_factory=list)
    phase: list[Phase] = field(default_factory=list)
    module: list[str] = field(default_factory=list)
    category: list[Category | None] = field(default_factory=list)  # explicit; None = by phase
    events: list[int] = field(default_factory=list)
    preexisting: list[int] = field(default_factory=list)
    phase_starts: dict[Phase, int] = field(default_factory=dict)  # index into events
    op_counts: Counter[str] = field(default_factory=Counter)  # every aten op seen, by name

    @property
    def num_storages(self) -> int:
        return len(self.nbytes)


class StorageTracer(TorchDispatchMode):
    """Dispatch mode recording storage births and deaths on one device type (``meta``).

    Storages on other devices (the CPU step counters of ``torch.optim``, for example) are
    ignored: they would not be on the GPU either.
    """

    def __init__(self, device_type: str = "meta", after_op: Callable[[Any, tuple, dict, Any], None] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        # Called after every op with (func, args, kwargs, out): kernel workspace rules that
        # add synthetic allocations for memory the meta kernels do not show.
        self.after_op = after_op
        self.trace = StepTrace()
        self.phase = Phase.SETUP
        self.modules = ModuleTracker()
        self._uid_by_key: dict[int, int] = {}
        self._cache = MetaKernelCache(device_type)
        self._refs: dict[int, weakref.ref] = {}
        self._recording = True

    # ---- the hot path -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = self._cache.run(func, args, kwargs or {}, self._run)
        self.trace.op_counts[func.__name__] += 1
        self._see(out)
        if self.after_op is not None:
            self.after_op(func, args, kwargs or {}, out)
        return out

    def _run(self, func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # any failure of a meta kernel ends the estimate, named
            raise SymbolicExecutionError(str(func), self.modules.current, self.phase.value, exc) from exc

    def _see(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            if out.device.type == self.device_type:
                self.track(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._see(item)

    # ---- storage bookkeeping ------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: Category | None = None) -> int:
        """The uid of ``tensor``'s storage, registering the storage as born now if new."""
        storage = tensor.untyped_storage()
        key = id(storage)
        uid = self._uid_by_key.get(key)
        if uid is not None:
            if category is not None:
                self.trace.category[uid] = category
            return uid
        trace = self.trace
        uid = len(trace.nbytes)
        trace.nbytes.append(storage.nbytes())
        trace.phase.append(self.phase)
        trace.module.append(self.modules.current)
        trace.category.append(category)
        trace.events.append(uid)
        self._uid_by_key[key] = uid
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key, uid=uid: self._on_free(key, uid))
        return uid

    def _on_free(self, key: int, uid: int) -> None:
        self._uid_by_key.pop(key, None)
        self._refs.pop(key, None)
        if self._recording:
            self.trace.events.append(~uid)

    def preexisting(self, tensor: torch.Tensor, category: Category) -> int:
        """Register a storage that exists before the step (parameter, buffer, input, target).

        A storage already traced as born during the step (a target built after the forward,
        when the output shape is known) is moved to the pre-existing set: in a real loop the
        targets arrive with the batch.
        """
        uid = self.track(tensor, category)
        trace = self.trace
        if uid not in trace.preexisting:
            trace.preexisting.append(uid)
            trace.phase[uid] = Phase.SETUP
            trace.module[uid] = ""
            try:
                trace.events.remove(uid)
            except ValueError:
                pass
        return uid

    def synthetic(self, nbytes: int, category: Category, *, persistent: bool, preexisting: bool = False) -> int:
        """Record an allocation no tensor stands for: a kernel's workspace (freed at once
        unless ``persistent``, like the cuBLAS workspace that lives as long as its handle),
        or a pre-existing buffer such as a KV cache."""
        trace = self.trace
        uid = len(trace.nbytes)
        trace.nbytes.append(int(nbytes))
        trace.phase.append(Phase.SETUP if preexisting else self.phase)
        trace.module.append("" if preexisting else self.modules.current)
        trace.category.append(category)
        if preexisting:
            trace.preexisting.append(uid)
        else:
            trace.events.append(uid)
            if not persistent:
                trace.events.append(~uid)
        return uid

    def uid_of(self, tensor: torch.Tensor) -> int | None:
        """The uid of a live traced storage, or None if the tracer never saw it."""
        return self._uid_by_key.get(id(tensor.untyped_storage()))

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.trace.phase_starts.setdefault(phase, len(self.trace.events))

    def stop(self) -> StepTrace:
        """Stop recording deaths (storages freed after the step are not part of it)."""
        self._recording = False
        return self.trace


class MetaKernelCache:
    """Outputs of functional ops, by the metadata of their arguments.

    A meta kernel computes only shapes, strides and dtypes, and for an op that mutates nothing
    and returns fresh tensors (no aliasing in its schema) they depend only on its arguments'
    metadata. Models repeat the same calls block after block, and many meta kernels are Python
    decompositions, so a repeated call makes fresh ``empty_strided`` meta tensors instead of
    running the kernel again — as FakeTensor's dispatch cache does. Anything unusual
    (mutation, aliasing, non-tensor outputs we cannot rebuild, storage offsets or oversized
    storages, unhashable arguments) is simply not cached.
    """

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._specs: dict[Any, Any] = {}
        self._cacheable: dict[Any, bool] = {}
        self.hits = 0

    def run(self, func, args: tuple, kwargs: dict, compute) -> Any:
        if not self._is_cacheable(func):
            return compute(func, args, kwargs)
        key = self._key(func, args, kwargs)
        if key is None:
            return compute(func, args, kwargs)
        spec = self._specs.get(key)
        if spec is not None:
            self.hits += 1
            return _materialize(spec, self.device_type)
        out = compute(func, args, kwargs)
        if _aliases_an_input(out, args, kwargs):
            # some ops alias their input without saying so in their schema (_unsafe_view)
            self._cacheable[func] = False
            return out
        spec = _spec(out)
        if spec is not None:
            self._specs[key] = spec
        return out

    def _is_cacheable(self, func) -> bool:
        known = self._cacheable.get(func)
        if known is None:
            schema = func._schema
            known = (not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
                     and not any(a.alias_info is not None for a in schema.arguments)
                     and "nondeterministic_seeded" not in getattr(func, "tags", ()))
            self._cacheable[func] = known
        return known

    def _key(self, func, args: tuple, kwargs: dict) -> Any:
        # Which arguments share a storage is part of the key: some meta kernels decide on it
        # (memory-efficient attention's backward packs dq/dk/dv into one buffer when q, k, v
        # are views of one storage).
        storages: dict[int, int] = {}
        try:
            parts = [func]
            for value in args:
                parts.append(_arg_key(value, storages))
            for name in sorted(kwargs):
                parts.append((name, _arg_key(kwargs[name], storages)))
            key = tuple(parts)
            hash(key)
            return key
        except _Uncacheable:
            return None
        except TypeError:
            return None


class _Uncacheable(Exception):
    pass


def _arg_key(value: Any, storages: dict[int, int]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise _Uncacheable  # a real (CPU) tensor: its values may matter
        alias = storages.setdefault(id(value.untyped_storage()), len(storages))
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset(), alias)
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v, storages) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    raise _Uncacheable


def _storage_ids(value: Any, into: set[int]) -> set[int]:
    if isinstance(value, torch.Tensor):
        into.add(id(value.untyped_storage()))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _storage_ids(item, into)
    elif isinstance(value, dict):
        for item in value.values():
            _storage_ids(item, into)
    return into


def _aliases_an_input(out: Any, args: tuple, kwargs: dict) -> bool:
    outputs = _storage_ids(out, set())
    return bool(outputs & _storage_ids(args, set())) or bool(outputs & _storage_ids(kwargs, set()))


def _spec(out: Any) -> Any:
    """How to rebuild ``out``; None if it cannot be rebuilt exactly."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta" or out.storage_offset() != 0:
            return None
        expected = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        if expected.untyped_storage().nbytes() != out.untyped_storage().nbytes():
            return None
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, tuple):
        specs = tuple(_spec(o) for o in out)
        tensors = [o for o in out if isinstance(o, torch.Tensor)]
        if any(s is None for s, o in zip(specs, out) if isinstance(o, torch.Tensor)):
            return None
        if len({id(t.untyped_storage()) for t in tensors}) != len(tensors):
            return None  # outputs sharing a storage
        if not all(isinstance(o, torch.Tensor) or o is None or isinstance(o, (int, float, bool)) for o in out):
            return None
        return ("tuple", tuple(s if isinstance(o, torch.Tensor) else ("C", o) for s, o in zip(specs, out)))
    return None


def _materialize(spec: Any, device_type: str) -> Any:
    kind = spec[0]
    if kind == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device=device_type)
    if kind == "C":
        return spec[1]
    return tuple(_materialize(s, device_type) for s in spec[1])


class ModuleTracker:
    """Which module is running: a stack of forward pre/post hooks, and during backward the
    leaf module whose output gradient arrived last (a tensor hook on each leaf's output).

    Hooks are installed on one model and removed by :meth:`remove` (the caller does it in a
    ``finally``), so the user's modules are left as they were.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._backward_module = ""
        self._handles: list[Any] = []
        self.output_shapes: dict[str, tuple[int, ...]] = {}
        self.order: list[str] = []  # module names in the order their forward first ran
        self.in_backward = False

    @property
    def current(self) -> str:
        if self.in_backward:
            return self._backward_module
        return self._stack[-1] if self._stack else ""

    def install(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if not name:
                continue  # the root: outside any submodule is reported as ""
            is_leaf = next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name, is_leaf)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, name: str):
        def hook(_module: nn.Module, _args: Any) -> None:
            self._stack.append(name)
            if name not in self.output_shapes:
                self.order.append(name)
                self.output_shapes[name] = ()
        return hook

    def _post_hook(self, name: str, is_leaf: bool):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            first = _first_tensor(output)
            if first is not None:
                self.output_shapes[name] = tuple(first.shape)
            if is_leaf and torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(name))
        return hook

    def _grad_hook(self, name: str):
        def hook(_grad: torch.Tensor) -> None:
            self._backward_module = name
        return hook

    @contextmanager
    def backward(self) -> Iterator[None]:
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False
            self._backward_module = ""


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _first_tensor(output: Any) -> torch.Tensor | None:
    return next(_tensors(output), None)
