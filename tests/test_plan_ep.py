"""``memcalc plan`` searches expert parallelism for a mixture of experts (memcalc/search/plan.py,
memcalc/distributed/strategy/ep.py's ``collectives``).

Three layers: the all-to-all's and FSDP2's bytes worked out by hand for a tiny Mixtral; the same
all-to-alls counted in the estimate's own ep trace (transformers' ``AllToAllEP`` over the fake
group, the ``_c10d_functional.all_to_all_single`` outputs it records); one plan run where ep wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support import hf_config_source

import memcalc
from memcalc.cli import main
from memcalc.core.checkpointing import FULL, OFF, Checkpointing, CheckpointKind
from memcalc.distributed.collectives import ModelFacts
from memcalc.distributed.expert_parallel import ExpertParallel, expert_parallelism_available
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.strategy.ep import ExpertParallelDimension
from memcalc.fields import build_step
from memcalc.search.plan import collectives_of, model_facts
from memcalc.search.plan_bounds import activations_floor, compute_floor, states_floor
from memcalc.targets.backend import trace_step

pytest.importorskip("transformers")
if not expert_parallelism_available():  # transformers 5.17 (the oldest matrix leg)
    pytest.skip("ep needs transformers' expert parallelism", allow_module_level=True)

SELECTIVE = Checkpointing(CheckpointKind.SELECTIVE_OP)
#: tests/test_ep.py's tiny Mixtral: 2 layers, d 64, 4 experts of SwiGLU 128, top-2, vocabulary 256.
TINY_MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 128}
#: Its parameters (tests/test_ep.py): 254,784, of which experts 2 layers · 4 · (2·128·64 + 64·128) = 196,608.
PARAMETERS, EXPERTS = 254_784, 196_608
#: An expert-heavy one: 32 experts of SwiGLU 4096 at d 1024 (805,306,368 expert parameters), where
#: FSDP2's all-gathers of every expert outweigh the compute and ep's all-to-alls.
HEAVY: dict[str, Any] = {**TINY_MIXTRAL, "num_local_experts": 32, "hidden_size": 1024, "intermediate_size": 4096}


def _facts(tokens: int, activation_bytes: int = 4, **changes: Any) -> ModelFacts:
    """The tiny Mixtral's facts, stored, gathered and computed in ``activation_bytes`` (fp32 or pure bf16)
    unless ``changes`` say otherwise."""
    dtypes = {"gather_bytes": activation_bytes, "stream_bytes": activation_bytes, **changes}
    return ModelFacts(parameters=PARAMETERS, trainable=PARAMETERS, reduce_bytes=4, layers=2, heads=4, kv_heads=2,
                      hidden=64, vocab=256, intermediate=128, activation_bytes=activation_bytes, tokens=tokens,
                      experts=4, top_k=2, moe_layers=2, moe_blocks=(0, 1), expert_parameters=EXPERTS,
                      expert_trainable=EXPERTS, **dtypes)


def _by_what(collectives: Any) -> dict[str, tuple[float, int, int]]:
    return {c.what: (c.received, c.count, c.span) for c in collectives}


def test_model_facts_of_a_mixture_of_experts_and_of_a_dense_model(tmp_path: Path) -> None:
    step = build_step(hf_config_source(tmp_path, TINY_MIXTRAL), batch_size=1, seq_len=16)
    facts = model_facts(step)
    assert (facts.experts, facts.top_k, facts.moe_layers) == (4, 2, 2)
    assert (facts.parameters, facts.expert_parameters, facts.expert_trainable) == (PARAMETERS, EXPERTS, EXPERTS)
    assert ExpertParallelDimension.plan_degrees(facts, 8) == (1, 2, 4)  # divisors of 8 that divide 4 experts
    dense = model_facts(build_step("llama-tiny", batch_size=1, seq_len=16))
    assert dense.experts is None and dense.expert_parameters == 0
    assert ExpertParallelDimension.plan_degrees(dense, 8) == (1,)  # no experts: never an ep dimension


def test_all_to_all_and_fsdp_bytes_by_hand() -> None:
    """dp_shard=2, ep=2, one micro-batch of 2 × 16 = 32 tokens, fp32. AllToAllEP per MoE layer: 32 tokens ·
    top-2 = 64 pairs over 4 experts, 16 each; rank 0 owns experts 0-1 and sends 32 rows to each rank and
    receives 32 from each (dispatch_rows). Off the node-local link go the other rank's: dispatch 32 rows,
    combine 32 rows back, 64 rows · 64 · 4 B = 16,384 B a layer, 2 layers: 32,768 B in 4 calls forward,
    the same backward. FSDP2: the dense 254,784 − 196,608 = 58,176 parameters over dp_shard × ep = 4
    ranks, ring 3/4, forward and backward: 2 · 58,176 · 4 · 3/4 = 349,056 B, reduce-scatter 174,528 B; each
    rank's 196,608 / 2 = 98,304 expert parameters over the 2 dp_shard ranks: 2 · 98,304 · 4 · 1/2 =
    393,216 B gathered, 196,608 B reduced. Every group: 4 consecutive GPUs. Before the rows, each layer
    all-to-alls its 4 int64 split counts (half from the other rank): 2 · 16 = 32 B in 2 calls."""
    got = _by_what(collectives_of(Mesh(dp_shard=2, ep=2), _facts(32), 1))
    assert got == {
        "all-to-all of the split counts (forward)": (32, 2, 2),
        "all-to-all of routed tokens (dispatch and combine, forward)": (32_768, 4, 2),
        "all-to-all of routed tokens' gradients (backward)": (32_768, 4, 2),
        "all-gather of parameters (dense; forward and backward)": (349_056, 2, 4),
        "reduce-scatter of gradients (dense)": (174_528, 1, 4),
        "all-gather of experts (forward and backward)": (393_216, 2, 4),
        "reduce-scatter of experts' gradients": (196_608, 1, 4),
    }


def test_all_to_all_under_tp_recompute_and_a_pipeline_by_hand() -> None:
    """tp=2, ep=2 (etp=1: the experts over ep × tp = 4 ranks) with dp_shard=2, pure bf16: a tp rank
    dispatches 32 / 2 = 16 tokens, 32 pairs, 8 to each of the 4 ranks' experts, receiving 8 from each:
    3 · 8 + 3 · 8 = 48 rows from the others a layer, 48 · 64 · 2 B = 6,144 B, 2 layers: 12,288 B. Recomputed
    (full or selective-op) the forward's twice: 24,576 B in 8 calls; every:2 recomputes block 1 only (its
    count from 1 is 2): 18,432 B in 6. pp=2: the busiest stage's 1 MoE layer, 4 micro-batches: 4 · 6,144 =
    24,576 B forward in 8 calls. Over tp (AllToAllEP's Replicate -> Shard(0) and back, 2 consecutive GPUs):
    forward the combined 32 · 64 rows in float32 (the router's weights are), half from the other rank:
    4,096 B a layer, not re-run under full checkpointing (the MoE layer ends the block, where torch's
    checkpoint stops early); backward the rows' bf16 gradients (32 · 64 · 2) and the float32 routing
    weights' (32 · 2 · 4), half each: 2,048 + 128 B a layer, 2 calls."""
    mesh = Mesh(dp_shard=2, tp=2, ep=2)
    forward = "all-to-all of routed tokens (dispatch and combine, forward)"
    assert _by_what(collectives_of(mesh, _facts(32, 2), 1))[forward] == (12_288, 4, 4)
    full = _by_what(collectives_of(mesh, _facts(32, 2, checkpoint=FULL), 1))
    assert full[forward] == (24_576, 8, 4)
    assert _by_what(collectives_of(mesh, _facts(32, 2, checkpoint=SELECTIVE), 1))[forward] == (24_576, 8, 4)
    every_2 = Checkpointing(CheckpointKind.EVERY, 2)
    assert _by_what(collectives_of(mesh, _facts(32, 2, checkpoint=every_2), 1))[forward] == (18_432, 6, 4)
    assert full["all-gather of the combined tokens over tp (forward)"] == (2 * 4_096, 2, 2)
    assert full["all-gather of routed tokens' and routing weights' gradients over tp (backward)"] == (
        2 * (2_048 + 128), 4, 2)
    piped = Mesh(dp_shard=2, ep=2, pp=2)
    # no tp: 32 tokens, 64 rows from the other rank a layer, 64 · 64 · 2 = 8,192 B; 1 layer, 4 microbatches
    assert _by_what(collectives_of(piped, _facts(32, 2), 4))[forward] == (32_768, 8, 2)


def test_a_mixture_of_experts_all_to_alls_its_residual_stream_under_autocast() -> None:
    """Under amp-bf16 alone the block's hidden states stay float32 (the parameters' dtype; autocast casts
    the matmuls' inputs only), and AllToAllEP dispatches them as they are: rows of 64 · 4 B, not 64 · 2 B
    (ep=2: 64 rows from the other rank a layer, 2 layers: 32,768 B). Under FSDP2 (dp_shard, or HSDP over
    ep) its MixedPrecisionPolicy runs the model in bf16, without autocast: rows of 64 · 2 B, 16,384 B."""
    forward = "all-to-all of routed tokens (dispatch and combine, forward)"
    amp = _facts(32, 2, stream_bytes=4, gather_bytes=2)
    assert _by_what(collectives_of(Mesh(ep=2), amp, 1))[forward] == (32_768, 4, 2)
    assert _by_what(collectives_of(Mesh(dp_shard=2, ep=2), amp, 1))[forward] == (16_384, 4, 2)
    assert _by_what(collectives_of(Mesh(dp_replicate=2, ep=2), amp, 1))[forward] == (16_384, 4, 2)


@pytest.mark.parametrize("checkpoint, calls", [(OFF, 8), (Checkpointing(CheckpointKind.SELECTIVE_OP), 12), (FULL, 12)])
def test_the_time_model_counts_what_the_estimates_ep_program_communicates(tmp_path: Path, checkpoint: Checkpointing,
                                                                          calls: int) -> None:
    """The estimate's own ep program (transformers' AllToAllEP on rank 0 of ep=2, fp32, 2 × 16 tokens)
    records each all-to-all's output: 8 outputs of 64 rows · 64 · 4 B = 16,384 B without checkpointing
    (2 layers: dispatch and combine, forward and backward), 12 where the backward re-runs the forward's
    (full, and selective-op: memcalc's and torchtitan's saved ops leave the all-to-all out). Half of each
    output is rank 0's own rows (balanced, ep=2): the other half crossed the link, which plan counts. Each
    forward (its recomputation too) first all-to-alls the split counts in place (``alltoall_base_``, no
    new storage): half as many calls."""
    step = build_step(hf_config_source(tmp_path, TINY_MIXTRAL), batch_size=2, seq_len=16, optimizer="adam",
                      gpu="cpu", checkpoint=checkpoint)
    trace = trace_step(step.resolved(batch_size=2), step, hooks=ExpertParallel(2)).trace
    outputs = [trace.nbytes[uid] for uid, op in enumerate(trace.op) if op.startswith("_c10d_functional.all_to_all")]
    assert outputs == [64 * 64 * 4] * calls
    modelled = _by_what(c for c in collectives_of(Mesh(dp_shard=2, ep=2), _facts(32, checkpoint=checkpoint), 1)
                        if c.dimension == "ep")
    rows = [modelled[f"all-to-all of routed tokens{what}"] for what in (" (dispatch and combine, forward)",
                                                                       "' gradients (backward)")]
    assert sum(count for _, count, _ in rows) == calls
    assert sum(received for received, _, _ in rows) == sum(outputs) / 2
    assert modelled["all-to-all of the split counts (forward)"][1] == trace.op_counts["alltoall_base_.default"]


def test_bounds_count_a_tokens_experts_and_ep_s_split_by_hand() -> None:
    """Matmul FLOPs per token: of the 254,784 − 256 · 64 = 238,400 parameters outside the embedding the
    experts' 196,608 run top-2 of 4, half: 238,400 − 98,304 = 140,096; 6 × 140,096 FLOPs a token. Model
    states under fp32 Adam (16 B a parameter) at dp_shard=2, ep=2: every parameter over 4 ranks at most."""
    facts = _facts(0)
    assert compute_floor(facts, Mesh(), 10, OFF, 1.0) == 10 * 6 * 140_096
    step = build_step("llama-tiny", batch_size=1, seq_len=16, precision="fp32", optimizer="adam")
    assert states_floor(step, facts, Mesh(dp_shard=2, ep=2)) == 16 * PARAMETERS / 4


#: A tiny Qwen3-MoE whose config keeps a dense ``intermediate_size`` (8,192) that no layer uses: every
#: layer is sparse (``decoder_sparse_step`` 1), 4 experts of SwiGLU 32, top-2.
WIDE_DENSE_QWEN: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 8192,
    "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "decoder_sparse_step": 1, "mlp_only_layers": []}


def test_the_activation_floor_counts_the_experts_width_not_an_unused_dense_one(tmp_path: Path) -> None:
    """A token passes top-2 experts of 32 (64 wide in all), never the config's dense 8,192: plan's floor
    counts a block at 4 · 64 + 2 · 64 elements a token, not 4 · 64 + 2 · 8,192. The experts' parameters say
    the same: 2 layers · 4 experts · 3 · 64 · 32. Mixtral's ``intermediate_size`` is an expert's: unchanged."""
    qwen = model_facts(build_step(hf_config_source(tmp_path, WIDE_DENSE_QWEN), batch_size=1, seq_len=16))
    assert (qwen.experts, qwen.top_k, qwen.expert_parameters) == (4, 2, 2 * 4 * 3 * 64 * 32)
    assert qwen.intermediate == 2 * 32
    (tmp_path / "mixtral").mkdir()
    mixtral = model_facts(build_step(hf_config_source(tmp_path / "mixtral", TINY_MIXTRAL), batch_size=1, seq_len=16))
    assert mixtral.intermediate == 128  # top-2 of 128 is wider than one expert: the config's 128 is the floor
    tokens = 4096
    floor = activations_floor(qwen, Mesh(), tokens, OFF, 1.0)  # no logits given: one tensor of the compute dtype
    assert floor == (2 * (4 * 64 + 2 * 64) + 256) * tokens * 4  # fp32: two blocks, then the vocabulary


@pytest.mark.slow  # two traces of 4,096 tokens
@pytest.mark.parametrize("checkpoint", ["off", "full"])
def test_the_moe_memory_floor_never_exceeds_the_traced_peak(tmp_path: Path, checkpoint: str) -> None:
    """plan prunes on model states + kept activations: sound only if that is never above the trace's
    peak. With the dense width counted, this model's floor was 560 MB (off) and 276 MB (full) against
    traced peaks of 182 MB and 128 MB (amp-bf16, 2 × 4,096 tokens, on the H100 target)."""
    from memcalc.core.checkpointing import parse_checkpointing
    from memcalc.distributed.collectives import DEFAULT_NETWORK
    from memcalc.search import plan as planning
    from memcalc.search.plan_bounds import in_flight, logits_bytes, off_saved, selective_saved

    step = build_step(hf_config_source(tmp_path, WIDE_DENSE_QWEN), batch_size=1, seq_len=4096,
                      precision="amp-bf16", gpu="h100-80gb")
    facts = model_facts(step)
    module = step.resolved(1).module
    selective, off = selective_saved(module), off_saved(module)
    checkpoints = (parse_checkpointing(checkpoint),)
    search = planning._Search(step, facts, DEFAULT_NETWORK, checkpoints, None, sequence=4096, selective=selective,
                              off=off)
    bound = states_floor(step, facts, Mesh()) + activations_floor(
        facts, Mesh(), 2 * 4096, checkpoints[0], in_flight(None, 1, facts.layers, 1), selective, off,
        logits_bytes(step.precision))
    peak = search.report(planning._Config(Mesh(), 0, 2, 1, None)).bytes.peak_allocated
    assert 0 < bound <= peak, (bound, peak)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    source = hf_config_source(tmp_path_factory.mktemp("heavy"), HEAVY)
    return source, memcalc.plan(source, gpus=4, gpu="h100-80gb", global_batch=4, seq_len=32, top=4, checkpoint="off",
                                gpus_per_node=1)


def test_plan_chooses_ep_where_fsdp_would_gather_every_expert(heavy: tuple[str, Any]) -> None:
    """Four GPUs on four nodes (50 GB/s): dp_shard=4 gathers all 805,306,368 expert parameters twice a
    step, dp_shard=2 × ep=2 (or HSDP over ep=2) each rank's half; ep's all-to-alls (32 tokens · top-2 = 64
    pairs, 32 of them from the other rank and 32 back, bf16 (FSDP2's param_dtype): 64 · 1,024 · 2 = 131,072 B a
    layer, 2 layers, forward and backward; before them each layer's 32 int64 split counts, 128 B from the other
    rank) are small beside them. A pipeline avoids the gathers too: pp=2 × dp_shard=2 (each
    rank gathers its stage's experts only, and sends one activation a microbatch) comes first, under GPipe and
    1F1B alike; ep=2 leads the meshes without one. (Until the pipeline's output shapes used the real kernels'
    ``_grouped_mm`` rule, every pipeline of this model failed under amp-bf16 and ep came first.)"""
    source, result = heavy
    assert "ep" in result.searched and "ep" not in result.not_searched
    assert [c.mesh for c in result.best[:2]] == [Mesh(dp_shard=2, pp=2)] * 2
    best = next(c for c in result.best if c.mesh.pp == 1)
    assert best.mesh.ep == 2 and best.report.fits
    a2a = [c for c in best.collectives if c.dimension == "ep" and c.what.startswith("all-to-all")]
    assert [(c.received, c.count) for c in a2a] == [(2 * 128, 2), (2 * 131_072, 4), (2 * 131_072, 4)]
    assert best.exposed_seconds >= sum(c.seconds(result.network) for c in a2a)
    # the memory bound plan pruned with never exceeds what the trace holds
    step = build_step(source, batch_size=1, seq_len=32, precision="amp-bf16", optimizer="adam", gpu="h100-80gb")
    for candidate in result.best:
        assert states_floor(step, model_facts(step), candidate.mesh) <= candidate.report.bytes.peak_allocated
    as_json = result.to_dict()
    assert as_json["best"][2]["mesh"]["ep"] == 2 and "ep" in as_json["dimensions_searched"]
    assert any(a.startswith("expert parallelism:") for a in as_json["assumptions"])


def test_no_ep_leaves_the_experts_unsplit(heavy: tuple[str, Any]) -> None:
    source, _ = heavy
    result = CliRunner().invoke(main, ["plan", source, "--gpus", "2", "--gpu", "h100-80gb", "--global-batch", "2",
                                       "--seq-len", "32", "--checkpoint", "off", "--top", "1", "--no-ep",
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert "ep" in payload["dimensions_not_searched"] and payload["why_not_searched"]["ep"] == "--no-ep"
    assert "1 meshes with ep: not searched (--no-ep)" in payload["pruned"]
    assert all(row["mesh"].get("ep", 1) == 1 for row in payload["best"])
