"""``memcalc plan``'s collectives for a mixture of experts under tensor parallelism (tp × ep), and
its recomputed collectives per checkpointed block (memcalc/distributed/tp_traffic.py, the ``tp``
and ``ep`` strategies' ``collectives``, memcalc/search/plan.py).

Two layers: the tiny Mixtral's collectives per kind worked out by hand from its Hugging Face plan
(transformers 5.25: q, k, v column-wise, o row-wise, the embedding row-wise, the head gathering its
output) and AllToAllEP; the same figures against the estimate's own traced step (torch's DTensor
and transformers' AllToAllEP over the fake group: the ``_c10d_functional`` outputs it records), per
kind, for three meshes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from support import hf_config_source

import memcalc
from memcalc.core.checkpointing import FULL, OFF, Checkpointing, CheckpointKind, parse_checkpointing
from memcalc.distributed import strategies
from memcalc.distributed.collectives import DEFAULT_NETWORK, Collective, ModelFacts
from memcalc.distributed.expert_parallel import expert_parallelism_available
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.tp_plans import llama_plan, resolve_plan
from memcalc.distributed.tp_traffic import Kind, plan_traffic
from memcalc.fields import build_step
from memcalc.search import plan as planning
from memcalc.search.plan import collectives_of, model_facts

pytest.importorskip("transformers")
if not expert_parallelism_available():  # transformers 5.17 (the oldest matrix leg)
    pytest.skip("ep needs transformers' expert parallelism", allow_module_level=True)

#: tests/test_plan_ep.py's tiny Mixtral: 2 layers, d 64, 4 experts, top-2, vocabulary 256.
TINY_MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 128}
EVERY_2 = Checkpointing(CheckpointKind.EVERY, 2)


def _kinds(collectives: tuple[Collective, ...], dimension: str | None = None) -> dict[str, tuple[int, float]]:
    """(calls, bytes received) per kind (the leading words of ``what``: "all-reduce", "all-to-all"), the
    split counts' all-to-all apart (the trace keeps no storage for it)."""
    out: dict[str, list[float]] = {}
    for c in collectives:
        if dimension is not None and c.dimension != dimension:
            continue
        kind = "split counts" if "split counts" in c.what else c.what.split(" of ")[0]
        total = out.setdefault(kind, [0, 0.0])
        total[0] += c.count
        total[1] += c.received
    return {k: (int(v[0]), v[1]) for k, v in out.items()}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_config_source(tmp_path_factory.mktemp("mixtral"), TINY_MIXTRAL)


@pytest.fixture(scope="module")
def facts(mixtral: str) -> ModelFacts:
    """fp32, one micro-batch of 2 × 16 = 32 tokens."""
    return replace(model_facts(build_step(mixtral, batch_size=1, seq_len=16)), tokens=32)


def test_tp_x_ep_counts_the_plan_without_the_experts_by_hand(facts: ModelFacts) -> None:
    """tp=2 × ep=2, fp32, 32 tokens (a tensor of d 64 is 32 · 64 · 4 = 8,192 B; a ring over 2 ranks brings
    half an all-gather's and a whole all-reduce's size). The plan, the experts left out (they keep no tp
    rule under ep): forward the embedding's and each o_proj's all-reduce (3), backward q, k and v's input
    gradients (3 a layer) and the head's (7): 10 all-reduces of 8,192 B = 81,920 B. All-gathers: the
    logits forward (32 · 256 · 4 / 2 = 16,384 B); AllToAllEP over tp: the combined rows forward (4,096 B a
    layer), the rows' and the routing weights' gradients backward (4,096 + 32 · 2 · 4 / 2 = 4,224 B a
    layer): 7 calls, 33,024 B. All-to-alls over ep × tp = 4: a tp rank's 16 tokens, 32 pairs, 8 to each
    rank, 3 · 8 + 3 · 8 rows from the others a layer, · 256 B = 12,288 B, dispatch and combine forward and
    backward: 8 calls, 49,152 B; and each forward's split counts (4 int64, 3/4 from the others: 24 B)."""
    assert facts.moe_blocks == (0, 1) and facts.stream_bytes == 4
    got = _kinds(collectives_of(Mesh(tp=2, ep=2), facts, 1))
    assert got == {"all-reduce": (10, 81_920), "all-gather": (7, 33_024), "all-to-all": (8, 49_152),
                   "split counts": (2, 48)}


def test_tp_alone_counts_what_the_plan_shards_by_hand(facts: ModelFacts) -> None:
    """tp=2 without ep: transformers 5.25's Mixtral plan has no rule on the experts, so the same 10 all-
    reduces, and of the all-gathers only the logits'. Before the plan was read, the closed Llama formula
    counted 16 + 5 all-gathers and reduce-scatters of 65,536 + 32,768 B; it still does where the installed
    transformers' plan shards the experts with styles the reading does not follow (5.24's
    ``packed_colwise`` and ``moe_tp_experts``)."""
    from transformers import MixtralConfig

    got = _kinds(collectives_of(Mesh(dp_shard=2, tp=2), facts, 1), "tp")
    if any(".experts" in pattern for pattern in MixtralConfig().base_model_tp_plan or {}):
        assert facts.tp_traffic is None
        assert got == {"all-gather and reduce-scatter": (16, 65_536),
                       "embedding, head input and logits (all-gather / reduce-scatter)": (5, 32_768)}
    else:
        assert got == {"all-reduce": (10, 81_920), "all-gather": (1, 16_384)}


@pytest.mark.parametrize("checkpoint, all_reduce, all_to_all, counts", [
    (OFF, 10, 8, 2),
    # o_proj's all-reduce and the three forward all-to-alls again in each recomputed block; the combined rows'
    # all-gather not (the block's last collective: torch's checkpoint stops once the saved tensors are back)
    (FULL, 12, 12, 4),
    (Checkpointing(CheckpointKind.SELECTIVE_OP), 12, 12, 4),
    (EVERY_2, 11, 10, 3),  # torchtitan's every:2 checkpoints the second block only
    (parse_checkpointing("auto"), 10, 8, 2),  # before its trace auto re-runs nothing (a bound)
])
def test_recomputed_blocks_run_their_forward_collectives_again(facts: ModelFacts, checkpoint: Checkpointing,
                                                               all_reduce: int, all_to_all: int, counts: int) -> None:
    got = _kinds(collectives_of(Mesh(tp=2, ep=2), replace(facts, checkpoint=checkpoint), 1))
    assert (got["all-reduce"][0], got["all-gather"][0], got["all-to-all"][0], got["split counts"][0]) == (
        all_reduce, 7, all_to_all, counts)
    assert got["all-reduce"][1] == all_reduce * 8_192


def test_a_dense_models_own_plan_is_read_and_torchtitans_keeps_the_closed_formula() -> None:
    """llama-tiny (8 blocks, d 512, vocabulary 32,000): plan reads the Hugging Face plan its trace runs
    (tp=2, fp32, 2 × 16 tokens: 58 all-reduces and the logits' all-gather, 66 all-reduces under full
    checkpointing, each block's o_proj again, not its down_proj; the trace itself:
    test_a_dense_models_plan_counts_what_its_traced_step_communicates)."""
    step = build_step("llama-tiny", batch_size=2, seq_len=16)
    facts = model_facts(step)
    assert facts.tp_traffic is not None and facts.tp_traffic_ep is None
    got = _kinds(collectives_of(Mesh(tp=2), replace(facts, tokens=32), 1))
    assert (got["all-reduce"][0], got["all-gather"][0]) == (58, 1)
    assert _kinds(collectives_of(Mesh(tp=2), replace(facts, tokens=32, checkpoint=FULL), 1))["all-reduce"][0] == 66
    resolved = step.resolved(2)
    blocks = [f"model.layers.{i}" for i in range(8)]
    traffic = plan_traffic(resolved.module, resolve_plan(resolved.module, None, resolved.name), blocks)
    assert traffic is not None
    kinds = Counter((t.kind, t.backward) for t in traffic)
    # forward: the embedding, o_proj and down_proj; backward: q, k, v, gate and up, and the head's input
    assert kinds == {(Kind.ALL_REDUCE, False): 1 + 2 * 8, (Kind.ALL_REDUCE, True): 5 * 8 + 1,
                     (Kind.ALL_GATHER, False): 1}
    assert sum(t.recomputed for t in traffic) == 8  # o_proj's
    # torchtitan's plan (sequence-parallel norms, PrepareModuleInput): layouts these rules do not read
    titan = llama_plan(resolved.module)
    assert titan is not None and plan_traffic(resolved.module, titan, blocks) is None


def test_plan_counts_what_checkpoint_auto_chose(mixtral: str) -> None:
    """``--checkpoint auto`` chooses after the trace, and the report says which setting it ran
    (``MemoryReport.checkpointing``, test_checkpoint_auto.py); the candidate's collectives then count the
    chosen blocks' recomputed all-to-alls (every:2: block 1's three), none before the trace (a bound)."""
    step = build_step(mixtral, batch_size=2, seq_len=16, gpu="h100-80gb", checkpoint="auto")
    search = planning._Search(step, model_facts(step), DEFAULT_NETWORK, (parse_checkpointing("auto"),), None,
                              sequence=16)
    config = planning._Config(Mesh(dp_shard=2, ep=2), 0, 2, 1, None)
    before, chosen = search.facts_for(config), search.facts_for(config, EVERY_2)
    assert _kinds(collectives_of(config.mesh, before, 1), "ep")["all-to-all"][0] == 8  # a bound: none re-run
    assert _kinds(collectives_of(config.mesh, chosen, 1), "ep")["all-to-all"][0] == 10


_FUNCTIONAL = {"_c10d_functional.all_reduce.default": "all-reduce",
               "_c10d_functional.all_gather_into_tensor.default": "all-gather",
               "_c10d_functional.all_to_all_single.default": "all-to-all"}


def _traced_kinds(trace: Any, mesh: Mesh) -> dict[str, tuple[int, float]]:
    """The traced step's functional collectives per kind: calls, and bytes a rank receives from the
    others by a ring (an all-gather or an all-reduce over tp: (n − 1) / n of the output, twice for the
    all-reduce; an all-to-all over ep × tp: the output less the rank's own 1/n, balanced routing); the
    split counts' in-place all-to-all by its calls."""
    out: dict[str, list[float]] = {}
    for uid, op in enumerate(trace.op):
        kind = _FUNCTIONAL.get(op)
        if kind is None:
            continue
        n = mesh.ep * mesh.tp if kind == "all-to-all" else mesh.tp
        total = out.setdefault(kind, [0, 0.0])
        total[0] += 1
        total[1] += trace.nbytes[uid] * (n - 1) / n * (2 if kind == "all-reduce" else 1)
    got = {k: (int(v[0]), v[1]) for k, v in out.items()}
    return {**got, "split counts": (trace.op_counts["alltoall_base_.default"], 0.0)}


@pytest.mark.slow  # three traced steps of a tiny Mixtral under a mesh, ~10 s each on this host
@pytest.mark.parametrize("mesh, checkpoint, precision", [
    (Mesh(tp=2, ep=2), "full", "fp32"),
    (Mesh(dp_replicate=2, tp=2, ep=2), "off", "amp-bf16"),
    (Mesh(dp_shard=2, ep=2), "every:2", "fp32"),
], ids=["tp2-ep2-full", "hsdp-tp2-ep2-amp", "dp_shard2-ep2-every2"])
def test_plan_counts_what_the_traced_step_communicates(mixtral: str, monkeypatch: pytest.MonkeyPatch, mesh: Mesh,
                                                       checkpoint: str, precision: str) -> None:
    """The estimate's traced rank program (its ``trace_step``, kept as it runs) against plan's collectives
    of tp and ep for the same configuration (2 × 16 tokens, the exposed ones: the activations'), count and
    bytes per kind. FSDP2's collectives are memcalc's own program's, not dispatched on the fake group: not
    in the trace, not compared."""
    _assert_plan_counts_the_trace(mixtral, mesh, checkpoint, precision, monkeypatch)


@pytest.mark.slow  # two traced llama-tiny steps under tp=2, ~5 s each
@pytest.mark.parametrize("checkpoint", ["off", "full"])
def test_a_dense_models_plan_counts_what_its_traced_step_communicates(monkeypatch: pytest.MonkeyPatch,
                                                                      checkpoint: str) -> None:
    """llama-tiny, transformers' Llama: its trace runs its Hugging Face plan (all-reduces), which plan
    now reads for a dense model too; torchtitan's closed formula counted 64 + 5 all-gathers and
    reduce-scatters where the trace runs 58 all-reduces and one all-gather (66 under full)."""
    _assert_plan_counts_the_trace("llama-tiny", Mesh(tp=2), checkpoint, "fp32", monkeypatch)


def _assert_plan_counts_the_trace(model: str, mesh: Mesh, checkpoint: str, precision: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[Any] = []

    def keep(*args: Any, **kwargs: Any) -> Any:
        made = trace_step(*args, **kwargs)
        traced.append(made)
        return made

    trace_step = strategies.trace_step
    monkeypatch.setattr(strategies, "trace_step", keep)
    monkeypatch.setattr(strategies, "traced_by_depth", lambda *args, **kwargs: None)  # the whole model traced
    options: dict[str, Any] = dict(batch_size=2, seq_len=16, optimizer="adam", gpu="cpu", checkpoint=checkpoint,
                                   precision=precision)
    memcalc.estimate(model, distributed=memcalc.Distributed(**mesh.used), **options)
    (step,) = traced
    facts = replace(model_facts(build_step(model, **options)), tokens=32, checkpoint=parse_checkpointing(checkpoint))
    modelled = {kind: (count, received) for kind, (count, received) in
                _kinds(tuple(c for c in collectives_of(mesh, facts, 1)
                              if c.dimension in ("tp", "ep") and not c.overlapped)).items()}
    split = modelled.pop("split counts", (0, 0.0))
    got = _traced_kinds(step.trace, mesh)
    assert got.pop("split counts", (0, 0.0))[0] == split[0]
    assert got == modelled
