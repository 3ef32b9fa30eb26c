"""A FLOP formula that fails costs FLOPs, never the estimate (issue 22).

torch's own formulas (``torch.utils.flop_counter.flop_registry``) change between releases:
before 2.13 ``sdpa_flop_count`` asserted on grouped-query attention (key/value with fewer heads
than the query), and every GQA LLM estimate died in the FLOP recorder on torch 2.11. These tests
put such formulas in place and check that the memory figures do not move, that a time still
comes out, that GQA is counted by broadcasting the key/value heads, and that an op whose formula
fails is named in a note. They also pin that no recording happens unless a time is asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import hf_config_source
from torch import nn

import memcalc
from memcalc.timing import flops

aten = torch.ops.aten
_SDPA_FORWARD = (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                 aten._scaled_dot_product_cudnn_attention)
_SDPA_BACKWARD = (aten._scaled_dot_product_efficient_attention_backward,
                  aten._scaled_dot_product_flash_attention_backward,
                  aten._scaled_dot_product_cudnn_attention_backward)


def _sdpa_flop_torch_2_11(query_shape: Any, key_shape: Any, value_shape: Any, *_args: Any, out_shape: Any = None,
                          **_kwargs: Any) -> int:
    """torch 2.11's ``sdpa_flop_count``: the same shapes for query, key and value, or an assert."""
    b, h, s_q, d_q = query_shape
    _b2, _h2, s_k, _d2 = key_shape
    _b3, _h3, _s3, d_v = value_shape
    assert b == _b2 == _b3 and h == _h2 == _h3 and d_q == _d2 and s_k == _s3, \
        "sdpa_flop_count: query/key/value shapes are incompatible"
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


def _sdpa_backward_flop_torch_2_11(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                                   *_args: Any, out_shape: Any = None, **_kwargs: Any) -> int:
    b, h, s_q, d_q = query_shape
    _b2, _h2, s_k, _d2 = key_shape
    _b3, _h3, _s3, d_v = value_shape
    assert h == _h2 == _h3 == grad_out_shape[1], "sdpa_backward_flop_count: batch/heads mismatch among tensors"
    return 2 * (2 * b * h * s_q * s_k * d_q) + 2 * (2 * b * h * s_q * s_k * d_v) + 2 * b * h * s_q * s_k * d_q


def _shape_wrapped(formula: Any) -> Any:
    """As torch registers them: a wrapper whose ``__wrapped__`` takes shapes (flops.py unwraps it)."""
    def wrapper(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("memcalc calls the unwrapped formula with shapes")
    wrapper.__wrapped__ = formula  # type: ignore[attr-defined]
    return wrapper


@pytest.fixture
def torch_2_11_sdpa_formulas(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The installed torch's SDPA FLOP formulas replaced by 2.11's, which assert on GQA."""
    registry = dict(flops.flop_registry)
    for op in _SDPA_FORWARD:
        registry[op] = _shape_wrapped(_sdpa_flop_torch_2_11)
    for op in _SDPA_BACKWARD:
        registry[op] = _shape_wrapped(_sdpa_backward_flop_torch_2_11)
    monkeypatch.setattr(flops, "flop_registry", registry)
    yield


def _failing(*_args: Any, **_kwargs: Any) -> int:
    raise RuntimeError("this formula cannot count this call")


def test_kv_heads_broadcast_hand_count(torch_2_11_sdpa_formulas: None) -> None:
    # q (2, 8, 16, 64), k and v (2, 2, 16, 64): 4 query heads per key/value head. The kernel
    # broadcasts K/V to 8 heads: Q·Kᵀ is 2·b·h·s·s·d = 2·2·8·16·16·64 = 524,288 FLOPs, and
    # P·V the same again: 1,048,576; causal halves it: 524,288.
    recorder = flops.OpCostRecorder()
    tracer = memcalc.engine.trace.StorageTracer("meta", after_op=recorder)
    recorder.attach(tracer)
    q = torch.empty(2, 8, 16, 64, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(2, 2, 16, 64, device="meta", dtype=torch.bfloat16)
    op = aten._scaled_dot_product_efficient_attention.default
    with tracer:
        for causal in (False, True):
            op(q, k.expand(2, 2, 16, 64), v, None, False, is_causal=causal)
    tracer.stop()
    counted = [r.flops for r in recorder.records if r.op == op.__name__]
    assert counted == [1_048_576, 524_288]
    assert recorder.failures == {}


def test_gqa_llm_estimates_and_times_with_torch_2_11_formulas(torch_2_11_sdpa_formulas: None, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    source = hf_config_source(tmp_path)  # Llama with 4 query heads over 2 key/value heads
    kwargs: dict[str, Any] = dict(batch_size=2, seq_len=64, gpu="h100-80gb", precision="amp-bf16")
    broadcasts: list[str] = []
    original = flops._kv_heads_broadcast

    def spy(rule: Any, shapes: tuple[Any, ...]) -> Any:
        widened = original(rule, shapes)
        if widened is not None:
            broadcasts.append(rule.name)
        return widened

    monkeypatch.setattr(flops, "_kv_heads_broadcast", spy)
    timed = memcalc.estimate(source, time=True, **kwargs)
    assert timed.time is not None and timed.time.flops.failed == ()
    # the key/value heads reached the kernel ungrouped (enable_gqa), forward and backward
    assert any("backward" in name for name in broadcasts) and any("backward" not in name for name in broadcasts)
    attention = sum(f for op, f in timed.time.flops.ops if "attention" in op)
    assert attention > 0
    # the count equals the installed torch's (2.13 on: GQA counted as the broadcast product)
    monkeypatched = flops.flop_registry
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flops, "flop_registry", torch.utils.flop_counter.flop_registry)
        native = memcalc.estimate(source, time=True, **kwargs)
    assert flops.flop_registry is monkeypatched
    assert native.time is not None and timed.time.flops.total == native.time.flops.total
    assert timed.bytes == native.bytes


def test_a_failing_formula_leaves_memory_unchanged_and_names_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    kwargs: dict[str, Any] = dict(inputs=torch.randn(100, 32), loss="mean", optimizer="adam", gpu="a100-80gb")
    before = memcalc.estimate(model, time=True, **kwargs)
    registry = dict(flops.flop_registry)
    registry[aten.addmm] = _failing  # the forward's Linear: torch's formula raises
    monkeypatch.setattr(flops, "flop_registry", registry)
    after = memcalc.estimate(model, time=True, **kwargs)
    assert after.bytes == before.bytes and after.peak_reserved == before.peak_reserved
    assert after.time is not None and before.time is not None
    # forward 2·100·32·64 + 2·100·64·16 = 614,400 FLOPs of addmm are missing; the backward's mm remain
    assert before.time.flops.total - after.time.flops.total == 614_400
    assert dict(after.time.flops.failed) == {"addmm.default": "RuntimeError: this formula cannot count this call"}
    assert dict(after.time.flops.uncounted)["addmm.default"] == 2
    notes = [n for n in after.notes if "addmm.default" in n]
    assert len(notes) == 1 and "not counted" in notes[0] and "memory figures do not depend on them" in notes[0]
    # the op is still timed by its bytes
    assert after.time.seconds > 0
    assert after.to_dict()["time"]["flops"]["failed"] == {"addmm.default": "RuntimeError: this formula cannot count "
                                                                           "this call"}


def test_a_failing_byte_rule_costs_the_op_not_the_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    kwargs: dict[str, Any] = dict(inputs=torch.randn(100, 32), loss="mean", optimizer="sgd", gpu="a100-80gb")
    before = memcalc.estimate(model, **kwargs)
    original = flops.OpCostRecorder._reads

    def reads(self: flops.OpCostRecorder, rule: Any, args: Any, kwargs: Any) -> Any:
        if rule.name == "relu.default":
            raise ValueError("no byte rule for this call")
        return original(self, rule, args, kwargs)

    monkeypatch.setattr(flops.OpCostRecorder, "_reads", reads)
    after = memcalc.estimate(model, time=True, **kwargs)
    assert after.bytes == before.bytes
    assert after.time is not None and dict(after.time.flops.failed) == {"relu.default": "ValueError: no byte rule "
                                                                                         "for this call"}
    assert any("relu.default" in n for n in after.notes)


def test_no_recording_unless_a_time_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    original = flops.OpCostRecorder.__call__

    def counting(self: flops.OpCostRecorder, *args: Any) -> None:
        nonlocal calls
        calls += 1
        original(self, *args)

    monkeypatch.setattr(flops.OpCostRecorder, "__call__", counting)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    kwargs: dict[str, Any] = dict(inputs=torch.randn(100, 32), loss="mean", optimizer="sgd", gpu="a100-80gb")
    report = memcalc.estimate(model, **kwargs)
    assert calls == 0 and report.time is None
    # asked afterwards: one more trace records the costs, and the figures are those of a timed estimate
    later = memcalc.step_time(report)
    assert calls > 0
    timed = memcalc.estimate(model, time=True, **kwargs)
    assert timed.time is not None and later.seconds == timed.time.seconds
    assert report.flops() == timed.flops()


def test_time_needs_a_gpu_with_figures() -> None:
    with pytest.raises(memcalc.InvalidInputError, match="time"):
        memcalc.estimate(nn.Linear(4, 4), inputs=torch.randn(2, 4), loss="mean", time=True)
