"""bfloat16/float16 convolutions on a CPU without oneDNN's support for them: ATen's ``Slow2d`` and
the columns it unfolds (memcalc/targets/cpu/convolution.py). By hand with the capability forced
both ways; against the CPU profiler on every host (on one with AVX512-BF16, where oneDNN runs them,
with oneDNN turned off, as torch then takes the AVX2 machines' path); and the report's list of
approximated convolutions, which names only those oneDNN (or float32's backends) run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import memcalc
from memcalc.engine.run import build_report, trace_model
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu
from memcalc.report.render import render_report
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import CpuBackend
from memcalc.targets.cpu.convolution import columns_nbytes
from memcalc.targets.cpu.kernels import NOT_FOLLOWED, CpuCapabilities

HERE = CpuCapabilities.here()
#: oneDNN enabled, its bf16 (and fp16) device checks failing: an AVX2 CPU; and passing: AVX512-BF16.
AVX2 = dataclasses.replace(HERE, onednn=True, onednn_bf16=False, onednn_fp16=False)
AVX512_BF16 = dataclasses.replace(HERE, onednn=True, onednn_bf16=True, onednn_fp16=True)


class Convs(nn.Module):
    """A 3×3 convolution with padding, a 1×1 one (its columns a view of the input) and a 3×3 of stride 2."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.first = nn.Conv2d(4, 4, 3, padding=1, bias=False, groups=groups)
        self.pointwise = nn.Conv2d(4, 4, 1, bias=False)
        self.strided = nn.Conv2d(4, 6, 3, stride=2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.strided(self.pointwise(self.first(x)))  # type: ignore[no-any-return]


INPUTS = (torch.randn(2, 4, 8, 8),)
INFERENCE = dict(mode="eval", optimizer="none", precision="bf16")


def _peak(capabilities: CpuCapabilities, model: type[nn.Module] = Convs,
          **step_options: object) -> memcalc.MemoryReport:
    """The report of ``model``'s step (bf16 inference unless ``step_options``) for a CPU of ``capabilities``."""
    step = build_step(gpu="cpu", **(step_options or INFERENCE))  # type: ignore[arg-type]
    resolved = resolve(model, inputs=INPUTS)
    return build_report(resolved, trace_model(resolved, step, CpuBackend(step, capabilities)), step)


def test_columns_by_hand() -> None:
    # N · C·kh·kw · oH·oW · itemsize: test_compile.py's SmallCNN, its second convolution (32 → 32, 3×3,
    # padding 1, 32×32, batch 8, bf16): 8 · 288 · 1024 · 2
    assert columns_nbytes((8, 32, 32, 32), (32, 32, 3, 3), (1, 1), (1, 1), 2) == 4_718_592
    # 3×3 of stride 2 without padding on 9×9: 4×4 outputs
    assert columns_nbytes((2, 4, 9, 9), (6, 4, 3, 3), (2, 2), (0, 0), 2) == 2 * 36 * 16 * 2 == 2_304
    # a 1×1 kernel of stride 1 without padding: the columns are a view of the input
    assert columns_nbytes((2, 4, 8, 8), (6, 4, 1, 1), (1, 1), (0, 0), 2) == 0
    assert columns_nbytes((2, 4, 8, 8), (6, 4, 1, 1), (2, 2), (0, 0), 2) == 2 * 4 * 16 * 2


def test_slow2d_columns_follow_onednns_bf16_device_check() -> None:
    # inference in bf16: weights 4·4·9·2 + 4·4·2 + 6·4·9·2 = 752 B, the input 2·4·64·2 = 1,024 B, each
    # activation 1,024 B but the last (2·6·9·2 = 216 B).
    weights, x, activation = 752, 1_024, 1_024
    # AVX2 (no native bf16): Slow2d; the first convolution's columns, 2 · 36 · 64 · 2 = 9,216 B, beside its
    # output, are the peak (the 1×1 takes none; the strided one's 2 · 36 · 9 · 2 = 1,296 B come later)
    avx2 = _peak(AVX2)
    assert avx2.peak_requested == weights + x + activation + 2 * 36 * 64 * 2 == 12_016
    assert any("aten.convolution.default ×3" in note for note in avx2.notes)
    # AVX512-BF16: oneDNN (its scratch inside ideep, not followed): the peak is the 1×1's output beside the first's
    avx512 = _peak(AVX512_BF16)
    assert avx512.peak_requested == weights + x + 2 * activation == 3_824
    assert not any("aten.convolution" in note for note in avx512.notes)
    # float16 follows its own device check
    assert _peak(AVX2, precision="fp16", mode="eval", optimizer="none").peak_requested == 12_016
    assert _peak(AVX512_BF16, precision="fp16", mode="eval", optimizer="none").peak_requested == 3_824


def test_a_grouped_slow_convolution_is_named() -> None:
    class Grouped(Convs):
        def __init__(self) -> None:
            super().__init__(groups=2)

    notes = _peak(AVX2, Grouped).notes
    assert (f"{NOT_FOLLOWED} aten.convolution.default ×1 (bfloat16 without oneDNN's: ATen's slow transposed, "
            "dilated, 3-D or grouped convolution)") in notes


#: Where oneDNN takes bf16 convolutions (AVX512-BF16), turning it off (``use_mkldnn`` false; NNPACK takes
#: float32 only) sends them to Slow2d, as an AVX2 CPU does; the capabilities memcalc reads then say so.
SLOW2D_HERE = not (HERE.onednn and HERE.onednn_bf16)


@pytest.mark.parametrize("step", [INFERENCE, dict(optimizer="sgd", precision="bf16"),
                                  dict(optimizer="sgd", precision="amp-bf16")], ids=["eval", "bf16", "amp-bf16"])
def test_slow2d_matches_the_profiler_to_the_byte(step: dict[str, object]) -> None:
    # measured 2026-12-07 (AMD EPYC, AVX2; and Intel AVX512-BF16 with oneDNN off): the forward's and the
    # backward's columns are the only memory the CPU's convolutions take beyond their outputs (the input
    # gradient's are make_unique arrays): 12,016 B, 12,988 B and 16,540 B
    with torch.backends.mkldnn.flags(enabled=SLOW2D_HERE):
        estimate = memcalc.estimate(Convs, gpu="cpu", inputs=INPUTS, **step)  # type: ignore[arg-type]
        measured = measure_cpu(build_step(Convs, inputs=INPUTS, **step)).peak_allocated  # type: ignore[arg-type]
    assert estimate.peak_requested == measured
    assert estimate.unsupported_ops == ()  # every convolution followed: none approximated


def test_the_report_lists_only_the_convolutions_it_does_not_follow() -> None:
    # bf16 training (sgd): three convolutions and their backwards (each asks for its weight's gradient).
    # AVX2: Slow2d runs all six, and the rule follows them (their columns): none approximated
    avx2 = _peak(AVX2, optimizer="sgd", precision="bf16")
    assert avx2.unsupported_ops == ()
    assert any("aten.convolution.default ×3, aten.convolution_backward.default ×3" in note for note in avx2.notes)
    # AVX512-BF16: oneDNN runs all six, its memory inside not modelled
    avx512 = _peak(AVX512_BF16, optimizer="sgd", precision="bf16")
    assert avx512.unsupported_ops == (("convolution.default", 3), ("convolution_backward.default", 3))
    # float32 runs oneDNN, NNPACK or Slow2d on any CPU: approximated on both
    assert _peak(AVX2, optimizer="sgd", precision="fp32").unsupported_ops == avx512.unsupported_ops
    # a grouped Slow2d convolution is named in the notes (test_a_grouped_slow_convolution_is_named), not listed

    class Grouped(Convs):
        def __init__(self) -> None:
            super().__init__(groups=2)

    assert _peak(AVX2, Grouped).unsupported_ops == ()
    # the report's note reads the list
    assert "approximated" not in render_report(avx2)
    assert "approximated: convolution.default ×3, convolution_backward.default ×3" in render_report(avx512)
