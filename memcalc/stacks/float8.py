"""Float8 training with torchao: its own ``convert_to_float8_training`` applied to the meta
model, so that what the step casts, saves and multiplies is torchao's code, traced op by op.

What the trace then shows (torchao 0.18, ``torchao/float8/float8_linear.py``,
``matmul_with_hp_or_float8_args``): the forward saves the high-precision input and a view of
the weight (``ctx.save_for_backward(input_hp, weight_hp_t)``) — no float8 tensor outlives the
forward — and casts both operands to float8 each time a matmul needs them: input and weight in
the forward, grad_output, weight and input again in the backward. Each cast
(``float8_scaling_utils.hp_tensor_to_float8_dynamic``) computes ``abs``/``max`` (an amax per
tensor, or per row for ``rowwise``), a float32 scale, then ``x.to(float32) * scale``, ``clamp``
and ``.to(float8)``: eager PyTorch runs those as separate kernels, so a float32 copy of each
operand is alive for a moment (``torch.compile`` fuses them). ``torch._scaled_mm`` has a meta
kernel in torch; it runs inside ``Float8TrainingTensor.__torch_dispatch__``, which the tracer
lets run first (:attr:`~memcalc.engine.trace.StorageTracer.defer_to`) so that the copies it makes
(a column-major operand made row-major) are seen too. ``force_recompute_fp8_weight_in_bwd`` is
deprecated in torchao 0.18 and changes nothing: the weight is always re-cast in the backward.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from torch import nn

from memcalc.core.errors import InvalidInputError, MissingPackageError
from memcalc.core.float8 import Float8
from memcalc.engine.model import ResolvedModel
from memcalc.stacks.transformers.hub import quiet_optional_kernels

__all__ = ("FLOAT8_EXTRA_HINT", "apply_float8", "float8_module")

#: What to install (the ``float8`` extra of pyproject.toml).
FLOAT8_EXTRA_HINT = "pip install 'memcalc[float8]' (or pip install torchao)"
#: ``torch._scaled_mm`` needs both dimensions of a weight divisible by 16 (its meta kernel checks it).
_ALIGN = 16
#: How many skipped layers a note names.
_SHOWN = 4


@contextmanager
def _quiet() -> Iterator[None]:
    """torchao warns (``warnings``) of its deprecated options, ``force_recompute_fp8_weight_in_bwd``
    among them, which the report's note covers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _torchao_float8() -> ModuleType:
    quiet_optional_kernels()
    try:
        with _quiet():
            return importlib.import_module("torchao.float8")
    except ImportError as exc:
        error = MissingPackageError("torchao", "float8 training (float8, --float8)")
        error.hint = f"Install it with: {FLOAT8_EXTRA_HINT}"
        raise error from exc


def float8_module(module: nn.Module, float8: Float8) -> tuple[nn.Module, list[str], type[Any]]:
    """Convert ``module``'s ``nn.Linear`` layers in place with torchao's
    ``convert_to_float8_training`` (every layer whose dimensions ``torch._scaled_mm`` takes).

    Returns:
        The module (a new one when ``module`` is itself a Linear), the report's notes, and
        torchao's ``Float8TrainingTensor`` (the wrapper the tracer defers to).

    Raises:
        MissingPackageError: torchao is not installed.
        InvalidInputError: no layer can be converted.
    """
    ao = _torchao_float8()
    config = float8.config if float8.config is not None else ao.Float8LinearConfig.from_recipe_name(float8.recipe)
    if float8.all_gather and not config.enable_fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    skipped: list[str] = []

    def eligible(layer: nn.Module, fqn: str) -> bool:
        if not isinstance(layer, nn.Linear):
            return False
        if layer.in_features % _ALIGN or layer.out_features % _ALIGN:
            skipped.append(f"{fqn} ({layer.in_features}→{layer.out_features})")
            return False
        return True

    linears = sum(isinstance(m, nn.Linear) for m in module.modules())
    with _quiet():  # force_recompute_fp8_weight_in_bwd warns of its deprecation
        module = ao.convert_to_float8_training(module, module_filter_fn=eligible, config=config)
    converted = linears - len(skipped)
    if converted == 0:
        raise InvalidInputError(
            f"float8 training converts nn.Linear layers whose dimensions are multiples of {_ALIGN} "
            f"(torch._scaled_mm's rule); this model has {linears} nn.Linear layers and none qualifies",
            hint="Leave out --float8 for this model.")
    wrapper: type[Any] = importlib.import_module("torchao.float8.float8_training_tensor").Float8TrainingTensor
    version = getattr(importlib.import_module("torchao"), "__version__", "?")
    note = (f"float8 training (torchao {version} convert_to_float8_training, {float8.label}): {converted} of "
            f"{linears} nn.Linear layers run torch._scaled_mm on float8 casts of their input, weight and "
            f"grad_output; they save their bf16 input for backward and re-cast it there. The casts run eager "
            f"(a float32 copy of each operand for a moment), as torchao's code does without torch.compile")
    notes = [note]
    if float8.fsdp_all_gather:
        notes.append("float8 all-gather (enable_fsdp_float8_all_gather): under FSDP2 the converted weights are "
                     "torchao's WeightWithDynamicFloat8CastTensor; its fsdp_pre_all_gather casts each shard to float8 "
                     "(the amax all-reduced), FSDP2 all-gathers 1 byte per element, and fsdp_post_all_gather makes the "
                     "unsharded weight a Float8TrainingTensor that forward and backward use without casting it again. "
                     "The scales are computed at each all-gather (precompute_float8_dynamic_scale_for_fsdp, a few "
                     "scalars after the optimizer step, is not modelled)")
    if skipped:
        more = f" and {len(skipped) - _SHOWN} more" if len(skipped) > _SHOWN else ""
        notes.append(f"float8: {len(skipped)} nn.Linear layers stay in high precision (a dimension not a multiple "
                     f"of {_ALIGN}): {', '.join(skipped[:_SHOWN])}{more}")
    return module, notes, wrapper


def apply_float8(resolved: ResolvedModel, float8: Float8 | None) -> ResolvedModel:
    """``resolved`` with its Linear layers converted by torchao (in place on its meta module), the
    notes added and torchao's float8 tensor among the wrappers the tracer defers to; as it is when
    ``float8`` is None."""
    if float8 is None:
        return resolved
    module, notes, wrapper = float8_module(resolved.module, float8)
    return dataclasses.replace(resolved, module=module, notes=(*resolved.notes, *notes),
                               defer_to=(*resolved.defer_to, wrapper))
