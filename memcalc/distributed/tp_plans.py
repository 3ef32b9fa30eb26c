"""Tensor-parallel plans: which module gets which of torch's ``ParallelStyle``s.

A plan comes from one of three places, in this order of precedence:

- the user's, module-name pattern → style string (``{"mlp.up_proj": "colwise"}``), in the
  strings transformers uses (``"colwise"``, ``"rowwise"``, ``"sequence_parallel"``, ...);
- a Hugging Face model's own (``model.tp_plan``: the class's ``_tp_plan`` merged with
  ``config.base_model_tp_plan`` under the base model's prefix, as transformers' ``post_init``
  merges them);
- for the zoo's Llama family, torchtitan's plan (``torchtitan/models/llama3/infra/parallelize.py``,
  ``apply_tp`` without ``loss_parallel``), with sequence parallelism on the norms.

transformers (5.x) applies its plans with its own ``TensorParallelLayer`` classes; each string
is mapped here to the torch style with the same layouts (``transformers/distributed/
tensor_parallel.py``, ``ALL_PARALLEL_STYLES``), so that torch's own ``parallelize_module`` runs.
A string without a torch equivalent (packed, MoE, MLA styles) or a pattern that names no module
is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Final

from torch import nn

from memcalc.core.errors import InapplicableOptionError, InvalidInputError

if TYPE_CHECKING:  # torch.distributed.tensor (and sympy under it) is imported where a plan is made
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ("STYLES", "TpPlan", "hf_plan", "llama_plan", "planned", "planned_modules", "resolve_plan", "stage_plan",
           "user_plan", "without_expert_rules")


def _colwise() -> ParallelStyle:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))


def _colwise_gather() -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _rowwise() -> ParallelStyle:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel
    return RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())


def _rowwise_replicated_input() -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _sequence_parallel() -> ParallelStyle:
    from torch.distributed.tensor.parallel import SequenceParallel
    return SequenceParallel(use_local_output=True)


#: transformers' style strings with a torch equivalent, and the torch style of the same layouts
#: (``ALL_PARALLEL_STYLES`` in transformers/distributed/tensor_parallel.py). On an ``nn.Embedding``
#: torch's RowwiseParallel shards the vocabulary and ColwiseParallel the hidden dimension, as
#: transformers' ``EmbeddingParallel(shard_dim=0 / 1)`` does.
STYLES: Final[Mapping[str, Callable[[], ParallelStyle]]] = {
    "colwise": _colwise,
    "colwise_rep": _colwise_gather,
    "colwise_gather_output": _colwise_gather,
    "rowwise": _rowwise,
    "rowwise_rep": _rowwise_replicated_input,
    "rowwise_split_input": _rowwise_replicated_input,
    "embedding_rowwise": _rowwise_replicated_input,
    "embedding_colwise": _colwise_gather,
    "sequence_parallel": _sequence_parallel,
}
#: transformers' strings that leave a module whole on every rank.
_REPLICATED: Final = frozenset({"replicate"})


@dataclass(frozen=True)
class TpPlan:
    """A plan ready for ``parallelize_module``: ``styles`` by module-name pattern (``*`` matches
    one name), and where it came from (for the report)."""

    styles: Mapping[str, ParallelStyle]
    source: str


def user_plan(strings: Mapping[str, str], source: str = "the user's tp_plan") -> TpPlan:
    """The styles of module-name pattern → transformers style string.

    Raises:
        InvalidInputError: a string transformers does not define, or one torch has no style for.
    """
    styles: dict[str, ParallelStyle] = {}
    for pattern, name in strings.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"tp_plan[{pattern!r}] is {name!r}, not a style string",
                                    hint=f"Use one of: {', '.join(STYLES)}.")
        if name in _REPLICATED:
            continue
        make = STYLES.get(name)
        if make is None:
            raise InvalidInputError(
                f"tp_plan[{pattern!r}]: style {name!r} is not one memcalc applies with torch's parallelize_module",
                hint=f"Use one of: {', '.join(STYLES)} (transformers' strings with a torch ParallelStyle); packed, "
                     f"MoE and MLA styles are not modelled.")
        styles[pattern] = make()
    return TpPlan(styles, source)


def hf_plan(module: nn.Module, *, expert_parallel: bool = False) -> TpPlan | None:
    """A Hugging Face model's own plan (None: it has none); ``expert_parallel``: without the rules
    on the modules its ep plan shards (:func:`without_expert_rules`)."""
    plan = _hf_strings(module)
    if plan is None:
        return None
    if expert_parallel:
        plan = without_expert_rules(plan, module)
    return user_plan(plan, source=f"{type(module).__name__}'s own tp_plan (transformers)")


def _hf_strings(module: nn.Module) -> dict[str, str] | None:
    plan = getattr(module, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    config = getattr(module, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base, Mapping) or not base:
        return None
    prefix = getattr(module, "base_model_prefix", "")
    inner = prefix if prefix and isinstance(getattr(module, prefix, None), nn.Module) else ""
    return {f"{inner}.{k}" if inner else k: v for k, v in base.items()}


def without_expert_rules(strings: Mapping[str, str], module: nn.Module) -> dict[str, str]:
    """``strings`` less the rules on the modules ``module``'s ep plan names and on their children:
    under ep, transformers' ``_resolve_parallel_plans`` gives EP rules precedence this way
    ("a module that has an EP rule keeps no TP rule"). transformers 5.24's Mixtral plan has
    ``packed_colwise``/``moe_tp_experts`` rules on the experts (ETP = tp), which tp × ep drops."""
    ep_plan = getattr(module, "ep_plan", None)
    if not isinstance(ep_plan, Mapping) or not ep_plan:
        return dict(strings)
    is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
    return {pattern: style for pattern, style in strings.items() if not is_expert(pattern)}


def llama_plan(module: nn.Module, *, loss_parallel: bool = False) -> TpPlan | None:
    """torchtitan's Llama plan on the zoo's Llama layout (HF names): None for another model.
    ``loss_parallel``: the logits stay sharded over the vocabulary (a DTensor) for torch's
    ``loss_parallel`` cross-entropy, else they are gathered.

    torchtitan's names → the zoo's: tok_embeddings → model.embed_tokens, attention_norm →
    input_layernorm, attention.wq/wk/wv/wo → self_attn.q/k/v/o_proj, ffn_norm →
    post_attention_layernorm, feed_forward.w1/w3/w2 → mlp.gate/up/down_proj, norm → model.norm,
    output → lm_head.
    """
    names = {name for name, _ in module.named_modules()}
    if not names >= _LLAMA_LAYOUT or "model.layers.0.self_attn.q_proj" not in names:
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    layer = "model.layers.*"
    styles: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
        f"{layer}.input_layernorm": SequenceParallel(),
        # the zoo's attention takes (x, cos, sin, mask); torchtitan's (x, freqs_cis, masks)
        f"{layer}.self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                 desired_input_layouts=(Replicate(), None, None, None)),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    logits = "logits sharded for loss_parallel" if loss_parallel else "logits gathered"
    return TpPlan(styles, f"torchtitan's Llama plan (sequence parallel norms, {logits})")


#: The modules of the zoo's Llama layout (models_zoo/llama.py) that torchtitan's plan names.
_LLAMA_LAYOUT: Final = frozenset({"model.embed_tokens", "model.layers", "model.norm", "lm_head"})


def resolve_plan(module: nn.Module, strings: Mapping[str, str] | None, model_name: str, *,
                 loss_parallel: bool = False, expert_parallel: bool = False) -> TpPlan:
    """The plan for ``module``: the user's ``strings``, else the model's own, else torchtitan's
    for the zoo's Llama family; every pattern checked to name a module. ``expert_parallel``
    (tp × ep): without the rules on the modules the ep plan shards (:func:`without_expert_rules`).

    Raises:
        InvalidInputError: a bad style string, or a pattern that names no module.
        InapplicableOptionError: no plan given and the model has none; ``loss_parallel``
            with another plan than torchtitan's Llama plan.
    """
    if loss_parallel:
        plan = None if strings else llama_plan(module, loss_parallel=True)
        if plan is None:
            raise InapplicableOptionError(
                f"loss_parallel is estimated with torchtitan's Llama plan only (its head keeps the logits sharded "
                f"over the vocabulary as a DTensor); {model_name} "
                f"{'has a plan of the user' if strings else 'is not of the zoo Llama family'}",
                hint="Leave out loss_parallel: the logits are then gathered on every rank.")
    else:
        if strings:
            plan = user_plan(without_expert_rules(strings, module) if expert_parallel else strings)
        else:
            plan = hf_plan(module, expert_parallel=expert_parallel) or llama_plan(module)
    if plan is None:
        raise InapplicableOptionError(
            f"{model_name} has no tensor-parallel plan of its own (no Hugging Face tp_plan, not the zoo's Llama "
            f"family)",
            hint='Give one as module-name patterns and style strings, e.g. tp_plan={"layers.*.fc1": "colwise", '
                 '"layers.*.fc2": "rowwise"}.')
    names = [name for name, _ in module.named_modules() if name]
    for pattern in plan.styles:
        if not any(_matches(pattern, name) for name in names):
            raise InvalidInputError(
                f"tensor-parallel plan ({plan.source}): {pattern!r} names no module of {model_name}",
                hint="Patterns are module names as model.named_modules() gives them, '*' standing for one name "
                     "(layers.*.mlp.up_proj).")
    return plan


def planned_modules(module: nn.Module, plan: TpPlan) -> list[nn.Module]:
    """The submodules of ``module`` some pattern of ``plan`` names."""
    return [m for _, m, _ in planned(module, plan)]


def planned(module: nn.Module, plan: TpPlan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """Each submodule of ``module`` some pattern of ``plan`` names, by name, with the style of its
    first pattern, in ``named_modules`` order."""
    out = []
    for name, m in module.named_modules():
        style = next((s for p, s in plan.styles.items() if name and _matches(p, name)), None)
        if style is not None:
            out.append((name, m, style))
    return out


def stage_plan(plan: TpPlan, module: nn.Module, prefix: str = "") -> TpPlan:
    """``plan`` (resolved on the whole model) on a pipeline stage's ``module``, whose modules are
    the model's under ``prefix``: each pattern's style on the modules it names that hold
    parameters, by their full names. The blocks of other stages and the stand-ins of the first
    and last stages' modules hold none (:mod:`memcalc.distributed.pipeline_split`), so they get
    no style, as torchtitan's pruned stage models skip what they lost. The patterns' order is
    kept (``parallelize_module`` applies them in order)."""
    named = [(name[len(prefix):], name, m) for name, m in module.named_modules()
             if name.startswith(prefix) and len(name) > len(prefix)]
    holding = [(short, full) for short, full, m in named if next(m.parameters(), None) is not None]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.styles.items():
        for short, full in holding:
            if _matches(pattern, short):
                styles.setdefault(full, style)
    return TpPlan(styles, plan.source)


def _matches(pattern: str, name: str) -> bool:
    """Whether ``name`` is matched by ``pattern`` as parallelize_module matches it: atom by atom
    (split at dots), each by ``fnmatch``."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch(part, atom) for part, atom in zip(parts, atoms, strict=True))
