"""The outputs memcalc.engine.meta_outputs makes without a meta kernel are the kernel's own, storage
for storage (issue 36, the per-op cost of a cold trace): every rule is compared with the op's
meta kernel over shapes (0-dim, empty, size-1 dimensions), dtypes (integer and bool ones, which
the rules leave alone, included), layouts (transposed, channels-last, expanded, offset, odd strides
on size-1 dimensions), scalars and keywords. Wherever a rule answers, the kernel must give the
same shapes, strides, dtypes, offsets and storage sizes, in storages of their own; wherever the
kernel raises, the rule must not answer; and the plain calls of a model must be answered (so the
comparison is not empty)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from torch._prims_common import make_contiguous_strides_for

from memcalc.engine.meta_outputs import OUTPUT_RULES, contiguous_strides
from memcalc.engine.meta_shortcuts import SHORTCUTS

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPES = (*FLOATS, torch.int64, torch.bool)
SHAPES = ((), (0,), (1,), (5,), (3, 4), (1, 4), (4, 1), (2, 1, 4), (2, 3, 4, 5), (0, 3), (2, 0, 3), (2, 3, 1, 1))
LAYOUTS = ("contiguous", "transposed", "channels_last", "expanded", "offset", "odd_size_one")


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, layout: str = "contiguous") -> torch.Tensor | None:
    """A meta tensor of ``shape`` laid out as ``layout`` (None: the layout does not apply)."""
    if layout == "contiguous":
        return torch.empty(shape, dtype=dtype, device="meta")
    if layout == "transposed":
        return torch.empty(shape[::-1], dtype=dtype, device="meta").permute(*reversed(range(len(shape)))) \
            if len(shape) >= 2 else None
    if layout == "channels_last":
        return torch.empty(shape, dtype=dtype, device="meta").to(memory_format=torch.channels_last) \
            if len(shape) == 4 else None
    if layout == "expanded":
        return torch.empty((1, *shape[1:]), dtype=dtype, device="meta").expand(shape) if shape and shape[0] > 1 \
            else None
    if layout == "offset":
        return torch.empty((2, *shape), dtype=dtype, device="meta")[1]
    if 1 not in shape:  # odd_size_one: a size-1 dimension's stride is free; give it one empty() does not
        return None
    strides = list(contiguous_strides(shape))
    strides[shape.index(1)] = 7
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def _described(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.storage_offset(),
                value.untyped_storage().nbytes(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value).__name__, [_described(v) for v in value]
    return value


def _storages(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [id(value.untyped_storage())]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _storages(v)]
    return []


def _compare(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the rule answered; asserts that its answer is the kernel's (or that it did not
    answer a call the kernel refuses)."""
    kwargs = kwargs or {}
    made = OUTPUT_RULES[op](args, kwargs)
    try:
        kernel = op(*args, **kwargs)
    except Exception:
        assert made is None, (op, [_described(a) for a in args], kwargs)
        return False
    if made is None:
        return False
    assert _described(made) == _described(kernel), (op, [_described(a) for a in args], kwargs)
    inputs = set(_storages(list(args)) + _storages(list(kwargs.values())))
    for outputs in (made, kernel):
        storages = _storages(outputs)
        assert len(set(storages)) == len(storages) and not inputs & set(storages)
    return True


#: The quick suite's sample: every SAMPLE-th case of each product (the full suite runs them all).
SAMPLE = 7
EVERY = pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sample", "every"])


def _sampled(cases: Iterable[Any], every: bool, step: int = SAMPLE) -> Iterable[Any]:
    """``cases``, or (the quick suite) every ``step``-th of them."""
    return cases if every else itertools.islice(cases, 0, None, step)


def _enough(answered: list[bool], least: int, every: bool) -> bool:
    """At least ``least`` answered of the whole product, a proportionate share of a sample."""
    return sum(answered) >= (least if every else max(1, least // (2 * SAMPLE)))


def _operands(arity: int, dtypes: tuple[torch.dtype, ...] = DTYPES) -> Iterator[tuple[torch.Tensor, ...]]:
    """Tensors of every shape, dtype and layout; binary ones also broadcast, of mixed dtypes and
    of mixed layouts."""
    for shape, dtype, layout in itertools.product(SHAPES, dtypes, LAYOUTS):
        x = _tensor(shape, dtype, layout)
        if x is None:
            continue
        if arity == 1:
            yield (x,)
            continue
        yield x, _tensor(shape, dtype)  # type: ignore[misc]  # contiguous always applies
        if layout == "contiguous":
            yield x, torch.empty(shape, dtype=torch.float32 if dtype != torch.float32 else torch.float16,
                                 device="meta")
            if shape:
                yield x, torch.empty(shape[-1:], dtype=dtype, device="meta")  # broadcast
            yield x, torch.empty((), dtype=dtype, device="meta")


UNARY = (aten.neg.default, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.tanh.default,
         aten.sigmoid.default, aten.relu.default, aten.gelu.default, aten.silu.default, aten.sin.default,
         aten.cos.default)
BINARY = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.silu_backward.default,
          aten.tanh_backward.default, aten.sigmoid_backward.default)


# one rule (``_elementwise``) answers every unary op: the quick suite samples one op whose kernel keeps
# an integer input's dtype and refuses a bool one (neg), and one that promotes an integer to float (rsqrt)
@pytest.mark.quick_cases("aten.neg.default-sample", "aten.rsqrt.default-sample")
@EVERY
@pytest.mark.parametrize("op", UNARY, ids=str)
def test_unary_elementwise(op: Any, every: bool) -> None:
    answered = [_compare(op, x) for x in _sampled(_operands(1), every)]
    answered += [_compare(aten.gelu.default, x, {"approximate": approximate})
                 for x in _sampled(_operands(1, FLOATS), every) for approximate in ("tanh", "bogus")]
    assert _enough(answered, 4 * len(SHAPES) - 4, every)


@EVERY
@pytest.mark.parametrize("op", BINARY, ids=str)
def test_binary_elementwise(op: Any, every: bool) -> None:
    answered = [_compare(op, pair) for pair in _sampled(_operands(2), every)]
    if op in (aten.add.Tensor, aten.sub.Tensor):
        answered += [_compare(op, pair, {"alpha": alpha}) for pair in _sampled(_operands(2, FLOATS), every)
                     for alpha in (2, 0.5)]
    assert _enough(answered, 4 * len(SHAPES) - 4, every)


@pytest.mark.parametrize("op", (aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.pow.Tensor_Scalar), ids=str)
@EVERY
def test_tensor_and_scalar(op: Any, every: bool) -> None:
    answered = [_compare(op, (*x, scalar)) for x in _sampled(_operands(1), every) for scalar in (2, 0.5, True, -3, "2")]
    assert _enough(answered, 4 * 4 * len(SHAPES) - 16, every)


@pytest.mark.parametrize("op", (aten.threshold_backward.default, aten.gelu_backward.default), ids=str)
@EVERY
def test_backward_with_a_scalar_or_string(op: Any, every: bool) -> None:
    pairs = _sampled(_operands(2), every)
    if op is aten.threshold_backward.default:
        answered = [_compare(op, (*pair, threshold)) for pair in pairs for threshold in (0, 0.5)]
    else:
        answered = [_compare(op, pair, {"approximate": a}) for pair in pairs for a in ("none", "tanh", "bogus")]
    assert _enough(answered, 2 * 4 * len(SHAPES) - 8, every)


@pytest.mark.parametrize("op", (aten.zeros_like.default, aten.ones_like.default), ids=str)
@EVERY
def test_like(op: Any, every: bool) -> None:
    keywords: list[dict[str, Any]] = [{}, {"dtype": torch.float16}, {"dtype": torch.int64},
                                      {"memory_format": torch.preserve_format},
                                      {"memory_format": torch.contiguous_format},
                                      {"memory_format": torch.channels_last}, {"pin_memory": False},
                                      {"device": torch.device("meta"), "layout": torch.strided}]
    answered = [_compare(op, x, kw) for x in _sampled(_operands(1), every) for kw in keywords]
    assert _enough(answered, 6 * 4 * len(SHAPES), every)


def _matrices() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for (m, k, n), dtype, layout_a, layout_b in itertools.product(
            ((5, 3, 8), (1, 3, 8), (5, 3, 1), (1, 1, 1), (0, 3, 4), (4, 0, 3), (4, 3, 0), (2, 7, 2)),
            (*FLOATS, torch.int64), ("contiguous", "transposed", "offset"), ("contiguous", "transposed", "expanded")):
        a, b = _tensor((m, k), dtype, layout_a), _tensor((k, n), dtype, layout_b)
        if a is not None and b is not None:
            yield a, b
    yield torch.empty(5, 3, device="meta"), torch.empty(3, 8, dtype=torch.float16, device="meta")
    yield torch.empty(5, 3, device="meta"), torch.empty(4, 8, device="meta")
    yield torch.empty(2, 5, 3, device="meta"), torch.empty(3, 8, device="meta")


@EVERY
def test_mm(every: bool) -> None:
    answered = [_compare(aten.mm.default, pair) for pair in _sampled(_matrices(), every)]
    assert _enough(answered, 100, every)


@EVERY
def test_addmm(every: bool) -> None:
    answered = []
    for a, b in _sampled(_matrices(), every):
        m, n = a.shape[0], b.shape[-1]
        for bias_shape, layout in itertools.product(((n,), (m, n), (1, n), (m, 1), ()), ("contiguous", "expanded",
                                                                                         "transposed")):
            bias = _tensor(bias_shape, a.dtype, layout)
            if bias is not None:
                answered.append(_compare(aten.addmm.default, (bias, a, b)))
                if layout == "contiguous":
                    answered.append(_compare(aten.addmm.default, (bias, a, b), {"beta": 0.5, "alpha": 2}))
    assert _enough(answered, 200, every)


LAYER_NORM_SHAPES = (((2, 5, 8), [8]), ((2, 5, 8), [5, 8]), ((4, 8), [8]), ((8,), [8]), ((2, 1, 8), [8]),
                     ((2, 5, 1), [1]), ((2, 0, 8), [8]), ((2, 5, 8), [4]), ((2, 5, 8), []))


@EVERY
def test_layer_norm_and_its_backward(every: bool) -> None:
    answered = []
    for (shape, normalized), dtype, layout, affine in _sampled(itertools.product(
            LAYER_NORM_SHAPES, (*FLOATS, torch.int64), LAYOUTS, ("both", "weight", "none", "float32")), every):
        x = _tensor(shape, dtype, layout)
        if x is None:
            continue
        weight_dtype = torch.float32 if affine == "float32" else dtype
        weight = None if affine == "none" else torch.empty(normalized, dtype=weight_dtype, device="meta")
        bias = torch.empty(normalized, dtype=weight_dtype, device="meta") if affine in ("both", "float32") else None
        args = (x, normalized, weight, bias, 1e-5)
        answered.append(_compare(aten.native_layer_norm.default, args))
        if layout not in ("contiguous", "transposed", "odd_size_one"):
            continue  # the backward over the layouts the forward's own refusals cover
        try:
            _out, mean, rstd = aten.native_layer_norm.default(*args)
        except Exception:
            continue
        masks = ((True, True, True), (True, False, False), (False, True, True), (True, True, False),
                 (False, False, True))
        for mask, grad_layout in itertools.product(masks, ("contiguous", "transposed")):
            grad = _tensor(shape, dtype, grad_layout)
            if grad is not None:
                answered.append(_compare(aten.native_layer_norm_backward.default,
                                         (grad, x, normalized, mean, rstd, weight, bias, list(mask))))
    assert _enough(answered, 100, every)


@EVERY
@pytest.mark.parametrize("name", ("_log_softmax", "_softmax"))
def test_softmax_and_its_backward(name: str, every: bool) -> None:
    forward, backward = getattr(aten, name).default, getattr(aten, f"{name}_backward_data").default
    answered = []
    for x in _sampled(_operands(1), every):
        (x,) = x
        for dim, half_to_float in itertools.product((0, -1, 1, 3, -5), (False, True)):
            answered.append(_compare(forward, (x, dim, half_to_float)))
        for dim, dtype in itertools.product((0, -1, 2), (x.dtype, torch.float32)):
            answered.append(_compare(backward, (x, torch.empty_like(x), dim, dtype)))
    assert _enough(answered, 100, every)


@EVERY
def test_nll_loss_and_its_backward(every: bool) -> None:
    answered = []
    for (n, c), dtype, layout, reduction, target_dtype, weight in _sampled(itertools.product(
            ((6, 10), (1, 10), (6, 1), (0, 10)), (*FLOATS, torch.int64), ("contiguous", "transposed", "offset"),
            (0, 1, 2), (torch.int64, torch.int32), (False, True)), every):
        x = _tensor((n, c), dtype, layout)
        if x is None:
            continue
        target = torch.empty(n, dtype=target_dtype, device="meta")
        class_weights = torch.empty(c, dtype=dtype, device="meta") if weight else None
        args = (x, target, class_weights, reduction, -100)
        answered.append(_compare(aten.nll_loss_forward.default, args))
        try:
            loss, total = aten.nll_loss_forward.default(*args)
        except Exception:
            continue
        answered.append(_compare(aten.nll_loss_backward.default,
                                 (torch.empty_like(loss), x, target, class_weights, reduction, -100, total)))
    # a 1-D input (one sample) and a target of another shape are the kernel's
    answered.append(_compare(aten.nll_loss_forward.default, (torch.empty(10, device="meta"),
                                                             torch.empty((), dtype=torch.int64, device="meta"),
                                                             None, 1, -100)))
    assert _enough(answered, 60, every)


@EVERY
def test_dropout_and_its_backward(every: bool) -> None:
    answered = []
    for x in _sampled(_operands(1), every):
        (x,) = x
        for p, train in itertools.product((0.1, 0.0, 1.0), (True, False)):
            answered.append(_compare(aten.native_dropout.default, (x, p, train)))
        for mask_dtype, scale in itertools.product((torch.bool, torch.uint8), (1.25, 2)):
            answered.append(_compare(aten.native_dropout_backward.default,
                                     (x, torch.empty_strided(x.shape, x.stride(), dtype=mask_dtype, device="meta"),
                                      scale)))
    assert _enough(answered, 100, every)


@pytest.mark.parametrize("op", (aten.sum.dim_IntList, aten.mean.dim), ids=str)
@EVERY
def test_reductions(op: Any, every: bool) -> None:
    answered = []
    for x in _sampled(_operands(1), every):
        (x,) = x
        for dims, keepdim, dtype in itertools.product(([0], [-1], [1, 2], [0, -1], [], [1, 1], [5]), (False, True),
                                                      (None, torch.float64)):
            answered.append(_compare(op, (x, dims, keepdim), {"dtype": dtype}))
            answered.append(_compare(op, (x, dims), {}))
    assert _enough(answered, 200, every)


@EVERY
def test_cat(every: bool) -> None:
    answered = []
    for shape, dtype, layout, dim in _sampled(itertools.product(SHAPES, DTYPES, LAYOUTS, (0, 1, -1)), every):
        x = _tensor(shape, dtype, layout)
        if x is None:
            continue
        same = torch.empty(shape, dtype=dtype, device="meta")
        answered.append(_compare(aten.cat.default, ([x, same], dim)))
        answered.append(_compare(aten.cat.default, ([x],)))
        answered.append(_compare(aten.cat.default, ([same, same.to(torch.float16)], dim)))
        answered.append(_compare(aten.cat.default, ([same, torch.empty(0, dtype=dtype, device="meta")], dim)))
        if shape:
            longer = torch.empty((shape[0] + 2, *shape[1:]), dtype=dtype, device="meta")
            answered.append(_compare(aten.cat.default, ([same, longer, same], 0)))
            answered.append(_compare(aten.cat.default, ([same, longer], -1)))
    assert _enough(answered, 100, every)


def test_contiguous_strides_are_torchs() -> None:
    for shape in (*SHAPES, (3, 0, 1, 5), (1, 1, 1), (7, 1, 3, 1)):
        assert contiguous_strides(shape) == make_contiguous_strides_for(shape)


def test_every_rule_is_a_shortcut_and_tested() -> None:
    tested: set[Any] = {*UNARY, *BINARY, aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.pow.Tensor_Scalar,
                        aten.threshold_backward.default, aten.gelu_backward.default, aten.zeros_like.default,
                        aten.ones_like.default, aten.mm.default, aten.addmm.default, aten.native_layer_norm.default,
                        aten.native_layer_norm_backward.default, aten._log_softmax.default, aten._softmax.default,
                        aten._log_softmax_backward_data.default, aten._softmax_backward_data.default,
                        aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.native_dropout.default,
                        aten.native_dropout_backward.default, aten.sum.dim_IntList, aten.mean.dim, aten.cat.default}
    assert set(OUTPUT_RULES) == tested
    rules: dict[Any, Callable[..., Any]] = dict(OUTPUT_RULES)
    assert all(SHORTCUTS[op] is rule for op, rule in rules.items())


def _traced(model: str, rules: bool, **options: Any) -> tuple[Any, ...]:
    """The report and every trace of one estimate, the meta-kernel cache emptied first, with the
    output rules or without them (the kernels then run)."""
    import memcalc
    from memcalc.engine import trace

    traces: list[tuple[Any, ...]] = []
    stop = trace.StorageTracer.stop

    def kept(self: trace.StorageTracer) -> trace.StepTrace:
        out = stop(self)
        t = self.trace
        traces.append((list(t.nbytes), list(t.events), list(t.op), list(t.module), list(t.phase), dict(t.op_counts)))
        return out

    table = dict(trace._SHORTCUTS)
    if not rules:
        for op in OUTPUT_RULES:
            trace._SHORTCUTS.pop(id(op))
    trace.StorageTracer.stop = kept  # type: ignore[method-assign]
    try:
        trace.MetaKernelCache.clear()
        report = memcalc.estimate(model, **options)
    finally:
        trace.StorageTracer.stop = stop  # type: ignore[method-assign]
        trace._SHORTCUTS.clear()
        trace._SHORTCUTS.update(table)
        trace.MetaKernelCache.clear()
    return report.to_dict(), traces


@pytest.mark.parametrize(("model", "options"), [
    ("resnet50", {"batch_size": 2, "optimizer": "adam"}),
    pytest.param("gpt2", {"batch_size": 1, "seq_len": 32, "optimizer": "adamw", "precision": "amp-bf16"},
                 marks=pytest.mark.slow),
], ids=["resnet50", "gpt2-amp-bf16"])
def test_a_step_traces_the_same_with_the_rules(model: str, options: dict[str, Any]) -> None:
    """A whole step, cold, with and without the rules: the same storages, sizes, ops, modules,
    phases and op counts, event for event, and the same report."""
    assert _traced(model, True, **options) == _traced(model, False, **options)
