"""What a CUDA GPU does differently from meta tensors, emulated above autograd.

Meta kernels ignore ``torch.autocast``, take the math path of
``scaled_dot_product_attention`` (keeping the full attention matrix) and implement dropout as
a float noise tensor; a CUDA GPU casts ops to fp16/bf16 by its own op lists, picks a fused
attention kernel that saves only the output and a logsumexp, and keeps a 1-byte dropout mask.
This ``TorchFunctionMode`` sits *above* autograd — so autograd records (and saves for
backward) exactly what CUDA would — and rewrites those calls:

- autocast (``amp-fp16``/``amp-bf16``, inside :meth:`CudaEmulation.autocast`): each call is
  looked up in CUDA's autocast policy (:func:`memcalc.targets.autocast.autocast_policy`, taken from
  ``aten/src/ATen/autocast_mode.cpp``) and its floating arguments cast as CUDA would,
  including the weight-cast cache (a float32 leaf that requires grad is cast once per
  autocast region);
- attention: the backend CUDA would choose (:func:`memcalc.targets.cuda.sdpa.choose_sdpa_backend`)
  and the matching fused aten op, called directly (their meta kernels give CUDA's outputs);
- dropout in training: ``aten.native_dropout``, CUDA's fused kernel (a bool mask).

The autocast policy is a table lookup by op name (the op lists are data); the calls handled
otherwise — attention, dropout, ``cross_entropy`` under autocast — are rules registered in
:data:`EMULATION_RULES` (a :class:`~memcalc.engine.rules.RuleRegistry`) under the Python
function objects that reach ``__torch_function__``.

A function mode only sees the outermost call of a Python composite (its handler runs with the
mode off), so for composites of ``torch.nn.functional`` (``multi_head_attention_forward``,
...) the mode lets the composite's own torch-function check pass once and stays on for the
calls inside it.
"""

from __future__ import annotations

import enum
import functools
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memcalc.core.errors import InvalidInputError
from memcalc.core.precision import Precision
from memcalc.engine.rules import RuleRegistry
from memcalc.engine.step_backend import AutocastRegion, pop_autocast_region, push_autocast_region
from memcalc.engine.trace import tensors_of
from memcalc.targets.autocast import AutocastPolicy, autocast_policy
from memcalc.targets.cuda.sdpa import AttentionBackend, SdpaCall, choose_sdpa_backend
from memcalc.targets.versions import TARGET_TORCH_VERSION

__all__ = ("EMULATION_RULES", "CudaEmulation", "EmulationRule")

_FLOATING_LOW = (torch.float16, torch.bfloat16)

# Python-level names that differ from the aten op they reach (for the autocast lists).
_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
            "__ipow__": "pow"}

# The names torch.nn.functional's composites use for their own torch-function check.
_TORCH_FUNCTION_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")

#: An emulation rule: ``(mode, func, args, kwargs) → result`` in place of ``func(*args, **kwargs)``.
EmulationRule = Callable[["CudaEmulation", Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
#: The calls the emulation rewrites, keyed by the function object ``__torch_function__`` gets.
EMULATION_RULES: RuleRegistry[EmulationRule] = RuleRegistry("CUDA emulation")


def _op_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    return _ALIASES.get(name, name)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        mapped = [_map_tensors(v, fn) for v in value]
        return type(value)(mapped) if isinstance(value, tuple) else mapped
    return value


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in tensors_of(value) if t.is_floating_point()]


class _Handling(enum.Enum):
    """How :class:`CudaEmulation` handles the calls of one function."""

    PLAIN = enum.auto()  # passed on as it is: no rule, no composite, in no autocast list
    AUTOCAST = enum.auto()  # in an autocast list: passed on as it is outside autocast regions
    EMULATED = enum.auto()  # a rule or a composite: always through dispatch


class CudaEmulation(TorchFunctionMode):
    """See the module docstring. ``compute_capability`` drives the attention backend;
    ``torch_version`` (``"X.Y"``) picks the release's autocast lists and SDPA rules."""

    def __init__(self, precision: Precision, compute_capability: tuple[int, int], *, emulate_kernels: bool = True,
                 emulate_attention: bool | None = None, torch_version: str = TARGET_TORCH_VERSION):
        super().__init__()
        self.precision = precision
        self.compute_capability = compute_capability
        self.emulate_kernels = emulate_kernels
        # the attention rule alone (None: as the other kernels): a compiled graph's attention is
        # CUDA's fused kernel, its dropout Inductor's (memcalc.targets.backend.CudaBackend)
        self.emulate_attention = emulate_kernels if emulate_attention is None else emulate_attention
        self.torch_version = torch_version
        self.autocast_dtype: torch.dtype | None = precision.compute_dtype if precision.is_amp else None
        self._autocast_depth = 0
        self._cast_cache: dict[int, torch.Tensor] = {}
        self.attention_backends: Counter[str] = Counter()
        # Whether a checkpointed forward is being recomputed during backward (set by the caller,
        # who tracks modules): the recomputation of an autocast forward is autocast too, as
        # torch.utils.checkpoint re-enters torch.autocast for it.
        self.recomputing: Callable[[], bool] = lambda: False
        # One object, so that leaving the mode removes exactly what entering it announced.
        self._region_in_force: Callable[[], AutocastRegion | None] = self._current_region
        # Per function reaching __torch_function__: how it is handled (_handling), decided once
        self._handling: dict[Callable[..., Any], _Handling] = {}

    def __enter__(self) -> CudaEmulation:
        push_autocast_region(self._region_in_force, self.autocast if self.autocast_dtype is not None else None)
        super().__enter__()  # type: ignore[no-untyped-call]  # torch.overrides is unannotated
        return self

    def __exit__(self, *exc: object) -> None:
        pop_autocast_region(self._region_in_force)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch.overrides is unannotated

    def _current_region(self) -> AutocastRegion | None:
        """The autocast region in force now (checkpoint recomputes under it), or None."""
        return self.autocast if self.autocasting else None

    # ---- the autocast region ---------------------------------------------------------------
    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The region ``torch.autocast`` would cover; the weight-cast cache is cleared when the
        outermost region exits (``at::autocast::clear_cache``), so the cast copies that
        autograd did not save are freed then."""
        self._autocast_depth += 1
        try:
            yield
        finally:
            self._autocast_depth -= 1
            if self._autocast_depth == 0:
                self._cast_cache.clear()

    @property
    def autocasting(self) -> bool:
        return self.autocast_dtype is not None and (self._autocast_depth > 0 or self.recomputing())

    def passes_through(self) -> bool:
        """Whether a call of a function with no rule and outside ``torch.nn.functional`` passes
        through this mode as it came: outside an autocast region (recomputation included), so
        that the step may take the mode off around torch's optimizers, which call no other
        (:func:`memcalc.engine.step_backend.idle_modes_off`)."""
        return not self.autocasting

    # ---- dispatch ---------------------------------------------------------------------------
    def __torch_function__(self, func: Callable[..., Any], types_: Iterable[type], args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        try:
            handling = self._handling.get(func)
        except TypeError:  # an unhashable callable (a method bound to an unhashable object): no rule
            return self.dispatch(func, args, dict(kwargs or {}))
        if handling is None:
            handling = self._handling[func] = self._handling_of(func)
        # most calls (a Tensor property, a method in no autocast list) are passed on as they are
        if handling is _Handling.PLAIN or (handling is _Handling.AUTOCAST and not self.autocasting):
            return func(*args, **(kwargs or {}))
        kwargs_ = dict(kwargs or {})
        rule = EMULATION_RULES.get(func)
        if rule is not None:
            return rule(self, func, args, kwargs_)
        return self.dispatch(func, args, kwargs_)

    def _handling_of(self, func: Callable[..., Any]) -> _Handling:
        """How calls of ``func`` are handled: each fact it rests on (a registered rule, a
        composite of ``torch.nn.functional``, the op's autocast policy) is one of ``func``'s."""
        name = _op_name(func)
        if EMULATION_RULES.get(func) is not None or (isinstance(func, types.FunctionType) and (
                func.__module__ == "torch.nn.functional" or name == "backward")):
            return _Handling.EMULATED
        return _Handling.PLAIN if self.autocast_policy_of(func) == "none" else _Handling.AUTOCAST

    def autocast_policy_of(self, func: Callable[..., Any]) -> AutocastPolicy:
        """What CUDA's autocast does with calls of ``func``."""
        return autocast_policy(_op_name(func), self.torch_version)

    def dispatch(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call no rule rewrites (or a rule hands on): CUDA's autocast policy, else the call
        itself (a ``torch.nn.functional`` composite with this mode on inside it)."""
        name = _op_name(func)
        if self.autocasting:
            policy = self.autocast_policy_of(func)
            if policy != "none":
                return self._autocast_call(func, name, policy, args, kwargs)
        if isinstance(func, types.FunctionType) and (func.__module__ == "torch.nn.functional" or name == "backward"):
            # Tensor.backward too: the autograd engine captures the torch-function modes in force
            # when backward starts, and checkpoint's recomputation must run under this mode.
            return self._composite(func, args, kwargs)
        return func(*args, **kwargs)

    def _composite(self, func: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a torch.nn.functional composite with this mode on for the calls inside it: its
        own torch-function check (its first statement) answers False once."""
        namespace = func.__globals__
        saved = {n: namespace[n] for n in _TORCH_FUNCTION_CHECKS if n in namespace}
        if not saved:  # a wrapper without its own check (boolean_dispatch): call it as it is
            return func(*args, **kwargs)

        def once(*_a: Any, **_k: Any) -> bool:
            namespace.update(saved)
            return False

        for n in saved:
            namespace[n] = once
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            namespace.update(saved)

    # ---- autocast ---------------------------------------------------------------------------
    def _autocast_call(self, func: Callable[..., Any], name: str, policy: AutocastPolicy, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        low = self.autocast_dtype
        assert low is not None
        if policy == "lower":
            args, kwargs = _map_tensors(args, lambda t: self.cast(t, low)), {
                k: _map_tensors(v, lambda t: self.cast(t, low)) for k, v in kwargs.items()}
        elif policy == "fp32":
            args = _map_tensors(args, _to_fp32)
            kwargs = {k: _map_tensors(v, _to_fp32) for k, v in kwargs.items()}
        elif policy == "fp32_set_opt_dtype":
            first = next(iter(_floating(args)), None)
            if first is not None and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float32
        elif policy == "promote":
            floats = _floating(args) + _floating(list(kwargs.values()))
            if floats:
                widest = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
                args = _map_tensors(args, lambda t: t.to(widest) if t.is_floating_point() and t.dtype != widest else t)
        elif policy == "banned":
            raise InvalidInputError(
                f"{name} is unsafe to autocast and CUDA refuses it under autocast",
                hint="Use binary_cross_entropy_with_logits (or BCEWithLogitsLoss), as PyTorch's error says.")
        return func(*args, **kwargs)

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``cached_cast``: floating non-double tensors to ``dtype``; float32 leaves that
        require grad (parameters) are cast once per autocast region."""
        if not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
            return tensor
        # the cache lives in an autocast region (a recomputation outside one casts per use)
        # autocast_mode.cpp's cached_cast: ... && arg.is_leaf() && !arg.is_view() && ...; a view of a
        # parameter made under no_grad (w.t() inside an autograd.Function) is a leaf that requires grad
        cacheable = (self._autocast_depth > 0 and tensor.is_leaf and tensor.requires_grad
                     and not tensor._is_view() and tensor.dtype is torch.float32)
        if cacheable:
            cached = self._cast_cache.get(id(tensor))
            if cached is not None:
                return cached
        cast = tensor.to(dtype)
        if cacheable:
            self._cast_cache[id(tensor)] = cast
        return cast


# ---- the rules ------------------------------------------------------------------------------
# What reaches __torch_function__ under these names (checked on torch 2.13): F.dropout and
# F.cross_entropy are Python functions that pass themselves; F.scaled_dot_product_attention is
# the builtin torch._C._nn.scaled_dot_product_attention, and a direct
# torch.ops.aten.scaled_dot_product_attention(...) arrives as that OpOverloadPacket (its
# ``.default`` overload is named "scaled_dot_product_attention.default" and was never matched).


@functools.lru_cache(maxsize=1 << 12)
def _backend_for(call: SdpaCall, compute_capability: tuple[int, int], torch_version: str) -> AttentionBackend:
    """:func:`choose_sdpa_backend`, remembered: a function of the call's facts, the GPU and the
    release, asked once per attention layer (about 50 µs: every backend's checks)."""
    return choose_sdpa_backend(call, compute_capability, torch_version=torch_version)


@EMULATION_RULES.register(F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)
def attention(mode: CudaEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """SDPA: the backend CUDA would choose and its fused aten op, called directly (math, a
    3-D call or GQA run the call itself, q/k/v cast under autocast)."""
    if not mode.emulate_attention:
        return mode.dispatch(func, args, kwargs)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if mode.autocasting:
        low = mode.autocast_dtype
        assert low is not None
        q, k, v = (mode.cast(t, low) for t in (q, k, v))
    mask = bound.get("attn_mask")
    dropout_p = float(bound.get("dropout_p", 0.0) or 0.0)
    is_causal = bool(bound.get("is_causal", False))
    scale = bound.get("scale")
    enable_gqa = bool(bound.get("enable_gqa", False))
    call = SdpaCall(
        batch=int(q.shape[0]) if q.dim() == 4 else 1, heads_q=int(q.shape[-3]), heads_kv=int(k.shape[-3]),
        seq_q=int(q.shape[-2]), seq_kv=int(k.shape[-2]), head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]),
        dtype=q.dtype, has_mask=mask is not None, dropout_p=dropout_p, is_causal=is_causal,
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        enable_gqa=enable_gqa)
    backend = _backend_for(call, tuple(mode.compute_capability), mode.torch_version)
    mode.attention_backends[backend.value] += 1
    aten = torch.ops.aten
    # grouped K/V heads (enable_gqa): the flash and cuDNN kernels take K/V unrepeated
    # (sdp_utils.cpp check_grouped_query_attention; memcalc.targets.cuda.sdpa admits GQA for them only);
    # the other backends repeat them, which the call itself does
    if q.dim() == 4 and (not enable_gqa or backend in (AttentionBackend.FLASH, AttentionBackend.CUDNN)):
        if backend is AttentionBackend.FLASH:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if backend is AttentionBackend.EFFICIENT:
            return aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, call.requires_grad, dropout_p, is_causal, scale=scale)[0]
        if backend is AttentionBackend.CUDNN:
            return aten._scaled_dot_product_cudnn_attention(
                q, k, v, mask, call.requires_grad, dropout_p, is_causal, False, scale=scale)[0]
    bound.update(query=q, key=k, value=v)
    return func(**bound)


@EMULATION_RULES.register(F.dropout)
def dropout(mode: CudaEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dropout in training: CUDA's fused ``native_dropout`` (a bool mask, 1 B per element)."""
    if not mode.emulate_kernels:
        return mode.dispatch(func, args, kwargs)
    names = ("input", "p", "training", "inplace")
    bound: dict[str, Any] = {"p": 0.5, "training": True, "inplace": False}
    bound.update(dict(zip(names, args, strict=False)))
    bound.update(kwargs)
    x, p = bound["input"], float(bound["p"])
    if not bound["training"] or bound["inplace"] or not 0.0 < p < 1.0 or not x.is_floating_point():
        return func(*args, **kwargs)
    # at::native::dropout: CUDA tensors take the fused native_dropout (mask: bool, 1 B/elt)
    return torch.ops.aten.native_dropout(x, p, True)[0]


@EMULATION_RULES.register(F.cross_entropy)
def cross_entropy(mode: CudaEmulation, func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """``cross_entropy_loss`` is a C++ composite in no autocast list; under CUDA autocast its
    pieces are cast one by one. ``cross_entropy_loss_symint`` (aten/src/ATen/native/LossNLL.cpp)
    calls ``at::log_softmax(self, class_dim, self.scalar_type())``: the dtype is *given*, so
    the fp32_set_opt_dtype policy leaves it alone and the log-probabilities stay in the logits'
    fp16/bf16 (saved by ``LogSoftmaxBackward``). ``nll_loss_nd`` then reaches ``nll_loss`` /
    ``nll_loss2d``, fp32 ops: autocast casts the log-probabilities to a float32 copy, which
    ``NllLossBackward`` saves. So the loss keeps both (1.5× the fp32 logits' bytes), and
    backward holds the fp32 gradient of the copy but never an fp32 one of log_softmax's —
    the sequence an H100 snapshot shows (llama-tiny amp-bf16: NllLossBackward0 524,288,000 B,
    ToCopyBackward0 262,144,000 B, LogSoftmaxBackward0 262,144,000 B).

    Label smoothing and probability targets take other composites
    (``cross_entropy_loss_label_smoothing`` / ``_prob_target``), emulated here as a float32
    cross-entropy (not checked against a GPU). Outside autocast: the composite as it is."""
    if not mode.autocasting:
        return mode.dispatch(func, args, kwargs)
    input_, target = args[0], args[1]
    rest = dict(zip(("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"), args[2:],
                    strict=False))
    rest.update(kwargs)
    if rest.get("label_smoothing", 0.0) or not input_.is_floating_point() or target.is_floating_point():
        return F.cross_entropy(_to_fp32(input_), target, **rest)
    log_probs = F.log_softmax(input_, dim=1 if input_.dim() > 1 else 0, dtype=input_.dtype)
    rest.pop("label_smoothing", None)
    if isinstance(rest.get("weight"), torch.Tensor):
        rest["weight"] = _to_fp32(rest["weight"])
    return F.nll_loss(_to_fp32(log_probs), target, **rest)


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype in _FLOATING_LOW:
        return tensor.float()
    return tensor
