"""memcalc's reading of the checkpoint PEFT's k-bit preparation sets up, under each peft's call.

peft 0.21.2 (``peft/utils/other.py``, ``prepare_model_for_kbit_training``) calls
``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})``: an empty dict, so
transformers binds no ``use_reentrant`` and torch's own default decides (torch 2.13: reentrant).
peft 0.22.0 calls ``model.activation_checkpointing_enable(activation_checkpointing_kwargs=None)``
(transformers >= 5.23; ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)`` before),
for which transformers 5.25 binds its default ``{"use_reentrant": False}``. Each call is made here on
transformers' own tiny Llama (on meta), and memcalc's reading (the kind, and the step it makes of
it) is held to the kind worked out by hand: what transformers bound (the keywords of its
``functools.partial``), else torch's default, read by calling ``torch.utils.checkpoint.checkpoint``
directly. On torch 2.13 the two calls give different kinds, so a memcalc that took either peft's
kind for granted fails one of them. The real steps: tests/test_kbit_reentrant.py and its siblings.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import memcalc
from memcalc.core.finetune import KbitCheckpointing, Quant
from memcalc.core.precision import Precision
from memcalc.fields import build_step
from memcalc.stacks.kbit import bound_use_reentrant, kbit_checkpointing, prepare_for_kbit_training, set_up_reentrant

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import llama_config, peft_default_reentrant, write_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = llama_config(64, hidden=32, layers=2)
RANK = 8


def _meta_llama() -> Any:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**TINY, use_cache=False))


def _peft_021_call(model: Any) -> None:
    """peft 0.21.2: ``model.gradient_checkpointing_enable(**{"gradient_checkpointing_kwargs": {}})``."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})


def _peft_022_call(model: Any) -> None:
    """peft 0.22.0: ``activation_checkpointing_enable`` with None where the model has it, else the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)


def _torch_default_reentrant() -> bool:
    """What torch's ``checkpoint`` runs without ``use_reentrant``, read off torch itself."""
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.simplefilter("ignore")  # torch's "use_reentrant should be passed explicitly"
        out = checkpoint(lambda t: t * 2, torch.zeros(1, requires_grad=True))
    return type(out.grad_fn).__name__ == "CheckpointFunctionBackward"


@pytest.mark.parametrize("call", [_peft_021_call, _peft_022_call], ids=["peft-0.21", "peft-0.22"])
def test_memcalc_reads_the_kind_each_peft_call_sets_up(tmp_path: Path, call: Callable[[Any], None]) -> None:
    model = _meta_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation of gradient_checkpointing_enable
        call(model)
    bound = bound_use_reentrant(model)
    if call is _peft_021_call:
        assert bound is None  # {} binds nothing
    elif hasattr(model, "activation_checkpointing_enable"):
        assert bound is False  # transformers >= 5.23: None → {"use_reentrant": False}
    expected = bound if bound is not None else _torch_default_reentrant()
    assert set_up_reentrant(model) is expected

    qlora = memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4")
    source = write_config(tmp_path, TINY)
    # memcalc's own loop with --checkpoint: PEFT's kind kept; a note where that is the reentrant one
    own = build_step(source, seq_len=16, finetune=qlora, checkpoint=True)
    made = kbit_checkpointing(model, own)
    assert made.checkpoint.reentrant is expected
    why = "bound no use_reentrant" if bound is None else f"bound use_reentrant={bound}"
    assert (made is own) is not expected and any(why in note for note in made.notes) is expected, made.notes
    # the Trainer with gradient_checkpointing=False on PEFT's default call: every layer, PEFT's kind
    finetune = memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4", kbit_checkpointing="on")
    trainer = build_step(source, seq_len=16, finetune=finetune, trainer_args={"gradient_checkpointing": False})
    assert not trainer.checkpoint
    made = kbit_checkpointing(model, trainer)
    assert made.checkpoint.kind.value == "full" and made.checkpoint.reentrant is expected
    assert why in made.notes[-1] and ("non-reentrant" in made.notes[-1]) is not expected, made.notes[-1]


@pytest.mark.parametrize("kbit", list(KbitCheckpointing))
def test_the_installed_peft_run_by_memcalc_sets_up_the_kind_asked(kbit: KbitCheckpointing) -> None:
    """memcalc's call of the installed peft on meta (the kwargs under the name its signature takes)
    against the kind asked for; for PEFT's default call, against a real forward of a real model the
    installed peft prepared (hf_harness.peft_default_reentrant)."""
    model = _meta_llama()
    model.to(torch.bfloat16)
    prepare_for_kbit_training(model, Quant.NF4, precision=Precision.BF16, checkpointing=kbit)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # PEFT's cast of the 16-bit ones
    if kbit is KbitCheckpointing.OFF:
        assert bound_use_reentrant(model) is None and not set_up_reentrant(model)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        return
    if kbit is not KbitCheckpointing.ON:
        assert bound_use_reentrant(model) is (kbit is KbitCheckpointing.REENTRANT)
    assert set_up_reentrant(model) is {KbitCheckpointing.ON: peft_default_reentrant(),
                                       KbitCheckpointing.REENTRANT: True}.get(kbit, False)
