"""What the reference scripts here share: run ``main`` on two CPU ranks (``torch.distributed.run``
relaunches the script itself when ``RANK`` is unset) over gloo with DeepSpeed's CPU accelerator, the
stage-3 config they run, TRL's small Llama (and its LoRA) for the TRL scripts, the probe that records
which parameters are gathered at every module's forward hooks, and rank 0's record as one JSON line.
The scripts import it as a sibling (Python puts a script's folder first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

#: A small Llama: embedding and head 512·64 = 32,768 elements, q and o 4,096, k and v 2,048, the MLP's
#: 8,192 each, norms 64.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False}
#: LoRA's rank (PEFT's default targets, no dropout).
LORA_RANK = 8


def stage3_config(batch: int, extra: dict[str, int]) -> dict[str, Any]:
    """The DeepSpeed config of every run: ZeRO-3 with ``extra``'s ``stage3_*`` settings, a small reduce
    bucket, ``batch`` rows a rank, a torch optimizer."""
    return {"train_micro_batch_size_per_gpu": batch, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, **extra}}


def small_llama() -> Any:
    """The policy: :data:`LLAMA` with the weights of seed 0 (the same on both ranks)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")})
    return transformers.LlamaForCausalLM(config)


def frozen_copy(policy: Any) -> Any:
    """A frozen reference with ``policy``'s weights, as TRL's ``create_reference_model`` makes it."""
    reference = type(policy)(policy.config)
    reference.load_state_dict(policy.state_dict())
    return reference.requires_grad_(False)


def with_lora(policy: Any) -> Any:
    """``policy`` with LoRA adapters (:data:`LORA_RANK`) in the model's dtype, as TRL's trainers make them
    under ZeRO-3 (``autocast_adapter_dtype=False``)."""
    import peft

    return peft.get_peft_model(policy, peft.LoraConfig(r=LORA_RANK, lora_dropout=0.0), autocast_adapter_dtype=False)


def bitmask(order: list[str], gathered: Iterable[str]) -> str:
    """The ``gathered`` parameters as a hex bitmask over ``order`` (bit i: the i-th name)."""
    index = {name: i for i, name in enumerate(order)}
    return hex(sum(1 << index[name] for name in set(gathered)))


def gathered_masks(models: dict[str, torch.nn.Module]) -> Callable[[], str]:
    """A probe: the parameters of each model not ``NOT_AVAILABLE`` now, one bitmask a model over its
    ``named_parameters``, joined by spaces."""
    names = {key: [n for n, _ in model.named_parameters()] for key, model in models.items()}

    def gathered() -> str:
        return " ".join(bitmask(names[key], (n for n, p in model.named_parameters()
                                              if p.ds_status.name != "NOT_AVAILABLE")) for key, model in models.items())
    return gathered


def record_forward_hooks(models: dict[str, torch.nn.Module], events: list[list[str]],
                         gathered: Callable[[], str]) -> list[Any]:
    """On every module with parameters of its own, a forward pre-hook and post-hook that append
    ``[f"pre {key}.{name}", gathered()]`` (``post``; ``pre {name}`` for the key "") to ``events``,
    registered after DeepSpeed's so that they see what its hooks gathered or released. Returns the handles."""
    handles = []
    for key, model in models.items():
        for index, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            where = f"{key}.{index}" if key else index
            handles.append(module.register_forward_pre_hook(
                lambda m, a, w=where: events.append([f"pre {w}", gathered()])))
            handles.append(module.register_forward_hook(
                lambda m, a, o, w=where: events.append([f"post {w}", gathered()])))
    return handles


def backward_and_step(engine: Any, loss: torch.Tensor, step: int, events: list[list[str]],
                      gathered: Callable[[], str]) -> None:
    """The engine's backward and optimizer step, what is gathered recorded after each."""
    engine.backward(loss)
    events.append([f"backward {step}", gathered()])
    engine.step()
    events.append([f"step {step}", gathered()])


def start(trl: bool = False) -> dict[str, Any]:
    """Join the gloo group through DeepSpeed; the record's first keys: the versions and the world size."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    versions = {"deepspeed": deepspeed.__version__}
    if trl:
        import trl as trl_package

        versions["trl"] = trl_package.__version__
    return {**versions, "world_size": torch.distributed.get_world_size()}


def write_record(out: dict[str, Any]) -> None:
    """Rank 0 writes ``out`` to the path given on the command line, as one line of JSON."""
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as file:
            json.dump(out, file, indent=None)
            file.write("\n")


def run_on_two_ranks(script: str, main: Callable[[], None], port: str) -> None:
    """Relaunch ``script`` as two ranks (``PORT`` overrides ``port``), or, inside a rank, run ``main``
    in a temporary working folder."""
    if "RANK" not in os.environ:
        from torch.distributed.run import main as run

        run(["--nproc_per_node", "2", "--master_port", os.environ.get("PORT", port), script,
             os.path.abspath(sys.argv[1])])
    else:
        with tempfile.TemporaryDirectory():
            main()
