"""An optimizer another package adds (memcalc.register_optimizer): registered from this test
module as a third-party package would, then estimated through the API and the CLI's --optim.

The toy is Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one
momentum buffer per parameter, in the parameter's dtype, and a sign update. It is not in
torch.optim, so it is written here as a plain ``torch.optim.Optimizer``; its state is whatever its
real ``step()`` keeps, as for torch's own optimizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Category
from memcalc.core.loop import OptimizerImpl
from memcalc.engine.optimizers import LOOPS, OPTIMIZERS, Optimizer, optimizer_names, spec_for
from memcalc.engine.rules import DuplicateRuleError
from memcalc.search.fit_result import DoesNotFitError

LION = "lion-toy"


class Lion(torch.optim.Optimizer):
    """Lion's update, one parameter at a time (the for-loop; ``foreach`` is accepted and ignored)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 foreach: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)  # the one state tensor, in p's dtype
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def _lion(params: Iterable[torch.nn.Parameter], impl: OptimizerImpl) -> torch.optim.Optimizer:
    return Lion(params, foreach=impl is OptimizerImpl.FOREACH)


SPEC = memcalc.OptimizerSpec(LION, "Lion (a test's own)", _lion, 3, "weights + grads + momentum", impls=LOOPS,
                             lighter="sgd")


@pytest.fixture(autouse=True)
def lion_registered() -> Iterator[None]:
    """Registered for each test and removed after, so that no other test (the --help goldens)
    sees it."""
    assert memcalc.register_optimizer(SPEC) is None
    try:
        yield
    finally:
        OPTIMIZERS.pop(LION)


def test_registered_optimizer_is_found_by_name_and_listed_before_none() -> None:
    assert spec_for(" Lion-Toy ") is SPEC
    assert optimizer_names()[-2:] == (LION, "none")


def test_a_second_registration_is_refused_unless_it_overrides() -> None:
    with pytest.raises(DuplicateRuleError, match="lion-toy"):
        memcalc.register_optimizer(SPEC)
    assert memcalc.register_optimizer(SPEC, override=True) is SPEC


@pytest.mark.parametrize("name", ["Lion", "lion toy", "a,b", ""])
def test_a_name_the_command_line_could_not_take_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="lower case"):
        memcalc.register_optimizer(memcalc.OptimizerSpec(name, "x", _lion, 3, "x"))


def test_estimate_counts_the_registered_optimizers_state() -> None:
    """Linear(256, 256, bias=False) in fp32: 65,536 weights × 4 B = 262,144 B of parameters; Lion
    keeps one fp32 buffer per weight: 262,144 B of optimizer state (a multiple of 512 B: no
    rounding), alive at the peak of the second iteration — as much as SGD with momentum keeps."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    report = memcalc.estimate(model, batch_size=4, input_shape=(256,), optimizer=LION)
    assert report.optimizer == LION
    assert report.bytes.category(Category.PARAMETERS) == 256 * 256 * 4
    assert report.bytes.category(Category.OPTIMIZER_STATE) == 256 * 256 * 4
    momentum = memcalc.estimate(model, batch_size=4, input_shape=(256,), optimizer="sgd-momentum")
    assert momentum.bytes.category(Category.OPTIMIZER_STATE) == report.bytes.category(Category.OPTIMIZER_STATE)


def test_the_spec_gives_the_lighter_optimizer_advice() -> None:
    """Batch 1 does not fit 256 KiB (the parameters alone take 256 KiB): the model states
    dominate, and the advice names the spec's lighter optimizer."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    with pytest.raises(DoesNotFitError) as caught:
        memcalc.max_batch_size(model, budget="256KiB", input_shape=(256,), optimizer=LION, margin=0)
    assert "a lighter optimizer (--optim sgd:" in str(caught.value.hint)


def test_cli_optim_takes_the_registered_optimizer() -> None:
    result = CliRunner().invoke(main, ["mlp", "--optim", LION, "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["optimizer"] == LION
    listed = CliRunner().invoke(main, ["estimate", "--help"], env={"COLUMNS": "2000"}).output
    assert re.search(r"--optim \[[a-z0-9|-]*\|lion-toy\|none\]", listed)


def test_every_registered_optimizer_is_in_the_estimate_docstring() -> None:
    """api.estimate's docstring lists every optimizer memcalc registers (this module's own aside:
    the docstring points a package's to register_optimizer)."""
    doc = memcalc.estimate.__doc__ or ""
    section = doc[doc.index("optimizer:"):doc.index("mode:")]
    listed = list(dict.fromkeys(re.findall(r"``([a-z0-9-]+)``", section)))  # in order, once each
    assert listed == [name for name in optimizer_names() if name != LION]
    assert set(listed) == {o.value for o in Optimizer}  # every built-in name registers
