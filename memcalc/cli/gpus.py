"""``memcalc gpus``: the GPUs this machine has, as PyTorch would number them."""

from __future__ import annotations

import warnings
from typing import Any

import click
from tabulate import tabulate

from memcalc.cli.options import handle_errors, output_options
from memcalc.core.units import format_bytes
from memcalc.report.formats import render_json
from memcalc.targets.cuda.gpus import local as gpu_local

__all__ = ("gpus_command",)


@click.command("gpus")
@output_options
@handle_errors
def gpus_command(fmt: str, units: str, debug: bool) -> None:
    """List the GPUs this process can see (after CUDA_VISIBLE_DEVICES), in torch's order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gpu_local.GpuDiscoveryWarning)
        found = gpu_local.list_local_gpus()
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)
    best = gpu_local.best_gpu(found)
    if fmt == "json":
        click.echo(render_json([_gpu_dict(g, g is best) for g in found]))
        return
    if not found:
        click.echo("No GPU is visible to this process (NVML, nvidia-smi and torch.cuda found none). "
                   "Fit questions can still name a GPU model: memcalc fit MODEL --gpu a100-40gb.")
        return
    rows = [[g.device, "-" if g.physical_index is None else str(g.physical_index), g.name,
             format_bytes(g.total_memory, units), format_bytes(g.free_memory, units),
             g.profile.key if g.profile else "-", "*" if g is best else ""] for g in found]
    click.echo(tabulate(rows, headers=["device", "physical", "name", "total", "free", "catalogue", ""],
                        tablefmt=fmt, colalign=("left", "right", "left", "right", "right", "left", "left"),
                        disable_numparse=True))
    assert best is not None
    click.echo(f"\n* most free memory: --device auto picks {best.device}. Memory in binary units; "
               f"physical = nvidia-smi's index.")


def _gpu_dict(gpu: gpu_local.LocalGpu, best: bool) -> dict[str, Any]:
    return {"device": gpu.device, "logical_index": gpu.logical_index, "physical_index": gpu.physical_index,
            "name": gpu.name, "uuid": gpu.uuid, "total_memory": gpu.total_memory,
            "free_memory": gpu.free_memory, "catalogue": gpu.profile.key if gpu.profile else None,
            "most_free": best}

