"""When DeepSpeed ZeRO-3 gathers and releases each parameter: its ``PartitionedParameterCoordinator``
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``) and the persistence of small
parameters (``parameter_offload.py``'s ``mark_persistent_parameters``), followed step by step so
that :class:`~memcalc.distributed.fsdp.ShardedProgram` allocates and frees the gathered parameters
where DeepSpeed does.

- The first forward records nothing and the trace is recorded from the next forward on
  (``reset_step``: INVALID → RECORD → COMPLETE): until the trace is complete there is no prefetch,
  and every parameter of a module, persistent ones too, is released after the module.
- Once complete, each fetch pops the module's parameters off the trace's queue and prefetches
  what follows while fewer than ``min(max_live_parameters − available, prefetch_bucket_size)``
  elements have been popped; a release keeps persistent parameters, parameters a prefetch has
  already claimed for a later use, and parameters used again within ``max_reuse_distance`` elements
  of the trace.
- The optimizer step releases everything (``release_and_reset_all``) and gathers the persistent
  parameters again after it (``_post_step``).

A mismatch with the recorded trace invalidates it, as DeepSpeed does (``trace_prologue``). Which
parameters a module releases at a step id is decided once per coordinator (DeepSpeed memoizes it).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from memcalc.distributed.vocabulary import ZeroStage3

__all__ = ("CoordinatedParam", "ParamCoordinator", "persistent_flags")


class CoordinatedParam(Protocol):
    """A parameter as the coordinator sees it: its element count (``ds_numel``), whether it
    persists (``ds_persist``) and whether it is trained (``requires_grad``)."""

    @property
    def ds_numel(self) -> int: ...

    @property
    def persistent(self) -> bool: ...

    @property
    def requires_grad(self) -> bool: ...


P = TypeVar("P", bound=CoordinatedParam)


class _Mode(enum.Enum):
    INVALID = "invalid"
    RECORD = "record"
    COMPLETE = "complete"


class _Status(enum.Enum):
    NOT_AVAILABLE = "not available"
    INFLIGHT = "inflight"  # all-gathered by a prefetch, not yet waited on by its module
    AVAILABLE = "available"


def persistent_flags(numels: Sequence[int], settings: ZeroStage3) -> list[bool]:
    """``mark_persistent_parameters``: in ``named_parameters`` order, a parameter of at most
    ``param_persistence_threshold`` elements persists while the persistent total stays within
    ``model_persistence_threshold``."""
    total = 0
    flags = []
    for numel in numels:
        persist = (numel + total <= settings.model_persistence_threshold
                   and numel <= settings.param_persistence_threshold)
        if persist:
            total += numel
        flags.append(persist)
    return flags


class ParamCoordinator(Generic[P]):
    """DeepSpeed's coordinator over ``params`` (in ``ds_id`` order). ``gather`` launches one
    all-gather of the parameters it is given (``all_gather_coalesced``), ``wait`` completes one
    of them (its handle's ``wait``), ``free`` frees one (``param.partition()``)."""

    def __init__(self, settings: ZeroStage3, params: Sequence[P], gather: Callable[[list[P]], None],
                 wait: Callable[[P], None], free: Callable[[P], None]):
        self.settings = settings
        self.params = list(params)
        self._id = {id(p): i for i, p in enumerate(self.params)}
        self._gather = gather
        self._wait = wait
        self._free = free
        self.status: dict[int, _Status] = {id(p): _Status.NOT_AVAILABLE for p in self.params}
        self._active: dict[int, set[Hashable]] = collections.defaultdict(set)
        self._mode = _Mode.INVALID
        #: the modules fetched, in trace order, with their parameter lists as the caller holds them: DeepSpeed
        #: reads each module's parameters (``iter_params``, external ones registered since included) when
        #: it builds the parameter trace
        self._order: list[tuple[Hashable, Sequence[P]]] = []
        self._param_order: list[tuple[P, int]] = []  # (parameter, step it is used at)
        self._queue: collections.deque[tuple[P, int]] = collections.deque()
        self._most_recent: dict[int, int] = {}
        self._step_id = 0
        self._n_available = 0
        self._backward_active: dict[Hashable, tuple[P, ...]] = {}
        #: ``ds_recompute_parameters``: the frozen parameters a checkpoint's recomputation fetched, kept
        #: for the module whose backward was the latest to start then, released with its backward
        self._recompute: dict[Hashable, dict[int, P]] = collections.defaultdict(dict)
        #: ``__params_to_release``'s memo: (module, step id) -> the parameters it released, never cleared
        self._release_cache: dict[tuple[Hashable, int], frozenset[int]] = {}

    @property
    def complete(self) -> bool:
        """Whether the trace is complete (prefetching, persistent parameters kept)."""
        return self._mode is _Mode.COMPLETE

    def available(self, p: P) -> bool:
        return self.status[id(p)] is not _Status.NOT_AVAILABLE

    def whole(self, p: P) -> bool:
        """AVAILABLE: gathered and waited on (not in flight)."""
        return self.status[id(p)] is _Status.AVAILABLE

    # ---- the step's boundaries --------------------------------------------------------------
    def reset_step(self) -> None:
        """The model's forward begins (``_start_of_forward_hook``)."""
        self._clean_inflight()
        if self._mode is _Mode.RECORD:
            self._param_order = [(p, step) for step, (_key, params) in enumerate(self._order)
                                 for p in sorted(set(params), key=lambda q: self._id[id(q)])]
            self._mode = _Mode.COMPLETE
        elif self._mode is _Mode.INVALID:
            self._mode = _Mode.RECORD
        self._queue = collections.deque(self._param_order)
        self._most_recent = {}
        self._step_id = 0
        self._n_available = 0

    def release_and_reset_all(self) -> None:
        """The optimizer step begins (``_partition_all_parameters``): every parameter, persistent
        ones too, goes back to its partition."""
        for p in self.params:
            self._complete(p)
            self._active[id(p)].clear()
            self._release(p)

    def gathered_on_access(self, p: P) -> None:
        """``ZeROOrderedDict.__getitem__``: a parameter read in an engine's forward outside its module is
        all-gathered at once (``param.all_gather()``, not through the coordinator: not counted as
        available) and registered as an external parameter of the module running; from then on it is
        fetched and released with that module's."""
        self.status[id(p)] = _Status.AVAILABLE

    def gathered_whole(self) -> list[P]:
        """``GatheredParameters(model.parameters())`` (TRL's generation under ``ds3_gather_for_generation``):
        what is in flight is waited on; the parameters NOT_AVAILABLE are returned, for the caller to
        all-gather at once (a blocking all-gather, not through the coordinator: not counted as
        available), and are AVAILABLE from then on."""
        for p in self.params:
            self._complete(p)
        missing = [p for p in self.params if self.status[id(p)] is _Status.NOT_AVAILABLE]
        for p in missing:
            self.status[id(p)] = _Status.AVAILABLE
        return missing

    def invalidate(self) -> None:
        """TRL's ``add_hooks`` after a generation with DeepSpeed's module hooks taken off: the trace
        is invalidated unless it is already (``_invalidate_trace``), to be recorded again."""
        if self._mode is not _Mode.INVALID:
            self._invalidate()

    def gather_persistent(self) -> None:
        """After the optimizer step (``_post_step``): the persistent parameters are all-gathered."""
        missing = [p for p in self.params if p.persistent and not self.available(p)]
        if missing:
            self._gather(missing)  # not through the coordinator: not counted as available
            for p in missing:
                self.status[id(p)] = _Status.INFLIGHT
                self._complete(p)

    def release_backward_leftovers(self) -> None:
        """The end of backward (``backward_epilogue``): modules whose post-backward never ran
        (an input without gradient) release their non-persistent parameters."""
        while self._backward_active:
            key, params = self._backward_active.popitem()
            for p in (*params, *self._recompute.pop(key, {}).values()):
                self._active[id(p)].discard(key)
                if not p.persistent:
                    self._release(p)

    # ---- a module ----------------------------------------------------------------------------
    def fetch(self, key: Hashable, params: Sequence[P], *, forward: bool, recomputing: bool = False) -> None:
        """``fetch_sub_module``: gather the module's parameters, then prefetch.

        ``recomputing``: a forward inside a backward (``torch._C._current_graph_task_id() != -1``:
        an activation checkpoint's recomputation). DeepSpeed 0.19.8 attributes the frozen parameters
        it fetches then to the module whose backward started last (``update_recompute_parameters``),
        so the recomputed module's own release keeps them, and that module's backward releases them;
        trained ones are released by their own module's backward."""
        if not forward:
            self._backward_active[key] = tuple(params)
        if self.complete:
            step = self._step_id
            if len(self._order) <= step or self._order[step][0] != key:
                self._invalidate()
        if self._mode is _Mode.RECORD:
            self._order.append((key, params))
        missing = [p for p in dict.fromkeys(params) if self.status[id(p)] is _Status.NOT_AVAILABLE]
        self._all_gather(missing)
        owner = next(reversed(self._backward_active), None) if forward and recomputing else None
        for p in params:
            self._active[id(p)].add(key)
            if owner is not None and not p.requires_grad:
                self._recompute[owner][id(p)] = p
                self._active[id(p)].add(owner)
            self._complete(p)
        if self.complete:
            self._prefetch(params)
        self._step_id += 1

    def release(self, key: Hashable, params: Sequence[P], *, forward: bool) -> None:
        """``release_sub_module`` after the module's forward or backward."""
        to_release = ({id(p) for p in params} if not self.complete else self._params_to_release(key, params))
        members = list(dict.fromkeys(params))
        if not forward:
            self._backward_active.pop(key, None)
            recomputed = self._recompute.pop(key, {})
            to_release |= {i for i, p in recomputed.items() if not p.persistent}
            held = {id(p) for p in members}
            members += [p for i, p in recomputed.items() if i not in held]
        for p in members:
            self._active[id(p)].discard(key)
            if id(p) in to_release:
                self._release(p)

    # ---- DeepSpeed's rules -------------------------------------------------------------------
    def _prefetch(self, params: Sequence[P]) -> None:
        wanted = {id(p) for p in params if self._most_recent.get(id(p), -10**10) < self._step_id}
        popped: set[int] = set()
        while self._queue and len(popped) < len(wanted):
            p, step = self._queue.popleft()
            self._most_recent[id(p)] = step
            popped.add(id(p))
        if popped != wanted:  # DeepSpeed raises "tracing error at step ..." here
            raise RuntimeError(f"ZeRO-3 parameter trace mismatch at step {self._step_id}")
        bucket = self.settings.prefetch_bucket_size
        if bucket <= 0:
            return
        limit = min(self.settings.max_live_parameters - self._n_available, bucket)
        chosen: dict[int, P] = {}
        numel = 0
        while self._queue and numel < limit:
            p, step = self._queue.popleft()
            fetch = self.status[id(p)] is _Status.NOT_AVAILABLE and id(p) not in chosen
            self._most_recent[id(p)] = max(self._most_recent.get(id(p), -10**10), step)
            if fetch:
                chosen[id(p)] = p
                numel += p.ds_numel
        self._all_gather(list(chosen.values()))

    def _params_to_release(self, key: Hashable, params: Sequence[P]) -> set[int]:
        """``__params_to_release``, which DeepSpeed memoizes (``functools.lru_cache``) on the module and the
        step id for the coordinator's life: a module released again at a step id it was released at before
        keeps the first answer, even when the trace has been recorded again since or the module has gained an
        external parameter (real DeepSpeed 0.19.8: GRPO's generation without ``ds3_gather_for_generation``
        keeps the LM head gathered after it from the second step on, tests/test_trl_grpo_zero3.py)."""
        cached = self._release_cache.get((key, self._step_id))
        if cached is None:
            cached = self._release_cache[(key, self._step_id)] = frozenset(self._released_now(params))
        return set(cached)

    def _released_now(self, params: Sequence[P]) -> set[int]:
        step = self._step_id
        out = {id(p) for p in params if not p.persistent}
        out -= {id(p) for p in params if self._most_recent.get(id(p), -10**10) > step}
        traversed = 0
        for _key, later in self._order[step:]:
            if traversed >= self.settings.max_reuse_distance:
                break
            for p in later:
                out.discard(id(p))
                traversed += p.ds_numel
        return out

    def _all_gather(self, params: list[P]) -> None:
        if params:
            self._n_available += sum(p.ds_numel for p in params)
            self._gather(params)
            for p in params:
                self.status[id(p)] = _Status.INFLIGHT

    def _complete(self, p: P) -> None:
        if self.status[id(p)] is _Status.INFLIGHT:
            self._wait(p)
            self.status[id(p)] = _Status.AVAILABLE

    def _release(self, p: P) -> None:
        if self.status[id(p)] is _Status.AVAILABLE and not self._active[id(p)]:
            self._free(p)
            self.status[id(p)] = _Status.NOT_AVAILABLE
            self._n_available -= p.ds_numel

    def _clean_inflight(self) -> None:
        for p in self.params:
            if self.status[id(p)] is _Status.INFLIGHT:
                self._complete(p)
                self._release(p)

    def _invalidate(self) -> None:
        self._mode = _Mode.INVALID
        self._order = []
        self._param_order = []
        self._most_recent = {}
        self._clean_inflight()
