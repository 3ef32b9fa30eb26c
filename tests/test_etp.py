"""Expert tensor parallelism (torchtitan's ``expert_tensor_parallel_degree``, ``--mesh ...,etp=N``):
etp=1 is the layout memcalc models and is accepted; etp = tp is refused by name, as torchtitan
dropped ``ExpertTensorParallel`` (PR #3167) and transformers deprecates ``moe_tp_experts``; other
values are refused as torchtitan's ``ParallelDims`` refused them.

The per-rank expert parameters etp = tp would hold are worked out by hand and checked against torch's
own DTensor shard arithmetic on torchtitan's placements (w1/w3 ``[Shard(0), Shard(1)]``, w2
``[Shard(0), Shard(2)]`` over the ``(ep, etp)`` mesh of a fake process group): the same count as
etp=1's whole experts over ep × tp ranks (docs/many-gpus.md, "Expert tensor parallelism").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from support import hf_config_source

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.mesh import Mesh, parse_mesh

#: tests/test_ep.py's tiny Mixtral with 8 experts (d 64, SwiGLU 128, 2 layers).
EXPERTS, HIDDEN, INTERMEDIATE = 8, 64, 128
#: One expert: gate_up_proj (2·128 × 64) and down_proj (64 × 128).
EXPERT = 2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE  # 24,576


def test_etp_1_is_the_modelled_layout() -> None:
    degrees = parse_mesh("dp_shard=2,tp=2,ep=2,etp=1")
    assert degrees == {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 1}
    assert Mesh.of(degrees) == Mesh(dp_shard=2, tp=2, ep=2)  # etp=1 is no dimension: world size 8
    assert Mesh.of({"ep": 4, "etp": 1}).world_size == 4


def test_etp_equal_to_tp_is_refused_by_name() -> None:
    with pytest.raises(InapplicableOptionError, match=r"etp=tp=2 \(expert tensor parallelism") as caught:
        Mesh.of(parse_mesh("dp_shard=2,tp=2,ep=2,etp=2"))
    assert "PR #3167" in str(caught.value) and "moe_tp_experts" in str(caught.value)
    assert "etp=1" in (caught.value.hint or "")
    with pytest.raises(InapplicableOptionError, match="etp=tp=2"):
        memcalc.Distributed(mesh={"tp": 2, "ep": 2, "etp": 2})


@pytest.mark.parametrize(("degrees", "words"), [
    ({"tp": 2, "ep": 2, "etp": 4}, "etp=4 with tp=2: torchtitan's expert_tensor_parallel_degree is 1 or tp"),
    ({"ep": 2, "etp": 2}, "etp=2 with tp=1"),
    ({"tp": 2, "etp": 2}, "etp=2 without ep"),
    ({"tp": 2, "ep": 2, "etp": 0}, "etp=0"),
])
def test_other_etp_values_refused_as_torchtitan_refused_them(degrees: dict[str, int], words: str) -> None:
    with pytest.raises(InvalidInputError, match=words.replace("(", r"\(")) as caught:
        Mesh.of(degrees)
    assert not isinstance(caught.value, InapplicableOptionError)


def test_cli_refuses_etp_tp(tmp_path: Path) -> None:
    model = hf_config_source(tmp_path, {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "vocab_size": 256,
        "max_position_embeddings": 128})
    result = CliRunner().invoke(main, [model, "--batch", "2", "--seq-len", "16", "--gpu", "cpu",
                                       "--mesh", "dp_shard=2,tp=2,ep=2,etp=2"])
    assert result.exit_code == 2, result.output
    assert "etp=tp=2" in result.output and "not modelled" in result.output


def _local_numel(shape: tuple[int, ...], placements: tuple[int, ...], rank: int) -> int:
    """The elements rank ``rank`` holds of a ``shape`` parameter sharded on dims ``placements`` over
    a 2 × 2 ``(ep, etp)`` mesh, as torch's DTensor computes it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("ep", "etp"))
        local, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(d) for d in placements])
        return int(torch.Size(local).numel())
    finally:
        dist.destroy_process_group()


def test_etp_tp_expert_parameters_per_rank_by_hand() -> None:
    # ep=2, tp=etp=2 (4 ranks), 8 experts: each ep rank holds 4 experts, each cut in two over tp: gate_up_proj
    # (8, 256, 64) column-wise -> (4, 128, 64) = 32,768; down_proj (8, 64, 128) row-wise -> (4, 64, 64) = 16,384.
    # Under etp=1 the same 4 ranks hold 8/4 = 2 whole experts: 2 x 24,576 = 49,152 -- the same count; etp=tp
    # changes the activations (each tp rank dispatches its group's whole batch, I/tp wide) and the divisibility
    # (E % ep and I % tp, not E % (ep x tp)), not the model states.
    gate_up, down = (EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)
    by_hand = EXPERTS // 2 * (2 * INTERMEDIATE // 2) * HIDDEN + EXPERTS // 2 * HIDDEN * (INTERMEDIATE // 2)
    assert by_hand == 32_768 + 16_384 == EXPERTS // 4 * EXPERT == 49_152
    if dist.is_initialized():
        pytest.skip("this process has a default process group already")
    for rank in range(4):
        assert _local_numel(gate_up, (0, 1), rank) + _local_numel(down, (0, 2), rank) == by_hand


def test_the_keyword_is_the_mesh_key() -> None:
    """``Distributed(etp=...)`` is ``mesh={..., "etp": ...}``: 1 is dropped, tp refused by name."""
    assert memcalc.Distributed(dp_shard=2, tp=2, ep=2, etp=1).mesh == memcalc.Distributed(dp_shard=2, tp=2, ep=2).mesh
    with pytest.raises(InapplicableOptionError, match="etp=tp=2"):
        memcalc.Distributed(dp_shard=2, tp=2, ep=2, etp=2)
