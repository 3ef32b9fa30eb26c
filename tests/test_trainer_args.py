"""Hugging Face ``TrainingArguments`` as memcalc reads them (memcalc.stacks.transformers.training_args):
``loop="trainer"`` with the installed defaults, ``trainer_args=`` and ``--training-args``.

Three layers: what the installed transformers says (its dataclass's fields, the class and keywords
its ``Trainer.get_optimizer_cls_and_kwargs`` returns), arithmetic worked out here for a single
Linear layer through the trainer loop, and the CLI's output and messages. The real
``Trainer.train()`` against these estimates is in tests/hf_reference/test_trainer_arguments.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Mode, Phase
from memcalc.core.checkpointing import FULL
from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError
from memcalc.core.loop import LoopPreset, OptimizerImpl
from memcalc.core.precision import Precision
from memcalc.engine.optimizers import Optimizer
from memcalc.engine.step_spec import Target
from memcalc.fields import build_step
from memcalc.stacks.transformers.training_args import IGNORED, MAPPED, REFUSED

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures"
#: The transformers the golden file was recorded with (its note names the version).
GOLDEN_TRANSFORMERS = "5.24.0"

# One Linear(1024, 1024), fp32: weight W bytes, all parameters P bytes (weight + bias).
W = 1024 * 1024 * 4  # 4,194,304
P = W + 1024 * 4  # 4,198,400
INPUT = 2 * 1024 * 4  # the batch of 2: 8,192 B


def _args(**kwargs: Any) -> Any:
    """TrainingArguments as a user makes them for a CPU run (``use_cpu``: bf16 needs no GPU then)."""
    return transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


def _linear(**options: Any) -> memcalc.MemoryReport:
    return memcalc.estimate(lambda: nn.Linear(1024, 1024), input_shape=(1024,), loss="mean", **options)


# ============================================================================================
# loop="trainer": the installed TrainingArguments' defaults
# ============================================================================================


def _installed_default(name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}[name]
    return field.default


def test_loop_trainer_takes_the_installed_defaults_optimizer_and_accumulation():
    # transformers 5.24: optim="adamw_torch_fused", which its Trainer builds as torch.optim.AdamW(fused=True)
    assert _installed_default("optim") == "adamw_torch_fused"
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(_args())
    assert cls.__name__ == "AdamW" and kwargs["fused"] is True
    step = build_step("mlp", batch_size=4, loop="trainer")
    assert step.optimizer_key is Optimizer.ADAMW and step.loop.optimizer_impl is OptimizerImpl.FUSED
    assert step.accum_steps == _installed_default("gradient_accumulation_steps") == 1
    assert step.batch_size == 4 and step.precision is Precision.FP32  # the defaults' batch and precision are not taken
    assert step.trainer_args is not None and step.trainer_args.defaults_only
    assert step.notes[-1] == (f"loop trainer with the TrainingArguments defaults of transformers "
                              f"{transformers.__version__}: optim adamw_torch_fused → optimizer adamw, fused; "
                              f"gradient_accumulation_steps 1 → accum_steps 1")


def test_the_users_options_win_over_the_defaults():
    adam = build_step("mlp", loop="trainer", optimizer="adam")  # --optim: memcalc's optimizer, auto
    assert adam.optimizer_key is Optimizer.ADAM and adam.loop.optimizer_impl is OptimizerImpl.AUTO
    assert adam.trainer_args.overridden == ("optimizer",)
    same = build_step("mlp", loop="trainer", optimizer="adamw")  # their optimizer: their implementation
    assert same.loop.optimizer_impl is OptimizerImpl.FUSED and same.trainer_args.overridden == ()
    foreach = build_step("mlp", loop=memcalc.Loop("trainer", optimizer_impl="foreach"), accum_steps=4)
    assert foreach.optimizer_key is Optimizer.ADAMW and foreach.loop.optimizer_impl is OptimizerImpl.FOREACH
    assert foreach.accum_steps == 4 and foreach.trainer_args.overridden == ("accum_steps", "optimizer_impl")
    # other loops read nothing of transformers
    assert build_step("mlp", loop="tutorial").trainer_args is None


# ============================================================================================
# trainer_args: the user's arguments
# ============================================================================================


@functools.cache
def checkpointing_argument() -> str:
    """The installed transformers' name of the checkpointing argument: 5.24 has
    ``activation_checkpointing`` (and still reads ``gradient_checkpointing``); 5.17, the floor CI
    runs, has ``gradient_checkpointing`` only. Read when a test asks, not at collection:
    ``transformers.TrainingArguments`` imports PEFT, with bitsandbytes, about 2 CPU-s in every
    xdist worker (issue 36 item 7)."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


#: Arguments memcalc judges that only some of the releases CI runs have.
NOT_IN_EVERY_RELEASE = {"activation_checkpointing", "activation_checkpointing_kwargs"}


def test_the_users_arguments_set_the_step():
    args = _args(per_device_train_batch_size=3, gradient_accumulation_steps=2, bf16=True,
                 optim="sgd", optim_args="momentum=0.9", **{checkpointing_argument(): True})
    step = build_step("gpt2", seq_len=64, trainer_args=args)
    assert (step.batch_size, step.accum_steps, step.precision, step.checkpoint) == (3, 2, Precision.AMP_BF16, FULL)
    assert step.optimizer_key is Optimizer.SGD_MOMENTUM  # optim_args' momentum: a momentum buffer
    assert step.loop.preset is LoopPreset.TRAINER and step.loop.optimizer_impl is OptimizerImpl.AUTO
    assert step.target is Target.CPU  # use_cpu
    assert step.weight_dtype is None  # bf16=True is autocast over the weights as loaded: fp32 here
    assert dict(step.trainer_args.read)["optim"] == "sgd → optimizer sgd-momentum"


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing:FutureWarning")  # the deprecated names, on purpose
def test_an_object_its_dict_and_its_json_and_yaml_files_are_one_step(tmp_path):
    args = _args(per_device_train_batch_size=4, fp16=True, gradient_checkpointing=True,
                 gradient_checkpointing_kwargs={"use_reentrant": False}, optim="adamw_torch")
    as_dict = json.loads(args.to_json_string())
    (tmp_path / "args.json").write_text(args.to_json_string())
    yaml = pytest.importorskip("yaml")
    (tmp_path / "args.yaml").write_text(yaml.safe_dump(as_dict))
    steps = [build_step("gpt2", seq_len=64, trainer_args=given)
             for given in (args, as_dict, tmp_path / "args.json", str(tmp_path / "args.yaml"))]
    first = steps[0]
    assert (first.batch_size, first.precision, first.checkpoint, first.optimizer_key) == (
        4, Precision.AMP_FP16, FULL, Optimizer.ADAMW)
    for step in steps[1:]:
        assert dataclasses.replace(step, notes=(), trainer_args=None) == dataclasses.replace(
            first, notes=(), trainer_args=None)
        assert step.trainer_args.read == first.trainer_args.read


def test_an_option_given_with_its_own_value_replaces_the_arguments():
    args = _args(per_device_train_batch_size=8, gradient_accumulation_steps=4, bf16=True, optim="adamw_torch_fused")
    step = build_step("mlp", trainer_args=args, batch_size=2, precision="bf16", gpu="h100-80gb", optimizer="sgd")
    assert (step.batch_size, step.accum_steps, step.precision) == (2, 4, Precision.BF16)
    assert step.optimizer_key is Optimizer.SGD and step.loop.optimizer_impl is OptimizerImpl.AUTO
    assert step.target is Target.CUDA and step.gpu.key == "h100-80gb"
    assert step.trainer_args.overridden == ("batch_size", "precision", "optimizer", "gpu")
    assert step.notes[-1].endswith("replaced by your options: batch_size, precision, optimizer, gpu")
    # an option at its default leaves the arguments' value (estimate()'s keywords cannot tell "given" apart)
    assert build_step("mlp", trainer_args=args, accum_steps=1).accum_steps == 4


def test_the_mapping_is_the_explicit_options_to_the_byte():
    # trainer_args are read into memcalc's own options: the same estimate as giving those options
    mapped = _linear(trainer_args=_args(per_device_train_batch_size=2, optim="adamw_torch_fused"))
    explicit = _linear(batch_size=2, gpu="cpu", optimizer="adamw", loop=memcalc.Loop("trainer", optimizer_impl="fused"))
    assert mapped.peak_requested == explicit.peak_requested and mapped.loop == "trainer"
    assert mapped.notes[0].startswith("loop trainer with your TrainingArguments")


def test_adamw_torch_and_adamw_torch_fused_differ_only_in_the_steps_temporaries():
    # Both build torch.optim.AdamW (adamw_torch: foreach=None, the for-loop on the CPU; _fused: fused=True):
    # the same parameters P, gradients P and moments 2P. What each step adds (torch/optim/adam.py, 2.13):
    #   for-loop, _single_tensor_adam: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` —
    #     sqrt() and its quotient alive together for the weight: 2W; the peak is in the step, holding
    #     the batch, 4P, 2W, three float32 scalars of the trainer loop (tr_loss, the last detached
    #     loss, the gradient norm) and, on this CPU target, the Python number bias_correction2_sqrt
    #     wrapped by the division: an 8 B float64 tensor cast to a 4 B float32 one (memcalc.targets.cpu.scalars);
    #   fused: one in-place kernel, nothing; its step counters are two 4-byte tensors on the device.
    for_loop, fused = (_linear(trainer_args=_args(per_device_train_batch_size=2, optim=optim))
                       for optim in ("adamw_torch", "adamw_torch_fused"))
    assert (for_loop.optimizer_impl, fused.optimizer_impl) == ("for-loop", "fused")
    assert for_loop.bytes.parameters == fused.bytes.parameters == P
    assert for_loop.bytes.optimizer_state == 2 * P and fused.bytes.optimizer_state == 2 * P + 2 * 4
    assert for_loop.peak_phase is Phase.OPTIMIZER
    assert for_loop.peak_requested == INPUT + 4 * P + 2 * W + 3 * 4 + 8 + 4 == 25_190_424
    # without the temporaries the step is below the second backward, which holds the peak instead
    assert fused.peak_phase is Phase.BACKWARD and fused.peak_requested < INPUT + 4 * P + 2 * W


def test_max_grad_norm_changes_nothing_allocated():
    # transformers 5.24's Trainer takes the gradient norm whether it clips or not (at 0,
    # _get_grad_norm calls clip_grad_norm_(..., inf); tests/hf_reference checks the real Trainer)
    clipped, unclipped = (_linear(trainer_args=_args(per_device_train_batch_size=2, max_grad_norm=norm))
                          for norm in (1.0, 0.0))
    assert clipped.peak_requested == unclipped.peak_requested


def test_a_search_varies_the_batch_the_arguments_set():
    fit = memcalc.max_batch_size("mlp", budget="64MiB", margin=0, trainer_args=_args(per_device_train_batch_size=8))
    assert fit.batch_size > 8 and fit.report.loop == "trainer"
    points = memcalc.sweep("mlp", batch_sizes=[1, 2], trainer_args=_args(optim="sgd"))
    assert [p.optimizer for p in points] == ["sgd", "sgd"]  # no optimizers given: the arguments'


# ============================================================================================
# What is refused, and what is not read
# ============================================================================================


def test_every_argument_of_the_installed_class_is_judged():
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    judged = MAPPED | IGNORED | REFUSED.keys()
    assert fields - judged == set(), "arguments memcalc has not judged: add each to MAPPED, IGNORED or REFUSED"
    assert judged - fields <= NOT_IN_EVERY_RELEASE, "arguments the installed TrainingArguments no longer has"
    assert not (MAPPED & IGNORED) and not (MAPPED & REFUSED.keys()) and not (IGNORED & REFUSED.keys())


@pytest.mark.parametrize("argument, value", [
    ("torch_compile", True), ("liger_kernel_config", {"rope": False}), ("neftune_noise_alpha", 5.0),
    ("auto_find_batch_size", True), ("eval_strategy", "steps"), ("label_smoothing_factor", 0.1),
    ("deepspeed", "ds_config.json"), ("fsdp", "full_shard"), ("full_determinism", True),
])
def test_what_changes_memory_unmodelled_is_refused_by_name(argument, value):
    with pytest.raises(InapplicableOptionError, match=rf"memcalc does not model these TrainingArguments, which "
                                                      rf"change memory: {argument}=") as caught:
        build_step("mlp", trainer_args={argument: value})
    assert caught.value.hint == "Leave them at their defaults to estimate the step without them."


def test_several_refusals_are_named_at_once():
    with pytest.raises(InapplicableOptionError) as caught:
        build_step("mlp", trainer_args={"torch_compile": True, "eval_strategy": "epoch"})
    assert "torch_compile=True: torch.compile" in str(caught.value)
    assert "eval_strategy='epoch': evaluation during training" in str(caught.value)


@pytest.mark.parametrize("kwargs, says", [
    ({"every_n_layers": 2}, "every_n_layers=2: memcalc checkpoints every layer"),
    ({"offload": True}, "offload=True: the saved activations held in host memory"),
    ({"context_fn": "x"}, "context_fn: not a keyword memcalc knows"),
])
def test_checkpointing_it_cannot_follow_is_refused(kwargs, says):
    with pytest.raises(InapplicableOptionError, match="memcalc cannot follow these activation_checkpointing_kwargs") \
            as caught:
        build_step("gpt2", seq_len=32, trainer_args={"gradient_checkpointing": True,
                                                     "gradient_checkpointing_kwargs": kwargs})
    assert says in str(caught.value)


def test_checkpointing_kwargs_it_follows_and_kwargs_without_checkpointing():
    accepted = {"use_reentrant": False, "preserve_rng_state": True}
    checkpointing = checkpointing_argument()
    step = build_step("gpt2", seq_len=32, trainer_args={checkpointing: True, f"{checkpointing}_kwargs": accepted})
    assert step.checkpoint
    # the Trainer reads the kwargs only when it checkpoints
    off = build_step("gpt2", seq_len=32, trainer_args={f"{checkpointing}_kwargs": {"use_reentrant": True}})
    assert not off.checkpoint


@pytest.mark.parametrize("optim, args, says", [
    ("adafactor", None, "builds transformers.optimization.Adafactor: transformers' own Adafactor is not "
                        "torch.optim.Adafactor"),
    pytest.param("lion_8bit", None, "builds bitsandbytes.optim.lion.Lion, which memcalc does not model",
                 marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                          reason="the Trainer builds bitsandbytes' Lion only where it is installed")),
    ("rmsprop", "momentum=0.9", "momentum or centered keeps a momentum buffer"),
    # the Trainer builds torchao's 4-bit AdamW where torchao is installed (the float8 extra), else it cannot
    ("adamw_torch_4bit", None, "builds torchao.optim.adam.AdamW4bit, which memcalc does not model"
     if importlib.util.find_spec("torchao") is not None else "the installed Trainer cannot build it here"),
])
def test_optimizers_it_does_not_model_are_refused(optim, args, says):
    with pytest.raises(InapplicableOptionError) as caught:
        build_step("mlp", trainer_args={"optim": optim, "optim_args": args})
    assert says in str(caught.value) and "adamw_torch_fused" in (caught.value.hint or "")


def test_the_bitsandbytes_optimizers_are_memcalcs():
    for optim, expected in (("adamw_bnb_8bit", Optimizer.ADAMW_8BIT), ("adamw_8bit", Optimizer.ADAMW_8BIT),
                            ("paged_adamw_8bit", Optimizer.PAGED_ADAMW_8BIT),
                            ("paged_adamw_32bit", Optimizer.PAGED_ADAMW_32BIT)):
        try:
            step = build_step("mlp", trainer_args={"optim": optim})
        except InapplicableOptionError as exc:  # the Trainer imports bitsandbytes to build them
            pytest.skip(f"bitsandbytes is not usable here: {exc}")
        assert step.optimizer_key is expected and step.loop.optimizer_impl is OptimizerImpl.AUTO


def test_invalid_values_are_named():
    with pytest.raises(InvalidInputError, match="TrainingArguments optim 'adamw_foo' is not an optimizer"):
        build_step("mlp", trainer_args={"optim": "adamw_foo"})
    with pytest.raises(InvalidInputError, match="per_device_train_batch_size must be an integer ≥ 1, got 0"):
        build_step("mlp", trainer_args={"per_device_train_batch_size": 0})
    with pytest.raises(InvalidInputError, match="bf16 and fp16 are both set"):
        build_step("mlp", trainer_args={"bf16": True, "fp16": True})
    with pytest.raises(InvalidInputError, match=r"trainer_args must be a transformers\.TrainingArguments"):
        build_step("mlp", trainer_args=42)


def test_a_subclass_arguments_it_does_not_know_are_named_as_not_read():
    # defined here, not at collection: transformers.TrainingArguments imports PEFT (checkpointing_argument)
    @dataclasses.dataclass
    class _SftLikeArguments(transformers.TrainingArguments):
        """A subclass with arguments of its own, as TRL's SFTConfig has."""

        max_length: int = 1024
        packing: bool = False

    config = _SftLikeArguments(output_dir="unused", use_cpu=True, report_to="none", per_device_train_batch_size=2,
                               max_length=512, packing=True)
    step = build_step("mlp", trainer_args=config)
    assert step.trainer_args.unknown == ("max_length", "packing")
    assert step.notes[-1].endswith("not read (memcalc does not know them): max_length, packing")


def test_a_key_trainingarguments_does_not_have_is_refused_with_the_closest():
    # TrainingArguments(**arguments) raises TypeError on it; a typo must not leave accumulation at 1 unnoticed
    with pytest.raises(InvalidInputError) as caught:
        build_step("mlp", trainer_args={"per_device_train_batch_size": 2, "gradient_accumulaton_steps": 4})
    message = str(caught.value)
    assert "TrainingArguments has no argument 'gradient_accumulaton_steps'" in message
    assert "did you mean 'gradient_accumulation_steps'?" in message
    with pytest.raises(InvalidInputError, match=r"no argument 'max_length' \(and 'packing'\)"):
        build_step("mlp", trainer_args={"max_length": 512, "packing": True})


def test_the_arguments_describe_the_trainers_loop_in_training():
    with pytest.raises(InapplicableOptionError, match="describe Hugging Face Trainer's loop; the loop is tutorial"):
        build_step("mlp", trainer_args={}, loop="tutorial")
    with pytest.raises(InapplicableOptionError, match=r"trainer_args \(--training-args\) describe a training run"):
        build_step("mlp", trainer_args={}, mode="eval")
    # the trainer loop alone outside training: the loop is refused, not the optimizer it took
    with pytest.raises(InapplicableOptionError, match=r"a training loop .* applies to mode train"):
        build_step("mlp", loop="trainer", mode="eval")
    # a Loop("trainer", ...) beside them is theirs, modified
    kept = build_step("mlp", trainer_args={}, loop=memcalc.Loop("trainer", keep_grads=True))
    assert kept.loop.keep_grads and kept.loop.optimizer_impl is OptimizerImpl.FUSED and kept.mode is Mode.TRAIN


def test_the_trainer_loop_without_transformers_runs_on_memcalcs_options(monkeypatch):
    # loop="trainer" alone reads the installed TrainingArguments' defaults; where transformers is
    # not installed it is still the trainer preset (clipping, outputs dropped), with memcalc's own
    # optimizer, and the note says what was not read. The user's own arguments still need it.
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    step = build_step("mlp", loop="trainer")
    assert step.loop.preset is LoopPreset.TRAINER and step.optimizer_key is Optimizer.ADAM
    assert step.trainer_args is not None and "transformers is not installed" in step.trainer_args.describe()
    assert any("were not read" in note for note in step.notes)
    with pytest.raises(MissingPackageError, match="transformers"):
        build_step("mlp", trainer_args={"per_device_train_batch_size": 2})


def test_files_it_cannot_read(tmp_path, monkeypatch):
    with pytest.raises(InvalidInputError, match="training arguments file not found"):
        build_step("mlp", trainer_args=str(tmp_path / "missing.json"))
    (tmp_path / "args.txt").write_text("{}")
    with pytest.raises(InvalidInputError, match=r"a \.json or \.yaml file, got \.txt"):
        build_step("mlp", trainer_args=str(tmp_path / "args.txt"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InvalidInputError, match="must hold a mapping of argument names to values, got list"):
        build_step("mlp", trainer_args=str(tmp_path / "list.json"))
    (tmp_path / "bad.json").write_text("{per_device_train_batch_size: 2}")
    with pytest.raises(InvalidInputError, match="is not valid JSON"):
        build_step("mlp", trainer_args=str(tmp_path / "bad.json"))
    (tmp_path / "args.yaml").write_text("per_device_train_batch_size: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed: `import yaml` raises ImportError
    needs = r"reading the YAML training arguments .* needs the package 'pyyaml'"
    with pytest.raises(MissingPackageError, match=needs) as caught:
        build_step("mlp", trainer_args=str(tmp_path / "args.yaml"))
    assert "give the arguments as JSON" in (caught.value.hint or "")


# ============================================================================================
# The CLI: --training-args
# ============================================================================================


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=True)


def test_cli_training_args(monkeypatch, golden):
    # the file sets the batch (16), accumulation (2) and optim adamw_torch (AdamW, foreach on CUDA);
    # logging, saving and the learning rate change nothing allocated
    monkeypatch.chdir(FIXTURES)
    result = _run("mlp", "--training-args", "trainer_args.json")
    assert result.exit_code == 0, result.output
    # the note names the installed transformers: read as the one the file was recorded with
    golden(result.output.replace(f"transformers {transformers.__version__}", f"transformers {GOLDEN_TRANSFORMERS}"))
    assert "memcalc: mlp, batch 16, training step, optimizer adamw (foreach), 2 accumulation steps" in result.output


def test_cli_options_replace_the_files():
    path = str(FIXTURES / "trainer_args.json")
    given = _run("mlp", "--training-args", path, "--batch", "4", "--optim-impl", "fused", "--format", "json")
    assert given.exit_code == 0, given.output
    data = json.loads(given.output)
    assert (data["batch_size"], data["optimizer"], data["optimizer_impl"], data["loop"]) == (4, "adamw", "fused",
                                                                                             "trainer")
    default = json.loads(_run("mlp", "--training-args", path, "--format", "json").output)
    assert (default["batch_size"], default["optimizer_impl"]) == (16, "foreach")
    fit = _run("fit", "mlp", "--training-args", path, "--budget", "64MiB", "--margin", "0", "--format", "json")
    assert fit.exit_code == 0, fit.output
    assert json.loads(fit.output)["report"]["loop"] == "trainer"


def test_cli_messages(tmp_path):
    refused = tmp_path / "compiled.json"
    refused.write_text(json.dumps({"torch_compile": True}))
    result = _run("mlp", "--training-args", str(refused))
    assert result.exit_code == 2
    assert result.output.startswith("error: memcalc does not model these TrainingArguments, which change memory: "
                                    "torch_compile=True")
    result = _run("mlp", "--training-args", str(tmp_path / "nope.json"))
    assert result.exit_code == 2 and "training arguments file not found" in result.output
    result = _run("mlp", "--training-args", str(FIXTURES / "trainer_args.json"), "--loop", "tutorial")
    assert result.exit_code == 2 and "the loop is tutorial" in result.output


def test_cli_help_says_the_precedence():
    text = " ".join(_run("estimate", "--help").output.split())
    assert "--training-args FILE" in text
    assert "An option you give with a value other than its default replaces the file's." in text
    assert "trainer: Hugging Face Trainer's loop, with the optim (--optim and --optim-impl) and accumulation of the " \
           "installed transformers' TrainingArguments defaults unless you give them." in text
