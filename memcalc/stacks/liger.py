"""Liger kernels (``use_liger_kernel=True``, ``--liger``) on a Hugging Face causal LM, modelled
from Liger-Kernel's code (linkedin/Liger-Kernel at ead96b61), not traced: Liger runs on Triton
only, which neither meta tensors nor this CPU machine can run. Each function below does what
Liger's Python does around its Triton kernels — the same ``torch`` allocations, views and
``save_for_backward`` — and leaves out the kernels, which write into tensors already allocated:

* ``ops/fused_linear_cross_entropy.py``: the LM head and the loss fused, the logits made one
  chunk at a time (``inc_factor = cdiv(V, H)``, ``chunk_size = next_power_of_2(cdiv(BT,
  inc_factor))``), the gradients computed in the forward: ``grad_input`` (BT × H),
  ``grad_weight`` (V × H, the weight's dtype), ``loss_1d`` (BT, fp32); per chunk the logits
  (chunk × V), ``grad_logits @ weight`` (chunk × H) and ``mm(grad_logits.t(), x).float()``
  (V × H, twice for a 16-bit weight; in place through ``addmm(out_dtype=float32)`` on CUDA sm80+
  for an fp32 ``grad_weight``). The backward only scales them in place.
* ``ops/rms_norm.py`` (``LigerRMSNorm``, casting mode ``llama``, ``in_place=True``): ``Y`` and
  an fp32 ``RSTD`` per row, saving ``X``; the backward's ``_dW`` is ``(sm_count, H)`` fp32 and
  ``dX`` is written into ``dY``.
* ``ops/swiglu.py`` (``LigerSwiGLUMLP``): ``c = silu(a) * b`` into a new tensor, saving ``a`` and
  ``b``, whose storage the backward overwrites with their gradients.
* ``transformers/model/llama.py``'s ``lce_forward``: in training with labels the logits are
  skipped (``LigerForCausalLMLoss``: labels padded by one and shifted, hidden states flattened).

RoPE (``ops/rope.py``) stays transformers' own: both save only ``cos``/``sin`` for the backward;
their temporaries differ (not modelled). Llama, Mistral, Qwen2 and Qwen3 are patched, as Liger's
``apply_liger_kernel_to_<model>`` patches them (on this instance only, never the class).
"""

from __future__ import annotations

import math
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memcalc.core.errors import InapplicableOptionError
from memcalc.stacks.peft import PEFT_MODEL

__all__ = ("LIGER_MODEL_TYPES", "apply_liger", "flce_chunk_size")

#: The model types memcalc patches as Liger does (RMSNorm, SwiGLU MLP, fused linear cross-entropy).
LIGER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
IGNORE_INDEX = -100


def flce_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk of tokens: ``next_power_of_2(cdiv(BT, cdiv(V, H)))``."""
    inc_factor = -(-vocab // hidden)
    return 1 << max(0, math.ceil(math.log2(-(-tokens // inc_factor))))


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` with reduction mean or sum (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                addmm_out_dtype: bool) -> torch.Tensor:
        tokens, hidden = x.shape
        vocab = weight.shape[0]
        chunk = flce_chunk_size(tokens, hidden, vocab)
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=x.device)
        target_mask = target != IGNORE_INDEX
        target_mask.sum()  # .item(): the count of tokens, a host number
        del target_mask
        for start in range(0, tokens, chunk):
            x_chunk = x[start:start + chunk]
            logits_chunk = (x_chunk @ weight.t()).contiguous()  # the CE kernel writes its gradient in place
            grad_input[start:start + chunk] = logits_chunk @ weight
            if grad_weight is not None:
                if addmm_out_dtype and grad_weight.dtype == torch.float32 and logits_chunk.dtype in (
                        torch.float16, torch.bfloat16):
                    x_cast = x_chunk if x_chunk.dtype == logits_chunk.dtype else x_chunk.to(logits_chunk.dtype)
                    # torch.addmm(grad_weight, grad_logits.t(), x, out_dtype=float32, out=grad_weight): in place
                    del x_cast
                else:
                    grad_weight += torch.mm(logits_chunk.t(), x_chunk).float()
            del logits_chunk
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(grad_input.detach(), None if grad_weight is None else grad_weight.detach())
        return loss

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        grad_input, grad_weight = ctx.saved_tensors  # scaled in place by element_mul_kernel
        return grad_input, grad_weight, None, None


class LigerRMSNormFunction(torch.autograd.Function):
    """``LigerRMSNormFunction`` (casting mode llama, in place)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, sm_count: int) -> torch.Tensor:
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])  # @ensure_contiguous
        y = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
        ctx.sm_count = sm_count
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(*shape)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        dy = grad_outputs[0].contiguous()
        x2, weight, _rstd = ctx.saved_tensors
        partial = torch.empty((ctx.sm_count, x2.shape[1]), dtype=torch.float32, device=weight.device)
        dw = partial.sum(dim=0).to(weight.dtype)
        return dy, dw, None  # dX written into dY


class LigerSiLUMulFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction``: ``silu(a) * b``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        c = torch.empty_like(a)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        grad_outputs[0].contiguous()
        a, b = ctx.saved_tensors
        return a, b  # the kernel overwrites a and b with their gradients


def apply_liger(module: nn.Module, *, sm_count: int, addmm_out_dtype: bool, name: str) -> str:
    """Patch ``module`` (a causal LM, or PEFT's model around one) as ``_apply_liger_kernel_to_instance``
    does, and say so for the report's note.

    Args:
        sm_count: the GPU's multiprocessors (RMSNorm's ``_dW`` rows); 1 on the CPU.
        addmm_out_dtype: CUDA sm80+: ``grad_weight`` accumulates through ``addmm(out_dtype=float32)``.

    Raises:
        InapplicableOptionError: a model Liger's patches are not modelled for.
    """
    policy = module.__dict__.get(PEFT_MODEL, module)
    base: Any = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LIGER_MODEL_TYPES or not hasattr(base, "lm_head") or not hasattr(base, "model"):
        raise InapplicableOptionError(
            f"--liger (use_liger_kernel) is modelled for Hugging Face causal LMs of type "
            f"{', '.join(sorted(LIGER_MODEL_TYPES))}; {name} is {model_type or type(base).__name__}",
            hint="Leave out --liger to estimate the model's own kernels.")
    norms = mlps = 0
    for sub in base.modules():
        kind = type(sub).__name__
        if kind.endswith("RMSNorm") and isinstance(getattr(sub, "weight", None), torch.Tensor):
            sub.forward = MethodType(_rms_norm_forward(sm_count), sub)
            norms += 1
        elif kind.endswith("MLP") and all(hasattr(sub, p) for p in ("gate_proj", "up_proj", "down_proj")):
            sub.forward = MethodType(_swiglu_forward, sub)
            mlps += 1
    base.forward = MethodType(_lce_forward(addmm_out_dtype), base)
    return (f"Liger kernels, modelled from Liger-Kernel's code (not traced: it runs on Triton only): fused linear "
            f"cross-entropy (the logits made {flce_note(base)}), RMSNorm ×{norms}, SwiGLU ×{mlps}; RoPE is "
            f"transformers' own")


def flce_note(base: Any) -> str:
    hidden, vocab = base.config.hidden_size, base.lm_head.weight.shape[0]
    return f"in chunks of next_power_of_2(cdiv(tokens, cdiv({vocab}, {hidden}))) tokens"


def _rms_norm_forward(sm_count: int) -> Any:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return LigerRMSNormFunction.apply(hidden_states, self.weight, sm_count)  # type: ignore[no-untyped-call,no-any-return]
    return forward


def _swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-untyped-call,no-any-return]


def _lce_forward(addmm_out_dtype: bool) -> Any:
    """Liger's ``lce_forward``: the base model, then in training with labels the fused loss (the
    logits skipped), else the LM head and the model's own loss."""

    def forward(self: Any, input_ids: Any = None, attention_mask: Any = None, labels: Any = None,
                logits_to_keep: int = 0, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("num_items_in_batch", None)  # reduction sum then: loss / n, a scalar
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = outputs[0][:, slice(-logits_to_keep, None), :]
        if self.training and labels is not None:
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
            loss = LigerFusedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
                hidden.view(-1, self.config.hidden_size), self.lm_head.weight, shifted.view(-1), addmm_out_dtype)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        logits = self.lm_head(hidden)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    return forward
