"""Real DeepSpeed ZeRO-3 on the CPU (``DS_ACCELERATOR=cpu``, two ranks over gloo): which parameters
are gathered on a rank (a bitmask over ``named_parameters``) after each module's forward pre-hook
and post-hook, after backward and after each optimizer step, for three steps, under a few
``stage3_*`` settings (:data:`CASES`, :data:`LLAMA_CASES`). The reference for
tests/test_zero3_coordinator.py, which replays memcalc's ZeRO-3 over the same model and compares.

DeepSpeed is not one of memcalc's dependencies (it builds its ops for a GPU); it does install
with ``DS_BUILD_OPS=0`` and its ZeRO-3 runs on the CPU accelerator. Run as::

    DS_BUILD_OPS=0 pip install --target DIR deepspeed hjson py-cpuinfo msgpack einops ninja
    PYTHONPATH=DIR:. python tests/deepspeed_reference/zero3_gathers.py tests/data/deepspeed_zero3_gathers.json

(the output is committed: tests/data/deepspeed_zero3_gathers.json, with the DeepSpeed version).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from two_ranks import (
    backward_and_step,
    bitmask,
    gathered_masks,
    record_forward_hooks,
    run_on_two_ranks,
    stage3_config,
    start,
    write_record,
)

#: The settings run (the keys of zero_optimization besides the stage; defaults elsewhere).
CASES: dict[str, dict[str, int]] = {
    "defaults": {},
    "threshold-300": {"stage3_param_persistence_threshold": 300, "stage3_max_reuse_distance": 0},
    "no-prefetch": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 0},
    "bucket-20000": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 20_000,
                     "stage3_max_reuse_distance": 0},
    "live-40000": {"stage3_param_persistence_threshold": 300, "stage3_prefetch_bucket_size": 100_000,
                   "stage3_max_live_parameters": 40_000},
    "reuse-70000": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 70_000},
}
#: Llama-3-8B's shape at 1/4096 of its elements (a layer 53,248 elements, q/o 4,096, k/v 1,024,
#: gate/up/down 14,336, the head 131,328, untied input projection the same) under DeepSpeed's defaults
#: scaled alike: prefetch 5e7 → 12,207, live and reuse 1e9 → 244,140, threshold 1e5 → 24 (the norms,
#: 64 elements, persist at 100).
LLAMA_CASES: dict[str, dict[str, int]] = {
    "llama-scaled-defaults": {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 12_207,
                              "stage3_max_live_parameters": 244_140, "stage3_max_reuse_distance": 244_140},
}
STEPS = 3


def model() -> nn.Module:
    """Modules of several sizes: weights of 16,384 to 65,536 elements, biases and a norm below 300."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64),
                         nn.LayerNorm(64), nn.Linear(64, 8))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(64), nn.LayerNorm(64)
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64, bias=False), nn.Linear(64, 16, bias=False),
                                          nn.Linear(64, 16, bias=False), nn.Linear(64, 64, bias=False))
        self.gate, self.up, self.down = (nn.Linear(64, 224, bias=False), nn.Linear(64, 224, bias=False),
                                         nn.Linear(224, 64, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        a = self.q(h)[..., :16] * self.k(h) * self.v(h)
        x = x + self.o(torch.cat([a, a, a, a], -1))
        h = self.n2(x)
        return x + self.down(torch.relu(self.gate(h)) * self.up(h))


class LlamaShaped(nn.Module):
    """Llama-3-8B's module order and relative sizes at 1/4096 (:data:`LLAMA_CASES`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2052, 64, bias=False)
        self.layers = nn.ModuleList(_Layer() for _ in range(32))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 2052, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def llama_shaped() -> nn.Module:
    torch.manual_seed(0)
    return LlamaShaped()


def mask_of(order: list[str]) -> Callable[[Iterable[str]], str]:
    """The gathered parameters as a hex bitmask over ``named_parameters`` order (bit i: the i-th)."""
    return lambda gathered: bitmask(order, gathered)


def _run(name: str, extra: dict[str, int]) -> list[list[str]]:
    import deepspeed

    net = llama_shaped() if name in LLAMA_CASES else model()
    config = stage3_config(4, extra)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    events: list[list[str]] = []
    gathered = gathered_masks({"": net})  # one model: its mask alone, its modules' events unprefixed
    record_forward_hooks({"": net}, events, gathered)
    for step in range(STEPS):
        x = torch.randn(4, 2052 if name in LLAMA_CASES else 64)
        loss = engine(x).mean()
        backward_and_step(engine, loss, step, events, gathered)
    return events


def main() -> None:
    out = {**start(), "cases": {name: {"settings": extra, "events": _run(name, extra)}
                                for name, extra in {**CASES, **LLAMA_CASES}.items()}}
    write_record(out)


if __name__ == "__main__":
    run_on_two_ranks(__file__, main, "29613")
