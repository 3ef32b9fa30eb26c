"""``memcalc plan``: which device mesh, micro-batch and checkpointing to train MODEL with on N
GPUs. Options, one call to :func:`memcalc.plan`, rendering; errors are mapped by
:func:`memcalc.cli.options.handle_errors`."""

from __future__ import annotations

from typing import Any

import click

from memcalc import api
from memcalc.cli.options import handle_errors, output_options, quiet
from memcalc.cli.params import OPTIMIZERS, PRECISIONS
from memcalc.core.units import Unit
from memcalc.distributed.collectives import DEFAULT_NETWORK
from memcalc.report.formats import render_json
from memcalc.report.plan_render import render_plan

__all__ = ("plan_command",)


@click.command("plan")
@click.argument("model")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs to train on (the mesh's world size).")
@click.option("--gpu", required=True, help="Catalogue GPU (memcalc gpus / README), e.g. h100-80gb.")
@click.option("--global-batch", type=click.IntRange(min=1), required=True,
              help="Samples per optimizer step over every GPU (micro-batch × data-parallel size × accumulation).")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Sequence length of a token model.")
@click.option("--precision", type=click.Choice(PRECISIONS, case_sensitive=False), default="amp-bf16",
              show_default=True, help="Numeric precision.")
@click.option("--optim", type=click.Choice(OPTIMIZERS, case_sensitive=False), default="adam", show_default=True,
              help="Optimizer.")
@click.option("--checkpoint", default="search",
              type=click.Choice(("search", "auto", "off", "selective-op", "full"), case_sensitive=False),
              show_default=True,
              help="Activation checkpointing: search tries off, selective-op and full; auto lets memcalc's "
                   "--checkpoint auto choose per configuration; or one setting.")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many configurations to show.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=DEFAULT_NETWORK.gpus_per_node,
              show_default=True, help="GPUs per node (joined by NVLink).")
@click.option("--intra-node-gbps", type=click.FloatRange(min=0, min_open=True),
              default=DEFAULT_NETWORK.intra_node_gbps, show_default=True,
              help="GB/s into each GPU within a node (NVLink 4: 450 each way).")
@click.option("--inter-node-gbps", type=click.FloatRange(min=0, min_open=True),
              default=DEFAULT_NETWORK.inter_node_gbps, show_default=True,
              help="GB/s into each GPU between nodes (one 400 Gb/s NIC per GPU: 50).")
@click.option("--cp/--no-cp", "context_parallel", default=None,
              help="Search context-parallel meshes (--cp) or not (--no-cp); by default from 16,384 tokens a sample.")
@click.option("--ep/--no-ep", "expert_parallel", default=None,
              help="Search expert-parallel meshes of a mixture of experts (the default) or not (--no-ep); a model "
                   "without experts has none.")
@output_options
@handle_errors
def plan_command(model: str, gpus: int, gpu: str, global_batch: int, seq_len: int | None, precision: str,
                 optim: str, checkpoint: str, top: int, gpus_per_node: int, intra_node_gbps: float,
                 inter_node_gbps: float, context_parallel: bool | None, expert_parallel: bool | None, fmt: str,
                 units: str, debug: bool) -> None:
    """The fastest meshes (dp_replicate, dp_shard, tp, pp, cp; ep for a mixture of experts), pipeline
    schedules, micro-batches and activation checkpointing to train MODEL on --gpus GPUs that fit
    --gpu, ranked by estimated step time (the roofline of the traced step, the pipeline bubble,
    and a collective cost model with NVLink within a node and the network between nodes).

    Exits 1 when nothing fits (what was pruned, and why, is printed).

    \b
    Example: memcalc plan llama-3-70b --gpus 64 --gpu h100-80gb --global-batch 64 --seq-len 8192
    """
    with quiet():
        result = api.plan(model, gpus=gpus, gpu=gpu, global_batch=global_batch, seq_len=seq_len,
                          precision=precision, optimizer=optim, gpus_per_node=gpus_per_node,
                          intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps, top=top,
                          checkpoint=checkpoint.lower(), context_parallel=context_parallel,
                          expert_parallel=expert_parallel)
    payload: Any = result.to_dict()
    if fmt == "json":
        click.echo(render_json(payload))
    else:
        click.echo(render_plan(result, unit=Unit(units), fmt=fmt))
    if not result.best:  # nothing fits: exit 1, as memcalc fit does
        raise SystemExit(1)
