"""bitsandbytes' 8-bit and paged AdamW, emulated on meta tensors without importing bitsandbytes,
and registered as memcalc's ``adamw-8bit``, ``paged-adamw-8bit`` and ``paged-adamw-32bit``
(:func:`memcalc.engine.optimizers.register_optimizer`, as any package adds an optimizer).

What is emulated is what bitsandbytes allocates, and where (bitsandbytes 0.50.2.dev0): 8-bit
state is ``2n + 8·ceil(n/256)`` B for a parameter of ``n ≥ 4096`` elements, plus two 256-entry
float32 qmaps per optimizer; 32-bit state (and 8-bit below 4096 elements) ``8n`` B. A paged
optimizer's state buffers of ``1e5`` elements or more are CUDA unified memory
(``cudaMallocManaged``), outside the caching allocator: memcalc reports them apart
(``MemoryReport.paged_optimizer_state``) and leaves them out of the peak.

The update kernels are ``memcalc::`` operators with bitsandbytes' schemas, so that the tracer
sees one kernel per parameter, as bitsandbytes launches, and a rule in
:data:`memcalc.engine.kernel_ops.KERNEL_COSTS` gives the step-time roofline the bytes it moves.
On meta tensors they do nothing and allocate nothing; on real tensors (a ``--measure`` run on
the CPU) they rewrite ``p`` and the states in place with arithmetic that is not bitsandbytes' —
only what is allocated, and when, is modelled, and what each kernel reads and writes.

Read from the source, function by function: docs/notes/bitsandbytes-adamw.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memcalc.core.loop import OptimizerImpl
from memcalc.core.throughput import OpClass
from memcalc.engine.kernel_ops import KERNEL_COSTS, KernelCost, define_kernels, device_bytes
from memcalc.engine.optimizers import FUSED_ONLY, Optimizer, OptimizerSpec, register_optimizer

__all__ = ("BLOCKSIZE", "MIN_8BIT_SIZE", "PAGED_MIN_NUMEL", "QMAP_ENTRIES", "UPDATE_KERNELS", "BnbAdamW",
           "EmulatedBnbAdamW", "eight_bit_state_bytes")

#: ``Optimizer2State.init_state``: ``blocksize = 256`` for the block-wise absmax of 8-bit states.
BLOCKSIZE = 256
#: ``Optimizer2State.__init__``: ``min_8bit_size=4096``; smaller parameters keep 32-bit states.
MIN_8BIT_SIZE = 4096
#: ``Optimizer8bit.get_state_buffer``: ``p.numel() < 1e5`` is never paged.
PAGED_MIN_NUMEL = 100_000
#: ``functional.create_dynamic_map``: ``2**total_bits`` entries (256 float32) per quantization map.
QMAP_ENTRIES = 256


#: bitsandbytes' update operators (``bitsandbytes/_ops.py``), as ``memcalc::`` operators. Kept:
#: the tensors and the arguments of AdamW; left out: AdEMAMix's ``beta3`` / ``alpha``,
#: ``unorm_vec`` / ``max_unorm`` / ``param_norm`` (None and 0 for AdamW), ``gnorm_scale`` and
#: ``skip_zeros``, which change no byte moved. ``g`` and the qmaps are read only here (bitsandbytes
#: marks them mutable; its kernels only load them).
UPDATE_KERNELS = (
    "optimizer_update_8bit_blockwise(str optimizer_name, Tensor g, Tensor(a0!) p, Tensor(a1!) state1, "
    "Tensor(a2!)? state2, float beta1, float beta2, float eps, int step, float lr, Tensor qmap1, Tensor? qmap2, "
    "Tensor(a3!) absmax1, Tensor(a4!)? absmax2, float weight_decay) -> ()",
    "optimizer_update_32bit(str optimizer_name, Tensor g, Tensor(a0!) p, Tensor(a1!) state1, Tensor(a2!)? state2, "
    "float beta1, float beta2, float eps, float weight_decay, int step, float lr) -> ()",
)
def _update_8bit_blockwise(optimizer_name: str, g: torch.Tensor, p: torch.Tensor, state1: torch.Tensor,
                           state2: torch.Tensor | None, beta1: float, beta2: float, eps: float, step: int, lr: float,
                           qmap1: torch.Tensor, qmap2: torch.Tensor | None, absmax1: torch.Tensor,
                           absmax2: torch.Tensor | None, weight_decay: float) -> None:
    """On real tensors: ``p`` and the states rewritten in place, nothing allocated (not
    bitsandbytes' values)."""
    _rewrite(p, g, (state1, state2, absmax1, absmax2), lr=lr, weight_decay=weight_decay)


def _update_32bit(optimizer_name: str, g: torch.Tensor, p: torch.Tensor, state1: torch.Tensor,
                  state2: torch.Tensor | None, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  lr: float) -> None:
    """On real tensors: as :func:`_update_8bit_blockwise`."""
    _rewrite(p, g, (state1, state2), lr=lr, weight_decay=weight_decay)


def _rewrite(p: torch.Tensor, g: torch.Tensor, states: Iterable[torch.Tensor | None], *, lr: float,
             weight_decay: float) -> None:
    """The emulation's stand-in arithmetic: in place, so it allocates what the kernel does (nothing)."""
    p.mul_(1.0 - lr * weight_decay).add_(g, alpha=-lr)
    for tensor in states:
        if tensor is not None:
            tensor.zero_()


# on meta the update is in place and allocates nothing; on real tensors, the stand-in above
_ops = define_kernels(UPDATE_KERNELS, {"optimizer_update_8bit_blockwise": _update_8bit_blockwise,
                                       "optimizer_update_32bit": _update_32bit})


@KERNEL_COSTS.register(_ops.optimizer_update_8bit_blockwise.default)
def _update_8bit_blockwise_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kOptimizerStatic8bit2StateBlockwise`` (csrc/kernels.cu): loads ``g``, ``state1``,
    ``state2``, each block's ``absmax1`` / ``absmax2`` and ``p``, and the two 256-entry qmaps
    into shared memory (each read once here: later blocks find them in L2); stores ``p``, the
    requantized states and their new absmax."""
    _name, g, p, state1, state2, *_hyper, qmap1, qmap2, absmax1, absmax2, _weight_decay = args
    return KernelCost(OpClass.MEMORY, device_bytes(g, p, state1, state2, qmap1, qmap2, absmax1, absmax2),
                      device_bytes(p, state1, state2, absmax1, absmax2))


@KERNEL_COSTS.register(_ops.optimizer_update_32bit.default)
def _update_32bit_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kOptimizer32bit2State`` (csrc/kernels.cu): loads ``g``, ``state1``, ``state2`` and
    ``p``, stores ``p`` and both states."""
    _name, g, p, state1, state2, *_rest = args
    return KernelCost(OpClass.MEMORY, device_bytes(g, p, state1, state2), device_bytes(p, state1, state2))


def eight_bit_state_bytes(numel: int) -> int:
    """Bytes of one parameter's 8-bit AdamW state (n ≥ 4096): two uint8 moments of n bytes and
    two float32 absmax vectors of ceil(n / 256) entries (the shared qmaps not included)."""
    return 2 * numel + 2 * 4 * math.ceil(numel / BLOCKSIZE)


class EmulatedBnbAdamW(torch.optim.Optimizer):
    """``bnb.optim.AdamW8bit`` / ``PagedAdamW8bit`` / ``PagedAdamW32bit`` as they allocate
    (see the module docstring). The learning-rate and beta hyper-parameters only fill the
    param groups, as bitsandbytes' defaults do."""

    def __init__(self, params: Iterable[torch.Tensor], *, optim_bits: int, paged: bool, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits is 8 or 32, got {optim_bits}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.optim_bits = optim_bits
        self.paged = paged
        self.min_8bit_size = min_8bit_size
        self.name2qmap: dict[str, torch.Tensor] = {}
        if optim_bits == 8:
            # fill_qmap(): made on the host by create_dynamic_map (values irrelevant here)
            self.name2qmap = {name: torch.zeros(QMAP_ENTRIES, dtype=torch.float32) for name in ("dynamic", "udynamic")}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """``Optimizer8bit.step``: for each parameter with a gradient, its state at the first
        step, then its in-place update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                self._update(group, p, state)
        return loss

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """``Optimizer2State.init_state``."""
        eight_bit = self.optim_bits == 8 and p.numel() >= self.min_8bit_size
        state["step"] = 0
        if not eight_bit:
            state["state1"] = self._state_buffer(p, torch.float32)
            state["state2"] = self._state_buffer(p, torch.float32)
            return
        for name in ("dynamic", "udynamic"):
            self.name2qmap[name] = self.name2qmap[name].to(p.device)
        blocks = math.ceil(p.numel() / BLOCKSIZE)
        state["state1"] = self._state_buffer(p, torch.uint8)
        state["qmap1"] = self.name2qmap["dynamic"]
        state["state2"] = self._state_buffer(p, torch.uint8)
        state["qmap2"] = self.name2qmap["udynamic"]
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    def _state_buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``Optimizer8bit.get_state_buffer``: a parameter-shaped buffer, in unified memory when
        paged and large enough (the CPU fallback, "Paged optimizers are not supported on CPU",
        is the memcalc CPU target's business: it does not count paged buffers apart)."""
        buffer = torch.zeros_like(p, dtype=dtype)
        if self.paged and p.device.type != "cpu" and p.numel() >= PAGED_MIN_NUMEL:
            buffer.is_paged = True  # type: ignore[attr-defined]  # as F.get_paged marks its tensors (engine.run reads it)
        return buffer

    def _update(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """``Optimizer2State.update_step``: contiguous parameter and gradient, then one kernel
        (``F.optimizer_update_8bit_blockwise`` for uint8 states, else ``F.optimizer_update_32bit``)."""
        p.data = p.data.contiguous()
        assert p.grad is not None
        p.grad = p.grad.contiguous()
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        if "absmax1" in state:
            _ops.optimizer_update_8bit_blockwise("adam", p.grad, p, state["state1"], state["state2"], beta1, beta2,
                                                 eps, state["step"], lr, state["qmap1"], state["qmap2"],
                                                 state["absmax1"], state["absmax2"], weight_decay)
        else:
            _ops.optimizer_update_32bit("adam", p.grad, p, state["state1"], state["state2"], beta1, beta2, eps,
                                        weight_decay, state["step"], lr)


@dataclass(frozen=True)
class BnbAdamW:
    """The factory of one emulated bitsandbytes AdamW: ``(params, impl)`` → the optimizer.
    bitsandbytes has one implementation (its own fused kernel per parameter), so ``impl`` is
    always :attr:`OptimizerImpl.FUSED` here."""

    optim_bits: int
    paged: bool

    def __call__(self, params: Iterable[torch.Tensor], impl: OptimizerImpl) -> torch.optim.Optimizer:
        if impl is not OptimizerImpl.FUSED:
            raise ValueError(f"bitsandbytes' optimizers run their own fused kernel, not {impl.value}")
        return EmulatedBnbAdamW(params, optim_bits=self.optim_bits, paged=self.paged)


def _one_byte_moments(p: torch.Tensor) -> int:
    """Two 1-byte moments per element (8-bit Adam's rule of thumb)."""
    return 2 * p.numel()


def _spec(key: Optimizer, display: str, optim_bits: int, paged: bool, terms: str,
          textbook_state: Callable[[torch.Tensor], int] | None) -> OptimizerSpec:
    return OptimizerSpec(key, display, BnbAdamW(optim_bits, paged), 2, terms, impls=FUSED_ONLY,
                         auto_cuda=OptimizerImpl.FUSED, auto_cpu=OptimizerImpl.FUSED, textbook_state=textbook_state,
                         only_impl="bitsandbytes runs its own fused kernel per parameter")


for _registered in (
    _spec(Optimizer.ADAMW_8BIT, "AdamW 8-bit (bitsandbytes)", 8, False,
          "weights + grads + 2 × 1-byte moments", _one_byte_moments),
    _spec(Optimizer.PAGED_ADAMW_8BIT, "paged AdamW 8-bit (bitsandbytes)", 8, True,
          "weights + grads; the 2 × 1-byte moments are paged: unified memory, not in the peak", None),
    _spec(Optimizer.PAGED_ADAMW_32BIT, "paged AdamW 32-bit (bitsandbytes)", 32, True,
          "weights + grads; the 2 fp32 moments are paged: unified memory, not in the peak", None),
):
    register_optimizer(_registered)
