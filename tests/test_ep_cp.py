"""Expert parallelism with context parallelism (``--mesh dp_shard=N,cp=C,ep=E``, or with dp_replicate or tp
instead of dp_shard), as torchtitan lays out MoE models with cp (``ParallelDims._build_mesh_with_ep``: its ep of
``E·C`` ranks borrows cp, and tp under its etp=1 rule): what a rank holds, worked out by hand, and what stays
refused, by name. The real multi-process runs: tests/test_gloo_cp.py.
"""

from __future__ import annotations

import pytest
from test_ep import EXPERT, tiny  # noqa: F401  (tiny: the fixture)

import memcalc
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.expert_parallel import expert_parallelism_available

pytest.importorskip("transformers")
if not expert_parallelism_available():
    pytest.skip("ep needs transformers' expert parallelism", allow_module_level=True)


def test_ep_x_cp_by_hand(tiny: str) -> None:  # noqa: F811
    # cp=2 x ep=2, 4 ranks: the 4 experts of each layer over all ep x cp = 4 ranks (one each, FSDP2 over the
    # one-rank dp_shard_mod_ep), the dense part sharded by FSDP2 over dp_shard x ep x cp = 4 ranks
    report = memcalc.estimate(tiny, batch_size=2, seq_len=16, optimizer="adam", gpu="cpu",
                              distributed=memcalc.Distributed(cp=2, ep=2))
    (role,) = report.roles
    layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 4 * 64 + 2 * 64  # q, k, v, o, router, 2 norms
    dense = 2 * 256 * 64 + 64 + 2 * layer  # embedding, head, final norm, 2 layers: every dim 0 divides by 4
    held = dense // 4 + 2 * EXPERT
    assert held == 14_544 + 49_152 == 63_696
    assert role.report.textbook.parameter_bytes == 4 * held
    assert role.model_states == 16 * held  # Adam: weights, gradients, 2 moments
    assert role.ranks == (0, 1, 2, 3)
    assert report.global_batch_size == 2 * 2  # a batch per ep rank; the 2 cp ranks share theirs
    assert [s.describe() for s in role.sharding] == [
        "params, grads, optimizer /2 (cp)", "sequence /2 (cp)", "experts, dense model states, batch /2 (ep)"]
    notes = " ".join(report.notes)
    assert "8 of 16 tokens per sample per rank" in notes
    assert "expert parallelism over ep x cp = 4 ranks" in notes and "dp_shard x ep x cp = 1 x 2 x 2 ranks" in notes


def test_ep_x_cp_traces_each_ranks_share_of_the_sequence(tiny: str) -> None:  # noqa: F811
    # the experts' all-to-all moves each rank's own B·S/cp tokens: with cp=2 a rank receives half the rows of
    # the same batch at the full sequence, so its peak sits below ep=2 alone (same experts per rank: 2 · 2 = 4)
    kwargs = dict(batch_size=4, seq_len=64, optimizer="sgd", gpu="cpu")
    with_cp = memcalc.estimate(tiny, distributed=memcalc.Distributed(cp=2, ep=2), **kwargs)
    alone = memcalc.estimate(tiny, distributed=memcalc.Distributed(dp_shard=2, ep=2), **kwargs)
    assert with_cp.roles[0].report.peak_requested < alone.roles[0].report.peak_requested


@pytest.mark.parametrize("degrees, error, message", [
    (dict(cp=2, ep=4), InvalidInputError, r"ep=4 with cp=2 splits the experts over ep x cp = 8 ranks.*4 experts"),
    (dict(dp_shard=2, cp=2, ep=2), InapplicableOptionError,
     r"dp_shard=2 with ep=2 and cp=2: each of the ep x cp = 4 ranks holds 1 experts"),
    (dict(tp=2, cp=2, ep=2), InvalidInputError,
     r"ep=2 with cp=2 and tp=2 splits the experts over ep x cp x tp = 8 ranks.*4 experts"),
    (dict(dp_replicate=2, dp_shard=2, tp=2, cp=2, ep=2), InapplicableOptionError,
     r"tp=2 with ep=2, cp=2 and dp_replicate=2, dp_shard=2 is not modelled yet.*32 processes"),  # tp's, first
    (dict(pp=2, cp=2, ep=2), InapplicableOptionError, r"pp=2 with cp=2 and ep=2 is not modelled yet"),
], ids=["uneven", "dp_shard-over-experts", "uneven-with-tp", "all-three", "pp"])
def test_what_ep_x_cp_refuses_is_named(tiny: str, degrees: dict[str, int], error: type[Exception],  # noqa: F811
                                       message: str) -> None:
    with pytest.raises(error, match=message):
        memcalc.estimate(tiny, batch_size=2, seq_len=16, gpu="cpu", distributed=memcalc.Distributed(**degrees))
