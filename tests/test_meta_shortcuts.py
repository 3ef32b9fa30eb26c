"""The outputs memcalc.engine.meta_shortcuts makes without a meta kernel are the kernel's own,
storage for storage (issue 36, the per-op cost): compared with ``aten.native_batch_norm`` run on
meta over dimensions, layouts (size-1 spatial dimensions, whose layouts are ambiguous, included),
dtypes, affine and running-statistics settings; the calls it leaves to the kernel are left. The
ops called through their ``Tensor`` method (views, ``detach``, ``lift_fresh``, a host tensor's
``.item()``) give the kernel's outputs over layouts, offsets and dtypes, the same storage
included, and leave to the kernel every call it refuses."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from memcalc.engine.meta_shortcuts import BY_METHOD, SHORTCUTS, batch_norm_backward_outputs, batch_norm_outputs

aten = torch.ops.aten
CHANNELS = 3
SHAPES = {2: (4, CHANNELS), 3: (4, CHANNELS, 5), 4: (4, CHANNELS, 5, 6), 5: (4, CHANNELS, 2, 5, 6)}


def _input(dim: int, layout: str, dtype: torch.dtype, size_one: bool) -> torch.Tensor:
    shape = tuple(1 if size_one and i >= 2 else n for i, n in enumerate(SHAPES[dim]))
    x = torch.empty(shape, dtype=dtype, device="meta")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if dim == 4 else torch.channels_last_3d)
    return x


def _described(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().nbytes())


CASES = [(dim, layout, dtype, size_one, affine, stats)
         for dim, layout, dtype, size_one, affine, stats in itertools.product(
             SHAPES, ("contiguous", "channels_last"), (torch.float32, torch.float16, torch.bfloat16), (False, True),
             (None, torch.float32, "input"), (False, True))
         if layout == "contiguous" or dim in (4, 5)]


def _case_id(case: tuple[Any, ...]) -> str:
    """``4d-channels_last-bfloat16-size_one-affine_input-stats``: what the case varies, by name."""
    dim, layout, dtype, size_one, *rest = case
    words = [f"{dim}d", layout, str(dtype).removeprefix("torch."), "size_one" if size_one else "sized"]
    if len(rest) == 2:
        affine = rest[0]
        words.append("no_affine" if affine is None else f"affine_{str(affine).removeprefix('torch.')}")
    return "-".join([*words, "stats" if rest[-1] else "no_stats"])


def _quick(cases: list[tuple[Any, ...]]) -> tuple[str, ...]:
    """The quick suite's cases of a grid (issue 36 item 7; the full suite runs all): every (dimension,
    layout, size-1 spatial dimensions) — the layouts whose strides the outputs take, the ambiguous ones
    included — once, the i-th of them with the i-th (dtype, affine) pair and running statistics or not
    in turn, so that every dtype meets every affine setting and both statistics settings."""
    shapes = list(dict.fromkeys((dim, layout, size_one) for dim, layout, _, size_one, *_ in cases))
    dtypes, affines = (torch.float32, torch.float16, torch.bfloat16), (None, torch.float32, "input")
    kept = []
    for i, (dim, layout, size_one) in enumerate(shapes):
        dtype, affine, stats = dtypes[i % 3], affines[(i // 3) % 3], bool(i % 2)
        kept.append((dim, layout, dtype, size_one, affine, stats) if len(cases[0]) == 6
                    else (dim, layout, dtype, size_one, stats))
    assert set(kept) <= set(cases)
    return tuple(_case_id(case) for case in kept)


@pytest.mark.quick_cases(*_quick(CASES))
@pytest.mark.parametrize(("dim", "layout", "dtype", "size_one", "affine", "stats"), CASES, ids=map(_case_id, CASES))
def test_batch_norm_outputs_are_the_kernels(dim: int, layout: str, dtype: torch.dtype, size_one: bool,
                                            affine: Any, stats: bool) -> None:
    x = _input(dim, layout, dtype, size_one)
    affine_dtype = dtype if affine == "input" else affine
    weight = None if affine is None else torch.empty(CHANNELS, dtype=affine_dtype, device="meta")
    bias = None if affine is None else torch.empty(CHANNELS, dtype=affine_dtype, device="meta")
    mean = torch.empty(CHANNELS, device="meta") if stats else None
    var = torch.empty(CHANNELS, device="meta") if stats else None
    args = (x, weight, bias, mean, var, True, 0.1, 1e-5)
    made = batch_norm_outputs(args, {})
    assert made is not None
    kernel = aten.native_batch_norm.default(*args)
    assert [_described(t) for t in made] == [_described(t) for t in kernel]
    # three storages of their own, as the kernel's (none aliases an input or another output)
    inputs = {id(t.untyped_storage()) for t in args if isinstance(t, torch.Tensor)}
    for outputs in (made, kernel):
        storages = [t.untyped_storage() for t in outputs]
        assert len({id(s) for s in storages}) == 3 and not inputs & {id(s) for s in storages}


def test_the_other_calls_run_the_kernel() -> None:
    x = _input(4, "contiguous", torch.float32, False)
    stats = (torch.empty(CHANNELS, device="meta"), torch.empty(CHANNELS, device="meta"))
    assert batch_norm_outputs((x, None, None, *stats, False, 0.1, 1e-5), {}) is None  # eval: outputs alias stats
    assert batch_norm_outputs((x.double(), None, None, None, None, True, 0.1, 1e-5), {}) is None  # float64
    assert batch_norm_outputs((x.transpose(2, 3), None, None, None, None, True, 0.1, 1e-5), {}) is None  # strided
    assert batch_norm_outputs((x[:, :, ::2], None, None, None, None, True, 0.1, 1e-5), {}) is None  # a slice
    assert batch_norm_outputs((x,), {"weight": None}) is None  # keywords
    odd = torch.empty_strided((4, CHANNELS, 1, 1), (CHANNELS, 1, 7, 7), device="meta")  # contiguous, odd strides
    assert odd.is_contiguous() and batch_norm_outputs((odd, None, None, None, None, True, 0.1, 1e-5), {}) is None


BACKWARD_CASES = [(dim, layout, dtype, size_one, stats)
                  for dim, layout, dtype, size_one, stats in itertools.product(
                      SHAPES, ("contiguous", "channels_last"), (torch.float32, torch.float16, torch.bfloat16),
                      (False, True), (False, True))
                  if layout == "contiguous" or dim in (4, 5)]


@pytest.mark.quick_cases(*_quick(BACKWARD_CASES))
@pytest.mark.parametrize(("dim", "layout", "dtype", "size_one", "stats"), BACKWARD_CASES,
                         ids=map(_case_id, BACKWARD_CASES))
def test_batch_norm_backward_outputs_are_the_kernels(dim: int, layout: str, dtype: torch.dtype, size_one: bool,
                                                     stats: bool) -> None:
    x = _input(dim, layout, dtype, size_one)
    grad = torch.empty_like(x)
    weight = torch.empty(CHANNELS, device="meta")
    mean = torch.empty(CHANNELS, device="meta") if stats else None
    var = torch.empty(CHANNELS, device="meta") if stats else None
    saved = (torch.empty(CHANNELS, device="meta"), torch.empty(CHANNELS, device="meta"))
    args = (grad, x, weight, mean, var, *saved, True, 1e-5, [True, True, True])
    made = batch_norm_backward_outputs(args, {})
    kernel = aten.native_batch_norm_backward.default(*args)
    if made is None:  # only the ambiguous layout is left to the kernel
        assert size_one and layout == "channels_last"
        return
    assert [_described(t) for t in made] == [_described(t) for t in kernel]
    storages = {id(t.untyped_storage()) for t in (*made, *args[:7]) if isinstance(t, torch.Tensor)}
    assert len(storages) == 3 + 5 + 2 * stats  # the three gradients' storages are their own


def test_the_other_backward_calls_run_the_kernel() -> None:
    x = _input(4, "contiguous", torch.float32, False)
    c = (torch.empty(CHANNELS, device="meta"),) * 3
    assert batch_norm_backward_outputs((x, x, c[0], None, None, c[1], c[2], True, 1e-5, [True, False, False]), {}) \
        is None  # a gradient not asked for
    assert batch_norm_backward_outputs((x, x, None, None, None, c[1], c[2], True, 1e-5, [True, True, True]), {}) \
        is None  # no weight
    assert batch_norm_backward_outputs((x, x, c[0], None, None, c[1], c[2], False, 1e-5, [True, True, True]), {}) \
        is None  # eval
    other = x.to(memory_format=torch.channels_last)
    assert batch_norm_backward_outputs((other, x, c[0], None, None, c[1], c[2], True, 1e-5, [True, True, True]), {}) \
        is None  # the gradient laid out otherwise


def _sources() -> list[torch.Tensor]:
    """Meta and host tensors in the layouts a trace hands views: standard, transposed,
    channels-last, offset (a slice), expanded (zero strides), a parameter, float and integer."""
    base = torch.empty(2, 3, 4, 6, device="meta")
    return [base, base.transpose(1, 3), base.to(memory_format=torch.channels_last), base[:, 1:],
            base[0, 0].expand(5, 4, 6), torch.nn.Parameter(torch.empty(4, 6, device="meta")),
            torch.empty(4, 6, dtype=torch.bfloat16, device="meta"), torch.empty(4, 6, dtype=torch.int64),
            torch.empty(6, device="meta"), torch.empty((), device="meta")]


def _arguments(op: object, x: torch.Tensor) -> list[tuple[Any, ...]]:
    """Calls of ``op`` on ``x``, each valid or refused by the kernel."""
    dims = x.dim()
    if op in (aten.view.default, aten._unsafe_view.default):
        return [(x, [-1]), (x, [x.numel()]), (x, [1, *x.shape]), (x, [*x.shape[:-1], -1, 2][:max(dims, 1)])]
    if op is aten.transpose.int:
        return [(x, a, b) for a in range(-dims, dims) for b in range(dims)] + [(x, 0, 9)]
    if op is aten.unsqueeze.default:
        return [(x, d) for d in range(-dims - 1, dims + 1)] + [(x, 9)]
    if op is aten.expand.default:
        return [(x, [2, *x.shape]), (x, [-1] * dims), (x, [7] * dims)]
    if op is aten.permute.default:
        return [(x, list(reversed(range(dims)))), (x, list(range(dims))), (x, [0] * max(dims, 1))]
    return [(x,)]  # detach, t (refused above 2 dimensions)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@pytest.mark.parametrize("op", list(BY_METHOD), ids=str)
def test_methods_give_the_kernels_outputs(op: Any) -> None:
    made_some = 0
    for x in _sources():
        for args in _arguments(op, x):
            made = SHORTCUTS[op](args, {})
            try:
                kernel = op(*args)
            except (RuntimeError, IndexError, TypeError):
                assert made is None, (op, args)  # refused: left to the kernel, which raises it
                continue
            if made is None:  # a subclass or a refusal of the method's: the kernel runs
                continue
            made_some += 1
            assert _described(made) == _described(kernel), (op, args)
            assert type(made) is type(kernel) and _storage(made) == _storage(kernel) == _storage(x), (op, args)
    assert made_some >= 5  # t: the five sources of at most two dimensions


def test_methods_leave_keywords_and_subclasses_to_the_kernel() -> None:
    x = torch.empty(4, 6, device="meta")
    assert SHORTCUTS[aten.expand.default]((x, [2, 4, 6]), {"implicit": True}) is None
    assert SHORTCUTS[aten.view.default]((x,), {"size": [24]}) is None

    class Wrapped(torch.Tensor):
        pass

    assert SHORTCUTS[aten.t.default]((x.as_subclass(Wrapped),), {}) is None


def test_lift_fresh_and_host_item_are_the_kernels() -> None:
    for value in (torch.tensor(3.5), torch.tensor(7), torch.tensor(True), torch.tensor([2.0]),
                  torch.tensor(1.5, dtype=torch.bfloat16)):
        assert SHORTCUTS[aten.lift_fresh.default]((value,), {}) is aten.lift_fresh.default(value) is value
        item = SHORTCUTS[aten._local_scalar_dense.default]((value,), {})
        kernel = aten._local_scalar_dense.default(value)
        assert item == kernel and type(item) is type(kernel)
    assert SHORTCUTS[aten._local_scalar_dense.default]((torch.empty((), device="meta"),), {}) is None  # the tracer's
    # Tensor.item refuses two elements where the kernel reads the first: left to the kernel
    assert SHORTCUTS[aten._local_scalar_dense.default]((torch.zeros(2),), {}) is None
