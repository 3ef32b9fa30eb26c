"""The global-memory scratch of PyTorch's CUDA reduction kernel: :func:`reduction_scratch`.

``gpu_reduce_kernel`` (``aten/src/ATen/native/cuda/Reduce.cuh``) sizes a launch with
``setReduceConfig``; when the work per output is large and the outputs are few, it splits each
output's inputs over several thread blocks (``ctas_per_output``) and takes two temporaries from
the caching allocator for the blocks to combine their partial results: a staging buffer of
``ReduceConfig::global_memory_size()`` bytes and one ``int`` semaphore per block column
(``semaphore_size()``). Both are freed when the launch returns. No meta kernel shows them.

The case that matters is a bias gradient: ``sum`` over the rows of an ``(N, C)`` gradient (the
columns contiguous) keeps ``C`` outputs, vectorised by 4, and stages
``4 B × C × ctas_per_output × 32 × 4`` — 138,412,032 B for ViT-B/16's ``mlp.0`` bias at batch 32
on an H100, the size a real snapshot shows (tests/test_gpu_snapshots.py).

Applied to estimates by the workspace rules of ``sum``/``mean`` over dimensions and of a
convolution's bias gradient (:mod:`memcalc.targets.cuda.workspaces`). On the H100 data it brings
ViT-B/16 (bf16, batch 32) from -3.2% to -0.3%. Its size (through ``ctas_per_output``) is not
affine in the batch below the size where ``ctas_per_output`` saturates at the grid's cap, and it
is 0 under a work threshold: the rules record both temporaries of every launch (0 B ones too)
with the rule that sized them (:class:`~memcalc.engine.trace.ShapeSized`), and the fit search's
batch-affine families apply that rule to the input's shape at each batch
(:mod:`memcalc.search.affine`).

This is a transcription of ``setReduceConfig`` and ``ReduceConfig`` (torch 2.x), from the
TensorIterator's view of the input: reduced dimensions first (``reorder_dimensions`` moves
them to the front), each group ordered by stride, contiguous neighbours coalesced. Not
modelled: inputs too large for 32-bit indexing (split into sub-iterators), the accumulation
buffer of a non-final sub-iterator, ROCm's configuration, the base address alignment that
``get_output_vec_size`` also checks (assumed aligned, as a fresh allocation is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ("MAX_THREADS_PER_SM", "ReductionScratch", "reduction_scratch")

#: ``ReduceConfig::MAX_NUM_THREADS`` (threads per block before output vectorisation).
MAX_NUM_THREADS = 512
#: ``at::cuda::warp_size()`` on NVIDIA GPUs.
WARP_SIZE = 32
#: ``setReduceConfig``'s bounds on the values one thread reduces.
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
#: ``vt0`` / ``input_vec_size`` defaults of ``gpu_reduce_kernel`` (4), the largest output
#: vector ``get_output_vec_size`` starts from.
VECTOR = 4
#: Max resident threads per SM (``maxThreadsPerMultiProcessor``), CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability" (the same table as the catalogue's
#: context model).
MAX_THREADS_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 7): 2048, (8, 9): 1536, (9, 0): 2048,
}


@dataclass(frozen=True)
class ReductionScratch:
    """The two temporaries of one reduction launch (0 B: no global reduction)."""

    staging: int
    semaphores: int


def _last_pow2(n: int) -> int:
    """``last_pow2``: the largest power of two ≤ n (at least 1)."""
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _iterator_dims(shape: Sequence[int], strides: Sequence[int], reduced: set[int]) -> list[tuple[int, int, bool]]:
    """(size, input stride, reduced) of the TensorIterator's dimensions, fastest first."""
    dims = [(int(shape[d]), int(strides[d]), d in reduced) for d in range(len(shape)) if shape[d] != 1]
    dims.sort(key=lambda d: (not d[2], d[1]))  # reduced dimensions first, each group by stride
    merged: list[tuple[int, int, bool]] = []
    for size, stride, is_reduced in dims:
        if merged and merged[-1][2] == is_reduced and merged[-1][1] * merged[-1][0] == stride:
            last = merged.pop()
            merged.append((last[0] * size, last[1], is_reduced))
        else:
            merged.append((size, stride, is_reduced))
    return merged


def _output_vec_size(dims: list[tuple[int, int, bool]], num_reduce_dims: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the first kept dimension's size and
    every other input stride (in elements)."""
    vec = VECTOR
    values = [dims[num_reduce_dims][0]] + [stride for i, (_, stride, _) in enumerate(dims) if i != num_reduce_dims]
    for value in values:
        while value % vec:
            vec //= 2
    return vec


def reduction_scratch(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int], dtype: torch.dtype,
                      compute_capability: tuple[int, int], sm_count: int) -> ReductionScratch:
    """The global-reduction temporaries of ``gpu_reduce_kernel`` for a sum/mean over ``dims`` of
    a tensor of ``shape`` and ``strides`` (in elements) on a GPU with ``sm_count`` SMs.

    Args:
        shape, strides: the input's.
        dims: the reduced dimensions (empty: all of them).
        dtype: the input's; the accumulator (``arg_t``) is float32, float64 for float64.
        compute_capability: picks the resident threads per SM (the target grid).
        sm_count: ``multiProcessorCount``.

    Returns:
        The staging buffer and semaphore bytes, both 0 when the launch reduces within blocks.
    """
    ndim = len(shape)
    reduced = {d % ndim for d in dims} if dims and ndim else set(range(ndim))
    iterator = _iterator_dims(shape, strides, reduced)
    num_reduce_dims = sum(1 for d in iterator if d[2])
    num_outputs = 1
    for size, _, is_reduced in iterator:
        if not is_reduced:
            num_outputs *= size
    numel = 1
    for size in shape:
        numel *= int(size)
    if numel == 0 or num_reduce_dims == 0:
        return ReductionScratch(0, 0)
    inputs_per_output = numel // num_outputs
    arg_size = 8 if dtype is torch.float64 else 4

    on_fastest = num_reduce_dims == len(iterator) or iterator[0][1] < iterator[num_reduce_dims][1]
    if on_fastest:
        dim0, dim1, fastest_stride = inputs_per_output, num_outputs, iterator[0][1]
    else:
        dim0, dim1, fastest_stride = num_outputs, inputs_per_output, iterator[num_reduce_dims][1]
    output_vec = 1
    if fastest_stride == 1:
        if on_fastest and dim0 > 128 and num_reduce_dims == 1:
            dim0 //= VECTOR  # vectorize_input
        elif not on_fastest:
            output_vec = _output_vec_size(iterator, num_reduce_dims)
            dim0 //= output_vec

    # set_block_dimension
    max_threads = MAX_NUM_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height

    step_input = step_output = 1
    block_x_reduce = on_fastest
    if on_fastest:
        step_input *= block_width
    else:
        step_output *= block_width
    warp_split_threshold = min(block_height * 16, MAX_VALUES_PER_THREAD)
    split_over_warps = _div_up(inputs_per_output, step_input) >= warp_split_threshold
    if split_over_warps:
        step_input *= block_height
    else:
        step_output *= block_height

    blocks_per_sm = MAX_THREADS_PER_SM.get((compute_capability[0], compute_capability[1]), 2048) // num_threads
    target_grid_size = sm_count * blocks_per_sm
    grid_x = _div_up(num_outputs // output_vec, step_output)
    values_per_thread = _div_up(inputs_per_output, step_input)
    if not (split_over_warps and values_per_thread >= MAX_VALUES_PER_THREAD and grid_x <= target_grid_size):
        return ReductionScratch(0, 0)
    ctas_per_output = max(min(_div_up(target_grid_size, grid_x), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
                          _div_up(values_per_thread, MAX_VALUES_PER_THREAD))
    if ctas_per_output <= 1:
        return ReductionScratch(0, 0)
    staging = arg_size * num_outputs * ctas_per_output
    if not block_x_reduce:
        staging *= block_width * output_vec
    return ReductionScratch(staging=staging, semaphores=4 * grid_x)  # sizeof(int) per block column
