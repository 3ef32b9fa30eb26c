"""What the notebooks tell readers is checked here against what memcalc and PyTorch do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memcalc
from memcalc.fields import build_step
from memcalc.measure.step import measure

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


class CheckpointedBlocks(nn.Module):
    """The user's own checkpoint calls, as notebook 05 writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(3))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _markdown(name: str) -> str:
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.slow  # a real CPU step under the profiler
def test_own_checkpoint_under_amp_agrees_with_a_real_cpu_step():
    # notebook 05: "under amp-* the recomputation runs under autocast again ... agrees to the byte"
    options = dict(batch_size=32, input_shape=(128,), optimizer="adam", precision="amp-bf16")
    estimate = memcalc.estimate(CheckpointedBlocks, gpu="cpu", **options)
    real = measure(build_step(CheckpointedBlocks, **options), device="cpu")
    assert real.peak_allocated is not None
    assert abs(estimate.peak_requested - real.peak_allocated) <= 0.005 * real.peak_allocated


def test_notebook_05_no_longer_says_amp_checkpointing_fails():
    text = _markdown("05_your_own_model.ipynb")
    assert "cannot yet run your own `checkpoint`" not in text
    assert "recomputation runs under autocast again" in text
