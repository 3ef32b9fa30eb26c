"""Real DeepSpeed ZeRO-3 on the CPU (``DS_ACCELERATOR=cpu``, two ranks over gloo): which parameters
are gathered on a rank after each module's forward pre-hook and post-hook, and after each
optimizer step, for three steps, under a few ``stage3_*`` settings. The reference for
tests/test_zero3_coordinator.py, which replays memcalc's ZeRO-3 over the same model and compares.

DeepSpeed is not one of memcalc's dependencies (it builds its ops for a GPU); it does install
with ``DS_BUILD_OPS=0`` and its ZeRO-3 runs on the CPU accelerator. Run as::

    DS_BUILD_OPS=0 pip install --target DIR deepspeed hjson py-cpuinfo msgpack einops ninja
    PYTHONPATH=DIR:. python tests/deepspeed_reference/zero3_gathers.py tests/data/deepspeed_zero3_gathers.json

(the output is committed: tests/data/deepspeed_zero3_gathers.json, with the DeepSpeed version).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

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
STEPS = 3


def model() -> nn.Module:
    """Modules of several sizes: weights of 16,384 to 65,536 elements, biases and a norm below 300."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64),
                         nn.LayerNorm(64), nn.Linear(64, 8))


def _run(name: str, extra: dict[str, int]) -> list[list[object]]:
    import deepspeed

    net = model()
    names = {id(p): n for n, p in net.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, **extra}}
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    events: list[list[object]] = []

    def gathered() -> list[str]:
        return sorted(names[id(p)] for p in net.parameters() if p.ds_status.name != "NOT_AVAILABLE")

    for index, module in enumerate(net):
        if next(module.parameters(recurse=False), None) is None:
            continue
        module.register_forward_pre_hook(lambda m, a, i=index: events.append([f"pre {i}", gathered()]))
        module.register_forward_hook(lambda m, a, o, i=index: events.append([f"post {i}", gathered()]))
    for step in range(STEPS):
        x = torch.randn(4, 64)
        loss = engine(x).mean()
        engine.backward(loss)
        events.append([f"backward {step}", gathered()])
        engine.step()
        events.append([f"step {step}", gathered()])
    return events


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = {"deepspeed": deepspeed.__version__, "world_size": torch.distributed.get_world_size(), "cases": {}}
    for name, extra in CASES.items():
        out["cases"][name] = {"settings": extra, "events": _run(name, extra)}
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as file:
            json.dump(out, file, indent=None)
            file.write("\n")


if __name__ == "__main__":
    if "RANK" not in os.environ:  # launch two ranks
        from torch.distributed.run import main as run

        run(["--nproc_per_node", "2", "--master_port", os.environ.get("PORT", "29613"), __file__,
             os.path.abspath(sys.argv[1])])
    else:
        with tempfile.TemporaryDirectory():
            main()
