"""What memcalc's ZeRO-3 engines hold gathered, read where the real DeepSpeed references read it
(tests/deepspeed_reference/*.py): at each parameter-owning module's forward pre-hook and
post-hook, after backward and after each step. Shared by the TRL ZeRO-3 comparisons (DPO, GRPO),
whose recorded events are bitmasks over each engine's ``named_parameters``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero import ZeroProgram

#: The recorded DeepSpeed config keys, by ZeroStage3's names for them.
KEYS = {"stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size", "stage3_max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance"}
#: No prefetch, no persistent parameter, nothing kept for reuse: each module gathers its own parameters
#: and releases them after itself.
PLAIN = ZeroStage3(param_persistence_threshold=0, prefetch_bucket_size=0, max_reuse_distance=0)


def hook_gathers(program: ZeroProgram, tracer: Any, module: nn.Module, keys: Sequence[str],
                 events: list[list[str]], install: Callable[[ZeroProgram, Any, nn.Module], None],
                 ) -> tuple[dict[str, Any], Callable[[], str]]:
    """Install ``program`` (the real ``ZeroProgram.install``), then record every module hook of the
    engines named ``keys`` (submodules of ``module``) into ``events``; returns the engines'
    coordinators by key and the reader of their bitmasks, for the caller's own points."""
    models = {key: module.get_submodule(key) for key in keys}
    names = {key: {id(p): n for n, p in m.named_parameters()} for key, m in models.items()}
    order = {key: {n: i for i, n in enumerate(v.values())} for key, v in names.items()}
    install(program, tracer, module)
    assert program.sharded is not None
    coordinators = dict(zip(keys, program.sharded.coordinators, strict=True))

    def gathered() -> str:
        return " ".join(hex(sum(1 << order[key][names[key][id(p.original)]] for p in c.params if c.available(p)))
                        for key, c in coordinators.items())

    for key, net in models.items():
        for index, child in net.named_modules():
            if next(child.parameters(recurse=False), None) is None:
                continue
            program._handles.append(child.register_forward_pre_hook(
                lambda m, a, k=key, i=index: events.append([f"pre {k}.{i}", gathered()])))
            program._handles.append(child.register_forward_hook(
                lambda m, a, o, k=key, i=index: events.append([f"post {k}.{i}", gathered()])))
    return coordinators, gathered


def record_steps(program: ZeroProgram, events: list[list[str]], gathered: Callable[[], str],
                 backward_label: Callable[[], str]) -> None:
    """Record the gathered bitmasks before each backward (labelled by ``backward_label``) and after
    each optimizer step (numbered by the backwards recorded so far)."""
    around = program._around()
    assert around is not None

    def before() -> None:
        events.append([backward_label(), gathered()])
        around[0]()

    def after() -> None:
        around[1]()
        events.append([f"step {sum(e[0].startswith('backward') for e in events) - 1}", gathered()])

    program._around = lambda: (before, after)  # type: ignore[method-assign]


def write_hf_config(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> str:
    """``config`` written as a Hugging Face config file, as the ``hf:`` model source that names it
    (the comparisons build the references' tiny models from the same dicts)."""
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return f"hf:{path}"
