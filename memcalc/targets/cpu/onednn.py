"""What oneDNN allocates for one LSTM layer on the CPU: its workspace, its scratchpad and the
weight copies ideep makes — the sizes :mod:`memcalc.targets.cpu.kernels` adds to ``mkldnn_rnn_layer``.

PyTorch runs ``nn.LSTM`` on the CPU one layer and direction at a time
(``mkldnn_rnn_layer``, ``aten/src/ATen/native/mkldnn/RNN.cpp``); in training oneDNN's
reference (GEMM-based) RNN runs it — its BRGEMM version refuses float32 training
(``ref_rnn.cpp`` ``init_brgemm``) — whatever the x86-64 ISA. The formulas transcribe oneDNN
v3.12 (the version torch 2.13 bundles): ``src/cpu/rnn/rnn_utils.{hpp,cpp}``
(``get_good_ld``, ``set_workspace_sizes``, ``set_offsets``), ``ref_rnn.cpp``
(``init_scratchpad``) and ``src/common/memory_tracking.hpp`` (``registry_t::book``), for
float32 and one layer, one direction (``n_layer = n_dir = 1``), and were checked byte for byte
against the CPU profiler.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = (
    "LSTM_GATES",
    "lstm_scratchpad_bytes",
    "lstm_weight_reorder_bytes",
    "lstm_workspace_bytes",
)

#: Gates of an LSTM cell, and its bias gates (RNN.cpp RNNParams: num_gates, num_bias_gates).
LSTM_GATES = 4
_F32 = 4
#: rnn_utils::set_offsets: every workspace and scratchpad part starts on a page.
_PAGE = 4096
#: get_good_ld: leading dimensions rounded up to 64 bytes, plus 64 more bytes when the result
#: is a multiple of 256 elements (against 4K aliasing).
_LD_ALIGN = 64
_LD_ALIASING = 256
#: registry_t::book: each entry takes its size plus max(its alignment, 128) bytes; the RNN
#: space is booked with a 4096-byte alignment (ref_rnn.cpp init_scratchpad).
_BOOK_ALIGNMENT = 128
_RNN_SPACE_ALIGNMENT = 4096
#: init_scratchpad's pointer arrays for one layer and direction: ptrs_wei_layer, _iter and
#: _projection (one float* each) and ptrs_bia (ptr_wei_sz × bias size = 4 void* for float32).
_POINTER_BOOKINGS = 3 * (8 + _BOOK_ALIGNMENT) + (4 * 8 + _BOOK_ALIGNMENT)
#: init_conf's merge_gemm_layer: the forward merges the layer GEMM over all steps (and keeps
#: every step's gates in its scratchpad) below this mini-batch; the backward always does.
_MERGE_GEMM_MAX_BATCH = 128


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _good_ld(dim: int, itemsize: int = _F32) -> int:
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
    gates = steps * batch * _good_ld(LSTM_GATES * hidden) * _F32
    ht = steps * batch * _good_ld(hidden) * _F32
    rows = 2 * (steps + 1) * batch  # (n_layer + 1) × (n_iter + 1) × mb
    states = rows * _good_ld(max(input_size, hidden)) * _F32
    c_states = rows * hidden * _F32  # ws_states_iter_c_ld = dhc: not a GEMM operand
    # gates, ht, states_layer, states_iter_c, diff_states_layer, diff_states_iter, diff_states_iter_c
    return _paged([gates, ht, states, c_states, states, states, c_states])


def lstm_scratchpad_bytes(steps: int, batch: int, hidden: int, *, forward: bool) -> int:
    """The scratchpad of one float32 LSTM layer's training forward or backward: the gates (of
    every step when the layer GEMM is merged, else of one), one ht and one diff-ht row block,
    page by page, then the registry's bookings."""
    merged = not forward or batch < _MERGE_GEMM_MAX_BATCH
    gates = (steps if merged else 1) * batch * _good_ld(LSTM_GATES * hidden) * _F32
    row = batch * _good_ld(hidden) * _F32
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
            total += _reorder(sizes, user, (ld, hidden, 1), rows * ld * _F32)
        else:
            ld = _good_ld(rows)
            total += _reorder(sizes, user, (1, hidden * ld, ld), gates * ld * _F32)
            total += rows * _good_ld(gates) * _F32  # the weight gradient in oneDNN's layout
    return total
