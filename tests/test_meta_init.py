"""Random fills skipped while a model is built on meta (memcalc.sources.meta_init, issue 36): the
same estimate, byte for byte, as with every fill run; the fills gone from the build; a real build
still filled as its constructor says."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memcalc
from memcalc.sources import resolve as resolve_module
from memcalc.sources.meta_init import MetaRandomFillsSkipped


class _AtenOps(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("model", "options"), [
    ("gpt2", {"batch_size": 2, "seq_len": 64, "optimizer": "adamw"}),  # transformers' Conv1D: nn.init.normal_
    ("resnet18", {"batch_size": 2, "optimizer": "sgd"}),  # conv and linear reset_parameters: kaiming_uniform_
    ("torch:llama-tiny", {"batch_size": 2, "seq_len": 32, "optimizer": "adam", "precision": "amp-bf16"}),
])
def test_the_estimate_is_the_one_with_every_fill_run(model: str, options: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    skipped = memcalc.estimate(model, **options).to_dict()
    monkeypatch.setattr(resolve_module, "MetaRandomFillsSkipped", contextlib.nullcontext)
    filled = memcalc.estimate(model, **options).to_dict()
    assert json.dumps(skipped, sort_keys=True, default=str) == json.dumps(filled, sort_keys=True, default=str)


def test_no_fill_reaches_a_meta_kernel() -> None:
    with _AtenOps() as seen, MetaRandomFillsSkipped(), torch.device("meta"):
        layer = nn.Linear(8, 4)  # kaiming_uniform_ on the weight, uniform_ on the bias
        nn.init.normal_(layer.weight, std=0.02)
        nn.init.trunc_normal_(layer.weight)
        layer.bias.uniform_(-1, 1)  # a method, by position
    assert not [name for name in seen.names if any(fill in name for fill in ("normal", "uniform", "fill"))]
    with _AtenOps() as seen, torch.device("meta"):
        nn.Linear(8, 4)
    assert any("uniform" in name for name in seen.names)  # without the mode the fills do run


def test_a_real_build_is_filled_as_without_the_mode() -> None:
    torch.manual_seed(0)
    with MetaRandomFillsSkipped():  # a CPU build (what --measure runs): every fill runs, the same draws
        got = nn.Linear(8, 4)
        nn.init.normal_(got.weight)
    torch.manual_seed(0)
    expected = nn.Linear(8, 4)
    nn.init.normal_(expected.weight)
    assert torch.equal(got.weight, expected.weight) and torch.equal(got.bias, expected.bias)
