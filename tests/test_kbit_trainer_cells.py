"""Which checkpointing a Trainer run of a QLoRA model really has, cell by cell, and memcalc's reading
of the same setup.

The cells: ``TrainingArguments(gradient_checkpointing=...)`` on or off, with
``gradient_checkpointing_kwargs`` none, ``{"use_reentrant": True}`` or ``{"use_reentrant": False}``;
and how the recipe called ``peft.prepare_model_for_kbit_training`` (``use_gradient_checkpointing``
False, True with no kwargs, or True with ``use_reentrant`` True or False: memcalc's
``FineTune(kbit_checkpointing=...)``). transformers 5.25's ``Trainer.train()`` calls
``activation_checkpointing_enable`` only when ``gradient_checkpointing`` is on (its kwargs, or
``use_reentrant=False`` when none), and never disables it: with it off, the model keeps what PEFT
set up (with no kwargs given to PEFT: reentrant with peft 0.21 on torch 2.13, which hands transformers
``{}`` and so torch's default; non-reentrant with peft 0.22, which hands None and so transformers'
``use_reentrant=False``; read off a real forward by hf_harness.peft_default_reentrant).

The reference is read off the real objects after a real ``Trainer.train()`` step on a model that
bitsandbytes loaded in 4 bits: whether any layer checkpoints (``is_activation_checkpointing``) and
the autograd node of the last layer's output in that step (``CheckpointFunctionBackward``: the
reentrant checkpoint). One cell, the Trainer with checkpointing off on a model PEFT prepared with
its defaults, is also run under the profiler against memcalc's estimate (the reentrant checkpoint
keeps one layer's output more than the non-reentrant kind: the estimate must pick it).
"""

from __future__ import annotations

import gc
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import memcalc
from memcalc.core.finetune import KbitCheckpointing

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import TOLERANCE, llama_config, model_bytes, peft_default_reentrant, profiled_peak, write_config

pytest.importorskip("transformers")
pytest.importorskip("peft")

#: A tiny Llama for the table (its checkpointing, not its memory, is read).
TINY = llama_config(256, hidden=64, layers=2)
RANK = 8
#: (gradient_checkpointing, gradient_checkpointing_kwargs) of TrainingArguments.
TRAINER = [(gc_on, kwargs) for gc_on in (False, True)
           for kwargs in (None, {"use_reentrant": True}, {"use_reentrant": False})]
CELLS = [(gc_on, kwargs, kbit) for gc_on, kwargs in TRAINER for kbit in KbitCheckpointing]


def _cell_id(cell: tuple[bool, Any, KbitCheckpointing]) -> str:
    gc_on, kwargs, kbit = cell
    given = "none" if kwargs is None else f"reentrant={kwargs['use_reentrant']}"
    return f"trainer-gc-{'on' if gc_on else 'off'}-{given}-peft-{kbit.value}"


def _saved_4bit(folder: Path, config: dict[str, object]) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.for_model(**config),
                                                       dtype=torch.float32)
    model.save_pretrained(folder)


def _qlora(folder: Path, kbit: KbitCheckpointing, weights: torch.dtype = torch.float32) -> Any:
    """The recipe: the checkpoint loaded in 4 bits, ``prepare_model_for_kbit_training`` called as
    ``kbit`` says, ``get_peft_model``."""
    import peft
    import transformers

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=weights)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=weights,
                                                          device_map="cpu")
    if not any(type(m).__name__ == "Linear4bit" and m.weight.dtype == torch.uint8 for m in model.modules()):
        pytest.skip("bitsandbytes did not quantize the Linear layers to 4 bits on this CPU")
    # peft 0.22 renamed the kwargs activation_checkpointing_kwargs (the old name warns); 0.21 has the old one only
    named = ("activation_checkpointing_kwargs" if "activation_checkpointing_kwargs"
             in inspect.signature(peft.prepare_model_for_kbit_training).parameters else "gradient_checkpointing_kwargs")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=kbit is not KbitCheckpointing.OFF,
                                                 **{named: kbit.kwargs or None})
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, task_type="CAUSAL_LM"))


def _args(folder: Path, gc_on: bool, kwargs: Any, batch: int, steps: int, **more: Any) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(folder / "out"), use_cpu=True, per_device_train_batch_size=batch, max_steps=steps,
        gradient_checkpointing=gc_on, gradient_checkpointing_kwargs=kwargs, optim="sgd", report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0, **more)


def _real_kind(folder: Path, cell: tuple[bool, Any, KbitCheckpointing]) -> str:
    """The checkpointing of the real Trainer step: off, reentrant or non-reentrant (module docstring)."""
    import transformers

    gc_on, kwargs, kbit = cell
    model = _qlora(folder, kbit)
    base = model.get_base_model()
    nodes: list[str] = []
    handle = base.model.norm.register_forward_hook(
        lambda _m, inputs, _o: nodes.append(type(inputs[0].grad_fn).__name__))
    ids = torch.randint(0, int(TINY["vocab_size"]), (16,))  # type: ignore[call-overload]
    trainer = transformers.Trainer(model=model, args=_args(folder, gc_on, kwargs, 1, 1),
                                   train_dataset=[{"input_ids": ids, "labels": ids}])
    trainer.train()
    handle.remove()
    assert nodes, "the step ran no forward"
    if not base.is_activation_checkpointing:
        assert nodes[-1] != "CheckpointFunctionBackward"
        return "off"
    return "reentrant" if nodes[-1] == "CheckpointFunctionBackward" else "non-reentrant"


def _memcalc_kind(source: str, cell: tuple[bool, Any, KbitCheckpointing]) -> str:
    gc_on, kwargs, kbit = cell
    report = memcalc.estimate(source, seq_len=16, gpu="cpu",
                              finetune=memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing=kbit),
                              trainer_args={"per_device_train_batch_size": 1, "gradient_checkpointing": gc_on,
                                            "gradient_checkpointing_kwargs": kwargs, "optim": "sgd",
                                            "use_cpu": True})
    # the note of what the trace applied (memcalc.engine.prepare): "activation checkpointing on N blocks ..."
    applied = [note for note in report.notes if note.startswith("activation checkpointing on")]
    if not report.step.checkpoint:
        assert not applied, applied
        return "off"
    assert len(applied) == 1, report.notes
    return "reentrant" if "(reentrant: torch's CheckpointFunction" in applied[0] else "non-reentrant"


#: What the real step runs in each cell (torch 2.13, transformers 5.25, peft 0.21.2 and 0.22.0): the
#: Trainer's kind where it enables checkpointing, PEFT's where it does not, none where neither does.
#: PEFT's default call (``on``) sets up ``peft_default``: reentrant with peft 0.21, not with 0.22.
def _expected(cell: tuple[bool, Any, KbitCheckpointing], peft_default: bool) -> str:
    gc_on, kwargs, kbit = cell
    if gc_on:
        return "reentrant" if (kwargs or {}).get("use_reentrant") else "non-reentrant"
    if kbit is KbitCheckpointing.ON:
        return "reentrant" if peft_default else "non-reentrant"
    return {KbitCheckpointing.OFF: "off", KbitCheckpointing.NON_REENTRANT: "non-reentrant"}.get(kbit, "reentrant")


def test_the_trainer_without_checkpointing_keeps_pefts(tmp_path: Path) -> None:
    """The cheap representative of the table: ``gradient_checkpointing=False`` on a model PEFT
    prepared with its defaults runs PEFT's checkpoint, reentrant with peft 0.21 on torch 2.13 and
    non-reentrant with peft 0.22 (measured below); memcalc's reading before this (no checkpointing)
    is ``kbit_checkpointing="off"``."""
    from memcalc.fields import build_step
    from memcalc.stacks.kbit import kbit_checkpointing
    from memcalc.stacks.peft import apply_finetune

    finetune = memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing="on")
    step = build_step(write_config(tmp_path, TINY), seq_len=16, finetune=finetune,
                      trainer_args={"gradient_checkpointing": False})
    assert not step.checkpoint
    resolved = apply_finetune(step.resolved(), finetune, precision=step.precision, mode=step.mode, checkpoint=False)
    made = kbit_checkpointing(resolved.module, step)  # the estimate's reading (the full estimate: the slow table)
    reentrant = peft_default_reentrant()
    assert made.checkpoint.kind.value == "full" and made.checkpoint.reentrant is reentrant
    assert "it stays on in loop trainer" in made.notes[-1]


def test_kbit_checkpointing_goes_with_the_qlora_recipe() -> None:
    with pytest.raises(memcalc.InvalidInputError, match="goes with a quantized base and LoRA"):
        memcalc.FineTune(lora=memcalc.LoRA(RANK), kbit_checkpointing="on")
    with pytest.raises(memcalc.InvalidInputError, match="kbit_checkpointing"):
        memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing="sometimes")
    assert KbitCheckpointing("non-reentrant").kwargs == {"use_reentrant": False}
    assert KbitCheckpointing.ON.kwargs == {}


def test_the_trainers_ddp_with_unused_parameters_and_reentrance_is_refused(tmp_path: Path) -> None:
    """A PeftModel is not a ``PreTrainedModel``, so the Trainer (TRL's too) passes DDP
    ``find_unused_parameters=True`` unless ``ddp_find_unused_parameters`` says otherwise (read off
    the real Trainer: test_the_real_trainer_picks_find_unused), and the real reentrant step then
    fails (tests/test_reentrant_gloo_options.py): refused, naming the way out."""
    pytest.importorskip("trl")
    args = {"per_device_train_batch_size": 1, "gradient_checkpointing": True, "max_length": 16,
            "gradient_checkpointing_kwargs": {"use_reentrant": True}, "use_cpu": True}
    with pytest.raises(memcalc.InapplicableOptionError, match="Expected to mark a variable ready only once"):
        memcalc.estimate(write_config(tmp_path, TINY), seq_len=16, loop="trl-sft", trainer_args=args,
                         finetune=memcalc.FineTune(lora=memcalc.LoRA(RANK)),
                         distributed=memcalc.Distributed("ddp", world_size=2))


@pytest.mark.parametrize("loop", ["trl-dpo", "trl-grpo"])
def test_trl_loops_that_reenable_checkpointing_are_refused_in_the_peft_cells(tmp_path: Path, loop: str) -> None:
    """TRL 1.16's DPO reference and GRPO generation run under ``disable_gradient_checkpointing``,
    which enables PEFT's checkpointing again with the config's kwargs: the kind changes mid-run."""
    pytest.importorskip("trl")
    finetune = memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing="on")
    with pytest.raises(memcalc.InapplicableOptionError, match="changes kind in the middle of the run"):
        memcalc.estimate(write_config(tmp_path, TINY), seq_len=16, loop=loop, finetune=finetune,
                         trainer_args={"per_device_train_batch_size": 2, "gradient_checkpointing": False,
                                       "use_cpu": True})


@pytest.mark.parametrize(("lora", "gc_on", "given", "expected"), [
    (True, True, None, True), (True, True, False, False), (False, True, None, False), (False, False, None, True)])
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_real_trainer_picks_find_unused(tmp_path: Path, lora: bool, gc_on: bool, given: bool | None,
                                            expected: bool) -> None:
    """What the installed Trainer hands DDP (``accelerator.ddp_handler``), read off the real object:
    the rule memcalc's refusal follows (memcalc.distributed.strategies.refuse_unused_reentrant)."""
    import peft
    import transformers

    model: Any = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.for_model(**TINY))
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, task_type="CAUSAL_LM"))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=gc_on,
                                          ddp_find_unused_parameters=given, report_to="none")
    assert transformers.Trainer(model=model, args=args).accelerator.ddp_handler.find_unused_parameters is expected


@pytest.fixture(scope="module")
def tiny_4bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("bitsandbytes")
    folder = tmp_path_factory.mktemp("tiny-4bit")
    _saved_4bit(folder, TINY)
    return folder


@pytest.mark.slow  # 24 real Trainer steps on a tiny 4-bit model and 24 estimates: ~1-2 min on two cores
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_every_cell_against_the_real_trainer(tiny_4bit: Path) -> None:
    (tiny_4bit / "memcalc").mkdir(exist_ok=True)
    source = write_config(tiny_4bit / "memcalc", TINY)
    rows = []
    for cell in CELLS:
        real = _real_kind(tiny_4bit, cell)
        mine = _memcalc_kind(source, cell)
        rows.append(f"{_cell_id(cell)}: real {real}, memcalc {mine}")
        gc.collect()
    print("\n".join(rows))
    assert all(row.split("real ")[1].split(",")[0] == row.split("memcalc ")[1] for row in rows), "\n".join(rows)
    peft_default = peft_default_reentrant()
    assert [row.split("real ")[1].split(",")[0] for row in rows] == [_expected(cell, peft_default) for cell in CELLS]


#: tests/test_kbit_reentrant.py's Llama: the peak is in its checkpointed layers' backward, where the
#: reentrant checkpoint keeps one layer's output more than the non-reentrant one.
CONFIG = {**llama_config(512, hidden=256, layers=3), "intermediate_size": 1024}
BATCH, SEQ = 2, 512


@pytest.mark.slow  # two real fp32 QLoRA Trainer steps on two CPU cores: ~20-60 s
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_trainer_without_checkpointing_runs_pefts_against_a_real_step(tmp_path: Path) -> None:
    """``Trainer(gradient_checkpointing=False)`` on a model ``prepare_model_for_kbit_training`` set
    up with its defaults: the real step (under the profiler, two optimizer steps, SGD, fp32) runs
    PEFT's checkpoint (reentrant with peft 0.21, non-reentrant with 0.22), and memcalc with
    ``kbit_checkpointing="on"`` estimates it within the CPU bar; the reading memcalc had before (no
    checkpointing: ``kbit_checkpointing="off"``, the default without ``checkpoint``) is far outside it."""
    import transformers

    pytest.importorskip("bitsandbytes")
    folder = tmp_path / "model"
    _saved_4bit(folder, CONFIG)
    model = _qlora(folder, KbitCheckpointing.ON)
    ids = torch.randint(0, int(CONFIG["vocab_size"]), (SEQ,))  # type: ignore[call-overload]
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, False, None, BATCH, 2),
                                   train_dataset=[{"input_ids": ids, "labels": ids}] * (2 * BATCH))
    real = profiled_peak(model_bytes(model), trainer.train)
    assert model.get_base_model().is_activation_checkpointing
    (tmp_path / "memcalc").mkdir()
    source = write_config(tmp_path / "memcalc", CONFIG)
    args = {"per_device_train_batch_size": BATCH, "gradient_checkpointing": False, "optim": "sgd", "use_cpu": True}
    estimates = {kbit: memcalc.estimate(source, seq_len=SEQ, trainer_args=args, finetune=memcalc.FineTune(
        lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing=kbit)).peak_requested for kbit in ("on", "off")}
    row = f"real {real:,} B; memcalc {estimates['on']:,} B (PEFT's checkpoint kept), {estimates['off']:,} B (none)"
    print(row)
    assert abs(estimates["on"] - real) <= TOLERANCE * real, row
    assert abs(estimates["off"] - real) > 10 * TOLERANCE * real, row
