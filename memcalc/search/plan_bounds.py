"""The cheap bounds ``memcalc plan`` prunes with before it traces anything.

Both are lower bounds, so pruning on them never drops a configuration that would have won:

- **memory**: the model states a rank holds whatever its activations (:func:`states_floor`):
  each trainable parameter's stored bytes × the optimizer's textbook multiplier (weights,
  gradients and state), each frozen one's stored bytes, over the shards that split them
  (``dp_shard × cp × tp × pp``: FSDP2 runs over dp_shard × cp; ``dp_replicate`` copies). A
  pipeline stage under FSDP2 also holds its unsharded parameters (gathered dtype) and unsharded
  gradients (reduce dtype) over the microbatches (``reshard_after_forward=False``). The busiest
  rank holds at least the average. Beside them, the activations its backward keeps
  (:func:`activations_floor`), per token: every block's input (any checkpointing keeps it);
  without checkpointing also the inputs of its linear layers (the two norms' outputs, the
  attention's output: 3 × hidden) and two MLP-wide tensors (the up-projection's output and the
  down-projection's input; 4 × hidden when the width is not known), or a Llama-layout block's
  distinct kept tensors where more (:func:`off_saved`); under selective-op checkpointing the input
  and the outputs torchtitan's op list saves (:func:`selective_saved`; else the input only); under
  full checkpointing one block recomputed whole; the others' microbatches in flight on the first
  stage. In the compute dtype, split by ``tp`` (sequence parallelism shards what tensor
  parallelism does not) and ``cp`` (``S / cp`` tokens a sample). Or, on the last stage (one
  microbatch's blocks), the moment the loss's log-softmax output is allocated: the logits and that
  output, whole on every tp rank (gathered, no loss_parallel), :func:`logits_bytes`; a pipeline
  rank keeps its blocks' share per microbatch in flight (:func:`in_flight`: GPipe all; 1F1B
  ``pp``; interleaved 1F1B the forwards torch's schedule runs before the first backward).
- **time**: the matmul FLOPs of the rank's share of the step (:func:`compute_floor`): forward
  ``2 × params × tokens``, backward ``2 ×`` that for the inputs' gradients plus ``2 ×`` the
  trainable parameters' for the weights' gradients, and the forward again under full
  checkpointing, split by ``tp × pp × cp``, over the GPU's dense peak for the compute dtype (the
  roofline divides each kernel's FLOPs by that peak times an efficiency ≤ 1, and adds memory-bound
  kernels). Left out: the embedding (a gather), attention, the experts a token is not routed to.
"""
from __future__ import annotations

import torch

from memcalc.core.checkpointing import Checkpointing, CheckpointKind
from memcalc.core.precision import Precision
from memcalc.distributed.collectives import ModelFacts
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.pipeline_schedules import PipelineSchedule
from memcalc.engine.step_spec import Step
from memcalc.timing.performance import device_rates

__all__ = ("activations_floor", "compute_floor", "in_flight", "logits_bytes", "off_saved", "peak_flops",
           "selective_saved", "states_floor")

_MODES = {torch.bfloat16: ("bf16",), torch.float16: ("fp16",), torch.float32: ("fp32", "tf32")}


def states_floor(step: Step, facts: ModelFacts, mesh: Mesh) -> float:
    """Bytes of model states a rank of ``mesh`` holds at least (module docstring)."""
    stored = step.precision.parameter_dtype.itemsize
    multiplier = step.optimizer.textbook_multiplier
    frozen = facts.parameters - facts.trainable
    fsdp = mesh.dp_shard * mesh.cp  # torchtitan's dp_shard_cp group
    if mesh.ep > 1:  # the experts split over ep x cp x tp, the rest (at most) over dp_shard x cp x ep: see below
        return _expert_states_floor(step, facts, mesh)
    held = (facts.trainable * stored * multiplier + frozen * stored) / (fsdp * mesh.tp * mesh.pp)
    if mesh.pp > 1 and fsdp > 1:
        stage = 1 / (mesh.tp * mesh.pp)
        # unsharded parameters and gradients replace the sharded gradients over the microbatches
        held += (facts.parameters * facts.gather_bytes + facts.trainable * facts.reduce_bytes) * stage
        held -= facts.trainable * stored / (fsdp * mesh.tp * mesh.pp)
    return held


def _expert_states_floor(step: Step, facts: ModelFacts, mesh: Mesh) -> float:
    """:func:`states_floor` under ep: every parameter over ``dp_shard × cp × ep × tp × pp`` ranks
    at most (the experts' split over ep × cp × tp, then FSDP2's over dp_shard; the dense part's
    FSDP2 over dp_shard × cp × ep, or whole without FSDP2: more), and under a pipeline of FSDP2
    stages (dp_shard's, or HSDP's over ep) the stage's unsharded share, the experts'
    ``1 / (ep × cp)`` of them, as :func:`states_floor` counts it."""
    stored = step.precision.parameter_dtype.itemsize
    frozen = facts.parameters - facts.trainable
    ways = mesh.dp_shard * mesh.cp * mesh.ep * mesh.tp * mesh.pp
    held = (facts.trainable * stored * step.optimizer.textbook_multiplier + frozen * stored) / ways
    if mesh.pp > 1 and (mesh.dp_shard > 1 or mesh.dp_replicate > 1):  # FSDP2 stages (HSDP's over ep)
        split = mesh.ep * mesh.cp
        local = facts.parameters - facts.expert_parameters * (1 - 1 / split)
        local_trained = facts.trainable - facts.expert_trainable * (1 - 1 / split)
        held += (local * facts.gather_bytes + local_trained * facts.reduce_bytes) / (mesh.tp * mesh.pp)
        held -= facts.trainable * stored / ways
    return held


def peak_flops(step: Step) -> float:
    """The GPU's dense peak FLOP/s for the step's compute dtype (fp32: tf32's where it has it)."""
    peaks = dict(device_rates(step.gpu).peaks)
    modes = _MODES.get(step.precision.compute_dtype, ("fp32",))
    return max(peaks.get(m, 0.0) for m in modes) or max(peaks.values())


def compute_floor(facts: ModelFacts, mesh: Mesh, tokens: int, checkpoint: Checkpointing, peak: float) -> float:
    """Seconds a rank's matmuls take at least for ``tokens`` tokens per optimizer step (of the
    whole sequences: a cp rank computes ``1 / cp`` of them)."""
    embedding = facts.vocab * facts.hidden if facts.vocab is not None and facts.hidden is not None else 0
    matmul: float = max(facts.parameters - embedding, 0)
    trained: float = max(facts.trainable - embedding, 0)
    # a token runs top_k of the experts: the others' weights do no FLOPs for it (and ep does not split them: under
    # balanced routing a rank computes as many routed rows as it sends)
    if facts.experts and facts.top_k:
        idle = 1 - min(facts.top_k, facts.experts) / facts.experts
        matmul -= facts.expert_parameters * idle
        trained -= facts.expert_trainable * idle
    flops = 4 * matmul + 2 * trained + (2 * matmul if checkpoint.kind is CheckpointKind.FULL else 0)
    return tokens * flops / (mesh.tp * mesh.pp * mesh.cp) / peak


def _llama_linears(module: torch.nn.Module) -> list[torch.nn.Linear] | None:
    """q, k, v, o, gate, up and down of the first Llama-layout block (``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, plain bias-free ``nn.Linear``: seven ``aten.mm`` in that order), or
    None: another layout (a bias makes ``addmm``, a fused projection shifts the count)."""
    for block in module.modules():
        attention, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if not isinstance(attention, torch.nn.Module) or not isinstance(mlp, torch.nn.Module):
            continue
        names = [(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        linears = [getattr(owner, name, None) for owner, name in names]
        if all(type(m) is torch.nn.Linear and m.bias is None for m in linears):
            return [m for m in linears if isinstance(m, torch.nn.Linear)]
        return None
    return None


def selective_saved(module: torch.nn.Module) -> int | None:
    """Elements per token one block keeps under selective-op checkpointing beside its input
    (:mod:`memcalc.engine.sac_policy`), where the layout says which ``mm`` is which
    (:func:`_llama_linears`): the 1st, 3rd, 5th and 7th ``mm``'s outputs (q, v, gate, down) and the
    attention's (o_proj's input). None: only the block's input is sure."""
    linears = _llama_linears(module)
    if linears is None:
        return None
    q, _, v, o, gate, _, down = linears
    return q.out_features + v.out_features + o.in_features + gate.out_features + down.out_features


def off_saved(module: torch.nn.Module) -> int | None:
    """Elements per token one Llama-layout block (:func:`_llama_linears`) keeps for its backward
    without checkpointing, counting distinct tensors only: its input and the middle residual (each
    norm's input); the inputs of q/k/v, o and gate/up (whose weights' gradients need them; each at
    least once) and of down; the attention's q, k, v and output; gate's, up's and SiLU's outputs
    (SiLU's and the product's gradients need them). None: another layout."""
    linears = _llama_linears(module)
    if linears is None:
        return None
    q, k, v, o, gate, up, down = linears
    hidden = q.in_features
    return (2 * hidden + q.in_features + o.in_features + gate.in_features + down.in_features
            + q.out_features + k.out_features + v.out_features + o.in_features
            + gate.out_features + up.out_features + gate.out_features)


def logits_bytes(precision: Precision) -> int:
    """Bytes per logit alive at least when the cross-entropy's log-softmax output is allocated:
    the logits (its input) and that output. fp32: 4 + 4. Autocast: the head's logits in the
    compute dtype and the log-softmax's output in float32 (an op autocast runs in float32; CUDA's
    ``_log_softmax(half_to_float=True)`` makes no float32 copy of its input). Pure half precision:
    two tensors of the compute dtype (a plain-torch loss does not upcast; transformers' does, more)."""
    compute = precision.compute_dtype.itemsize
    if compute == 4:
        return 8
    return compute + 4 if precision.is_amp else 2 * compute


def in_flight(schedule: PipelineSchedule | None, pp: int, layers: int | None, microbatches: int) -> float:
    """Microbatches of a whole stage's blocks the first pipeline rank keeps at its peak, at least:
    one without a pipeline; GPipe's every microbatch; 1F1B's ``pp``; interleaved 1F1B's (two
    stages per rank) forwards before its first backward, each of one local stage's blocks
    (``layers // (2 pp)``): torch's ``_get_warmup_ops``, ``min(per round + 2 (pp − 1),
    2 × microbatches)`` with ``per round = microbatches // max(1, microbatches // pp)``."""
    if schedule is None:
        return 1
    if schedule is PipelineSchedule.GPIPE:
        return microbatches
    if schedule is not PipelineSchedule.INTERLEAVED_1F1B or layers is None or layers < 2 * pp:
        return min(pp, microbatches)
    per_round = microbatches // max(1, microbatches // pp)
    warmup = min(per_round + 2 * (pp - 1), 2 * microbatches)
    return warmup * (layers // (2 * pp)) / (layers // pp)


def activations_floor(facts: ModelFacts, mesh: Mesh, tokens: int, checkpoint: Checkpointing,
                      in_flight: float, selective: int | None = None, off: int | None = None,
                      logits: int | None = None) -> float:
    """Bytes of activations a rank keeps at least for ``in_flight`` micro-batches of ``tokens``
    (whole sequences: a cp rank holds ``1 / cp`` of them);
    ``selective`` and ``off``: :func:`selective_saved` and :func:`off_saved` of the model (None:
    the block's input only; the generic count); ``logits``: :func:`logits_bytes` (None: one
    tensor of the compute dtype)."""
    if facts.hidden is None or facts.layers is None:
        return 0.0
    block = 4 * facts.hidden + 2 * (facts.intermediate or 2 * facts.hidden)  # one block's, whole
    blocks = facts.layers // mesh.pp
    tokens //= mesh.cp
    kind = checkpoint.kind
    if kind is CheckpointKind.OFF:
        per, recomputed = blocks * max(block, off or 0), 0
    elif kind is CheckpointKind.FULL:
        per, recomputed = blocks * facts.hidden, block
    else:  # selective-op: what its recomputation adds beside the saved outputs is not bounded; every:N, a
        # policy or auto (which may choose either): the blocks' inputs only
        saved = selective if kind is CheckpointKind.SELECTIVE_OP and selective is not None else 0
        per, recomputed = blocks * (facts.hidden + saved), 0
    # the first stage keeps every microbatch in flight, and a recomputed block under full checkpointing;
    # the last (or only) one, at least one, and at its loss the logits (whole on every tensor-parallel rank:
    # plan's tp gathers them, no loss_parallel) and the log-softmax's output
    unit = tokens * facts.activation_bytes / mesh.tp
    if logits is None:
        return (max(in_flight * per, per + (facts.vocab or 0) * mesh.tp) + recomputed) * unit
    return max((in_flight * per + recomputed) * unit, per * unit + tokens * (facts.vocab or 0) * logits)
