"""What oneDNN allocates on the CPU, the sizes the CPU target's rules
(:mod:`memcalc.targets.cpu.kernels`) add to the ops that run it: for one LSTM layer, its
workspace, its scratchpad and the weight copies ideep makes (``mkldnn_rnn_layer``); for a
bfloat16 GEMM, the matmul primitive's scratchpad (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``
and ``addmv`` in bfloat16). Both transcribe oneDNN v3.12, the version torch 2.13 bundles, and
were checked byte for byte against the CPU profiler.

**LSTM.** PyTorch runs ``nn.LSTM`` on the CPU one layer and direction at a time
(``mkldnn_rnn_layer``, ``aten/src/ATen/native/mkldnn/RNN.cpp``); in training oneDNN's
reference (GEMM-based) RNN runs it — its BRGEMM version refuses float32 training
(``ref_rnn.cpp`` ``init_brgemm``) — whatever the x86-64 ISA. Transcribed from
``src/cpu/rnn/rnn_utils.{hpp,cpp}`` (``get_good_ld``, ``set_workspace_sizes``, ``set_offsets``),
``ref_rnn.cpp`` (``init_scratchpad``) and ``src/common/memory_tracking.hpp``
(``registry_t::book``), for float32 and one layer, one direction (``n_layer = n_dir = 1``).

**bfloat16 matmul.** With oneDNN enabled on a CPU that ``mkldnn_bf16_device_check`` accepts,
PyTorch runs a bfloat16 GEMM larger than 16·16·16 multiply-adds through oneDNN's matmul primitive
(``aten/src/ATen/native/mkldnn/Matmul.cpp``), and ideep books the primitive's scratchpad in the
CPU allocator for the call: per thread the brgemm batch, a VNNI copy of a block of B, a float32
accumulator block and, for a transposed A, a copy of a block of A. Transcribed from
``src/cpu/x64/matmul/brgemm_matmul_utils.cpp`` (``init_brgemm_matmul_conf``,
``compute_blocking_heuristic_avx512``, ``init_aux_values``, ``init_scratchpad``),
``brgemm_types.hpp`` and ``registry_t::book``, for ``brg_matmul:avx512_core_bf16``, the
implementation of AVX512-BF16 CPUs without AMX (:func:`onednn_bf16_matmul_isa` tells which one
a CPU runs); checked on 1 to 8 threads, plain and transposed A, one row or one column, K split
over threads, ``bmm``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

__all__ = (
    "LSTM_GATES",
    "ONEDNN_BF16_MATMUL_ISA",
    "lstm_scratchpad_bytes",
    "lstm_weight_reorder_bytes",
    "lstm_workspace_bytes",
    "onednn_bf16_matmul_isa",
    "onednn_bf16_matmul_scratchpad",
)

#: float32: the LSTM's data, the matmul's accumulator (acc_dt f32).
_F32_BYTES = 4
#: registry_t::book (common/memory_tracking.hpp): each booking takes its size plus max(its
#: alignment, 128) bytes.
_BOOKING_PAD = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(value: int, multiple: int) -> int:
    return _cdiv(value, multiple) * multiple


# ---- LSTM (mkldnn_rnn_layer) ---------------------------------------------------------------
#: Gates of an LSTM cell, and its bias gates (RNN.cpp RNNParams: num_gates, num_bias_gates).
LSTM_GATES = 4
#: rnn_utils::set_offsets: every workspace and scratchpad part starts on a page.
_PAGE = 4096
#: get_good_ld: leading dimensions rounded up to 64 bytes, plus 64 more bytes when the result
#: is a multiple of 256 elements (against 4K aliasing).
_LD_ALIGN = 64
_LD_ALIASING = 256
#: The RNN space is booked with a 4096-byte alignment (ref_rnn.cpp init_scratchpad).
_RNN_SPACE_ALIGNMENT = 4096
#: init_scratchpad's pointer arrays for one layer and direction: ptrs_wei_layer, _iter and
#: _projection (one float* each) and ptrs_bia (ptr_wei_sz × bias size = 4 void* for float32).
_POINTER_BOOKINGS = 3 * (8 + _BOOKING_PAD) + (4 * 8 + _BOOKING_PAD)
#: init_conf's merge_gemm_layer: the forward merges the layer GEMM over all steps (and keeps
#: every step's gates in its scratchpad) below this mini-batch; the backward always does.
_MERGE_GEMM_MAX_BATCH = 128


def _good_ld(dim: int, itemsize: int = _F32_BYTES) -> int:
    """rnn_utils::get_good_ld."""
    ld = _round_up(dim, _LD_ALIGN // itemsize)
    return ld + _LD_ALIGN // itemsize if ld % _LD_ALIASING == 0 else ld


def _paged(parts: Sequence[int]) -> int:
    """set_offsets' ``register_space``: each part starts on a page; the registration after
    the last one (an empty part) rounds the end up too."""
    offset = 0
    for size in parts:
        offset = _round_up(offset, _PAGE) + size
    return _round_up(offset, _PAGE)


def lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int) -> int:
    """The workspace of one float32 LSTM layer in training, which its backward reads: the
    gates and ht of every step, the states and c-states of every step and their gradients
    (``ws_states_iter`` shares the states' space), each part on its own pages."""
    gates = steps * batch * _good_ld(LSTM_GATES * hidden) * _F32_BYTES
    ht = steps * batch * _good_ld(hidden) * _F32_BYTES
    rows = 2 * (steps + 1) * batch  # (n_layer + 1) × (n_iter + 1) × mb
    states = rows * _good_ld(max(input_size, hidden)) * _F32_BYTES
    c_states = rows * hidden * _F32_BYTES  # ws_states_iter_c_ld = dhc: not a GEMM operand
    # gates, ht, states_layer, states_iter_c, diff_states_layer, diff_states_iter, diff_states_iter_c
    return _paged([gates, ht, states, c_states, states, states, c_states])


def lstm_scratchpad_bytes(steps: int, batch: int, hidden: int, *, forward: bool) -> int:
    """The scratchpad of one float32 LSTM layer's training forward or backward: the gates (of
    every step when the layer GEMM is merged, else of one), one ht and one diff-ht row block,
    page by page, then the registry's bookings."""
    merged = not forward or batch < _MERGE_GEMM_MAX_BATCH
    gates = (steps if merged else 1) * batch * _good_ld(LSTM_GATES * hidden) * _F32_BYTES
    row = batch * _good_ld(hidden) * _F32_BYTES
    return _paged([gates, row, row]) + _RNN_SPACE_ALIGNMENT + _POINTER_BOOKINGS


def _reorder(sizes: tuple[int, int, int], user: tuple[int, int, int], wanted: tuple[int, int, int],
             nbytes: int) -> int:
    """A weight copy into oneDNN's layout, unless both layouts agree on every dimension longer
    than 1 (a length-1 dimension's stride does not matter)."""
    same = all(u == w for size, u, w in zip(sizes, user, wanted, strict=True) if size > 1)
    return 0 if same else nbytes


def lstm_weight_reorder_bytes(input_size: int, hidden: int, *, forward: bool) -> int:
    """The weight copies ideep makes inside one float32 LSTM layer. PyTorch's weights are
    dense ldgoi; the forward wants ldigo with a good leading dimension on the gates, the
    backward ldgoi with one on the inputs, and fills the weight gradients in ldigo first."""
    gates = LSTM_GATES * hidden
    total = 0
    for rows in (input_size, hidden):  # weights_layer, weights_iter: (i, g, o) = (rows, 4, hidden)
        sizes = (rows, LSTM_GATES, hidden)
        user = (1, hidden * rows, rows)
        if forward:
            ld = _good_ld(gates)
            total += _reorder(sizes, user, (ld, hidden, 1), rows * ld * _F32_BYTES)
        else:
            ld = _good_ld(rows)
            total += _reorder(sizes, user, (1, hidden * ld, ld), gates * ld * _F32_BYTES)
            total += rows * _good_ld(gates) * _F32_BYTES  # the weight gradient in oneDNN's layout
    return total


# ---- bfloat16 matmul (brg_matmul) ---------------------------------------------------------
#: oneDNN's ISA whose bf16 matmul the scratchpad formula follows (cpu_isa_traits.hpp).
ONEDNN_BF16_MATMUL_ISA = "avx512_core_bf16"
#: The variables that cap oneDNN's ISA (dnnl_set_max_cpu_isa's environment twin).
_ONEDNN_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: Caps (``dnnl_cpu_isa_t`` names, as the variables take them) that leave AMX allowed: the ISA is
#: the CPU's own. ``ALL`` and ``DEFAULT`` cap nothing.
_CAPS_WITH_AMX = frozenset({"ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
                            "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2"})
#: Caps that allow avx512_core_bf16 but not AMX (``AVX512_CORE_FP16`` is ``AVX10_1_512``).
_CAPS_AT_AVX512_CORE_BF16 = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2_512"})
#: cpu_isa_traits.hpp ``mayiuse``: avx512_core_vnni plus AVX512-BF16; AMX adds amx_int8/amx_bf16
#: (and avx512_core_fp16); avx2_vnni_2 is avx2_vnni plus AVX-VNNI-INT8 and AVX-NE-CONVERT.
_AVX512_CORE_BF16_FLAGS = ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni", "avx512_bf16")
_AMX_BF16_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
_AVX2_VNNI_2_FLAGS = ("avx2", "avx_vnni", "avx_vnni_int8", "avx_ne_convert")
_BF16_BYTES = 2
#: init_scratchpad: per thread 16·brgemm_batch_size brgemm_batch_element_t (brgemm_types.hpp:
#: A and B pointers, vvpad top and bottom, has_s8s8_comp_batch_pad, 8 bytes each).
_BATCH_ELEMENTS_PER_THREAD = 16
_BATCH_ELEMENT_BYTES = 40
#: get_default_n_block: B in blocks of 64 columns without AMX (its VNNI copy's LDB).
_N_BLOCK = 64
#: get_wei_k_blk: 16 rows × bf16's VNNI granularity 2.
_WEI_K_BLOCK = 32
#: get_actual_lda: a copied A row padded to a cache line (32 bf16), one more past 512 when a
#: power of 2.
_LDA_ALIGN = 32
_LDA_BIG = 512
#: compute_blocking_heuristic_avx512: M blocks from 256 down to 32 (16 when there are fewer N
#: blocks than threads), K blocks of 512 (1024 past 1024 for a plain A), up to 16 N chunks when
#: A is copied, up to 4 threads along a power-of-2 K of 2048 or more for a transposed A.
_M_BLOCK_MAX = 256
_M_BLOCK_MIN = 32
_M_BLOCK_MIN_LOW_PARALLEL = 16
_K_BLOCK = 512
_K_BLOCK_EXTENDED = 1024
_N_CHUNKS_COPIED_A = 16
_K_THREADS_MAX = 4
_K_SPLIT_MIN = 2048
#: compute_blocking_heuristic: prefer_copy_a for bf16 when M ≥ 1024 and lda_big_pow2 (a plain
#: A whose K is a power of 2 of at least 8192 bytes).
_COPY_A_MIN_M = 1024
_BIG_LDA_BYTES = 8192


def onednn_bf16_matmul_isa(flags: Mapping[str, object], environ: Mapping[str, str]) -> str:
    """The ISA oneDNN's matmul runs a bfloat16 GEMM with: the first of its bf16 ISAs
    (``check_isa_with_datatype``: avx512_core_amx, avx512_core_bf16, avx2_vnni_2) the CPU's
    ``flags`` (``torch._C._cpu._get_cpu_capability()``) allow; "" for none of them (oneDNN then
    runs another implementation). Where ``environ`` caps the ISA: the CPU's own under a cap that
    allows AMX, avx512_core_bf16 under a cap at that level (AMX excluded: ``ONEDNN_MAX_CPU_ISA=
    AVX512_CORE_BF16`` on an AMX CPU, checked by ``ONEDNN_VERBOSE``: ``brg_matmul:avx512_core_bf16``)
    where the CPU has it; under any other cap, the cap's setting (an ISA not followed)."""
    for variable in _ONEDNN_ISA_CAPS:
        cap = environ.get(variable, "").upper()
        if not cap or cap in _CAPS_WITH_AMX:
            continue
        if cap in _CAPS_AT_AVX512_CORE_BF16 and all(flags.get(flag) for flag in _AVX512_CORE_BF16_FLAGS):
            return ONEDNN_BF16_MATMUL_ISA
        return f"{variable}={environ[variable]}"
    if all(flags.get(flag) for flag in _AVX512_CORE_BF16_FLAGS):
        return "avx512_core_amx" if all(flags.get(flag) for flag in _AMX_BF16_FLAGS) else ONEDNN_BF16_MATMUL_ISA
    return "avx2_vnni_2" if all(flags.get(flag) for flag in _AVX2_VNNI_2_FLAGS) else ""


def _f32(value: float) -> float:
    """``value`` rounded to float: the heuristic scores in float, and ties decide blocks."""
    return float(np.float32(value))


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class _Blocking(NamedTuple):
    """What compute_blocking_heuristic_avx512 chooses (M_chunk_size and the batch size are 1)."""

    m_blk: int
    n_chunks: int  # N_chunk_size: N blocks per chunk
    k_blk: int
    k_threads: int  # nthr_k


def _disbalance(work: int, block: int) -> float:
    """calculate_spatial_disbalance."""
    mod = work % block
    return _f32((block - mod if work < block else min(block - mod, mod)) / block)


def _imbalance(m: int, n: int, k: int, batch: int, threads: int, b: _Blocking) -> float:
    """matmul_avx512_blocking_params_t::get_imbalance, in float as oneDNN sums it."""
    n_blk = min(_N_BLOCK, n)
    bmn_threads = threads // b.k_threads
    parallel = _disbalance(_cdiv(m, b.m_blk) * _cdiv(n, n_blk * b.n_chunks) * batch, bmn_threads)
    m_tail = _f32((b.m_blk * _cdiv(m, b.m_blk)) % m / m)
    n_blocks = _cdiv(n, n_blk)
    n_chunk = _f32(_f32(_cdiv(n_blocks, b.n_chunks) * b.n_chunks - n_blocks) / n_blocks)
    k_split = _disbalance(k, b.k_threads * b.k_blk)
    unused = _f32((threads - bmn_threads * b.k_threads) / threads)
    return _f32(_f32(_f32(_f32(_f32(parallel + m_tail) + n_chunk) + unused) + k_split) / 5)


def _blocking(m: int, n: int, k: int, batch: int, src_transposed: bool, copy_a: bool, threads: int) -> _Blocking:
    """compute_blocking_heuristic_avx512 for bf16: the least imbalanced blocks, the first of
    equals, work amounts that leave threads idle skipped."""
    n_blocks = _cdiv(n, min(_N_BLOCK, n))
    k_blk = min(k, _K_BLOCK_EXTENDED if k > _K_BLOCK_EXTENDED and not src_transposed else _K_BLOCK)
    max_m_blk, min_m_blk = min(_M_BLOCK_MAX, m), min(_M_BLOCK_MIN, m)
    first_k_threads = 1
    if threads > batch * n_blocks:  # low parallel work
        min_m_blk = min(m, _M_BLOCK_MIN_LOW_PARALLEL)
        if batch == 1 and src_transposed and _is_pow2(k) and k >= _K_SPLIT_MIN:  # bwd_w_par_k_blk
            first_k_threads = min(threads, _K_THREADS_MAX)
    best, chosen = _f32(1.0), None
    for k_threads in range(first_k_threads, 0, -1):
        found = False
        for n_chunks in range(min(_N_CHUNKS_COPIED_A if copy_a else 1, n_blocks), 0, -1):
            for m_blk in range(max_m_blk, min_m_blk - 1, -1):
                candidate = _Blocking(m_blk, n_chunks, k_blk, k_threads)
                work = batch * _cdiv(m, m_blk) * _cdiv(n_blocks, n_chunks)
                bmn_threads = threads // k_threads
                if work < 3 * bmn_threads and work % bmn_threads and first_k_threads == 1:
                    continue
                score = _imbalance(m, n, k, batch, threads, candidate)
                if score < best:
                    best, chosen, found = score, candidate, True
        if not found:
            candidate = _Blocking(min_m_blk, 1, k_blk, k_threads)
            score = _imbalance(m, n, k, batch, threads, candidate)
            if score < best:
                best, chosen = score, candidate
    if chosen is None:  # VCONDCHECK_BG(best_imbalance != 1.f): oneDNN falls back to another matmul
        raise ValueError(f"no brgemm blocking for a {m}×{k}·{k}×{n} matmul")
    return chosen


def onednn_bf16_matmul_scratchpad(m: int, n: int, k: int, *, threads: int, batch: int = 1,
                                  a_transposed: bool = False) -> int:
    """Bytes of the scratchpad of oneDNN's ``brg_matmul:avx512_core_bf16`` for a bfloat16
    (m × k)·(k × n) product (``batch`` of them), A stored column-major when ``a_transposed``.

    Per thread: the brgemm batch; the VNNI copy of a K block of B in 64-column blocks; the
    float32 accumulator of an M block (of all of C when K is split over threads), once per N
    chunk when K takes several blocks; and, for a transposed A (never one row: oneDNN treats
    it as plain), a copy of its M block with a cache-line-padded K. Each booking adds 128 bytes.
    """
    src_transposed = a_transposed or m == 1  # matmul_helper_t::transA is 'T' for one row
    copy_a = (a_transposed and m > 1) or (not src_transposed and m >= _COPY_A_MIN_M and _is_pow2(k)
                                           and k * _BF16_BYTES >= _BIG_LDA_BYTES)
    b = _blocking(m, n, k, batch, src_transposed, copy_a, threads)
    n_blk = min(_N_BLOCK, n)
    total = threads * _BATCH_ELEMENTS_PER_THREAD * _BATCH_ELEMENT_BYTES + _BOOKING_PAD
    if copy_a:
        lda = _round_up(b.k_blk, _LDA_ALIGN)
        lda += _LDA_ALIGN if lda >= _LDA_BIG and _is_pow2(lda) else 0
        total += threads * _BF16_BYTES * b.m_blk * lda + _BOOKING_PAD
    total += threads * _BF16_BYTES * _round_up(n_blk, _N_BLOCK) * _round_up(b.k_blk, _WEI_K_BLOCK) + _BOOKING_PAD
    if b.k_threads > 1:  # each K thread accumulates all of C (LDC = LDD = n)
        accumulator = _F32_BYTES * n * m
    else:
        accumulator = _F32_BYTES * n_blk * b.m_blk * (1 if b.k_blk >= k else b.n_chunks)
    return total + threads * accumulator + _BOOKING_PAD
