"""memcalc's own loops under an accelerate config, as ``accelerator.prepare`` prepares the model
(memcalc.distributed.launch.accelerate_config, Step.accelerate_prepared): FSDP2 with accelerate's
``fsdp2_prepare_model`` units and MixedPrecisionPolicy (16-bit reduce), DDP and one GPU with the
forward's 16-bit outputs copied to float32 (``convert_outputs_to_fp32``). The real runs these are
checked against: tests/test_accelerate_own_gloo.py (slow)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import memcalc
from memcalc.core.categories import Phase
from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.launch.accelerate_config import read_accelerate
from memcalc.engine.run import accelerator_backward
from memcalc.fields import build_step

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import llama_config, write_config

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

#: A small Llama whose logits (batch x seq x vocab) dominate the backward's peak.
VOCAB, HIDDEN = 4_000, 64
BATCH, SEQ = 2, 64
FSDP = "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n"


def _config(tmp_path: Path, kind: str, precision: str, extra: str = "") -> Path:
    path = tmp_path / f"{kind}-{precision}.yaml"
    path.write_text(f"distributed_type: '{kind}'\nmixed_precision: {precision}\n"
                    f"num_processes: {1 if kind == 'NO' else 2}\n{extra}")
    return path


def _estimate(tmp_path: Path, **kw: object) -> memcalc.MemoryReport:
    model = write_config(tmp_path, llama_config(VOCAB, hidden=HIDDEN, layers=1))
    return memcalc.estimate(model, batch_size=BATCH, seq_len=SEQ, gpu="cpu", **kw)  # type: ignore[arg-type]


def _notes(report: memcalc.MemoryReport) -> tuple[str, ...]:
    return report.roles[0].report.notes if report.roles else report.notes


# ============================================================================================
# The mapping: which settings accelerate prepares, and what the notes say
# ============================================================================================


@pytest.mark.parametrize("kind, extra", [("NO", ""), ("MULTI_GPU", ""), ("FSDP", FSDP)])
def test_accelerate_prepares_the_model_under_no_multi_gpu_and_fsdp(tmp_path, kind, extra):
    setup = read_accelerate(_config(tmp_path, kind, "bf16", extra))
    assert setup.accelerate_prepares
    said = [note for note in setup.notes if "convert_outputs_to_fp32" in note]
    # prepare_model's autocast and float32 outputs: DDP and one GPU; _prepare_fsdp2 wraps no forward
    assert len(said) == (0 if kind == "FSDP" else 1)


def test_no_float32_copy_is_noted_without_mixed_precision(tmp_path):
    setup = read_accelerate(_config(tmp_path, "MULTI_GPU", "no"))
    assert setup.accelerate_prepares
    assert not any("convert_outputs_to_fp32" in note for note in setup.notes)


def test_a_tp_mesh_keeps_torchtitans_layout_and_says_so(tmp_path):
    mesh = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    path = tmp_path / "mesh.yaml"
    path.write_text(f"distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 4\n{FSDP}{mesh}")
    setup = read_accelerate(path)
    assert not setup.accelerate_prepares
    assert any("torchtitan's layout" in note and "not with accelerate's" in note for note in setup.notes)


def test_a_one_dimension_mesh_is_prepared_as_accelerate_prepares_it(tmp_path):
    mesh = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
    path = tmp_path / "mesh.yaml"
    path.write_text(f"distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\n{FSDP}{mesh}")
    assert read_accelerate(path).accelerate_prepares


def test_a_deepspeed_plugin_is_not_marked(tmp_path):
    extra = "deepspeed_config:\n  zero_stage: 2\n"
    assert not read_accelerate(_config(tmp_path, "DEEPSPEED", "bf16", extra)).accelerate_prepares


# ============================================================================================
# The estimates
# ============================================================================================


def test_fsdp2_under_accelerate_uses_its_units_and_16_bit_reduce(tmp_path):
    by_file = _estimate(tmp_path, accelerate_config=_config(tmp_path, "FSDP", "bf16", FSDP))
    notes = _notes(by_file)
    assert any("fsdp2_prepare_model makes them for accelerator.prepare" in note for note in notes)
    assert any("reduce_dtype=bfloat16" in note for note in notes)
    # memcalc's own FSDP2 given by hand: torchtitan's blocks + root and a float32 reduce
    by_hand = _estimate(tmp_path, precision="amp-bf16", distributed=memcalc.Distributed("fsdp", world_size=2))
    assert any("reduce_dtype=float32" in note for note in _notes(by_hand))
    assert by_file.peak_requested < by_hand.peak_requested  # the head's gradient sharded early, a 16-bit reduce


@pytest.mark.parametrize("kind", ["NO", "MULTI_GPU"])
def test_amp_outputs_copied_to_float32_hold_the_logits_through_backward(tmp_path, kind):
    by_file = _estimate(tmp_path, accelerate_config=_config(tmp_path, kind, "bf16"))
    distributed = memcalc.Distributed("ddp", world_size=2) if kind == "MULTI_GPU" else None
    by_hand = _estimate(tmp_path, precision="amp-bf16", distributed=distributed)
    # the loop's outputs hold float32 logits instead of bf16 ones during backward: 2 more bytes each; and
    # accelerator.backward's loss / gradient_accumulation_steps, a float32 scalar (4 B), alive through it
    assert by_file.peak_requested - by_hand.peak_requested == BATCH * SEQ * VOCAB * (4 - 2) + 4
    assert any("convert_outputs_to_fp32" in note for note in _notes(by_file))


def test_fp32_is_what_it_was_but_accelerator_backwards_division(tmp_path):
    by_file = _estimate(tmp_path, accelerate_config=_config(tmp_path, "MULTI_GPU", "no"))
    by_hand = _estimate(tmp_path, distributed=memcalc.Distributed("ddp", world_size=2))
    # DDP as given by hand, and the float32 scalar accelerator.backward divides the loss into (peak: backward)
    assert by_file.peak_phase is Phase.BACKWARD
    assert by_file.peak_requested == by_hand.peak_requested + 4


def test_fp16_under_accelerates_fsdp2_is_refused_by_name(tmp_path):
    with pytest.raises(InapplicableOptionError, match="loop minimal under an accelerate config's FSDP2 with "
                                                      "mixed_precision fp16 is not modelled"):
        _estimate(tmp_path, accelerate_config=_config(tmp_path, "FSDP", "fp16", FSDP))


# ============================================================================================
# Accelerator.backward: the loss divided by gradient_accumulation_steps before backward
# ============================================================================================


def test_accelerator_backward_divides_the_loss_first(tmp_path):
    """accelerate's ``backward`` runs ``loss = loss / self.gradient_accumulation_steps`` (1 here), then
    ``loss.backward()``: a new 0-dim float32 tensor, alive through the backward beside the caller's undivided
    loss. This model's peak is in the backward, and the CPU target rounds nothing: 4 B more, exactly."""
    plain = _estimate(tmp_path, optimizer="adam")
    prepared = _estimate(tmp_path, optimizer="adam", accelerate_config=_config(tmp_path, "NO", "no"))
    assert prepared.peak_phase is plain.peak_phase is Phase.BACKWARD
    assert prepared.peak_requested - plain.peak_requested == 4  # one float32 scalar: 1 x 4 B


def test_accumulating_the_loops_own_division_stands_for_accelerates(tmp_path):
    """At ``accum_steps`` 2 memcalc's own loop divides the loss by 2 itself, the one division accelerate's
    backward makes in a loop written for it (``accelerator.accumulate``): no second one, the same peak."""
    plain = _estimate(tmp_path, optimizer="adam", accum_steps=2)
    prepared = _estimate(tmp_path, optimizer="adam", accum_steps=2,
                         accelerate_config=_config(tmp_path, "NO", "no"))
    assert prepared.peak_requested == plain.peak_requested


def test_the_trainers_loop_goes_through_accelerator_backward():
    """The Trainer's ``training_step`` ends in ``self.accelerator.backward(loss)`` whatever the launch (its
    accelerator at one accumulation step); memcalc's own loops only under an accelerate config."""
    assert accelerator_backward(build_step(loop="trainer", gpu="cpu"))
    own = build_step(gpu="cpu")
    assert not accelerator_backward(own)
    assert accelerator_backward(replace(own, accelerate_prepared=True))
    assert not accelerator_backward(replace(own, accelerate_prepared=True, accum_steps=2))
