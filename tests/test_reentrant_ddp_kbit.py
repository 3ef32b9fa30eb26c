"""QLoRA's own loop under DDP checkpoints as PEFT set it up (tests/test_kbit_reentrant.py on one GPU):
reentrant with peft 0.21 (it passes transformers ``{}``, no ``use_reentrant``, and torch 2.13 runs
``CheckpointFunction``), non-reentrant with peft 0.22 (it passes None: transformers' ``use_reentrant=False``).
Each DDP rank runs the same model and loop, so its estimate follows the same kind: the role's model is
read after ``prepare_model_for_kbit_training`` (memcalc.stacks.kbit.kbit_checkpointing), as on one GPU.
DDP with reentrant checkpointing is checked against real gloo runs in tests/test_reentrant_ddp.py.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_runs import profiled, spawn_ranks, until_complete
from torch import nn

import memcalc
from memcalc.core.checkpointing import FULL, Checkpointing, CheckpointKind
from memcalc.stacks.kbit import set_up_reentrant

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import (
    TOLERANCE,
    Recipe,
    llama_config,
    model_bytes,
    peft_default_reentrant,
    real_model,
    relative_error,
    write_config,
)

pytest.importorskip("transformers")
pytest.importorskip("peft")

QLORA = memcalc.FineTune(lora=memcalc.LoRA(8), quant="nf4")
DDP = memcalc.Distributed("ddp", world_size=2)


def _estimate(checkpoint: Checkpointing) -> memcalc.MemoryReport:
    return memcalc.estimate("llama-tiny", batch_size=1, seq_len=32, optimizer="sgd", finetune=QLORA,
                            checkpoint=checkpoint, distributed=DDP)


def test_the_own_loop_under_ddp_keeps_the_kind_peft_set_up() -> None:
    report = _estimate(FULL)
    reentrant = peft_default_reentrant()  # peft 0.21 on torch 2.13: True; peft 0.22: False
    notes = [note for note in report.notes if "reentrant" in note]
    assert any("prepare_model_for_kbit_training set up is reentrant" in note for note in notes) is reentrant, notes
    assert any("(reentrant: torch's CheckpointFunction" in note for note in notes) is reentrant, notes
    # the same trace as asking for PEFT's kind outright (the reentrant one modelled under DDP too)
    explicit = _estimate(Checkpointing(CheckpointKind.FULL, reentrant=reentrant))
    assert report.peak_requested == explicit.peak_requested



# ============================================================================================
# Against real DDP ranks over gloo: QLoRA with PEFT's checkpointing, and with the other kind forced
# ============================================================================================

#: tests/test_kbit_reentrant.py's Llama and recipe: the peak is in the backward of its checkpointed
#: layers, where the two kinds differ by one layer's fp32 output (1 MiB).
CONFIG = {**llama_config(512, hidden=256, layers=3), "intermediate_size": 1024}
BATCH, SEQ, RANK = 2, 512, 8
WORLD = 2
RECIPE = Recipe(CONFIG, batch=BATCH, seq_len=SEQ, bf16=True, weights=torch.bfloat16, qlora=True, lora=RANK,
                checkpointing=True)


def _real_model(reenable: dict[str, bool] | None) -> tuple[nn.Module, bool]:
    """The QLoRA model with PEFT's checkpointing, or re-enabled with ``reenable``; and whether its
    checkpoint is torch's reentrant one. Built before the process group exists: transformers'
    ``save_pretrained`` writes on the main process only once torch.distributed is initialised."""
    model = real_model(RECIPE)
    if reenable is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reenable)
    model.train()
    return model, set_up_reentrant(model)


def _real_ddp_rank(model: nn.Module) -> int:
    """This rank's peak of the user's loop (memcalc's minimal loop: bf16 autocast, the model's own
    loss, SGD, two steps) on ``model`` in DDP. A warm-up step first (DDP's bucket rebuild); the
    step is repeated until its trace is complete (tests/gloo_runs.py)."""
    ids = torch.randint(0, int(CONFIG["vocab_size"]), (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ddp = nn.parallel.DistributedDataParallel(model)  # find_unused_parameters=False, as torch's notes ask
    trainable = [p for p in ddp.parameters() if p.requires_grad]

    def step() -> None:
        optimizer = torch.optim.SGD(trainable, lr=1e-3)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = ddp(input_ids=ids, labels=ids)
            output.loss.backward()
            del output
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
        gc.collect()

    step()  # the warm-up
    buckets = sum(b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets())
    before = model_bytes(model, ids) + buckets
    return until_complete(lambda: profiled(step), before, 0, "qlora ddp: ").peak


def _worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    warnings.simplefilter("ignore")  # torch's use_reentrant warning, PEFT's and bitsandbytes' notes
    peft_model, peft_reentrant = _real_model(None)
    other_model, other_reentrant = _real_model({"use_reentrant": not peft_reentrant})
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        peft_kind = _real_ddp_rank(peft_model)
        del peft_model
        other = _real_ddp_rank(other_model)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(
        {"peft": peft_kind, "peft_reentrant": peft_reentrant, "other": other, "other_reentrant": other_reentrant}))


@pytest.mark.slow  # two real bf16 QLoRA DDP setups on two gloo ranks
def test_the_estimate_follows_the_real_ddp_ranks_kind(tmp_path: Path) -> None:
    """memcalc's DDP rank (the own loop: PEFT's kind) against the real ranks with PEFT's kind, within
    the CPU bar, and outside it of the ranks with the other kind forced: the test fails if memcalc
    picks the other kind under DDP (as it did before: the kbit rule was applied on one GPU only)."""
    pytest.importorskip("bitsandbytes")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    spawn_ranks(_worker, WORLD, (str(tmp_path),), timeout_s=900.0)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    estimate = memcalc.estimate(write_config(tmp_path, CONFIG), batch_size=BATCH, seq_len=SEQ, gpu="cpu",
                                optimizer="sgd", precision="bf16", checkpoint=True,
                                finetune=memcalc.FineTune(lora=memcalc.LoRA(RANK), quant="nf4"),
                                distributed=memcalc.Distributed("ddp", world_size=WORLD)).peak_requested
    for rank, real in enumerate(ranks):
        print(f"rank {rank}: PEFT's kind (reentrant {real['peft_reentrant']}) {real['peft']:,} B, the other kind "
              f"{real['other']:,} B; memcalc {estimate:,} B ({relative_error(estimate, real['peft']):+.3%}, "
              f"{relative_error(estimate, real['other']):+.3%})")
        assert real["peft_reentrant"] is peft_default_reentrant()
        assert real["other_reentrant"] is not real["peft_reentrant"]
        assert abs(relative_error(estimate, real["peft"])) <= TOLERANCE
        assert abs(relative_error(estimate, real["other"])) > TOLERANCE
