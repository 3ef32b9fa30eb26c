"""``aten._grouped_mm`` on meta as the real kernels run it: every floating dtype, a padded output.

Mixture-of-experts models in transformers run their experts with one grouped GEMM per projection
(``integrations/moe.py`` ``grouped_mm_experts_forward``, the default ``experts_implementation``),
which calls ``torch.nn.functional.grouped_mm`` → ``aten._grouped_mm``. torch 2.13's meta kernel
(``torch/_meta_registrations.py`` ``_meta_grouped_mm_common``) still refuses anything but
bfloat16 ("Expected inputs of BF16 type"), while the kernels it stands for accept every floating
dtype:

- CUDA, ``_grouped_mm_cuda`` (``aten/src/ATen/native/cuda/GroupedBlas.cpp``): the CUTLASS kernel
  ``bf16bf16_grouped_mm`` when A, B and the output are bfloat16 on sm90/sm100, else
  ``_grouped_mm_fallback`` (``aten/src/ATen/native/GroupedMMUtils.h``: one ``mm_out`` per group
  into slices of the output, nothing else allocated on the device);
- CPU, ``_grouped_mm`` (``CompositeExplicitAutograd``): ``_grouped_mm_fallback`` always.

Autocast does not change that: ``_grouped_mm`` is in none of CUDA's or the CPU's autocast lists
(``aten/src/ATen/autocast_mode.cpp``; no ``AutocastCUDA``/``AutocastCPU`` kernel in the 2.13
dispatcher, :mod:`memcalc.targets.autocast`), so under ``amp-bf16`` with float32 weights it
runs in float32 (transformers casts the input to the weights' dtype first: pytorch#174763).

Both kernels allocate their output with ``create_grouped_gemm_output_tensor``
(``GroupedMMUtils.h``): outside ROCm the last dimension's stride is rounded up to 16 bytes
(for TMA), on the CPU too (checked on this torch: ``(10, 6)`` bf16 comes out with strides
``(8, 1)``). torch's meta mirror pads only where ``torch.version.cuda`` is set, so its CPU-only
build sizes that output unpadded. :func:`grouped_mm_on_meta` puts a meta kernel in place that
sizes it as the real kernels do, for the traced step only.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ("GROUPED_MM_ALIGNMENT_BYTES", "grouped_mm_on_meta", "grouped_mm_output")

#: ``create_grouped_gemm_output_tensor``: the output's row stride is a multiple of 16 bytes.
GROUPED_MM_ALIGNMENT_BYTES = 16


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output ``_grouped_mm`` allocates for these arguments (on their device), as
    ``create_grouped_gemm_output_tensor`` sizes it; A and B must share one floating dtype, as
    ``_grouped_mm_validate_inputs`` requires."""
    if mat_a.dtype != mat_b.dtype or not mat_a.is_floating_point():
        raise RuntimeError(f"_grouped_mm: expected A and B of one floating dtype, got {mat_a.dtype} and {mat_b.dtype}")
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        raise RuntimeError("_grouped_mm: A and B must be 2-D or 3-D")
    if (mat_a.dim() == 2 or mat_b.dim() == 2) and offs is None:
        raise RuntimeError("_grouped_mm: a 2-D operand needs offs")
    groups = offs.size(0) if offs is not None else 0
    if mat_a.dim() == 2:
        size = [groups, mat_a.size(0), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    alignment = GROUPED_MM_ALIGNMENT_BYTES // dtype.itemsize
    row = -(-size[-1] // alignment) * alignment
    stride = [size[1] * row, row, 1] if len(size) == 3 else [row, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


#: The key ``torch.library`` keeps for a Python kernel of ``aten._grouped_mm`` on Meta: torch's own
#: ``_meta_registrations`` holds it.
_META_KEY = "aten/_grouped_mm/Meta"


@contextmanager
def grouped_mm_on_meta() -> Iterator[None]:
    """While active, ``aten._grouped_mm``'s meta kernel is :func:`grouped_mm_output` (module
    docstring); torch's own is back on exit.

    torch's meta kernel is itself registered from Python, and ``torch.library`` refuses a second
    one unless told it overrides: torch 2.13 takes ``allow_override`` (and defaults it to True);
    torch 2.11 has no such keyword and refuses ("there's already a kernel registered from python"),
    so there the key is lifted from ``torch.library._impls`` for the registration. The dispatcher
    itself stacks kernels: removing ours (``_destroy``) puts torch's back, and its key is restored."""
    impls: set[str] = torch.library._impls  # private: the registered keys
    held = _META_KEY in impls
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # untyped in torch
    try:
        if "allow_override" in inspect.signature(library.impl).parameters:
            library.impl("_grouped_mm", grouped_mm_output, "Meta", allow_override=True)  # type: ignore[no-untyped-call]
        else:
            impls.discard(_META_KEY)
            library.impl("_grouped_mm", grouped_mm_output, "Meta")  # type: ignore[no-untyped-call]
        yield
    finally:
        library._destroy()  # type: ignore[no-untyped-call]  # untyped in torch: removes the kernel
        # the library's finalizer takes its keys from _impls once more when it is collected
        library._op_impls.clear()
        if held:
            impls.add(_META_KEY)
