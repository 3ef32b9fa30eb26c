"""ATen's CPU composites, op for op, where the CPU runs other ops than meta tensors do — for
the CPU target (:mod:`memcalc.targets.cpu.kernels`, whose rules call these on meta tensors):

- :func:`autocast_arguments`: what ``torch.autocast("cpu")`` casts an op's inputs to, by CPU
  autocast's own lists (:func:`memcalc.targets.autocast.cpu_autocast_policy`).
- :func:`linear`: ``at::linear`` adds the bias in place after a ``matmul``; under memcalc's
  tracer (a dispatch mode makes every tensor "subclass-like") it would add out of place.
- :func:`mkldnn_rnn`: ``nn.LSTM`` through oneDNN, one ``mkldnn_rnn_layer`` per layer and
  direction (``native/mkldnn/RNN.cpp``).
- :func:`generic_rnn`: ``at::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` without oneDNN
  (``native/RNN.cpp``): on a CPU tensor ``FullLayer`` projects the inputs of all steps at once
  (``inputs.device().is_cpu()``), which meta tensors never do; :func:`packed_rnn` is the same
  for a ``PackedSequence`` (``PackedLayer``, ``ReversedPackedLayer``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from memcalc.targets.autocast import AutocastPolicy

__all__ = ("LSTM_MODE", "RnnKind", "autocast_arguments", "generic_rnn", "linear", "mkldnn_rnn", "packed_rnn")

#: ``ideep::rnn_kind::LSTM``: mkldnn_rnn_layer's ``mode`` for an LSTM (RNN.cpp RNNParams).
LSTM_MODE = 2
#: parseLinearFlatten3d(): TORCH_LINEAR_FLATTEN_3D=1 makes a non-contiguous 3-D input contiguous.
_LINEAR_FLATTEN_3D = os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


Cast = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (list, tuple)) else []


def _cast_floating(value: Any, dtype: torch.dtype, cast: Cast) -> Any:
    """``cached_cast`` over an argument (a tensor, a TensorList or anything else): eligible
    tensors — floating, not float64 — that are not ``dtype`` yet."""
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype not in (dtype, torch.float64)
        return cast(value, dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        cast_items = [_cast_floating(item, dtype, cast) for item in value]
        return tuple(cast_items) if isinstance(value, tuple) else cast_items
    return value


def autocast_arguments(policy: AutocastPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype,
                       cast: Cast) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments AutocastCPU's ``WrapFunction_`` hands on for an op of ``policy``
    (autocast_mode.h): every eligible floating input in ``low`` ("lower"), in float32
    ("fp32"), or in float32 when one of them is and else in ``low`` ("promote",
    ``promote_type``); unchanged for "none". ``cast`` makes each copy (the emulation's, with
    the weight-cast cache), last argument first: the order of a real CPU step, whose wrapper
    casts the arguments of one call (``cached_cast(to_type, args, device_type)...``) in an
    order C++ leaves to the compiler — right to left in PyTorch's GCC builds.

    Raises:
        ValueError: a policy of CUDA's lists that CPU autocast has not.
    """
    if policy == "none":
        return args, kwargs
    if policy == "lower":
        dtype = low
    elif policy == "promote":
        floats = [t for t in _tensors((args, tuple(kwargs.values()))) if t.is_floating_point()]
        dtype = torch.float32 if any(t.dtype is torch.float32 for t in floats) else low
    elif policy == "fp32":
        dtype = torch.float32
    else:
        raise ValueError(f"CPU autocast has no {policy!r} policy")
    cast_kwargs = {name: _cast_floating(value, dtype, cast) for name, value in reversed(kwargs.items())}
    cast_args = [_cast_floating(value, dtype, cast) for value in reversed(args)]
    return tuple(reversed(cast_args)), dict(reversed(cast_kwargs.items()))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``at::linear`` (native/Linear.cpp): a 2-D input runs ``addmm``, a contiguous one is
    flattened into ``addmm``, any other runs ``matmul`` and adds the bias in place."""
    flattened = x.is_contiguous() and (x.dim() == 3 or (bias is not None and bias.dim() == 1))
    if bias is None or x.dim() in (0, 2) or flattened or (_LINEAR_FLATTEN_3D and x.dim() == 3):
        return torch.nn.functional.linear(x, weight, bias)
    return torch.matmul(x, weight.t()).add_(bias)


def mkldnn_rnn(x: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
               num_layers: int, dropout_p: float, train: bool, bidirectional: bool,
               batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mkldnn_rnn`` for an LSTM: time-major contiguous input, one ``mkldnn_rnn_layer`` per
    layer and direction, dropout between layers in training."""
    stride = 4 if has_biases else 2
    layer_input = (x.transpose(0, 1) if batch_first else x).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = int(h0.shape[2])
    directions = 2 if bidirectional else 1
    hy: list[torch.Tensor] = []
    cy: list[torch.Tensor] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * stride:(index + 1) * stride]
            # without biases RNN.cpp passes zeros shaped like the weights
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            out = torch.ops.aten.mkldnn_rnn_layer(
                layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], direction > 0, [], LSTM_MODE, hidden,
                num_layers, has_biases, bidirectional, batch_first, train)
            outputs.append(out[0])
            hy.append(out[1])
            cy.append(out[2])
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


class RnnKind(NamedTuple):
    """Which cell ``generic_rnn`` runs: "lstm", "gru", "rnn_tanh" or "rnn_relu"."""

    name: str

    @property
    def is_lstm(self) -> bool:
        return self.name == "lstm"


class _CellParams(NamedTuple):
    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None


def _gather_params(params: Sequence[torch.Tensor], has_biases: bool, has_projections: bool) -> list[_CellParams]:
    """gather_params: per layer and direction w_ih, w_hh[, b_ih, b_hh][, w_hr]."""
    stride = 2 + 2 * has_biases + has_projections
    cells = []
    for i in range(0, len(params), stride):
        p = params[i:i + stride]
        cells.append(_CellParams(p[0], p[1], p[2] if has_biases else None, p[3] if has_biases else None,
                                 p[-1] if has_projections else None))
    return cells


def _cell(kind: RnnKind, gates_ih: torch.Tensor, hidden: Hidden, p: _CellParams) -> Hidden:
    """One step of LSTMCell / GRUCell / SimpleCell with the input projection precomputed
    (``pre_compute_input``), including their in-place ops."""
    if isinstance(hidden, tuple):  # LSTMCell
        hx, cx = hidden
        gates = linear(hx, p.w_hh, p.b_hh).add_(gates_ih)
        chunks = gates.unsafe_chunk(4, 1)
        ingate, forgetgate, cellgate, outgate = (chunks[0].sigmoid_(), chunks[1].sigmoid_(), chunks[2].tanh_(),
                                                 chunks[3].sigmoid_())
        cy = (forgetgate * cx).add_(ingate * cellgate)
        hy = outgate * cy.tanh()
        return (torch.matmul(hy, p.w_hr.t()) if p.w_hr is not None else hy), cy
    if kind.name == "gru":
        i_r, i_z, i_n = gates_ih.unsafe_chunk(3, 1)
        h_r, h_z, h_n = linear(hidden, p.w_hh, p.b_hh).unsafe_chunk(3, 1)
        reset = h_r.add_(i_r).sigmoid_()
        update = h_z.add_(i_z).sigmoid_()
        new = i_n.add(h_n.mul_(reset)).tanh_()
        return (hidden - new).mul_(update).add_(new)
    pre = linear(hidden, p.w_hh, p.b_hh).add_(gates_ih)
    return torch.tanh(pre) if kind.name == "rnn_tanh" else torch.relu(pre)


def _run(kind: RnnKind, steps: Sequence[torch.Tensor], hidden: Hidden,
         p: _CellParams) -> tuple[list[torch.Tensor], Hidden]:
    """FullLayer's step loop: the cell over the (projected) steps, each step's output kept."""
    outputs = []
    for step in steps:
        hidden = _cell(kind, step, hidden, p)
        outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
    return outputs, hidden


def _full_layer(kind: RnnKind, x: torch.Tensor, hidden: Hidden, p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """FullLayer on a CPU tensor: project every step's input at once, run, stack (the
    projection lives until the layer returns)."""
    projected = linear(x, p.w_ih, p.b_ih)
    outputs, final = _run(kind, projected.unbind(0), hidden, p)
    return torch.stack(outputs, 0), final


def _bidirectional_layer(kind: RnnKind, x: torch.Tensor, hidden: tuple[Hidden, Hidden],
                         p: tuple[_CellParams, _CellParams]) -> tuple[torch.Tensor, tuple[Hidden, Hidden]]:
    """FullBidirectionalLayer on a CPU tensor, with its locals' lifetimes: the forward
    projection lives until the backward one is made, which lives until the layer returns."""
    projected = linear(x, p[0].w_ih, p[0].b_ih)
    steps = list(projected.unbind(0))
    fw_outputs, fw_final = _run(kind, steps, hidden[0], p[0])
    fw_output = torch.stack(fw_outputs, 0)
    projected = linear(x, p[1].w_ih, p[1].b_ih)
    steps = list(projected.unbind(0))
    steps.reverse()
    rev_outputs, rev_final = _run(kind, steps, hidden[1], p[1])
    rev_outputs.reverse()
    rev_output = torch.stack(rev_outputs, 0)
    return torch.cat([fw_output, rev_output], fw_output.dim() - 1), (fw_final, rev_final)


def generic_rnn(kind: RnnKind, x: torch.Tensor, hx: torch.Tensor | Sequence[torch.Tensor],
                params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout_p: float, train: bool,
                bidirectional: bool, batch_first: bool) -> tuple[torch.Tensor, ...]:
    """``_rnn_impl`` with FullLayer / FullBidirectionalLayer as a CPU tensor runs it; returns
    what ``at::lstm`` (output, h_n, c_n) or ``at::gru`` / ``at::rnn_*`` (output, h_n) return."""
    hiddens: list[Hidden]
    if isinstance(hx, torch.Tensor):
        hiddens = list(hx.unbind(0))
        has_projections = False
    else:
        hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0), strict=True))
        has_projections = hx[0].shape[2] != hx[1].shape[2]
    cells = _gather_params(params, has_biases, has_projections)
    layer_input = x.transpose(0, 1) if batch_first else x
    directions = 2 if bidirectional else 1
    finals: list[Hidden] = []
    for layer in range(num_layers):
        i = layer * directions
        if bidirectional:
            layer_input, (fw, rev) = _bidirectional_layer(kind, layer_input, (hiddens[i], hiddens[i + 1]),
                                                          (cells[i], cells[i + 1]))
            finals += [fw, rev]
        else:
            layer_input, final = _full_layer(kind, layer_input, hiddens[i], cells[i])
            finals.append(final)
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    if kind.is_lstm:
        pairs = [f for f in finals if isinstance(f, tuple)]
        return output, torch.stack([h for h, _ in pairs], 0), torch.stack([c for _, c in pairs], 0)
    return output, torch.stack([f for f in finals if isinstance(f, torch.Tensor)], 0)


def _slice(hidden: Hidden, start: int, end: int) -> Hidden:
    """hidden_slice: rows ``start:end`` of the batch."""
    if isinstance(hidden, tuple):
        return hidden[0].narrow(0, start, end - start), hidden[1].narrow(0, start, end - start)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: Sequence[Hidden]) -> Hidden:
    """hidden_concat: along the batch."""
    if isinstance(hiddens[0], tuple):
        pairs = [h for h in hiddens if isinstance(h, tuple)]
        return torch.cat([h for h, _ in pairs], 0), torch.cat([c for _, c in pairs], 0)
    return torch.cat([h for h in hiddens if isinstance(h, torch.Tensor)], 0)


def _packed_layer(kind: RnnKind, data: torch.Tensor, sizes: list[int], hidden: Hidden,
                  p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """PackedLayer on a CPU tensor: project all inputs at once, then per step narrow the
    batch (setting aside the finished sequences' hidden states)."""
    projected = linear(data, p.w_ih, p.b_ih)
    outputs: list[torch.Tensor] = []
    finished: list[Hidden] = []
    offset, last = 0, sizes[0]
    for size in sizes:
        step = projected.narrow(0, offset, size)
        offset += size
        if last > size:
            finished.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = _cell(kind, step, hidden, p)
        outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
    finished.append(hidden)
    finished.reverse()
    return torch.cat(outputs, 0), _concat(finished)


def _reversed_packed_layer(kind: RnnKind, data: torch.Tensor, sizes: list[int], hidden: Hidden,
                           p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """ReversedPackedLayer on a CPU tensor: from the last step back, widening the batch."""
    projected = linear(data, p.w_ih, p.b_ih)
    outputs: list[torch.Tensor] = []
    offset, last = int(data.shape[0]), sizes[-1]
    state = _slice(hidden, 0, last)
    for size in reversed(sizes):
        if size > last:
            state = _concat([state, _slice(hidden, last, size)])
        step = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        state = _cell(kind, step, state, p)
        outputs.append(state[0] if isinstance(state, tuple) else state)
    outputs.reverse()
    return torch.cat(outputs, 0), state


def packed_rnn(kind: RnnKind, data: torch.Tensor, batch_sizes: torch.Tensor,
               hx: torch.Tensor | Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
               num_layers: int, dropout_p: float, train: bool, bidirectional: bool) -> tuple[torch.Tensor, ...]:
    """``_rnn_impl`` with PackedLayer / PackedBidirectionalLayer as a CPU tensor runs it (the
    packed overloads of ``at::lstm`` / ``gru`` / ``rnn_*``, which never use oneDNN)."""
    sizes = [int(b) for b in batch_sizes.tolist()]
    hiddens: list[Hidden]
    if isinstance(hx, torch.Tensor):
        hiddens = list(hx.unbind(0))
    else:
        hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0), strict=True))
    cells = _gather_params(params, has_biases, has_projections=False)
    directions = 2 if bidirectional else 1
    layer_input = data
    finals: list[Hidden] = []
    for layer in range(num_layers):
        i = layer * directions
        output, final = _packed_layer(kind, layer_input, sizes, hiddens[i], cells[i])
        finals.append(final)
        if bidirectional:
            rev_output, rev_final = _reversed_packed_layer(kind, layer_input, sizes, hiddens[i + 1], cells[i + 1])
            finals.append(rev_final)
            output = torch.cat([output, rev_output], -1)
        layer_input = output
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    if kind.is_lstm:
        pairs = [f for f in finals if isinstance(f, tuple)]
        return layer_input, torch.stack([h for h, _ in pairs], 0), torch.stack([c for _, c in pairs], 0)
    return layer_input, torch.stack([f for f in finals if isinstance(f, torch.Tensor)], 0)
