"""Per-op rules (memcalc.engine.rules): a registry refuses a second rule for an op, override
swaps one on purpose, and the CUDA registries hold the ops they are meant to."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memcalc.engine.rules import DuplicateRuleError, RuleRegistry
from memcalc.targets.cuda.emulation import EMULATION_RULES
from memcalc.targets.cuda.workspaces import CUBLAS_OPS, WORKSPACE_RULES

aten = torch.ops.aten


def first(*_: object) -> str:
    return "first"


def second(*_: object) -> str:
    return "second"


def test_duplicate_registration_is_refused() -> None:
    rules: RuleRegistry[Any] = RuleRegistry("test")
    rules.register(aten.mm.default)(first)
    with pytest.raises(DuplicateRuleError, match=r"aten\.mm\.default"):
        rules.register(aten.mm.default)(second)
    assert rules.get(aten.mm.default) is first  # the refused rule left nothing behind


def test_a_refused_group_registers_none_of_its_ops() -> None:
    rules: RuleRegistry[Any] = RuleRegistry("test")
    rules.register(aten.mm.default)(first)
    with pytest.raises(DuplicateRuleError):
        rules.register(aten.bmm.default, aten.mm.default)(second)
    assert aten.bmm.default not in rules


def test_the_workspace_registry_refuses_a_second_cublas_rule() -> None:
    with pytest.raises(DuplicateRuleError):
        WORKSPACE_RULES.register(aten.mm.default)(second)


def test_override_returns_the_previous_rule() -> None:
    rules: RuleRegistry[Any] = RuleRegistry("test")
    rules.register(F.dropout)(first)
    assert rules.override(F.dropout, second) is first
    assert rules.get(F.dropout) is second
    assert rules.override(F.dropout, None) is second  # None removes it
    assert F.dropout not in rules
    assert rules.override(F.dropout, first) is None  # there was none


def test_override_on_the_workspace_registry_can_be_undone() -> None:
    previous = WORKSPACE_RULES.override(aten.mm.default, second)
    try:
        assert previous is not None and WORKSPACE_RULES.get(aten.mm.default) is second
    finally:
        WORKSPACE_RULES.override(aten.mm.default, previous)
    assert WORKSPACE_RULES.get(aten.mm.default) is previous


def test_workspace_rules_cover_cublas_cudnn_fused_attention_and_reductions() -> None:
    attention = {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
    }
    reductions = {aten.sum.dim_IntList, aten.mean.dim}  # gpu_reduce_kernel's global scratch
    expected = {*CUBLAS_OPS, aten.convolution.default, aten.convolution_backward.default, *attention, *reductions}
    assert set(WORKSPACE_RULES) == expected
    # 12 cuBLAS kernels, float8's _scaled_mm (cuBLASLt shares the workspace from torch 2.11),
    # linear / matmul, which reach the tracer whole under inference_mode, and the four ``.out``
    # overloads Inductor's extern kernels call in a compiled step
    assert aten.mm.out in CUBLAS_OPS and aten.addmm.out in CUBLAS_OPS
    assert len(CUBLAS_OPS) == 19 and aten.addmm.default in CUBLAS_OPS and aten.bmm.default in CUBLAS_OPS
    assert aten._scaled_mm.default in CUBLAS_OPS
    assert aten.linear.default in CUBLAS_OPS and aten.matmul.default in CUBLAS_OPS
    # one rule for all cuBLAS ops; the forward and backward attention ops share one each
    assert len({WORKSPACE_RULES.get(op) for op in CUBLAS_OPS}) == 1


def test_emulation_rules_are_keyed_by_the_functions_torch_function_sees() -> None:
    assert set(EMULATION_RULES) == {
        F.scaled_dot_product_attention,
        aten.scaled_dot_product_attention,  # torch.ops.aten.scaled_dot_product_attention(...) called directly
        F.dropout,
        F.cross_entropy,
    }
    seen: list[object] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 4, 8)
    with Record():
        F.scaled_dot_product_attention(q, q, q)
        aten.scaled_dot_product_attention(q, q, q)
        F.dropout(q, 0.1)
        F.cross_entropy(torch.randn(3, 5), torch.tensor([1, 2, 3]))
    assert [func for func in seen if func in EMULATION_RULES] == [
        F.scaled_dot_product_attention, aten.scaled_dot_product_attention, F.dropout, F.cross_entropy]


def test_get_follows_override_and_takes_any_callable() -> None:
    # get() looks rules up by identity: a removed rule is gone from it too, and an unhashable
    # callable (a method of an unhashable object) is simply without a rule
    rules: RuleRegistry[Any] = RuleRegistry("test")
    rules.register(aten.mm.default)(first)
    rules.override(aten.mm.default, None)
    assert rules.get(aten.mm.default) is None
    assert rules.get([].append) is None
