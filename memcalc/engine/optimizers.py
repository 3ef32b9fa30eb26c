"""The optimizers memcalc knows, each built from the real ``torch.optim`` class (or, for
bitsandbytes', an emulation of what it allocates: :mod:`memcalc.stacks.bitsandbytes.adamw`),
and the registry they are found in: :func:`register_optimizer` adds an :class:`OptimizerSpec`
(duplicates refused, as ``torch.utils.flop_counter.register_flop_formula`` refuses them), and
:func:`spec_for` finds one by the name ``--optim`` and ``optimizer=`` take. The ``torch.optim``
ones register below; bitsandbytes' in :mod:`memcalc.stacks.bitsandbytes.adamw`; another
package registers its own the same way, on import.

Optimizer state is never taken from a table: the real class runs its real ``step()`` on the
symbolic parameters and whatever it keeps in ``optimizer.state`` is what we count. The
textbook multiplier (SGD ×2, momentum ×3, Adam ×4 of parameter memory) is kept only as the
explanation printed beside the simulated peak.

**Implementations** (:class:`~memcalc.core.loop.OptimizerImpl`): the for-loop, foreach (a
temporary for every parameter at once) and fused (one in-place kernel). ``auto`` is what torch
2.13 picks: foreach on CUDA, the for-loop on the CPU (Adafactor: the for-loop everywhere).

**On meta parameters** torch's real code needs two things meta lacks, each given only while a
build or a step runs: :func:`fused_kernels_on_meta` lets the fused path run on meta (and
registers allocate-nothing meta kernels for ``_fused_sgd_`` and ``_fused_adagrad_`` where torch
has none); :func:`scalars_on_meta` answers ``.item()`` of a meta tensor with 1.

Where torch makes each choice: docs/notes/optimizers.md.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.errors import InapplicableOptionError
from memcalc.core.loop import OptimizerImpl
from memcalc.engine.rules import DuplicateRuleError

__all__ = ("DEFAULT_OPTIMIZER", "FUSED_ONLY", "LOOPS", "LOOPS_AND_FUSED", "META_KERNELS_ADDED", "OPTIMIZERS",
           "Factory", "Optimizer", "OptimizerSpec", "TorchOptim", "fused_kernels_on_meta", "optimizer_names",
           "register_optimizer", "resolve_impl", "scalars_on_meta", "spec_for", "step_under")


class Optimizer(str, enum.Enum):
    """The built-in optimizers' user-facing names (a registered one has its own name, a plain
    string: :func:`optimizer_names` lists them all)."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    SGD_NESTEROV = "sgd-nesterov"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"
    ADAFACTOR = "adafactor"
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes.optim.AdamW8bit
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"  # bitsandbytes.optim.PagedAdamW8bit
    PAGED_ADAMW_32BIT = "paged-adamw-32bit"  # bitsandbytes.optim.PagedAdamW32bit
    NONE = "none"  # forward + backward only


#: The optimizer a training step has when none is named (``--optim``, ``optimizer=``).
DEFAULT_OPTIMIZER = Optimizer.ADAM

Params = Iterable[torch.nn.Parameter]
#: Builds the optimizer over the parameters in one (concrete) implementation.
Factory = Callable[[Params, OptimizerImpl], torch.optim.Optimizer]

#: The implementation sets a spec's ``impls`` takes: torch's loops; the loops and fused; a
#: library's own fused kernel only.
LOOPS = frozenset({OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH})
LOOPS_AND_FUSED = LOOPS | {OptimizerImpl.FUSED}
FUSED_ONLY = frozenset({OptimizerImpl.FUSED})


@dataclass(frozen=True)
class TorchOptim:
    """A ``torch.optim`` class by name, with its hyper-parameters: called with ``(params, impl)``
    it passes ``foreach`` (and ``fused``, where the constructor takes it) for ``impl``."""

    name: str  # the class in torch.optim
    hyper: tuple[tuple[str, Any], ...] = ()  # keyword arguments (a tuple: the spec stays hashable)
    takes_fused: bool = False
    reads_scalars: bool = False  # its step reads tensor values (.item()) that size the update

    def __call__(self, params: Params, impl: OptimizerImpl) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.name)
        flags: dict[str, bool] = {"foreach": impl is OptimizerImpl.FOREACH}
        if self.takes_fused:
            flags["fused"] = impl is OptimizerImpl.FUSED
        elif impl is OptimizerImpl.FUSED:
            raise ValueError(f"torch.optim.{self.name} has no fused implementation")
        params = list(params)
        optimizer: torch.optim.Optimizer = cls(params, **dict(self.hyper), **flags)  # no constructor checks devices
        if not any(isinstance(p, torch.Tensor) and p.is_meta for p in params):
            return optimizer
        # on meta (fused_kernels_on_meta, scalars_on_meta below): the same code path, with what meta lacks
        contexts = [*([fused_kernels_on_meta] if impl is OptimizerImpl.FUSED else []),
                    *([scalars_on_meta] if self.reads_scalars else [])]
        return step_under(optimizer, contexts)


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer, which implementations it has, its textbook line and the
    advice that names a lighter one: what :func:`register_optimizer` takes.

    The state it keeps is never read from here: the factory's optimizer runs its real ``step()``
    on the symbolic parameters, and what it keeps in ``optimizer.state`` (each tensor with its
    dtype) is what is counted. The textbook fields only explain the figure beside the peak.

    Attributes:
        key, display: its name (``--optim``, ``optimizer=``; lower case), and how the report
            writes it.
        factory: builds it (None for ``none``: no optimizer step).
        textbook_multiplier: × parameter bytes: weights + grads + state tensors per weight.
        textbook_terms: what the textbook line adds up.
        impls: the implementations it has.
        auto_cuda, auto_cpu: what ``auto`` is for CUDA and for CPU parameters (module docstring).
        textbook_state: optimizer state per parameter that is not a multiple of its bytes (the
            1-byte moments of 8-bit Adam, Adafactor's factored moments), for the textbook line.
        torch_class: the ``torch.optim`` class it needs ("" for none and the emulations), and
            ``torch_since`` the torch version that added it.
        lighter: optimizers with less state per parameter, as ``--optim`` spells them ("sgd" or
            "sgd-momentum or sgd"), suggested when the model states fill the memory; "" for none.
        only_impl: why it has no other implementation, when ``impls`` holds one (an error says it).
    """

    key: str
    display: str
    factory: Factory | None
    textbook_multiplier: int
    textbook_terms: str
    impls: frozenset[OptimizerImpl] = LOOPS
    auto_cuda: OptimizerImpl = OptimizerImpl.FOREACH
    auto_cpu: OptimizerImpl = OptimizerImpl.FOR_LOOP
    textbook_state: Callable[[torch.Tensor], int] | None = None
    torch_class: str = ""
    torch_since: str = ""
    lighter: str = ""
    only_impl: str = ""

    @property
    def name(self) -> str:
        """Its name as a plain string (``adam``), a built-in's enum member or not."""
        return str(self.key.value if isinstance(self.key, enum.Enum) else self.key)

    def build(self, params: Params, impl: OptimizerImpl = OptimizerImpl.FOREACH) -> torch.optim.Optimizer | None:
        """The optimizer over ``params`` in implementation ``impl``; None for ``none``.

        Args:
            params: the parameters to optimize.
            impl: the implementation; ``AUTO`` must have been resolved for the target already
                (:func:`resolve_impl`).

        Returns:
            A ``torch.optim.Optimizer``, or None when no optimizer step is simulated.

        Raises:
            InapplicableOptionError: the optimizer has no such implementation, or the
                installed torch lacks the optimizer.
        """
        if impl is OptimizerImpl.AUTO:
            raise ValueError("OptimizerImpl.AUTO is resolved for the target before the optimizer is built")
        if self.factory is None:
            return None
        _check_available(self, impl)
        return self.factory(params, impl)

    def textbook_state_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """The textbook's optimizer state outside the multiplier, over those of ``params`` that
        require grad (0 for most): a frozen parameter is never handed to the optimizer."""
        rule = self.textbook_state
        return 0 if rule is None else sum(rule(p) for p in params if p.requires_grad)


#: Every registered optimizer by name, in the order registered (:func:`register_optimizer`).
OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, *, override: bool = False) -> OptimizerSpec | None:
    """Make ``spec`` an optimizer of every estimate: ``--optim NAME``, ``optimizer="NAME"``.

    Args:
        spec: the optimizer; its ``key`` is its name (lower case, no spaces).
        override: replace a registered optimizer of that name on purpose.

    Returns:
        The spec it replaced (with ``override``), else None.

    Raises:
        DuplicateRuleError: the name is taken and ``override`` is not given.
        ValueError: a name that ``--optim`` could not take, or an ``auto`` the spec does not have.
    """
    name = spec.name
    if not name or name != name.strip().lower() or "," in name or " " in name:
        raise ValueError(f"an optimizer's name is lower case, without spaces or commas: {name!r}")
    if not {spec.auto_cuda, spec.auto_cpu} <= spec.impls:
        raise ValueError(f"optimizer {name}: auto_cuda and auto_cpu must be among its impls")
    previous = OPTIMIZERS.get(name)
    if previous is not None and not override:
        raise DuplicateRuleError(f"optimizer {name!r} is registered already (override=True replaces it)")
    OPTIMIZERS[name] = spec
    return previous


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer's name, in the order registered, ``none`` last (it is no optimizer)."""
    names = [name for name in OPTIMIZERS if name != Optimizer.NONE.value]
    return (*names, *([Optimizer.NONE.value] if Optimizer.NONE.value in OPTIMIZERS else []))


def _torch_spec(key: Optimizer, display: str, name: str, multiplier: int, terms: str, *, fused: bool = False,
                auto_cuda: OptimizerImpl = OptimizerImpl.FOREACH, since: str = "", reads_scalars: bool = False,
                textbook_state: Callable[[torch.Tensor], int] | None = None, lighter: str = "",
                **hyper: Any) -> OptimizerSpec:
    factory = TorchOptim(name, tuple(hyper.items()), takes_fused=fused, reads_scalars=reads_scalars)
    return OptimizerSpec(key, display, factory, multiplier, terms, impls=LOOPS_AND_FUSED if fused else LOOPS,
                         auto_cuda=auto_cuda, textbook_state=textbook_state, torch_class=name, torch_since=since,
                         lighter=lighter)


def _factored_second_moment(p: torch.Tensor) -> int:
    """Adafactor's state (torch/optim/_adafactor.py ``Adafactor._init_group``): a matrix keeps a
    row vector (``row_shape[-1] = 1``) and a column vector (``col_shape[-2] = 1``) of second
    moments; a vector keeps a full ``variance`` copy."""
    if p.dim() > 1:
        return (p.numel() // p.shape[-1] + p.numel() // p.shape[-2]) * p.element_size()
    return p.numel() * p.element_size()


for _spec in (
    _torch_spec(Optimizer.SGD, "SGD", "SGD", 2, "weights + grads", fused=True, lr=0.01),
    _torch_spec(Optimizer.SGD_MOMENTUM, "SGD (momentum 0.9)", "SGD", 3, "weights + grads + momentum",
                fused=True, lighter="sgd", lr=0.01, momentum=0.9),
    _torch_spec(Optimizer.SGD_NESTEROV, "SGD (Nesterov momentum 0.9)", "SGD", 3, "weights + grads + momentum",
                fused=True, lr=0.01, momentum=0.9, nesterov=True),
    _torch_spec(Optimizer.ADAM, "Adam", "Adam", 4, "weights + grads + 2 moments", fused=True,
                lighter="sgd-momentum or sgd"),
    _torch_spec(Optimizer.ADAMW, "AdamW", "AdamW", 4, "weights + grads + 2 moments", fused=True,
                lighter="sgd-momentum or sgd"),
    _torch_spec(Optimizer.RMSPROP, "RMSprop", "RMSprop", 3, "weights + grads + square average", lighter="sgd"),
    _torch_spec(Optimizer.ADAGRAD, "Adagrad", "Adagrad", 3, "weights + grads + sum of squares", fused=True,
                lighter="sgd"),
    _torch_spec(Optimizer.ADAFACTOR, "Adafactor", "Adafactor", 2,
                "weights + grads + factored second moments: a row and a column vector per matrix, "
                "not a full copy", auto_cuda=OptimizerImpl.FOR_LOOP, since="2.5", reads_scalars=True,
                textbook_state=_factored_second_moment),
    OptimizerSpec(Optimizer.NONE, "none (forward + backward)", None, 2, "weights + grads", impls=LOOPS_AND_FUSED),
):
    register_optimizer(_spec)


def spec_for(optimizer: Optimizer | str) -> OptimizerSpec:
    """The spec for an optimizer name; ``ValueError`` listing the choices for anything else."""
    key = optimizer.value if isinstance(optimizer, Optimizer) else str(optimizer).strip().lower()
    spec = OPTIMIZERS.get(key)
    if spec is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(optimizer_names())}")
    return spec


def resolve_impl(spec: OptimizerSpec, impl: OptimizerImpl, *, cuda: bool) -> OptimizerImpl:
    """The implementation ``spec`` runs in: ``impl`` as given, or for ``AUTO`` what the installed
    torch picks for the target's parameters (module docstring).

    Args:
        spec: the optimizer.
        impl: the user's choice.
        cuda: whether the parameters are CUDA tensors (else CPU).

    Returns:
        A concrete implementation (never ``AUTO``).

    Raises:
        InapplicableOptionError: ``spec`` has no implementation ``impl``, or the installed torch
            lacks the optimizer.
    """
    if impl is OptimizerImpl.AUTO:
        impl = spec.auto_cuda if cuda else spec.auto_cpu
    _check_available(spec, impl)
    return impl


def _check_available(spec: OptimizerSpec, impl: OptimizerImpl) -> None:
    if spec.torch_class and not hasattr(torch.optim, spec.torch_class):
        raise InapplicableOptionError(
            f"optimizer {spec.name} needs torch.optim.{spec.torch_class}, added in torch {spec.torch_since}; "
            f"the installed torch is {torch.__version__}",
            hint=f"upgrade torch to {spec.torch_since} or later, or choose another --optim")
    if impl in spec.impls:
        return
    has = ", ".join(i.value for i in OptimizerImpl if i in spec.impls)
    fused = ", ".join(s.name for s in OPTIMIZERS.values() if s.torch_class and OptimizerImpl.FUSED in s.impls)
    why = (spec.only_impl if spec.only_impl and len(spec.impls) == 1
           else f"fused=True is offered by torch {torch.__version__} for: {fused}" if impl is OptimizerImpl.FUSED
           else f"its implementations: {has}")
    raise InapplicableOptionError(f"optimizer {spec.name} has no {impl.value} implementation: {why}",
                                  hint=f"choose optimizer_impl (--optim-impl) auto or one of: {has}")


# ---- torch.optim on meta parameters (module docstring) ---------------------------------------
#: The fused optimizer ops torch 2.13 has no meta kernel for (torch/_meta_registrations.py
#: registers only ``_fused_adam_``, ``_fused_adamw_`` and the out-of-place ``_fused_adam``),
#: with every overload: ``default`` (float lr) and ``tensor_lr``.
META_KERNELS_ADDED = ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_fused_adagrad_", "_fused_adagrad_.tensor_lr")
#: The name ``_device_dtype_check_for_fused`` looks the fused devices up by, in torch.optim.optimizer
#: (imported there from torch.utils._foreach_utils).
_FUSED_DEVICES = "_get_fused_kernels_supported_devices"


def _in_place_fused_kernel(*args: Any, **kwargs: Any) -> None:
    """The meta kernel of an in-place fused optimizer op: like ``meta__fused_adam_``, check that
    the tensor arguments are lists and allocate nothing (the op returns ``()``)."""
    for value in args:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a tensor list, got {type(value).__name__}")


@contextmanager
def fused_kernels_on_meta() -> Iterator[None]:
    """While active: ``fused=True`` accepts meta parameters and every fused optimizer kernel of
    ``torch.optim`` has a meta kernel. Both changes are undone on exit."""
    original: Callable[[], list[str]] = getattr(torch_optimizer, _FUSED_DEVICES)

    def with_meta() -> list[str]:
        return [*original(), "meta"]

    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # untyped in torch
    try:
        for name in META_KERNELS_ADDED:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
                library.impl(name, _in_place_fused_kernel, "Meta")  # type: ignore[no-untyped-call]  # untyped
        setattr(torch_optimizer, _FUSED_DEVICES, with_meta)
        yield
    finally:
        setattr(torch_optimizer, _FUSED_DEVICES, original)
        library._destroy()  # type: ignore[no-untyped-call]  # untyped in torch: removes the kernels


class _MetaScalars(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """``.item()`` (``aten._local_scalar_dense``) of a meta tensor is 1 of its kind; every other
    op goes on to the modes below (the tracer) unchanged."""

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            tensor: torch.Tensor = args[0]
            return True if tensor.dtype is torch.bool else 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def scalars_on_meta() -> AbstractContextManager[Any]:
    """While active, ``.item()`` of a meta tensor is 1 (1.0, ``True``) instead of an error."""
    return _MetaScalars()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped in torch


def step_under(optimizer: torch.optim.Optimizer,
               contexts: Sequence[Callable[[], AbstractContextManager[Any]]]) -> torch.optim.Optimizer:
    """``optimizer`` with its ``step()`` run inside ``contexts`` (an attribute of this instance:
    its class, and every other optimizer, are left as they were)."""
    if not contexts:
        return optimizer
    step = optimizer.step

    @functools.wraps(step)
    def step_in_contexts(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return step(*args, **kwargs)

    optimizer.step = step_in_contexts  # type: ignore[method-assign]
    return optimizer
