"""What the gloo ranks import, imported once per test process by the forkserver that forks them
(:func:`gloo_runs.spawn_ranks`), so that a rank starts without an interpreter start and these
imports: about 2.5 CPU-s a rank with ``spawn``, 4 where the rank also imports transformers (the
expert-parallel runs), and 1.5 more where ``distribute_tensor`` first imports ``torch._dynamo``
(issue 36, item 7: a 2 × 2 mesh run paid it four times).

Imports only: nothing here runs a tensor operation, which would start OpenMP's threads in the
forkserver and leave its forked children with a pool they cannot use. Then the collector freezes
what the imports made (as tests/conftest.py does after collection), so that each rank's
``gc.collect()`` between its steps scans the objects of its own run, not every imported module.
A module the installed torch or transformers lacks is left to the rank, which then imports it or
fails as it would under ``spawn`` (the forkserver ignores an ``ImportError`` in its preload, not
another error, hence the ``try`` around each).
"""

from __future__ import annotations

import contextlib
import gc
import importlib

#: Every module a rank of tests/gloo_*.py imports beyond the harness's own imports, in import order.
MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch._dynamo",  # imported by distribute_tensor's first call (parallelize_module, fully_shard over DTensors)
    "torch.profiler",
    "gloo_runs",
    "gloo_tp",
    "gloo_pipeline",
    "gloo_pipeline_tp",
    "gloo_ep",
    "memcalc.measure.step",
    "memcalc.distributed.tp_plans",
    "memcalc.stacks.peft",
    "memcalc.engine.step",
    "memcalc.fields",
    "transformers",
    "transformers.distributed.expert_parallel",
    "transformers.models.mixtral.modeling_mixtral",
)

for _name in MODULES:
    with contextlib.suppress(Exception):  # the rank imports it, or reports why not (module docstring)
        importlib.import_module(_name)
gc.collect()
gc.freeze()
