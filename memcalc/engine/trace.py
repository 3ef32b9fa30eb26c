"""Storage-lifetime tracing: a ``TorchDispatchMode`` that sees every op's outputs while a
step runs on meta tensors and records when each *storage* is born and when it dies.

Why storages, not tensors: views, ``.detach()``, in-place results and tied weights share one
storage and one allocation; a CUDA allocator sees storages. Why weak references: the tracer
must never keep a tensor alive, and a storage's death is exactly the moment the real caching
allocator gets the block back (autograd frees saved tensors from C++ during backward; the
Python storage object is preserved with its ``StorageImpl``, so its weakref callback fires
then).

The tracer records raw facts only — sizes, birth phase and module, the alloc/free order.
Categories and peaks are computed afterwards by :mod:`memcalc.engine.timeline`, when it is known
which storages ended up as gradients or optimizer state.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import torch
from torch import nn
from torch._compile import _disable_dynamo
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InternalError, MemcalcError, symbolic_execution_error
from memcalc.engine.meta_shortcuts import SHORTCUTS

__all__ = ("AfterOpHook", "MetaKernelCache", "ModuleTracker", "Op", "ReadOracle", "ShapeSized", "SizeRule",
           "SteadyRun", "StepTrace", "StorageTracer", "UnwrittenSteps", "tensors_of")

#: An aten operator overload, as a dispatch mode receives it (``aten.add.Tensor``).
Op: TypeAlias = "OpOverload[..., Any]"
#: Called after every op with ``(func, args, kwargs, out)``.
AfterOpHook: TypeAlias = Callable[[Op, tuple[Any, ...], dict[str, Any], Any], None]
#: The value of a one-element tensor the code reads (None: not known without data); asked about
#: ``nonzero``'s input, the number of its nonzero elements (the rows of the result); asked about a
#: copy to the host (``.tolist()``, ``.cpu()``), the host tensor the estimated run would copy.
ReadOracle: TypeAlias = Callable[[torch.Tensor], "bool | int | float | torch.Tensor | None"]
#: The op behind ``.item()``, ``bool()`` and ``if`` on a tensor.
_READ_VALUE: Final = torch.ops.aten._local_scalar_dense.default
#: The op behind ``nonzero``, ``argwhere`` and one-argument ``torch.where``: a row per nonzero element.
_NONZERO: Final = torch.ops.aten.nonzero.default
#: The op behind ``.tolist()`` and ``.cpu()``: a copy to the host, which a meta tensor cannot give.
_TO_COPY: Final = torch.ops.aten._to_copy.default
#: Ops whose outputs are made without their meta kernel's binding where known exactly, by id
#: (:mod:`memcalc.engine.meta_shortcuts`; the ops are held by torch.ops, so their ids stay theirs).
_SHORTCUTS: Final = {id(op): shortcut for op, shortcut in SHORTCUTS.items()}
#: Ops whose real kernel hands back its argument's memory (the position given) but whose meta
#: kernel allocates: the tracer runs them as a view. ``_c10d_functional::_wrap_tensor_autograd``
#: wraps a collective's output in an AsyncCollectiveTensor, and ``_c10d_functional::wait_tensor``
#: waits on it and returns it (the C++ kernel hands back its input); both fake kernels are
#: ``empty_like`` (torch/distributed/_functional_collectives.py).
_SAME_MEMORY: Final[Mapping[str, int]] = {"_c10d_functional::_wrap_tensor_autograd": 0,
                                          "_c10d_functional::wait_tensor": 0}
#: Turns ``__torch_function__`` off (modes and subclasses) for the block: below autograd, in the
#: tracer's own bookkeeping and the meta kernels it runs, a function mode above (the CUDA
#: emulation) has nothing to do, and answering every ``.shape`` and ``untyped_storage()`` there
#: cost it about five calls per aten op.
_NO_FUNCTION_MODES: Final[Callable[[], AbstractContextManager[None]]] = torch._C.DisableTorchFunction
#: Dynamo's frame callback, None unless it compiles or runs compiled code (a C function).
_dynamo_callback: Final[Callable[[], object]] = torch._C._dynamo.eval_frame.get_eval_frame_callback
#: Tensor types whose reads (``.grad``, ``untyped_storage()``) no ``__torch_function__`` of their
#: own changes (a parameter's only disables itself).
_PLAIN: Final = frozenset({torch.Tensor, nn.Parameter})
#: Runs an op: ``(func, args, kwargs) -> out``.
_Compute: TypeAlias = Callable[[Op, tuple[Any, ...], dict[str, Any]], Any]


#: The size of a synthetic storage from integer arguments (a tensor's shape and strides): it
#: must compare equal for the same rule (a frozen dataclass), since batch-affine families match
#: two traces' rules (:mod:`memcalc.search.affine`).
SizeRule: TypeAlias = Callable[[tuple[int, ...]], int]


@dataclass(frozen=True)
class ShapeSized:
    """How a synthetic storage's size follows from the step rather than being one: ``rule``
    applied to ``arguments`` (the shape and strides of the tensor a kernel works on) gives its
    bytes. A kernel's scratch can be a step function of a tensor's shape (a reduction's, whose
    thread blocks per output saturate): its size is then not affine in the batch although the
    shape is, and a batch-affine family computes it from the shape at each batch instead."""

    rule: SizeRule
    arguments: tuple[int, ...]


@dataclass(frozen=True)
class SteadyRun:
    """Decode steps ``engine.steady`` wrote as copies of one steady step: ``count`` steps of
    ``length`` events each from event ``start``, each making ``storages`` storages (the first from
    uid ``base``); the last decode step follows them. ``affine``: every storage's bytes are on a
    line (no rule-sized one grows) and each is freed in its step or the next, so the bytes alive
    at each point of a step are affine in the step (:mod:`memcalc.engine.steady_sums`)."""

    start: int
    length: int
    count: int
    storages: int
    base: int
    affine: bool


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
    op: list[str] = field(default_factory=list)  # per storage: the op that made it ("" pre-existing)
    phase_log: list[tuple[Phase, int]] = field(default_factory=list)  # every set_phase: (phase, index into events)
    sized: dict[int, ShapeSized] = field(default_factory=dict)  # synthetic storages sized by a rule, by uid
    stream: dict[int, int] = field(default_factory=dict)  # uid -> the stream it was allocated on, where not 0
    steady: SteadyRun | None = None  # a generation's decode steps written as copies (engine.steady)
    #: the decode steps engine.steady extrapolated, not yet in the lists above (:class:`UnwrittenSteps`)
    unwritten: UnwrittenSteps | None = field(default=None, repr=False, compare=False)

    @property
    def num_storages(self) -> int:
        """How many storages the trace knows (births, pre-existing and synthetic)."""
        nbytes: list[int] = self.__dict__["nbytes"]  # not the property: the unwritten steps stay so
        return len(nbytes) + (self.unwritten.storages if self.unwritten is not None else 0)

    @property
    def num_events(self) -> int:
        """How many events the trace holds (``len(events)``, the unwritten steps' not written out)."""
        events: list[int] = self.__dict__["events"]
        return len(events) + (self.unwritten.num_events if self.unwritten is not None else 0)

    def hold(self, unwritten: UnwrittenSteps) -> None:
        """Append ``unwritten`` to the trace without writing it into the lists: until one of them is
        read (:meth:`write_out`), the trace is a :class:`_HoldingTrace`, whose lists write them out
        first; a trace that holds none keeps its lists as plain attributes (the tracer's hot path)."""
        self.unwritten = unwritten
        self.__class__ = _HoldingTrace

    def write_out(self) -> None:
        """Write the unwritten decode steps into the lists (done by the first reader of one)."""
        unwritten = self.unwritten
        if unwritten is not None:
            self.__class__ = StepTrace
            self.unwritten = None
            unwritten.write_into(self.__dict__)

    def parts(self, name: str) -> list[tuple[list[Any], int]]:
        """Column ``name`` (``phase``, ``module``, ``category``, ``op``) as (list, times) pieces,
        the unwritten steps' one step's list ``count`` times, without writing them out."""
        column: list[Any] = self.__dict__[name]
        if self.unwritten is None:
            return [(column, 1)]
        return [(column, 1), (self.unwritten.columns[name], self.unwritten.count), (self.unwritten.tail[name], 1)]

    def column_at(self, name: str, uid: int) -> Any:
        """``getattr(self, name)[uid]`` for a per-storage column, without writing the steps out."""
        column: list[Any] = self.__dict__[name]
        if self.unwritten is None or uid < len(column):
            return column[uid]
        return self.unwritten.at(name, uid - len(column))

    def column_range(self, name: str, lo: int, hi: int) -> list[Any]:
        """``getattr(self, name)[lo:hi]`` for a per-storage column, without writing the steps out
        (a range within one unwritten step is that step's list itself, or its slice)."""
        column: list[Any] = self.__dict__[name]
        if self.unwritten is None or hi <= len(column):
            return column[lo:hi]
        return [self.column_at(name, uid) for uid in range(lo, hi)] if lo < len(column) else \
            self.unwritten.range(name, lo - len(column), hi - len(column))

    def events_array(self) -> np.ndarray:
        """``events`` as int64, the unwritten steps' straight from their array."""
        events: list[int] = self.__dict__["events"]
        if self.unwritten is None:
            return np.asarray(events, dtype=np.int64)
        return np.concatenate([np.asarray(events, dtype=np.int64), self.unwritten.events,
                               np.asarray(self.unwritten.tail_events, dtype=np.int64)])

    def nbytes_array(self) -> np.ndarray:
        """``nbytes`` as int64, the unwritten steps' straight from their array."""
        nbytes: list[int] = self.__dict__["nbytes"]
        if self.unwritten is None:
            return np.asarray(nbytes, dtype=np.int64)
        return np.concatenate([np.asarray(nbytes, dtype=np.int64), self.unwritten.nbytes,
                               np.asarray(self.unwritten.tail["nbytes"], dtype=np.int64)])

    def rebuilt(self, sources: Sequence[int], events: list[int], preexisting: list[int],
                phase_log: list[tuple[Phase, int]], phase_starts: dict[Phase, int], *,
                module: list[str] | None = None, op_counts: Counter[str] | None = None) -> StepTrace:
        """A trace of the same kind of step whose storage ``n`` is this one's ``sources[n]`` (a
        storage may be the source of several: a composed step's copies of a block), with its own
        event stream and phase boundaries (storages numbered by them); ``module``: the new
        storages' module names, where they are not their sources' (a block's copies renamed);
        ``op_counts``: where the new step ran other ops. The one place that knows every field, for
        the steps composed from traced ones (:mod:`memcalc.distributed.pipeline_compose`,
        :mod:`memcalc.distributed.depth_compose`)."""
        return StepTrace(
            nbytes=[self.nbytes[u] for u in sources], phase=[self.phase[u] for u in sources],
            module=[self.module[u] for u in sources] if module is None else module,
            category=[self.category[u] for u in sources], events=events, preexisting=preexisting,
            phase_starts=phase_starts, op_counts=Counter(self.op_counts) if op_counts is None else op_counts,
            op=[self.op[u] for u in sources], phase_log=phase_log,
            sized={n: self.sized[u] for n, u in enumerate(sources) if u in self.sized},
            stream={n: self.stream[u] for n, u in enumerate(sources) if u in self.stream})




#: The per-storage and per-event lists of a trace that wait for :class:`UnwrittenSteps`.
_WAITING = ("nbytes", "phase", "module", "category", "events", "op")


def _written_column(name: str) -> property:
    """A :class:`_HoldingTrace` list that writes the unwritten decode steps out before it is read
    (or replaced), so that every reader of the list sees the whole trace."""

    def get(trace: StepTrace) -> Any:
        trace.write_out()
        return trace.__dict__[name]

    def put(trace: StepTrace, value: Any) -> None:
        trace.write_out()
        trace.__dict__[name] = value

    return property(get, put, doc=f"The trace's ``{name}``, the unwritten decode steps written out first.")


class _HoldingTrace(StepTrace):
    """A :class:`StepTrace` that holds :class:`UnwrittenSteps` (:meth:`StepTrace.hold`): each of its
    lists writes them out before it is read or replaced, and the trace is a plain one again."""

    def __eq__(self, other: object) -> bool:
        self.write_out()
        if isinstance(other, StepTrace):
            other.write_out()
        return self == other


for _name in _WAITING:
    setattr(_HoldingTrace, _name, _written_column(_name))


@dataclass(frozen=True)
class UnwrittenSteps:
    """A generation's extrapolated decode steps (:mod:`memcalc.engine.steady`) held as the copies
    they are, not yet written into the trace's lists: a long generation's millions of events and
    storages cost a pass each to write, to read back as arrays and for Python's collector to walk,
    where the report reads them as arrays (:meth:`StepTrace.events_array`) or a few steps
    (:meth:`StepTrace.column_at`). The first reader of a list writes them out
    (:meth:`StepTrace.write_out`), so every other reader sees the whole trace as it was.

    They follow the trace's lists: ``count`` copies of one step (``events``, ``nbytes``: every
    copy's, int64; ``columns``: one step's ``phase``, ``module``, ``category``, ``op``), then the
    last step (``tail_events``; ``tail``: its storages' ``nbytes`` and the four columns); ``run``
    describes the copies as the trace's :attr:`StepTrace.steady` does (the same object)."""

    events: np.ndarray
    nbytes: np.ndarray
    columns: Mapping[str, list[Any]]
    count: int
    tail_events: list[int]
    tail: Mapping[str, list[Any]]
    run: SteadyRun | None  # the trace's ``steady`` they are (None: no step copied, the last step alone)

    @property
    def storages(self) -> int:
        """The storages they make."""
        return int(self.nbytes.size) + len(self.tail["nbytes"])

    @property
    def num_events(self) -> int:
        """Their events."""
        return int(self.events.size) + len(self.tail_events)

    def at(self, name: str, index: int) -> Any:
        """Column ``name`` of their ``index``-th storage."""
        written = int(self.nbytes.size)
        if index >= written:
            return self.tail[name][index - written]
        return int(self.nbytes[index]) if name == "nbytes" else self.columns[name][index % len(self.columns[name])]

    def range(self, name: str, lo: int, hi: int) -> list[Any]:
        """Column ``name`` of their storages ``lo .. hi - 1``."""
        n, written = len(self.columns["op"]), int(self.nbytes.size)
        if name != "nbytes" and hi <= written and n and lo // n == (hi - 1) // n:  # within one step
            one = self.columns[name]
            return one if hi - lo == n else one[lo % n:lo % n + hi - lo]
        return [self.at(name, index) for index in range(lo, hi)]

    def write_into(self, lists: dict[str, Any]) -> None:
        """Extend the trace's lists (``lists``: its ``__dict__``) with these steps."""
        lists["events"].extend(self.events.tolist())
        lists["events"].extend(self.tail_events)
        lists["nbytes"].extend(self.nbytes.tolist())
        lists["nbytes"].extend(self.tail["nbytes"])
        for name in ("phase", "module", "category", "op"):
            column, one = lists[name], self.columns[name]
            for _ in range(self.count):  # a step's column at a time: no list of every step made to be copied
                column.extend(one)
            column.extend(self.tail[name])


class StorageTracer(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """Dispatch mode recording storage births and deaths on one device type (``meta``).

    Storages on other devices (the CPU step counters of ``torch.optim``, for example) are
    ignored: they would not be on the GPU either.

    ``defer_to``: wrapper tensor subclasses (DTensor, under tensor parallelism) whose own
    ``__torch_dispatch__`` runs first: the tracer declines their ops (``NotImplemented``) and so
    sees the ops they run on their inner tensors — the allocations a rank makes — and a
    storage of theirs is their inner tensor's (:meth:`storage_of`).
    """

    def __init__(self, device_type: str = "meta", after_op: AfterOpHook | None = None,
                 read_values: ReadOracle | None = None, after_op_applies: Callable[[Op], bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init__ is untyped
        self.device_type = device_type
        self._meta = device_type == "meta"  # Tensor.is_meta: a tenth of Tensor.device.type's cost, once per output
        # Called after every op with (func, args, kwargs, out): kernel workspace rules that
        # add synthetic allocations for memory the meta kernels do not show.
        self.after_op = after_op
        # whether after_op does anything for an op (asked once per op; None: call it after every op)
        self.after_op_applies = after_op_applies
        # Asked for the value of a tensor the code reads (.item(), bool(), an `if` on one), which
        # a meta tensor cannot give: the model's source knows some (memcalc.stacks.transformers.reads).
        self.read_values = read_values
        self.trace = StepTrace()
        self.phase = Phase.SETUP
        self.modules = ModuleTracker()
        self._uid_by_key: dict[int, int] = {}
        self._cache = MetaKernelCache(device_type)
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._released: set[int] = set()  # storages whose memory free_storage returned
        self._recording = True
        self._op = ""  # the aten op being dispatched ("" between ops): what made a new storage
        self.last_op: Op | None = None  # the aten op dispatched last: where an internal error happened
        self.defer_to: tuple[type[torch.Tensor], ...] = ()
        self.stream = 0  # the stream storages born now are allocated on (:meth:`on_stream`)
        self._facts: dict[int, _OpFacts] = {}  # per op, by id (_OpFacts): what is looked up once
        #: pre-existing storages the step replaces with one of its own, by uid: where the tensor
        #: in their place will be when the step ends (:meth:`replaced_by`)
        self.successors: dict[int, Callable[[], torch.Tensor | None]] = {}
        #: synthetic storages recorded ``persistent`` (a cuBLAS handle's workspace), by uid
        self.held: set[int] = set()

    # ---- the hot path -------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap ``__torch_dispatch__`` in ``torch._disable_dynamo``, five
        Python calls per aten op that matter only while Dynamo's frame callback is set; the
        method turns Dynamo off itself in that case (:func:`_dispatch_without_dynamo`)."""
        return False

    def __torch_dispatch__(self, func: Op, types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _dynamo_callback() is not None:  # compiling or running compiled code: as torch's wrapper does
            return _dispatch_without_dynamo(self, func, types, args, kwargs)
        if self.defer_to and any(issubclass(t, self.defer_to) for t in types):
            # the subclass's own dispatch runs next, with this mode still active: its inner ops come back here
            return NotImplemented
        self.last_op = func
        kwargs = kwargs or {}
        try:
            with _NO_FUNCTION_MODES():
                facts = self._facts.get(id(func))
                if facts is None:
                    facts = self._facts[id(func)] = _OpFacts(func, self.after_op is not None and (
                        self.after_op_applies is None or self.after_op_applies(func)))
                if facts.uncached:  # views and the like: the kernel (or its shortcut), as the cache would
                    out = self._run(func, args, kwargs)
                elif facts.same_memory >= 0:  # a view where the real kernel allocates nothing
                    out = args[facts.same_memory].view_as(args[facts.same_memory])
                else:
                    out = self._cache.run(func, args, kwargs, self._run)
                self.trace.op_counts[facts.short_name] += 1
                self._op = facts.name
                if type(out) is torch.Tensor:  # most ops: one plain tensor (_see without its call)
                    if out.is_meta if self._meta else out.device.type == self.device_type:
                        self.track(out)
                else:
                    self._see(out)
                after_op = self.after_op
                if facts.after_op and after_op is not None:
                    after_op(func, args, kwargs, out)
        except MemcalcError:
            raise
        except Exception as exc:  # the op ran (_run maps its failures): what failed is memcalc's bookkeeping
            raise self.internal_error(exc) from exc
        finally:
            self._op = ""
        return out

    def internal_error(self, cause: BaseException) -> InternalError:
        """``cause`` as a bug of memcalc's, named by the op last dispatched and the module and
        phase the trace is in."""
        return InternalError(cause, op=str(self.last_op) if self.last_op is not None else "",
                             module=self.modules.current, phase=self.phase.value, stage="while tracing")

    def _run(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        shortcut = _SHORTCUTS.get(id(func))
        if shortcut is not None:
            try:
                outputs = shortcut(args, kwargs)
            except Exception:  # e.g. sizes past int64: torch's kernel below fails as the user should see it
                outputs = None
            if outputs is not None:
                return outputs  # its meta kernel is a slow Python decomposition (engine.meta_shortcuts)
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # any failure of a meta kernel ends the estimate, named
            if func is _READ_VALUE and self.read_values is not None:
                value = self.read_values(args[0])
                if value is not None:  # a read the model's source answers for the estimated run
                    return value
            if func is _NONZERO and self.read_values is not None:
                rows = self.read_values(args[0])
                if isinstance(rows, int) and not isinstance(rows, bool):  # the count the estimated run finds
                    return torch.empty((rows, args[0].dim()), dtype=torch.long, device=args[0].device)
            if func is _TO_COPY and self.read_values is not None and _to_host(kwargs):
                host = self.read_values(args[0])
                if isinstance(host, torch.Tensor):  # the values the estimated run copies to the host
                    return host
            raise symbolic_execution_error(str(func), self.modules.current, self.phase.value, exc) from exc

    def _see(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            if out.is_meta if self._meta else out.device.type == self.device_type:
                self.track(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._see(item)

    # ---- storage bookkeeping ------------------------------------------------------------
    def storage_of(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        """The storage that holds ``tensor``'s memory: a deferred wrapper's (a DTensor's) is
        its inner tensor's (the rank's local shard)."""
        if self.defer_to and isinstance(tensor, self.defer_to):
            attributes, _context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass
            return self.storage_of(getattr(tensor, attributes[0]))
        return tensor.untyped_storage()

    def track(self, tensor: torch.Tensor, category: Category | None = None) -> int:
        """The uid of ``tensor``'s storage, registering the storage as born now if new."""
        # a plain tensor is no deferred wrapper: its storage directly, without storage_of's call
        deferring = self.defer_to and type(tensor) is not torch.Tensor
        storage = self.storage_of(tensor) if deferring else tensor.untyped_storage()
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
        trace.op.append(self._op)
        trace.events.append(uid)
        if self.stream:
            trace.stream[uid] = self.stream
        self._uid_by_key[key] = uid
        self._refs[key] = weakref.ref(storage, lambda _ref: self._on_free(key, uid))
        return uid

    @contextmanager
    def on_stream(self, stream: int) -> Iterator[None]:
        """Storages born inside are allocated on ``stream`` (``with torch.cuda.stream(s):``):
        the allocator caches them in that stream's pools (:mod:`memcalc.core.streams`)."""
        previous, self.stream = self.stream, int(stream)  # a plain int: traces and snapshots hold no enum
        try:
            yield
        finally:
            self.stream = previous

    def _on_free(self, key: int, uid: int) -> None:
        self._uid_by_key.pop(key, None)
        self._refs.pop(key, None)
        if key in self._released:  # its memory went back earlier (free_storage)
            self._released.discard(key)
            return
        if self._recording:
            self.trace.events.append(~uid)

    # ---- storages resized in place (FSDP's unsharded parameters) -------------------------
    def free_storage(self, tensor: torch.Tensor) -> None:
        """The memory of ``tensor``'s storage is returned now although the storage object
        lives on: FSDP's ``storage.resize_(0)`` on an unsharded parameter that autograd still
        references. Views of it are not new allocations until :meth:`alloc_storage`, and its
        eventual death is not an event."""
        key = id(tensor.untyped_storage())
        uid = self._uid_by_key.get(key)
        if uid is None or key in self._released:
            return
        self._released.add(key)
        if self._recording:
            self.trace.events.append(~uid)

    def alloc_storage(self, tensor: torch.Tensor, category: Category | None = None) -> int:
        """The storage of ``tensor`` takes memory again (FSDP's ``storage.resize_(n)`` before
        an all-gather): a new allocation, born now, for the same storage."""
        key = id(tensor.untyped_storage())
        if key in self._released:
            self._released.discard(key)
            self._uid_by_key.pop(key, None)
            self._refs.pop(key, None)  # the old weak reference goes, and its callback with it
            uid = self.track(tensor, category)
            self.trace.op[uid] = self._op or "storage.resize_"  # no aten op takes the memory back
            return uid
        return self.track(tensor, category)

    def replaced_by(self, tensor: torch.Tensor, later: Callable[[], torch.Tensor | None]) -> None:
        """A pre-existing ``tensor`` that the step frees and replaces with one it makes, found by
        ``later()`` when the step ends (a pipeline stage's received activation's ``.grad``, which
        ``step()`` drops and backward sets again). The engine then synthesises the second
        iteration from the first, the first's successor freed where the pre-existing one was,
        instead of tracing it (:func:`memcalc.engine.timeline.build_program`)."""
        uid = self.uid_of(tensor)
        assert uid is not None and uid in self.trace.preexisting, "register the tensor as pre-existing first"
        self.successors[uid] = later

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
            trace.module[uid] = trace.op[uid] = ""
            trace.stream.pop(uid, None)  # model states and inputs: the compute stream's
            with suppress(ValueError):
                at = trace.events.index(uid)
                del trace.events[at]
                trace.phase_log[:] = [(p, i - (i > at)) for p, i in trace.phase_log]
        return uid

    def synthetic(self, nbytes: int, category: Category, *, persistent: bool, preexisting: bool = False,
                  label: str | None = None, sized: ShapeSized | None = None) -> int:
        """Record an allocation no tensor stands for: a kernel's workspace (freed at once
        unless ``persistent``, like the cuBLAS workspace that lives as long as its handle),
        or a pre-existing buffer such as a KV cache. ``label`` names it in the timeline
        (``"synthetic: cuBLAS workspace"``); by default the category and the op running.
        ``sized``: the rule ``nbytes`` came from (``nbytes == sized.rule(sized.arguments)``)."""
        trace = self.trace
        uid = len(trace.nbytes)
        if sized is not None:
            assert sized.rule(sized.arguments) == nbytes, "a sized storage's bytes are its rule's"
            trace.sized[uid] = sized
        trace.nbytes.append(int(nbytes))
        trace.phase.append(Phase.SETUP if preexisting else self.phase)
        trace.module.append("" if preexisting else self.modules.current)
        trace.category.append(category)
        kind = f"{'persistent ' if persistent and not preexisting else ''}{category.value.replace('_', ' ')}"
        trace.op.append(label or f"synthetic: {kind}{f' in {self._op}' if self._op else ''}")
        if preexisting:
            trace.preexisting.append(uid)
        else:
            trace.events.append(uid)
            if self.stream:
                trace.stream[uid] = self.stream
            if not persistent:
                trace.events.append(~uid)
            else:
                self.held.add(uid)
        return uid

    def release(self, uid: int) -> None:
        """Free a synthetic allocation recorded with ``persistent=True``: for a kernel whose
        temporaries are alive together (a reduction's staging buffer and semaphores), taken
        one after the other and returned when it ends."""
        self.trace.events.append(~uid)

    def uid_of(self, tensor: torch.Tensor) -> int | None:
        """The uid of a live traced storage, or None if the tracer never saw it."""
        if type(tensor) is torch.Tensor:  # a plain tensor's storage, read with no function mode (one call less)
            with _NO_FUNCTION_MODES():
                return self._uid_by_key.get(id(tensor.untyped_storage()))
        return self._uid_by_key.get(id(self.storage_of(tensor)))

    def uids_of(self, tensors: Sequence[torch.Tensor]) -> list[int | None]:
        """:meth:`uid_of` of each tensor, the plain tensors' and parameters' storages read with no
        function mode, turned off once for all (the optimizer's state after a step: a few tensors
        per parameter, whose reads the CUDA emulation would pass on as they are, a call each)."""
        get = self._uid_by_key.get
        with _NO_FUNCTION_MODES():
            uids = [get(id(t.untyped_storage())) if type(t) in _PLAIN else None for t in tensors]
        for at, tensor in enumerate(tensors):
            if type(tensor) not in _PLAIN:  # a subclass's own torch-function handling stays on
                uids[at] = self.uid_of(tensor)
        return uids

    def gradient_uids(self, params: Sequence[torch.Tensor]) -> list[int]:
        """The uids of the traced storages of ``params``' gradients (those that have one), the
        plain parameters' ``.grad`` read with no function mode, as :meth:`uids_of` reads."""
        with _NO_FUNCTION_MODES():
            grads = [p.grad if type(p) in _PLAIN else None for p in params]
        for at, param in enumerate(params):
            if type(param) not in _PLAIN:
                grads[at] = param.grad
        uids = self.uids_of([grad for grad in grads if grad is not None])
        return [uid for uid in uids if uid is not None]

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase``: storages born from now on belong to it."""
        self.phase = phase
        self.trace.phase_starts.setdefault(phase, len(self.trace.events))
        self.trace.phase_log.append((phase, len(self.trace.events)))

    def stop(self) -> StepTrace:
        """Stop recording deaths (storages freed after the step are not part of it)."""
        self._recording = False
        return self.trace


#: The dispatch with Dynamo's frame callback off (what ``TorchDispatchMode.__init_subclass__``
#: wraps every ``__torch_dispatch__`` in): inside it the callback is None, so it runs the body.
_dispatch_without_dynamo: Final = _disable_dynamo(StorageTracer.__torch_dispatch__, recursive=True)


class _OpFacts:
    """What the tracer looks up about one op, once: its dispatch facts, kept by ``id(func)``
    because an ``OpOverload`` hashes in Python (``torch/_ops.py``), and a dictionary keyed by it
    pays that call on every look-up. It holds ``func``, so the id stays its own while the tracer
    lives. The facts that are the op's alone (its names, its cache plan) are the process's
    (:func:`_op_facts`): a trace does not format each op's schema name again."""

    __slots__ = ("after_op", "func", "name", "same_memory", "short_name", "uncached")

    def __init__(self, func: Op, after_op: bool) -> None:
        self.func = func
        self.after_op = after_op  # whether the tracer's after-op hook is called after it
        self.name, self.short_name, self.same_memory, plan = _op_facts(func)
        # never cached (a view, a value read): run without the cache's look-ups. An op the cache
        # stops caching later (an unannounced alias) still goes through it and is refused there.
        self.uncached = self.same_memory < 0 and plan[2] is None and not plan[1]


#: Per op, by id (the op object held last, so the id stays its own): its schema name (what made
#: a storage), its name in the trace's op counts and the argument whose memory it returns
#: (_SAME_MEMORY) or -1.
_OP_FACTS: Final[dict[int, tuple[str, str, int, Op]]] = {}


def _op_facts(func: Op) -> tuple[str, str, int, tuple[Op, bool, _Plan | None]]:
    """``func``'s names, the argument whose memory it returns and its cache plan (now: an op the
    cache stopped caching has none)."""
    facts = _OP_FACTS.get(id(func))
    if facts is None:
        facts = _OP_FACTS[id(func)] = (str(func), func.__name__, _SAME_MEMORY.get(func._schema.name, -1), func)
    return facts[0], facts[1], facts[2], _op_plan(func)


def _op_plan(func: Op) -> tuple[Op, bool, _Plan | None]:
    """The cache's entry for ``func`` (_OP_PLANS), made on first use."""
    plan = _OP_PLANS.get(id(func))
    if plan is None:
        plan = _OP_PLANS[id(func)] = (func, _is_foreach_elementwise(func), _plan_of(func))
    return plan


class MetaKernelCache:
    """Outputs of ops, by the metadata of their arguments.

    A meta kernel computes only shapes, strides and dtypes; for an op whose returns are either
    fresh tensors or a mutated argument returned as itself (``add_``, ``relu_``; the running
    statistics ``native_batch_norm`` updates), they depend only on its arguments' metadata.
    Models repeat the same calls block after block, and many meta kernels are Python
    decompositions, so a repeated call makes fresh ``empty_strided`` meta tensors (and hands
    back the mutated argument) instead of running the kernel again — as FakeTensor's dispatch
    cache does. Views, ops that change metadata in place, non-tensor outputs we cannot
    rebuild, storage offsets, oversized storages and unhashable arguments are not cached; an
    op whose output turns out to alias an input in a way its schema does not say
    (``_unsafe_view``) is never cached again.

    The outputs learnt are the process's, as FakeTensor's cache is (a class attribute of
    ``FakeTensorMode``): a meta kernel's output is a function of its arguments' metadata, so a
    later trace (the next estimate, a fit's next batch) rebuilds what an earlier one ran. They
    are kept per device type and default dtype (which a factory op without a dtype reads, as
    FakeTensor's key does), at most :data:`_MAX_SPECS` of them (then forgotten all at once).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._device = torch.device(device_type)  # a device object: a string is parsed at every empty_strided
        self._specs = _SPECS.setdefault((device_type, torch.get_default_dtype()), {})
        self._ops = _OP_PLANS
        self.hits = 0

    @staticmethod
    def clear() -> None:
        """Forget every output learnt (the next trace runs each meta kernel once again)."""
        _SPECS.clear()

    def run(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any], compute: _Compute) -> Any:
        """The output of ``func(*args, **kwargs)``: rebuilt from the cache, or ``compute``'s."""
        facts = self._ops.get(id(func))
        if facts is None:
            facts = _op_plan(func)
        _func, foreach, plan = facts
        if foreach:
            shortcut = _foreach_shortcut(func, args, kwargs, self._device)
            if shortcut is not _NO_SHORTCUT:
                self.hits += 1
                return shortcut
        if plan is None or (func is _TO_COPY and _to_host(kwargs)):  # a copy to the host holds values
            return compute(func, args, kwargs)
        # The key: which arguments share a storage is part of it, as some meta kernels decide on it
        # (memory-efficient attention's backward packs dq/dk/dv into one buffer when q, k, v are
        # views of one storage). Built for every cacheable op, here without a call: a flat tuple, a
        # tensor's metadata inline behind a marker (torch.Size is a tuple: equal to, and hashed as,
        # the tuple of its sizes). ``storages`` gets every input tensor's storage, which
        # _spec_with_plan reads; no key if a tensor is not meta or sits in a container _arg_key refuses.
        storages: dict[int, int] = {}
        parts: list[object] = [id(func)]  # run() holds func: its id is its own while the cache lives
        append = parts.append
        try:
            for value in args:
                kind = type(value)
                if kind in _ATOMS:
                    append(value)
                elif kind is torch.Tensor or kind is nn.Parameter:
                    if not value.is_meta:
                        return compute(func, args, kwargs)  # a real (CPU) tensor: its values may matter
                    parts += (_TENSOR, value.shape, value.stride(), value.dtype, value.storage_offset(),
                              storages.setdefault(id(value.untyped_storage()), len(storages)))
                else:
                    append(_arg_key(value, storages))
            if kwargs:
                for name in sorted(kwargs):
                    append((name, _arg_key(kwargs[name], storages)))
        except _Uncacheable:
            return compute(func, args, kwargs)
        key = tuple(parts)
        try:
            cached = self._specs.get(key)  # hashes the key once: an unhashable argument raises here
        except TypeError:
            return compute(func, args, kwargs)
        if cached is not None:
            self.hits += 1
            if cached[0] == "one":
                part = cached[1][0]
                if part[0] == "T":  # most ops: one fresh tensor (_materialize without its call)
                    return torch.empty_strided(part[1], part[2], dtype=part[3], device=self._device)
            return _materialize(cached, self._device, args, kwargs)
        out = compute(func, args, kwargs)
        spec = _spec_with_plan(out, plan, args, kwargs, storages)
        if spec is _ALIASING:
            self._ops[id(func)] = (func, foreach, None)  # aliases an input although its schema says otherwise
        elif spec is not None:
            if len(self._specs) >= _MAX_SPECS:
                self._specs.clear()
            self._specs[key] = spec
        return out


#: Marks a tensor's metadata in a flat key (MetaKernelCache.run): no argument is this object.
_TENSOR: Final = object()


class _Sentinel(enum.Enum):
    ALIASING = enum.auto()  # a "fresh" output shares a storage with an input
    NO_SHORTCUT = enum.auto()  # the foreach shortcut does not apply


_ALIASING: Final = _Sentinel.ALIASING
_NO_SHORTCUT: Final = _Sentinel.NO_SHORTCUT

# How a cacheable op's returns are rebuilt (_make_plan), one step per return: a fresh tensor, a
# fresh list of tensors, or the mutated argument at (position, name) returned as itself.
_PlanStep: TypeAlias = "tuple[Literal['fresh']] | tuple[Literal['fresh_list']] | tuple[Literal['arg'], int, str]"
_Plan: TypeAlias = "tuple[_PlanStep, ...]"
# A cached output (_spec_with_plan), part by part: a tensor's (shape, strides, dtype), a
# constant, an argument returned as itself, or a list of tensors.
_TensorPart: TypeAlias = "tuple[Literal['T'], tuple[int, ...], tuple[int, ...], torch.dtype]"
_ConstPart: TypeAlias = "tuple[Literal['C'], int | float | bool | None]"
_ArgPart: TypeAlias = "tuple[Literal['A'], int, str]"
_ListPart: TypeAlias = "tuple[Literal['L'], tuple[_TensorPart, ...]]"
_Part: TypeAlias = "_TensorPart | _ConstPart | _ArgPart | _ListPart"
_Spec: TypeAlias = "tuple[Literal['void'], tuple[()]] | tuple[Literal['tuple', 'one'], tuple[_Part, ...]]"

#: The meta-kernel cache's outputs (:class:`MetaKernelCache`), by device type and default dtype.
_SPECS: Final[dict[tuple[str, torch.dtype], dict[tuple[object, ...], _Spec]]] = {}
#: Bounds the outputs kept per device type and dtype: a spec is a few small tuples (about 1 KiB),
#: and a large model's trace learns a few thousand.
_MAX_SPECS: Final = 200_000
#: Per op, by id (the op object held, as in _OpFacts): the op, whether it is an elementwise
#: foreach op (_foreach_shortcut), and its plan (_plan_of; None once it aliases unannounced).
_OP_PLANS: Final[dict[int, tuple[Op, bool, _Plan | None]]] = {}

# Elementwise foreach ops of torch.optim: out[i] has the shape, strides and dtype of the first
# list's tensor i when every tensor of the call has that dtype. On meta their kernel is a
# Python loop of per-tensor meta kernels, once per parameter; the in-place ones change no
# metadata at all. (Checked against the real kernels by tests/test_meta_cache.py.)
_FOREACH_ELEMENTWISE = frozenset({
    "_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div", "_foreach_addcdiv", "_foreach_addcmul",
    "_foreach_lerp", "_foreach_sqrt", "_foreach_neg", "_foreach_abs", "_foreach_reciprocal", "_foreach_sign",
    "_foreach_exp", "_foreach_maximum", "_foreach_minimum", "_foreach_pow", "_foreach_clamp_min",
    "_foreach_clamp_max", "_foreach_copy",
})


def _is_foreach_elementwise(func: Op) -> bool:
    name = func.__name__.split(".")[0]
    return (name[:-1] if name.endswith("_") else name) in _FOREACH_ELEMENTWISE


def _foreach_shortcut(func: Op, args: tuple[Any, ...], kwargs: dict[str, Any],
                      device: torch.device) -> list[torch.Tensor] | Literal[_Sentinel.NO_SHORTCUT] | None:
    """The outputs of an elementwise foreach op (None: an in-place one, which returns nothing),
    or ``_NO_SHORTCUT`` where its kernel must decide: the first list's tensors all on ``device``'s
    type, every other tensor of more than 0 dimensions too and of one dtype with them, the other
    lists of tensors matching the first's shapes. One pass over the tensors: the optimizer's step
    calls these ops on every parameter."""
    if not args or not isinstance(args[0], list):  # the caller asks only for an elementwise foreach op
        return _NO_SHORTCUT
    first = args[0]
    if not first:
        return _NO_SHORTCUT
    device_type = device.type
    meta = device_type == "meta"  # Tensor.is_meta: a tenth of Tensor.device.type's cost
    tensor = torch.Tensor
    for t in first:
        if not isinstance(t, tensor) or not (t.is_meta if meta else t.device.type == device_type):
            return _NO_SHORTCUT
    dtype: torch.dtype | None = None
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(t, tensor) or t.dim() == 0:
                continue  # a 0-dim tensor (a step count, a scalar) may be elsewhere and of any dtype
            if not (t.is_meta if meta else t.device.type == device_type):
                return _NO_SHORTCUT
            if dtype is None:
                dtype = t.dtype
            elif t.dtype != dtype:
                return _NO_SHORTCUT  # type promotion: let the real kernel decide
    if dtype is None:
        return _NO_SHORTCUT
    for other in args[1:]:
        if isinstance(other, list) and other and isinstance(other[0], tensor) and (
                len(other) != len(first) or any(o.shape != f.shape for o, f in zip(other, first, strict=True))):
            return _NO_SHORTCUT
    if func.__name__.split(".")[0].endswith("_"):  # in place
        return None
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in first]


_METADATA_MUTATORS = ("resize", "set_", "as_strided", "swap", "_unsafe_set")


def _plan_of(func: Op) -> _Plan | None:
    """Per return: ("fresh",), ("fresh_list",) or ("arg", position, name) for a returned mutated
    argument; None if the op is not cacheable."""
    # a value read (.item()) is never cached: its answer changes with the data it stands for
    return None if func is _READ_VALUE or func is _NONZERO else _make_plan(func)


def _make_plan(func: Op) -> _Plan | None:
    schema = func._schema
    tags = getattr(func, "tags", ())
    if torch.Tag.inplace_view in tags or "nondeterministic_seeded" in tags or any(
            m in func.__name__ for m in _METADATA_MUTATORS):
        return None
    written: dict[frozenset[str], tuple[int, str]] = {}
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None:
            continue
        if not info.is_write:
            return None  # a view argument
        # a mutated list (the in-place foreach ops) is fine; returning it is not handled
        written[frozenset(info.before_set)] = (position, argument.name)
    plan: list[_PlanStep] = []
    for ret in schema.returns:
        info = ret.alias_info
        if info is None:
            plan.append(("fresh_list",) if "Tensor[]" in str(ret.type) else ("fresh",))
            continue
        if "[]" in str(ret.type):
            return None
        target = written.get(frozenset(info.before_set))
        if target is None or not info.is_write:
            return None  # a view of an argument
        position, name = target
        plan.append(("arg", position, name))
    return tuple(plan)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


class _Uncacheable(Exception):
    pass


#: Argument types that are their own key (exact types: the common case, tested first by ``type``).
_ATOMS: Final = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
                           torch.memory_format})


def _arg_key(value: Any, storages: dict[int, int]) -> object:
    # exact types first: isinstance against torch.Tensor goes through its metaclass, and the
    # key is built for every argument of every cacheable op
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list or kind is tuple:
        return tuple([_arg_key(v, storages) for v in value])
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _Uncacheable  # a real (CPU) tensor: its values may matter
        alias = storages.setdefault(id(value.untyped_storage()), len(storages))
        # torch.Size is a tuple: equal to, and hashed as, the tuple of its sizes
        return (_TENSOR, value.shape, value.stride(), value.dtype, value.storage_offset(), alias)
    if isinstance(value, (list, tuple)):
        return tuple([_arg_key(v, storages) for v in value])
    if isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    raise _Uncacheable


def _strided_nbytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """The bytes ``torch.empty_strided(shape, stride)`` allocates (ATen's ``computeStorageNbytes``
    at offset 0): the furthest element's offset plus one, times the item size; none if empty."""
    if 0 in shape:
        return 0
    furthest = 0
    for size, step in zip(shape, stride, strict=True):
        if step < 0:
            return -1  # no storage empty_strided makes
        furthest += (size - 1) * step
    return (1 + furthest) * itemsize


#: The plan of an op that returns one fresh tensor (most ops).
_ONE_FRESH: Final[_Plan] = (("fresh",),)


def _spec_with_plan(out: Any, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any],
                    inputs: Container[int]) -> _Spec | Literal[_Sentinel.ALIASING] | None:
    """How to rebuild ``out`` following ``plan``; None if it cannot be rebuilt exactly;
    ``_ALIASING`` if a "fresh" output shares a storage with an input (``inputs``: the ids of
    the input tensors' storages, as :meth:`MetaKernelCache.run` collected them)."""
    if not plan:  # returns nothing (in-place foreach ops)
        return ("void", ()) if out is None else None
    if type(out) is torch.Tensor and plan == _ONE_FRESH:  # most ops: one fresh tensor (fresh() below, inline)
        untyped = out.untyped_storage()
        if id(untyped) in inputs:
            return _ALIASING
        if not out.is_meta or out.storage_offset() != 0:
            return None
        shape, stride = tuple(out.shape), out.stride()
        if _strided_nbytes(shape, stride, out.dtype.itemsize) != untyped.nbytes():
            return None  # a storage larger than its view needs: not what empty_strided makes
        return ("one", (("T", shape, stride, out.dtype),))
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(plan):
        return None
    fresh_storages: set[int] = set()

    def fresh(value: Any) -> _TensorPart | _ConstPart | Literal[_Sentinel.ALIASING] | None:
        if isinstance(value, torch.Tensor):
            untyped = value.untyped_storage()
            storage = id(untyped)
            if storage in inputs:
                return _ALIASING
            if storage in fresh_storages or not value.is_meta or value.storage_offset() != 0:
                return None
            fresh_storages.add(storage)
            shape, stride = tuple(value.shape), value.stride()
            if _strided_nbytes(shape, stride, value.dtype.itemsize) != untyped.nbytes():
                return None  # a storage larger than its view needs: not what empty_strided makes
            return ("T", shape, stride, value.dtype)
        if value is None or isinstance(value, (int, float, bool)):
            return ("C", value)
        return None

    parts: list[_Part] = []
    for value, step in zip(outs, plan, strict=True):
        if step[0] == "arg":
            if value is not _argument(args, kwargs, step[1], step[2]):
                return None
            parts.append(("A", step[1], step[2]))
        elif step[0] == "fresh_list":
            if not isinstance(value, list):
                return None
            items = [fresh(v) for v in value]
            if any(i is _ALIASING for i in items):
                return _ALIASING
            tensors = [i for i in items if i is not None and i is not _ALIASING and i[0] == "T"]
            if len(tensors) != len(items):  # a None or a constant among them
                return None
            parts.append(("L", tuple(tensors)))
        else:
            part = fresh(value)
            if part is None or part is _ALIASING:
                return part
            parts.append(part)
    return ("tuple" if isinstance(out, tuple) else "one", tuple(parts))


def _materialize(spec: _Spec, device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if spec[0] == "void":
        return None
    values: list[Any] = []
    for part in spec[1]:
        if part[0] == "T":
            values.append(torch.empty_strided(part[1], part[2], dtype=part[3], device=device))
        elif part[0] == "L":
            values.append([torch.empty_strided(p[1], p[2], dtype=p[3], device=device) for p in part[1]])
        elif part[0] == "A":
            values.append(_argument(args, kwargs, part[1], part[2]))
        else:
            values.append(part[1])
    return tuple(values) if spec[0] == "tuple" else values[0]


class ModuleTracker:
    """Which module is running: a stack of forward pre/post hooks, and during backward the
    leaf module whose output gradient arrived last (a tensor hook on each leaf's output).

    Hooks are installed on one model and removed by :meth:`remove` (the caller does it in a
    ``finally``), so the user's modules are left as they were.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._backward_module = ""
        self._handles: list[RemovableHandle] = []
        self.output_shapes: dict[str, tuple[int, ...]] = {}
        self.order: list[str] = []  # module names in the order their forward first ran
        self.in_backward = False

    @property
    def current(self) -> str:
        """The running module's name ("" outside any submodule)."""
        if self.in_backward:
            return self._backward_module
        return self._stack[-1] if self._stack else ""

    @property
    def recomputing(self) -> bool:
        """A module's forward running during backward: activation checkpointing recomputing."""
        return self.in_backward and bool(self._stack)

    def install(self, model: nn.Module) -> None:
        """Hook every submodule of ``model`` (undone by :meth:`remove`)."""
        for name, module in model.named_modules():
            if not name:
                continue  # the root: outside any submodule is reported as ""
            is_leaf = next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            # always_call: a forward stopped by an exception still leaves the stack, so that the stack
            # is non-empty in backward exactly while a recomputation runs (non-reentrant checkpoint
            # stops one early by raising _StopRecomputationError, torch/utils/checkpoint.py)
            self._handles.append(module.register_forward_hook(self._post_hook(name, is_leaf), always_call=True))

    def remove(self) -> None:
        """Remove every hook :meth:`install` added."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._stack.append(name)
            if name not in self.output_shapes:
                self.order.append(name)
                self.output_shapes[name] = ()
        return hook

    def _post_hook(self, name: str, is_leaf: bool) -> Callable[[nn.Module, Any, Any], None]:
        grad_hook = self._grad_hook(name)  # one per module: every output of its calls shares it

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            if type(output) is torch.Tensor:  # most modules: one plain tensor (no walk through the output)
                # read with no function mode: the CUDA emulation would hand back the same shape and flag,
                # one torch-function call each
                with _NO_FUNCTION_MODES():
                    self.output_shapes[name] = tuple(output.shape)
                    if is_leaf and torch.is_grad_enabled() and output.requires_grad:
                        output.register_hook(grad_hook)  # type: ignore[no-untyped-call]  # untyped in torch
                return
            first = _first_tensor(output)
            if first is not None:
                self.output_shapes[name] = tuple(first.shape)
            if is_leaf and torch.is_grad_enabled():
                for tensor in tensors_of(output):
                    if not tensor.requires_grad:
                        continue
                    if type(tensor) is torch.Tensor:  # a function mode (the CUDA emulation) passes it on as it is
                        with _NO_FUNCTION_MODES():
                            tensor.register_hook(grad_hook)  # type: ignore[no-untyped-call]  # untyped in torch
                    else:
                        tensor.register_hook(grad_hook)  # type: ignore[no-untyped-call]  # untyped in torch
        return hook

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            self._backward_module = name
            # A recomputation is over when backward reaches a module's gradient (kept as a guard:
            # the post-hooks run even for a forward stopped early, see install)
            self._stack.clear()
        return hook

    @contextmanager
    def backward(self) -> Iterator[None]:
        """The backward pass: the current module is the one whose output gradient arrived last."""
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False
            self._backward_module = ""
            self._stack.clear()


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) tensor / tuple / list / mapping value (a dict, a Hugging
    Face ``ModelOutput``, a batch of keyword inputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_of(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_of(item)


def _first_tensor(output: Any) -> torch.Tensor | None:
    return next(tensors_of(output), None)


def _to_host(kwargs: dict[str, Any]) -> bool:
    """Whether ``aten._to_copy``'s keywords move a tensor to the host (``.tolist()``, ``.cpu()``)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"
