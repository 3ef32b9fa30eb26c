"""The meta-kernel cache is an optimisation only: traces are identical with and without it."""

from __future__ import annotations

import pytest

import memcalc.engine.trace as trace_module
from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import trace_step as trace_model

pytestmark = pytest.mark.slow  # traces zoo models twice, with and without the cache

CASES = [
    *[("mlp", dict(batch_size=4), dict(optimizer=o, precision=p))  # the foreach shortcut, every optimizer
      for o in ("sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad") for p in ("fp32", "amp-fp16", "bf16")],
    ("resnet18", dict(batch_size=2, input_shape=(3, 64, 64))),
    ("vit_b_16", dict(batch_size=2), dict(precision="amp-fp16")),  # packed q/k/v gradients
    ("llama-tiny", dict(batch_size=2, seq_len=64)),  # _unsafe_view aliases without saying so
    ("densenet121", dict(batch_size=1, input_shape=(3, 64, 64))),
]


def _trace(name, resolve_kwargs, options):
    options = {"optimizer": "adam", **options}
    traced = trace_model(resolve(name, **resolve_kwargs), build_step(**options))
    return traced.trace.nbytes, traced.trace.events, traced.categories


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_cache_changes_nothing(case, monkeypatch):
    name, resolve_kwargs, *rest = case
    options = rest[0] if rest else {}
    trace_module.MetaKernelCache.clear()
    cached = _trace(name, resolve_kwargs, options)  # each output learnt in this trace, used from its repeats
    warm = _trace(name, resolve_kwargs, options)  # every cacheable call rebuilt from the first trace's
    monkeypatch.setattr(trace_module.MetaKernelCache, "run",
                        lambda self, func, args, kwargs, compute: compute(func, args, kwargs))
    uncached = _trace(name, resolve_kwargs, options)
    assert cached == uncached
    assert warm == uncached
