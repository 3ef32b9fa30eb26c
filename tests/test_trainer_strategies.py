"""The Trainer's own loop (``--loop trainer``) under multi-GPU strategies: what is estimated, what is
refused and why, and accelerate's FSDP2 layout of the model's units. The real two-process runs it is
checked against are tests/test_trainer_gloo.py's (slow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.accelerate_fsdp import accelerate_units

pytest.importorskip("transformers")

SEQ = 32
TWO = {"world_size": 2}


@pytest.fixture
def model(tmp_path: Path) -> str:
    return hf_config_source(tmp_path)


def test_cli_estimates_the_trainer_loop_under_ddp(model: str) -> None:
    """The command that said "estimated on one GPU only for now" estimates each rank."""
    result = CliRunner().invoke(main, [model, "--batch", "2", "--seq-len", str(SEQ), "--loop", "trainer",
                                       "--strategy", "ddp", "--world-size", "2", "--gpu", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["loop"] == "trainer"
    api = memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer",
                           distributed=memcalc.Distributed("ddp", **TWO))
    assert data["bytes"]["peak_allocated"] == api.bytes.peak_allocated


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_trainer_loop_runs_under_accelerates_strategies(model: str, strategy: str) -> None:
    report = memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer",
                              distributed=memcalc.Distributed(strategy, **TWO))
    assert report.distribution is not None and report.distribution.strategy == strategy
    assert report.loop == "trainer"


def test_other_loops_still_refused_under_a_strategy(model: str) -> None:
    with pytest.raises(InapplicableOptionError, match=r"the loop tutorial .* one GPU only for now; a multi-GPU "
                                                      r"strategy runs memcalc's own loop or the Trainer's") as caught:
        memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="tutorial",
                         distributed=memcalc.Distributed("ddp", **TWO))
    assert "--loop trainer" in (caught.value.hint or "")


@pytest.mark.parametrize("mesh", [{"dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2}, {"cp": 2}])
def test_trainer_loop_refused_under_other_meshes(model: str, mesh: dict[str, int]) -> None:
    with pytest.raises(InapplicableOptionError, match=r"loop trainer under --strategy mesh is not modelled: the "
                                                      r"Trainer's loop is estimated under ddp, fsdp, zero1, zero2 "
                                                      r"and zero3"):
        memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer",
                         distributed=memcalc.Distributed(mesh=mesh))


def _meta_llama(tie: bool) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(**{**SMALL_LLAMA, "tie_word_embeddings": tie})
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)  # type: ignore[no-any-return]


def test_accelerate_units_untied() -> None:
    """fsdp2_prepare_model's units (accelerate 1.16): each layer, the embeddings alone, the final
    norm with the head (not resharded after forward), the root holding the rotary buffers' module (torch's
    default for a root: not resharded after forward either)."""
    module = _meta_llama(tie=False)
    units = accelerate_units(module, ("model.layers",))
    assert [u.name for u in units] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                       "model.norm + lm_head", "(root)"]
    tail = units[3]
    assert tail.group == (module.model.norm, module.lm_head) and tail.reshard_after_forward is False
    assert all(u.reshard_after_forward is None for u in units[:3]) and units[4].reshard_after_forward is False
    gathered = [p for u in units for m in u.members for p in m.parameters(recurse=False)]
    assert len(gathered) == len(list(module.parameters()))  # every parameter in one unit, once
    assert not [p for m in units[4].members for p in m.parameters(recurse=False)]


def test_accelerate_units_tied() -> None:
    """Tied embeddings: no unit of their own; the tail is norm, embeddings, head (one weight)."""
    module = _meta_llama(tie=True)
    units = accelerate_units(module, ("model.layers",))
    assert [u.name for u in units] == ["model.layers.0", "model.layers.1",
                                       "model.norm + model.embed_tokens + lm_head", "(root)"]
    assert units[2].group == (module.model.norm, module.model.embed_tokens, module.lm_head)


def test_fsdp_notes_name_accelerates_layout_for_the_trainer_only(model: str) -> None:
    def notes(loop: str) -> list[str]:
        return memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop=loop,
                                distributed=memcalc.Distributed("fsdp", **TWO)).notes

    said = "FSDP2 units as accelerate's fsdp2_prepare_model makes them for the Trainer"
    assert any(said in note for note in notes("trainer"))
    assert not any(said in note for note in notes("minimal"))


@pytest.mark.parametrize(("trainer_args", "checkpoint", "lora", "expected"), [
    (None, False, False, True),  # a PreTrainedModel without checkpointing: not is_activation_checkpointing
    (None, True, False, False),
    (None, False, True, True),  # the Trainer is handed the PeftModel, not a PreTrainedModel
    ({"ddp_find_unused_parameters": False}, False, False, False),
    ({"ddp_find_unused_parameters": True}, True, False, True),
])
def test_trainer_finds_unused_as_transformers_decides(model: str, trainer_args: dict[str, bool] | None,
                                                      checkpoint: bool, lora: bool, expected: bool) -> None:
    from memcalc.distributed.ddp import trainer_finds_unused
    from memcalc.fields import build_step

    finetune = memcalc.FineTune(lora=memcalc.LoRA(8)) if lora else None
    step = build_step(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer", trainer_args=trainer_args,
                      checkpoint=checkpoint, finetune=finetune)
    assert trainer_finds_unused(step.resolved(2).module, step) is expected


def test_ddp_sink_clones_raise_the_trainer_estimate(model: str) -> None:
    """DDP's _DDPSink clones the outputs under find_unused_parameters=True (the Trainer's default
    here): the estimate with it is above the one with ddp_find_unused_parameters=False."""
    def peak(args: dict[str, bool] | None) -> int:
        return memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer", trainer_args=args,
                                distributed=memcalc.Distributed("ddp", **TWO)).peak_requested

    assert peak(None) > peak({"ddp_find_unused_parameters": False})
    notes = memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer",
                             distributed=memcalc.Distributed("ddp", **TWO)).notes
    assert any("_DDPSink clones the model's outputs" in note for note in notes)


def _fsdp2_program(model: str, loop: str, precision: str) -> tuple[Any, list[str]]:
    """The FSDP2 rank program memcalc builds for ``loop`` over two ranks, and its notes."""
    from memcalc.distributed.strategy.dp_shard import fsdp_program
    from memcalc.distributed.vocabulary import FsdpSharding
    from memcalc.fields import build_step

    step = build_step(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop=loop, precision=precision)
    build, notes = fsdp_program(FsdpSharding.FULL_SHARD, step, 2)
    return build(step.resolved(2)), notes


def test_trainer_fsdp_program_takes_accelerates_policy(model: str) -> None:
    """Under amp the Trainer's FSDP2 program gathers and reduces in the dtypes of the policy accelerate's
    own FSDP plugin makes from ``mixed_precision="bf16"`` (what ``AcceleratorState`` calls for bf16=True
    under FSDP), over float32 shards (fsdp2_prepare_model's upcast masters); memcalc's own loop keeps
    torchtitan's float32 reduce."""
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    policy = plugin.mixed_precision_policy
    trainer, notes = _fsdp2_program(model, "trainer", "amp-bf16")
    assert (trainer.gather_dtype, trainer.reduce_dtype) == (policy.param_dtype, policy.reduce_dtype)
    assert (trainer.gather_dtype, trainer.reduce_dtype, trainer.sharded_dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32)
    assert "reduce_dtype=bfloat16), as accelerate's FSDP plugin sets it" in notes[0]
    own, notes = _fsdp2_program(model, "minimal", "amp-bf16")
    assert (own.gather_dtype, own.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert "reduce_dtype=float32): the model computes in bfloat16 without autocast" in notes[0]
    fp32, _ = _fsdp2_program(model, "trainer", "fp32")
    assert (fp32.gather_dtype, fp32.reduce_dtype, fp32.sharded_dtype) == (None, None, None)


def test_trainer_loop_under_fsdp_estimates_bf16_amp(model: str) -> None:
    """bf16=True under FSDP2, once refused, is estimated with accelerate's policy, without autocast: the
    16-bit gathered parameters are the compute, as at amp-bf16 under memcalc's own FSDP2 loop. Below fp32
    (half the gathered bytes), and the notes say the policy."""
    def estimate(precision: str) -> memcalc.MemoryReport:
        return memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer", precision=precision,
                                distributed=memcalc.Distributed("fsdp", **TWO))

    amp, fp32 = estimate("amp-bf16"), estimate("fp32")
    assert amp.precision == "amp-bf16"
    assert amp.peak_requested < fp32.peak_requested
    assert any("MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)" in note for note in amp.notes)


def test_trainer_loop_under_fsdp_refuses_fp16(model: str) -> None:
    """fp16 under accelerate's FSDP2 (GradScaler over the sharded gradients) is refused by name."""
    with pytest.raises(InapplicableOptionError, match=r"loop trainer under --strategy fsdp with precision amp-fp16 "
                                                      r"\(fp16=True\) is not modelled: accelerate runs FSDP2 with "
                                                      r"MixedPrecisionPolicy\(param_dtype and reduce_dtype float16\) "
                                                      r"and torch's GradScaler") as caught:
        memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer", trainer_args={"fp16": True},
                         distributed=memcalc.Distributed("fsdp", **TWO))
    assert "bf16=True" in (caught.value.hint or "")
    memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trainer", precision="amp-fp16",
                     distributed=memcalc.Distributed("ddp", **TWO))  # accelerate's autocast around DDP: estimated


#: TRL's loops read TRL's config classes: the oldest version leg of .ci/run installs no trl extra.
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the trl extra is not installed")


@needs_trl
def test_trl_fsdp_program_takes_accelerates_policy(model: str) -> None:
    """TRL's trainers run accelerate's FSDP2 path as the Trainer's loop does: the same policy."""
    trainer, _ = _fsdp2_program(model, "trainer", "amp-bf16")
    for loop in ("trl-sft", "trl-dpo", "trl-reward"):
        trl, notes = _fsdp2_program(model, loop, "amp-bf16")
        assert (trl.gather_dtype, trl.reduce_dtype, trl.sharded_dtype) == (
            trainer.gather_dtype, trainer.reduce_dtype, trainer.sharded_dtype), loop
        assert "as accelerate's FSDP plugin sets it" in notes[0]


@pytest.mark.parametrize("loop", ["trainer", *(pytest.param(loop, marks=needs_trl)
                                              for loop in ("trl-sft", "trl-dpo", "trl-reward", "trl-grpo"))])
def test_accelerates_fsdp2_refuses_fp16(model: str, loop: str) -> None:
    with pytest.raises(InapplicableOptionError, match=rf"loop {loop} under --strategy fsdp with precision amp-fp16 "
                                                      r"\(fp16=True\) is not modelled"):
        memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop=loop, precision="amp-fp16",
                         distributed=memcalc.Distributed("fsdp", **TWO))


@needs_trl
def test_grpo_under_fsdp_refuses_amp(model: str) -> None:
    """GRPO opens accelerator.autocast() itself around its scoring and training forwards: refused by name
    under FSDP2's bf16 policy; fp32 under FSDP2 is not refused here."""
    with pytest.raises(InapplicableOptionError, match=r"loop trl-grpo under --strategy fsdp with precision "
                                                      r"amp-bf16 is not modelled: GRPOTrainer opens "
                                                      r"accelerator.autocast\(\)") as caught:
        memcalc.estimate(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trl-grpo", precision="amp-bf16",
                         distributed=memcalc.Distributed("fsdp", **TWO))
    assert "bf16=False" in (caught.value.hint or "")
    from memcalc.distributed.setting import Distributed
    from memcalc.estimation import _check
    from memcalc.fields import build_step

    step = build_step(model, batch_size=2, seq_len=SEQ, gpu="cpu", loop="trl-grpo", trainer_args={"bf16": False})
    assert step.precision.value == "fp32"
    _check(step, Distributed("fsdp", **TWO))
