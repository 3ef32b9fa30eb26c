"""A pipeline with tensor parallelism and no ``dp_shard`` (nor ``cp``) that memcalc refuses at trace time,
found before any trace (:func:`memcalc.search.plan.refusal` asks it).

Without FSDP2 a stage's parameters that the tensor-parallel plan gives no distributing style
(a Hugging Face plan's norms) stay plain tensors beside the DTensors, and a foreach or fused
optimizer refuses that mix: each stage's :class:`~memcalc.distributed.tensor_parallel.TensorParallel`
raises it when installed, after ``plan`` has spent a probe (seconds on a 70B model) on it. Both ask
one rule, :func:`~memcalc.distributed.tensor_parallel.refused_mix`: the trace of the parallelized
stage's parameters, this module of each block's as the plan's styles will distribute them.

Said here only where the trace would certainly say it: the optimizer's implementation (resolved
as the pipeline resolves it) is foreach or fused, the whole model is trained (no adapters, nothing
frozen), and every block holds both a parameter some style distributes and one none does. Each
stage holds at least one whole block (plan's pp degrees never exceed the blocks), so every
stage, rank 0 first, would refuse. A parameter is distributed when it lies under a module that
a ``ColwiseParallel``, ``RowwiseParallel`` or ``SequenceParallel`` style names (torch's
``distribute_module`` replicates whatever its partition function leaves, recursively);
``PrepareModuleInput``/``Output`` only add hooks. Any other style: not decided here (traced).
tests/test_plan_refusals.py checks the answer against the real trace's refusal.
"""

from __future__ import annotations

from torch import nn

from memcalc.core.finetune import FineTune
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.pipeline_split import block_containers_of
from memcalc.distributed.tensor_parallel import mix_refused_by, refused_mix
from memcalc.distributed.tp_plans import TpPlan, planned_modules, resolve_plan
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.step_spec import Step

__all__ = ("plain_beside_dtensors",)



def plain_beside_dtensors(step: Step, mesh: Mesh, resolved: ResolvedModel) -> str | None:
    """Why ``mesh`` (pp × tp without dp_shard or cp) would be refused at trace time for mixing plain
    and DTensor parameters under a foreach or fused optimizer (module docstring); None: not
    certain, left to the trace. With cp FSDP2 wraps each stage over dp_shard × cp, as with dp_shard:
    every parameter a DTensor, nothing refused."""
    if (mesh.pp == 1 or mesh.tp == 1 or mesh.dp_shard > 1 or mesh.cp > 1 or mesh.ep > 1
            or step.finetune != FineTune()):
        return None
    impl = resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)
    if not mix_refused_by(impl):
        return None
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )
    distributing_styles = (ColwiseParallel, RowwiseParallel, SequenceParallel)
    hooks_only = (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
    module = resolved.module
    plan = resolve_plan(module, None, resolved.name)
    if any(not isinstance(style, distributing_styles + hooks_only) for style in plan.styles.values()):
        return None
    distributing = TpPlan({p: s for p, s in plan.styles.items() if isinstance(s, distributing_styles)}, plan.source)
    styled = {id(m) for m in planned_modules(module, distributing)}
    roots = [name for name, m in module.named_modules() if id(m) in styled]
    parameters = list(module.named_parameters())
    if not parameters or not all(p.requires_grad for _, p in parameters):
        return None
    blocks = [f"{c}.{i}" for c in block_containers_of(module, resolved.block_containers)
              for i, _ in enumerate(_children(module, c))]
    if not blocks:
        return None
    plain: list[str] = []
    for block in blocks:  # each stage holds whole blocks: refused if each block alone would be
        names = [name for name, _ in parameters if name.startswith(block + ".")]
        refused = refused_mix(impl, {name: any(name.startswith(root + ".") for root in roots) for name in names})
        if not refused:
            return None  # a block of one kind only: a stage of such blocks may run
        plain += refused
    shown = ", ".join(plain[:2]) + (f" and {len(plain) - 2} more" if len(plain) > 2 else "")
    return (f"pp={mesh.pp} with tp={mesh.tp} and no dp_shard: the tensor-parallel plan ({plan.source}) leaves "
            f"trainable parameters of every block plain tensors beside DTensors ({shown}), which torch's "
            f"{impl.value} optimizer refuses (aten._foreach_* ops); with dp_shard FSDP2 makes them DTensors")


def _children(module: nn.Module, container: str) -> list[nn.Module]:
    return list(module.get_submodule(container).children())
