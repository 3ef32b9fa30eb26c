"""memcalc/targets/convolution_args.py: the one reader of ``aten.convolution`` and
``convolution_backward`` arguments that the CPU's Slow2d rule and CUDA's cuDNN rules share."""

from __future__ import annotations

import torch

from memcalc.targets import convolution_args
from memcalc.targets.convolution_args import ConvolutionBackwardArgs, convolution_call

aten = torch.ops.aten


def test_the_reader_follows_torchs_schemas() -> None:
    # the names it binds are the schemas' own, in order: a torch that moved an argument fails here
    for op, names in ((aten.convolution.default, convolution_args._FORWARD),
                      (aten.convolution_backward.default, convolution_args._BACKWARD)):
        assert tuple(argument.name for argument in op._schema.arguments) == names


def test_positions_and_keywords_read_alike() -> None:
    x, w, g = torch.empty(2, 4, 8, 8, device="meta"), torch.empty(6, 2, 3, 3, device="meta"), torch.empty(0)
    forward = (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 2)
    read = convolution_call(aten.convolution.default, forward, {})
    assert not isinstance(read, ConvolutionBackwardArgs)
    assert (read.input, read.weight, read.stride, read.groups, read.transposed) == (x, w, [2, 2], 2, False)
    assert convolution_call(aten.convolution.default, forward[:6], {"transposed": False, "output_padding": [0, 0],
                                                                    "groups": 2}) == read
    backward = (g, x, w, [6], [2, 2], [1, 1], [1, 1], True, [0, 0], 2, [True, False, True])
    read_backward = convolution_call(aten.convolution_backward.default, backward, {})
    assert isinstance(read_backward, ConvolutionBackwardArgs)
    assert (read_backward.grad_output, read_backward.input, read_backward.weight) == (g, x, w)
    assert (read_backward.stride, read_backward.transposed, read_backward.groups) == ([2, 2], True, 2)
    assert read_backward.output_mask == [True, False, True]
