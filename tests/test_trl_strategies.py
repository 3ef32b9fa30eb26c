"""TRL's trainers under data parallelism (``--loop trl-dpo --strategy ddp|fsdp|zero1|zero2``; zero3 in
tests/test_trl_zero3.py), the README's example config (``examples/trl/dpo.json``, issue 35's "Done
when" command) and launch configurations in ``memcalc fit``.

Each rank traces TRL's own ``compute_loss`` (memcalc.stacks.trl.step) under its rank program. What is
checked by hand-worked bytes: DDP adds its gradient bucket to the one-GPU step; under FSDP2 the DPO
reference is sharded on its root alone (TRL's ``prepare_fsdp``: ``fully_shard(ref_model)``), so its
whole all-gather output (every reference parameter, once) is allocated in the forward and freed
when the reference's forward ends, before the policy's backward. That wrapping against real
``fully_shard`` (a fake process group) is below; against real two-process gloo runs, DDP's and
FSDP2's, in tests/test_trl_gloo.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from trl_llama import CONFIG, HIDDEN, VOCAB, P

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

pytest.importorskip("transformers")
pytest.importorskip("trl")

SEQ = 64
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "trl"


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return f"hf:{path}"


def _dpo(model: str, strategy: str | None, **config: Any) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False, **config}
    distributed = None if strategy is None else memcalc.Distributed(strategy, world_size=2)
    return memcalc.estimate(model, loop="trl-dpo", trainer_args=args, seq_len=SEQ, gpu="cpu", distributed=distributed)


def test_ddp_adds_its_gradient_bucket(model: str) -> None:
    """DDP's rank is the one-GPU step plus the Reducer's bucket: every trainable parameter of the policy
    (P bytes, under the 25 MiB bucket cap: one bucket); the reference is not wrapped in DDP
    (``accelerator.prepare_model(ref_model, evaluation_mode=True)``) and has no bucket."""
    one, ddp = _dpo(model, None), _dpo(model, "ddp")
    assert P == 9_570_816 and P % 512 == 0
    assert ddp.bytes.peak_allocated - one.bytes.peak_allocated == P
    assert ddp.roles[0].report.peak_phase is one.peak_phase is Phase.BACKWARD


def test_fsdp_shards_the_reference_on_its_own_root(model: str) -> None:
    """The frozen reference costs P (a whole copy) at the one-GPU peak and P/2 (its shard) per rank under
    FSDP2 over 2 ranks (every dim 0 divides by 2: no padding); its all-gather output, the whole
    reference in fp32 (P bytes: one unit, ``fully_shard`` on its root alone) is made in the forward
    and freed when the reference's forward ends, before the policy's backward."""
    one = _dpo(model, None).bytes.peak_allocated - _dpo(model, None, precompute_ref_log_probs=True).bytes.peak_allocated
    fsdp = _dpo(model, "fsdp")
    sharded = fsdp.bytes.peak_allocated - _dpo(model, "fsdp", precompute_ref_log_probs=True).bytes.peak_allocated
    assert one - sharded == P // 2
    timeline = fsdp.timeline()
    step = [i for i in range(1, timeline.num_events)
            if timeline.category[i] is Category.WORKSPACE and timeline.phase[i] is Phase.FORWARD
            and timeline.allocated[i] - timeline.allocated[i - 1] in (P, -P)]
    # per iteration: the all-gather output (+P), gloo's staging copy of it (+P, −P), the output freed (−P)
    assert [int(timeline.allocated[i] - timeline.allocated[i - 1]) for i in step] == [P, P, -P, -P] * 2
    backward = next(s.start for s in timeline.spans if s.phase is Phase.BACKWARD)
    assert step[3] < backward
    assert any("FSDP2 FULL_SHARD over 2 ranks" in note for note in fsdp.notes)


@pytest.mark.parametrize("precompute", [False, True])
def test_zero_model_states_by_hand(model: str, precompute: bool) -> None:
    """ZeRO over 2 ranks, fp32: stage 1 keeps every gradient (P), stage 2 only this rank's partition
    (P/2); the frozen reference is whole on every rank (TRL's ``prepare_deepspeed`` gives it ZeRO
    stage 0 under stages 1 and 2): P more model states than with precomputed log-probs."""
    def states(stage: str, **config: Any) -> int:
        args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False, **config}
        report = memcalc.estimate(model, loop="trl-dpo", trainer_args=args, seq_len=SEQ, gpu="cpu",
                                  distributed=memcalc.Distributed(stage, world_size=2, reduce_bucket_size=10**6))
        return report.roles[0].model_states

    one = states("zero1", precompute_ref_log_probs=precompute)
    two = states("zero2", precompute_ref_log_probs=precompute)
    assert one - two == P // 2
    if precompute:
        assert states("zero2") - two == P


@pytest.mark.parametrize("loop, strategy, message", [
    ("trl-grpo", "dp", "under --strategy dp is not modelled"),
    ("trl-dpo", "dp", "under --strategy dp is not modelled"),
])
def test_unmodelled_strategies_refused(model: str, loop: str, strategy: str, message: str) -> None:
    with pytest.raises(InapplicableOptionError, match=message):
        memcalc.estimate(model, loop=loop, seq_len=SEQ, gpu="cpu",
                         trainer_args={"gradient_checkpointing": False, "bf16": False},
                         distributed=memcalc.Distributed(strategy, world_size=2))


def _grpo(model: str, strategy: str | None) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "bf16": False,
            "gradient_checkpointing": False, "beta": 0.04}
    distributed = None if strategy is None else memcalc.Distributed(strategy, world_size=2)
    return memcalc.estimate(model, loop="trl-grpo", trainer_args=args, seq_len=16, gpu="cpu", distributed=distributed)


def test_grpo_under_ddp_adds_its_gradient_bucket(model: str) -> None:
    """GRPO under DDP: generation runs the unwrapped policy (``unwrap_model_for_generation``), which
    allocates what it allocates on one GPU; DDP adds its one bucket of every trainable parameter (P
    bytes), alive through the whole step: both phases' peaks grow by P."""
    one, ddp = _grpo(model, None), _grpo(model, "ddp")
    assert one.generation_peak is not None and ddp.generation_peak is not None
    assert ddp.bytes.peak_allocated - one.bytes.peak_allocated == P
    assert ddp.generation_peak - one.generation_peak == P


def test_grpo_under_fsdp_gathers_the_reference_whole(model: str) -> None:
    """GRPO under FSDP2: the policy in accelerate's units (``fsdp2_prepare_model``), called by every
    generate() step, the scoring and the training forward, each gathering its layers and embeddings
    again; its final norm and head, ``fully_shard([norm, lm_head], reshard_after_forward=False)``, stay
    gathered from the first generate() step to the backward (torch's ``FSDPParamGroup.reshard`` keeps
    such a group unsharded after any forward, no_grad too); the frozen reference is sharded on its own
    root (``prepare_fsdp``), one unit. Its scoring peaks the generation phase: the reference's whole
    all-gather output (P) beside the two models' shards (P/2 each) is the one GPU's two whole models
    (2 P), with the same scoring tensors beside them, plus the policy's gathered head and norm (V·H and
    H fp32 elements); the training step, where the policy's gradients and Adam's state are sharded, is
    lower."""
    one, fsdp = _grpo(model, None), _grpo(model, "fsdp")
    assert one.generation_peak is not None and fsdp.generation_peak is not None
    assert fsdp.generation_peak - one.generation_peak == 4 * (VOCAB * HIDDEN + HIDDEN)  # 4,194,816 B
    assert fsdp.bytes.peak_allocated < one.bytes.peak_allocated
    assert fsdp.roles[0].report.generation_peak == fsdp.generation_peak


def test_lora_policy_blocks_are_fsdp_units(model: str) -> None:
    """With LoRA the policy is the PeftModel, whose base model's layers (``base_model.model.model.layers``)
    are FSDP2's units: DPO with LoRA under fsdp answers, the frozen base sharded (its model states per
    rank below DDP's, which replicates them)."""
    lora = memcalc.FineTune(lora=memcalc.LoRA(8))
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False}

    def states(strategy: str) -> int:
        report = memcalc.estimate(model, loop="trl-dpo", trainer_args=args, seq_len=SEQ, gpu="cpu", finetune=lora,
                                  distributed=memcalc.Distributed(strategy, world_size=2))
        return report.roles[0].model_states

    assert states("fsdp") < states("ddp")


def test_grpo_lora_under_fsdp_refused(model: str) -> None:
    args = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "bf16": False,
            "gradient_checkpointing": False}
    with pytest.raises(InapplicableOptionError, match=r"PeftModel\.generate"):
        memcalc.estimate(model, loop="trl-grpo", trainer_args=args, seq_len=16, gpu="cpu",
                         finetune=memcalc.FineTune(lora=memcalc.LoRA(8)),
                         distributed=memcalc.Distributed("fsdp", world_size=2))


def test_cli_trl_under_a_strategy(model: str, tmp_path: Path) -> None:
    args = tmp_path / "sft.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False}))
    result = CliRunner().invoke(main, [model, "--loop", "trl-sft", "--training-args", str(args), "--seq-len",
                                       str(SEQ), "--strategy", "fsdp", "--world-size", "2", "--gpu", "cpu"])
    assert result.exit_code == 0, result.output
    assert "SFTTrainer.compute_loss on meta" in result.output
    assert "under fsdp, 2 GPUs" in result.output


def test_max_length_is_the_sequence_length_without_seq_len(model: str) -> None:
    """TRL truncates every sequence to ``max_length`` (DPOConfig's default: 1024): without ``seq_len``
    that is the sequence estimated, not the model's longest position."""
    report = memcalc.estimate(model, loop="trl-dpo", gpu="cpu",
                              trainer_args={"per_device_train_batch_size": 1, "max_length": 96, "bf16": False,
                                            "gradient_checkpointing": False})
    assert "(2, 96)" in report.input_description  # one pair: chosen and rejected rows


@pytest.mark.slow
def test_readme_dpo_example_answers() -> None:
    """Issue 35's "Done when" command, with the README's example config."""
    result = CliRunner().invoke(main, ["llama-3-8b", "--loop", "trl-dpo", "--lora", "16", "--training-args",
                                       str(EXAMPLES / "dpo.json"), "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    assert "input_ids=(4, 1024)" in result.output  # 2 pairs, max_length 1024
    assert "adapters disabled (PEFT)" in result.output
    assert "fits in" in result.output


def test_fit_reads_a_deepspeed_config(model: str) -> None:
    """``max_batch_size(deepspeed=...)`` finds what the same setting given by hand finds."""
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": 10**6}}
    options: dict[str, Any] = {"seq_len": SEQ, "budget": "192MiB", "margin": 0, "max_batch": 64}
    by_file = memcalc.max_batch_size(model, deepspeed=config, world_size=2, **options)
    by_hand = memcalc.max_batch_size(model, distributed=memcalc.Distributed("zero2", world_size=2,
                                                                            reduce_bucket_size=10**6), **options)
    assert by_file.batch_size == by_hand.batch_size > 1
    assert by_file.report.bytes.peak_allocated == by_hand.report.bytes.peak_allocated


# ---- the reference's own FSDP2 root against real fully_shard ------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(3))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _PolicyAndReference(nn.Module):
    """DPO's shape of step: the policy's forward, then the frozen reference's under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = _Net()
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.policy(x)
        with torch.no_grad():
            ref = self.reference(x)
        return out - ref


def test_reference_root_against_real_fully_shard(fake_process_group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's FSDP2 setting run for real on the CPU over a fake process group (no collective
    allocates): the policy sharded per block and on its root (accelerate's ``fsdp2_prepare_model``),
    the reference by ``fully_shard`` on its root alone with ``reshard_after_forward=True`` (TRL's
    ``prepare_fsdp``, which passes accelerate's value explicitly: torch then reshards a root after its
    forward); two Adam steps under the profiler. memcalc's rank program with the reference as a
    separate model (what ``trl_model`` declares) agrees to the byte, less Adam's CPU step counters
    (4 B per trained parameter tensor)."""
    from test_strategies import _real_peak
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _PolicyAndReference()
    mesh = init_device_mesh("cpu", (fake_process_group,))
    for block in model.policy.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.policy, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.reference, mesh=mesh, reshard_after_forward=True)
    real = _real_peak(model, torch.randn(16, 64), [p.to_local() for p in model.parameters()])
    counters = 4 * len(list(model.policy.parameters()))

    resolved = Step.resolved

    def with_reference(self: Step, *args: Any, **kwargs: Any) -> ResolvedModel:
        return replace(resolved(self, *args, **kwargs), separate_models=("reference",))

    monkeypatch.setattr(Step, "resolved", with_reference)
    estimate = memcalc.estimate(_PolicyAndReference, input_shape=(64,), batch_size=16, optimizer="adam", loss="mean",
                                gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"),
                                distributed=memcalc.Distributed("fsdp", world_size=fake_process_group))
    assert estimate.peak_requested == real - counters


def test_cli_fit_reads_a_deepspeed_config(model: str, tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10**6}}))
    result = CliRunner().invoke(main, ["fit", model, "--deepspeed", str(config), "--world-size", "2", "--seq-len",
                                       str(SEQ), "--budget", "192MiB", "--margin", "0", "--neighbours", "0"])
    assert result.exit_code == 0, result.output
    expected = memcalc.max_batch_size(model, deepspeed=json.loads(config.read_text()), world_size=2, seq_len=SEQ,
                                      budget="192MiB", margin=0)
    assert f"largest batch that fits: {expected.batch_size} " in result.output
    assert "under zero2, 2 GPUs" in result.output


def _trl_resolved(model: str, loop: str, **config: Any) -> tuple[ResolvedModel, Step]:
    """The module memcalc traces for a TRL loop (``trl_model``: the policy and the reference inside the
    module whose forward is TRL's ``compute_loss``) and its step."""
    from memcalc.fields import build_step
    from memcalc.stacks.trl.step import trl_model

    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False, **config}
    step = build_step(model, loop=loop, trainer_args=args, seq_len=SEQ, gpu="cpu")
    return trl_model(step.resolved(2), step), step


def _fsdp_groups(model: nn.Module) -> dict[frozenset[tuple[int, str]], bool]:
    """Each ``fully_shard`` group of ``model`` that holds parameters, as the (module, name) pairs of its
    parameters, with whether torch reshards it after forward (``post_forward_mesh_info`` set)."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups[id(group)] = group
    return {frozenset((id(p._module_info.module), p._module_info.param_name) for p in group.fsdp_params):
            group.post_forward_mesh_info is not None for group in groups.values()}


def test_dpo_units_against_accelerate_and_trl(fake_process_group: int, model: str) -> None:
    """DPO's policy and reference under FSDP2, sharded by accelerate 1.16's own ``fsdp2_prepare_model``
    (the Trainer's policy) and TRL's own ``prepare_fsdp`` (the reference), over a fake process group on
    meta: memcalc's units are the same parameter groups with the same ``reshard_after_forward`` —
    each layer and the embeddings resharded, the norm with the head not, the reference whole, resharded
    (the policy's root holds no parameter here; torch resolves its default to False at lazy init). Before
    TRL's loops used accelerate's layout memcalc sharded the policy's blocks and root alone."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from trl.models.utils import prepare_fsdp

    from memcalc.distributed.accelerate_fsdp import accelerate_units

    resolved, _step = _trl_resolved(model, "trl-dpo")
    units = accelerate_units(resolved.module, resolved.block_containers, resolved.separate_models,
                             resolved.trained_root)
    ours = {frozenset((id(m), name) for m in unit.members for name, p in m.named_parameters(recurse=False)):
            unit.reshard_after_forward is not False for unit in units}
    ours = {members: reshards for members, reshards in ours.items() if members}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap")
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  is_main_process=True, device=torch.device("cpu"))
    fsdp2_prepare_model(accelerator, resolved.module.policy)
    prepare_fsdp(resolved.module.reference, accelerator)
    assert _fsdp_groups(resolved.module) == ours
    assert len(ours) == 5  # the reference; the embeddings; two layers; the norm with the head


@pytest.mark.parametrize(("loop", "config", "lora", "finds_unused"), [
    ("trl-sft", {}, False, True),  # a PreTrainedModel policy, not checkpointed
    ("trl-sft", {"gradient_checkpointing": True}, False, False),
    ("trl-dpo", {"gradient_checkpointing": True}, True, True),  # the Trainer is handed the PeftModel
    ("trl-dpo", {"ddp_find_unused_parameters": False}, False, False),
])
def test_trl_ddp_finds_unused_as_the_trainer_decides(model: str, loop: str, config: dict[str, Any], lora: bool,
                                                     finds_unused: bool) -> None:
    """TRL's trainers are Trainers: DDP gets the ``find_unused_parameters`` the Trainer decides from the
    policy (``_build_accelerator_args``), and _DDPSink clones the policy's outputs, not the loss of the
    module around TRL's ``compute_loss`` (which is no module of DDP's)."""
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False, **config}
    report = memcalc.estimate(model, loop=loop, trainer_args=args, seq_len=SEQ, gpu="cpu",
                              finetune=memcalc.FineTune(lora=memcalc.LoRA(8)) if lora else None,
                              distributed=memcalc.Distributed("ddp", world_size=2))
    assert any("_DDPSink clones" in note for note in report.notes) is finds_unused


def test_ddp_sink_on_the_policy(model: str) -> None:
    """The DDP rank program of a TRL loop wraps the policy (``trained_root``): its forward hook (the
    _DDPSink clones) sits there, on no other module."""
    from memcalc.distributed.ddp import DdpProgram
    from memcalc.engine.trace import StorageTracer

    resolved, _step = _trl_resolved(model, "trl-sft")
    program = DdpProgram(25 * 2**20, True, True, find_unused_parameters=True, wrapped=resolved.trained_root)
    program.install(StorageTracer(), resolved.module)
    try:
        hooked = [name for name, m in resolved.module.named_modules() if m._forward_hooks]
        assert hooked == ["policy"]
    finally:
        program.remove()


@pytest.mark.parametrize("loop", ["trl-sft", "trl-dpo"])
def test_trl_fsdp_notes_accelerates_layout(model: str, loop: str) -> None:
    """TRL's trainers run the Trainer's accelerate: their FSDP2 estimate says it lays accelerate's units."""
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False}
    notes = memcalc.estimate(model, loop=loop, trainer_args=args, seq_len=SEQ, gpu="cpu",
                             distributed=memcalc.Distributed("fsdp", world_size=2)).notes
    assert any("FSDP2 units as accelerate's fsdp2_prepare_model makes them" in note for note in notes)
