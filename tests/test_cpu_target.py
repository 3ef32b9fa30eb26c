"""The CPU target (``gpu="cpu"``, :mod:`memcalc.targets.cpu.kernels`) against what the CPU really runs.

``--measure`` without a GPU runs the step on the CPU under ``torch.profiler`` and compares it
with this estimate, so the estimate must follow the CPU's own kernels: its flash attention for
SDPA, oneDNN for ``nn.LSTM``, its generic RNN path otherwise. Here: the issue's three models
through the CLI and the API; the CPU's RNN paths; the size formulas against the bytes the
profiler showed; the SDPA choice against the real dispatcher; the notes that name what is not
followed; a profiler that keeps stderr clean; CUDA estimates left as they were.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memcalc
from memcalc.cli import main
from memcalc.fields import build_step
from memcalc.measure.step import attach_measurement, cpu_comparison_note, measure_cpu
from memcalc.targets.cpu import onednn
from memcalc.targets.cpu.kernels import (
    CpuCapabilities,
    cpu_flash_refusal,
    flash_backward_temporaries,
    flash_forward_temporaries,
    uniform_packed_lstm_runs_onednn,
)
from memcalc.targets.versions import parse_torch_version

# The issue's bar is 2 %; on torch 2.13 these agree within ~0.01 % (a few CPU scalars such as
# Adam's step counters), so a tighter 0.5 % catches regressions.
TOLERANCE = 0.005

# The issue's three models, as a user's file (the CLI takes FILE.py:factory).
MODELS_SOURCE = textwrap.dedent('''
    import torch.nn.functional as F
    from torch import nn


    class SdpaOnly(nn.Module):
        """Just scaled_dot_product_attention on projections."""

        def __init__(self, d=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


    class Mha(nn.Module):
        """nn.MultiheadAttention; without the attention weights it runs SDPA."""

        def __init__(self, d=256, heads=4, need_weights=False):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.out = nn.Linear(d, d)
            self.need_weights = need_weights

        def forward(self, x):
            return self.out(self.attn(x, x, x, need_weights=self.need_weights)[0])


    class Lstm(nn.Module):
        """A 2-layer nn.LSTM."""

        def __init__(self, d=128, hidden=256):
            super().__init__()
            self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
            self.out = nn.Linear(hidden, 10)

        def forward(self, x):
            return self.out(self.lstm(x)[0][:, -1])


    def sdpa():
        return SdpaOnly()


    def mha():
        return Mha()


    def mha_weights():
        return Mha(need_weights=True)


    def lstm():
        return Lstm()
''')

# factory, batch, one sample's shape; the first three are the issue's models
ISSUE_MODELS = {
    "sdpa": ("sdpa", 8, (256, 256)),
    "mha": ("mha", 8, (256, 256)),
    "lstm": ("lstm", 8, (64, 128)),
}
# What the old estimate (meta's math attention, meta's LSTM decomposition) said against the
# real CPU peak with these models: +58.3 %, +41.0 %, -39.4 %.


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cpu_target") / "issue_models.py"
    path.write_text(MODELS_SOURCE)
    return path


def _error(measured: int, estimate: int) -> float:
    return (estimate - measured) / measured


@pytest.mark.parametrize("name", list(ISSUE_MODELS))
@pytest.mark.slow  # a real CPU step under the profiler per case (through_the_api keeps one quick)
def test_issue_models_measure_within_the_bar_from_the_cli(models_file: Path, name: str) -> None:
    factory, batch, shape = ISSUE_MODELS[name]
    result = CliRunner().invoke(main, [f"{models_file}:{factory}", "--batch", str(batch), "--input-shape",
                                       ",".join(map(str, shape)), "--measure", "--format", "json"])
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output)["measured"]
    assert measured["device"] == "cpu (torch.profiler)"
    assert abs(measured["relative_error"]) <= TOLERANCE, measured
    text = CliRunner().invoke(main, [f"{models_file}:{factory}", "--batch", str(batch), "--input-shape",
                                     ",".join(map(str, shape)), "--measure", "--depth", "0"]).output
    assert "compared with the estimate for this CPU: its own kernels" in text
    assert "own workspaces differ" not in text  # the old, vague blame


@pytest.mark.parametrize("name", [*ISSUE_MODELS, "mha_weights"])
@pytest.mark.quick_cases("sdpa")
def test_issue_models_measure_within_the_bar_through_the_api(models_file: Path, name: str) -> None:
    factory, batch, shape = ISSUE_MODELS.get(name, ("mha_weights", 8, (256, 256)))
    model = f"{models_file}:{factory}"
    report = attach_measurement(memcalc.estimate(model, batch_size=batch, input_shape=shape),
                                build_step(model, batch_size=batch, input_shape=shape))
    measurement = report.measurement
    assert measurement is not None and measurement.peak_allocated and measurement.compared_with
    error = measurement.relative_error()
    assert error is not None and abs(error) <= TOLERANCE, (
        f"{name}: CPU estimate {measurement.compared_with:,} B vs real {measurement.peak_allocated:,} B "
        f"({error:+.2%})")
    assert "not followed" not in measurement.note  # every op of these models is followed


class Rnn(nn.Module):
    """One recurrent layer stack and a head; ``packed`` feeds it a PackedSequence, its sequences
    of decreasing lengths, or all as long as the input with ``uniform`` (every step's batch the
    same), in the reverse order with ``enforce_sorted=False``."""

    def __init__(self, kind: str, packed: bool = False, uniform: bool = False, enforce_sorted: bool = True,
                 features: int = 128, **options: object) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(features, 64, batch_first=True, **options)
        self.packed, self.uniform, self.enforce_sorted = packed, uniform, enforce_sorted
        width = (self.rnn.proj_size or self.rnn.hidden_size) * (2 if self.rnn.bidirectional else 1)
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            batch, steps = x.shape[0], x.shape[1]
            lengths = torch.full((batch,), steps) if self.uniform else torch.arange(batch, 0, -1) * (steps // batch)
            if not self.enforce_sorted:
                lengths = lengths.flip(0)
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.enforce_sorted)
            return self.out(self.rnn(x)[0].data.sum(0, keepdim=True))
        return self.out(self.rnn(x)[0][:, -1])


# The CPU's RNN paths: oneDNN for an LSTM (bidirectional, without biases), the generic path with
# the CPU's precomputed input projection otherwise (GRU, RNN, LSTM with projections, packed
# sequences). The old estimate followed meta's path: GRU +2.6 %, projected LSTM -8.9 %,
# bidirectional tanh RNN +6.1 %, ReLU RNN -25.8 %, packed bidirectional RNN +9.2 %, GRU in
# eval -25 %.
RNN_CASES = {
    "lstm-bidirectional-dropout": dict(kind="LSTM", num_layers=3, bidirectional=True, dropout=0.2),
    "lstm-without-bias": dict(kind="LSTM", num_layers=2, bias=False),
    "lstm-projections": dict(kind="LSTM", num_layers=2, proj_size=32),
    "gru": dict(kind="GRU", num_layers=2),
    "gru-bidirectional": dict(kind="GRU", num_layers=2, bidirectional=True),
    "rnn-tanh-bidirectional": dict(kind="RNN", num_layers=2, bidirectional=True, dropout=0.1),
    "rnn-relu": dict(kind="RNN", nonlinearity="relu"),
    "lstm-packed": dict(kind="LSTM", packed=True, num_layers=2),
    "rnn-packed-bidirectional": dict(kind="RNN", packed=True, num_layers=2, bidirectional=True),
    "gru-eval": dict(kind="GRU", num_layers=2, mode="eval"),
}


#: torch 2.11's oneDNN LSTM without bias allocates 64,488 B less than the rule, which follows
#: 2.13 (measured: +0.79% on 2.11.0; exact on 2.13.0 and 2.14.1): not followed.
_RNN_OLDER_TORCH = pytest.mark.xfail(parse_torch_version(torch.__version__) < (2, 13), strict=True,
                                     reason="torch < 2.13's oneDNN LSTM without bias (the rule follows 2.13)")


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("name", [pytest.param(n, marks=_RNN_OLDER_TORCH) if n == "lstm-without-bias" else n
                                  for n in RNN_CASES])
@pytest.mark.quick_cases("gru-eval")
def test_cpu_rnn_paths_match_the_real_cpu(name: str) -> None:
    options = dict(RNN_CASES[name])
    mode = str(options.pop("mode", "train"))
    step: dict[str, object] = {"mode": mode} if mode != "train" else {"optimizer": "adam"}

    def model() -> nn.Module:
        return Rnn(**options)  # type: ignore[arg-type]

    estimate = memcalc.estimate(model, batch_size=8, input_shape=(64, 128), gpu="cpu", **step)
    torch.manual_seed(0)
    measured = measure_cpu(build_step(model, batch_size=8, input_shape=(64, 128), **step)).peak_allocated
    assert measured
    error = _error(measured, estimate.peak_requested)
    assert abs(error) <= TOLERANCE, f"{name}: {estimate.peak_requested:,} B vs real {measured:,} B ({error:+.2%})"


# A packed LSTM (issue 32, item 4): torch 2.13's packed at::lstm unwraps a batch whose sizes are
# all equal (every sequence as long as the longest: batch 1, or lengths never shorter than the
# padding) into a time-major tensor and runs oneDNN's LSTM, workspace and all (native/RNN.cpp).
# The old estimate kept PackedLayer's generic path for every packed LSTM: here -25.5 % (uniform),
# -26.6 %, -26.9 %, -27.7 %, -32.8 % (without bias); with projections (never oneDNN) it crashed
# (IndexError in gather_params). Varying lengths and GRUs stay on the generic path (exact before
# and after).
PACKED_LSTM_CASES = {
    "uniform": dict(num_layers=1),
    "uniform-two-layers-unsorted": dict(num_layers=2, enforce_sorted=False),
    "uniform-bidirectional": dict(num_layers=1, bidirectional=True),
    "uniform-two-layers-bidirectional-dropout": dict(num_layers=2, bidirectional=True, dropout=0.2),
    "uniform-without-bias": dict(num_layers=1, bias=False),
    "uniform-projections": dict(num_layers=2, proj_size=16),
    "varying-unsorted-bidirectional": dict(num_layers=2, bidirectional=True, uniform=False, enforce_sorted=False),
    "varying-projections": dict(num_layers=1, proj_size=16, uniform=False),
    "gru-uniform": dict(kind="GRU", num_layers=2, bidirectional=True),
}


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("name", list(PACKED_LSTM_CASES))
@pytest.mark.quick_cases("uniform-two-layers-unsorted")
def test_cpu_packed_lstm_matches_the_real_cpu(name: str) -> None:
    options: dict[str, object] = {"kind": "LSTM", "packed": True, "uniform": True, "features": 32,
                                  **PACKED_LSTM_CASES[name]}

    def model() -> nn.Module:
        return Rnn(**options)  # type: ignore[arg-type]

    estimate = memcalc.estimate(model, batch_size=4, input_shape=(16, 32), gpu="cpu", optimizer="adam")
    torch.manual_seed(0)
    measured = measure_cpu(build_step(model, batch_size=4, input_shape=(16, 32), optimizer="adam")).peak_allocated
    assert measured
    error = _error(measured, estimate.peak_requested)
    assert abs(error) <= TOLERANCE, f"{name}: {estimate.peak_requested:,} B vs real {measured:,} B ({error:+.2%})"


def _real_lstm_ops(lengths: list[int]) -> set[str]:
    """The aten ops a real packed LSTM step (forward and backward) records in the profiler."""
    lstm = nn.LSTM(4, 8)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(max(lengths), len(lengths), 4), torch.tensor(lengths))
    with torch.profiler.profile() as prof:
        lstm(packed)[0].data.sum().backward()
    return {event.name for event in prof.events()}


def test_uniform_packed_lstm_probe_matches_the_profiler() -> None:
    # the CPU target reads off one real call whether this torch's packed at::lstm unwraps a batch
    # whose sizes are all equal onto oneDNN; a real step under the profiler says the same, and a
    # batch whose sizes vary never runs oneDNN
    assert ("aten::mkldnn_rnn_layer" in _real_lstm_ops([5, 5, 5])) is uniform_packed_lstm_runs_onednn()
    assert "aten::mkldnn_rnn_layer" not in _real_lstm_ops([5, 4, 4])


def test_cpu_packed_lstm_follows_onednn_only_on_a_uniform_batch() -> None:
    # a 2-layer LSTM fed a packed batch of 4 sequences of 16 steps: every sequence as long as the
    # padding runs oneDNN, one mkldnn_rnn_layer per layer (2: the second iteration is replayed from
    # the traced first) and one backward each; a single shorter sequence keeps the whole batch on
    # PackedLayer's generic path
    if not CpuCapabilities.here().onednn_uniform_packed_lstm:
        pytest.skip("this torch runs every packed LSTM on the generic path")

    def notes(uniform: bool) -> str:
        def model() -> nn.Module:
            return Rnn("LSTM", packed=True, uniform=uniform, features=16, num_layers=2)

        return "\n".join(memcalc.estimate(model, batch_size=4, input_shape=(16, 16), gpu="cpu",
                                          optimizer="adam").notes)

    assert "aten.mkldnn_rnn_layer.default ×2, aten.mkldnn_rnn_layer_backward.default ×2" in notes(uniform=True)
    assert "mkldnn_rnn_layer" not in notes(uniform=False)


@pytest.mark.slow  # a real oneDNN LSTM step under the profiler
def test_cpu_estimate_names_the_op_it_cannot_follow(models_file: Path) -> None:
    # oneDNN's LSTM without autograd packs its weights with MKL: not modelled, and said so
    model = f"{models_file}:lstm"
    step = build_step(model, batch_size=8, input_shape=(64, 128), mode="eval")
    report = attach_measurement(memcalc.estimate(model, batch_size=8, input_shape=(64, 128), mode="eval"), step)
    assert report.measurement is not None
    assert "not followed on the CPU: aten.mkldnn_rnn_layer.default ×2 (oneDNN LSTM inference" in (
        report.measurement.note)
    # oneDNN's convolutions keep their own reorders and scratchpad
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    note = cpu_comparison_note(memcalc.estimate(conv, batch_size=2, input_shape=(3, 8, 8), gpu="cpu"))
    assert "not followed on the CPU: convolution.default ×1" in note
    assert "convolution_backward.default ×1" in note


@pytest.mark.slow  # a real CPU step under the profiler
def test_cpu_measurement_keeps_stderr_clean(capfd: pytest.CaptureFixture[str]) -> None:
    # kineto wrote "USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start" (and _stop) to
    # file descriptor 2 at every profiler start and stop
    measure_cpu(build_step("mlp", batch_size=4))
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT" not in err


def test_cuda_estimates_do_not_change(models_file: Path) -> None:
    # the CPU target is a backend of its own: the CUDA estimates of the issue's models are
    # those memcalc gave before it existed, but for a CUDA rule added since: sdpa's qkv bias
    # gradient (a sum over 8 × 256 rows of 768 columns) stages 12,582,912 B in gpu_reduce_kernel
    # (43,566,080 B without it)
    expected = {"sdpa": 44_320_256, "mha_weights": 63_457_280, "lstm": 40_947_712}
    for factory, peak in expected.items():
        shape = (64, 128) if factory == "lstm" else (256, 256)
        report = memcalc.estimate(f"{models_file}:{factory}", batch_size=8, input_shape=shape)
        assert report.bytes.peak_allocated == peak, factory


# ---- the size formulas, against the bytes the CPU profiler showed on torch 2.13 -----------------

def test_onednn_lstm_workspace_bytes() -> None:
    # T=64 steps, N=8, input 128, hidden 256; get_good_ld(1024) = 1040, get_good_ld(256) = 272:
    # gates 64·8·1040·4 = 2,129,920 (520 pages), ht 64·8·272·4 = 557,056 (136), states
    # 2·65·8·272·4 = 1,131,520 (277 pages, rounded up), c-states 2·65·8·256·4 = 1,064,960
    # (260); states, c-states and their gradients: 520+136+277+260+277+277+260 = 2007 pages
    assert onednn.lstm_workspace_bytes(64, 8, 128, 256) == 2007 * 4096 == 8_220_672
    assert onednn.lstm_workspace_bytes(64, 16, 128, 256) == 16_429_056  # measured
    assert onednn.lstm_workspace_bytes(100, 4, 32, 64) == 1_585_152  # measured
    assert onednn.lstm_workspace_bytes(1, 1, 1, 1) == 7 * 4096  # seven parts of one page


def test_onednn_lstm_scratchpad_and_reorders() -> None:
    # gates 2,129,920 (520 pages) + ht 8·272·4 = 8,704 (→ 523) + diff-ht 8,704 (→ 526 pages)
    # = 2,154,496; + the RNN space's 4096-byte alignment + 3·(8+128) + (32+128) = 568
    assert onednn.lstm_scratchpad_bytes(64, 8, 256, forward=True) == 2_154_496 + 4096 + 568 == 2_159_160
    assert onednn.lstm_scratchpad_bytes(64, 16, 256, forward=False) == 4_305_464  # measured
    assert onednn.lstm_scratchpad_bytes(20, 32, 200, forward=True) == 2_110_008  # measured
    # forward: both weights into ldigo with ld 1040: 128·1040·4 + 256·1040·4
    assert onednn.lstm_weight_reorder_bytes(128, 256, forward=True) == 532_480 + 1_064_960
    # backward: w_ih needs no copy (ld 128 = 128), w_hh into ld 272 (1024·272·4), and both
    # weight gradients in ldigo (128·1040·4 + 256·1040·4)
    assert onednn.lstm_weight_reorder_bytes(128, 256, forward=False) == 1_114_112 + 532_480 + 1_064_960


def test_cpu_flash_attention_buffers() -> None:
    q = torch.empty(8, 4, 256, 64, device="meta")
    # 256 query rows → q blocks of 64, kv blocks of min(512, 256); per thread
    # 64·256 (q·kᵀ) + 2·64 (max, sum) + 64·64 (output block) floats, two threads
    assert flash_forward_temporaries(q, q, threads=2) == 2 * (64 * 256 + 2 * 64 + 64 * 64) * 4 == 164_864
    grad = torch.empty(8, 256, 4, 64, device="meta").transpose(1, 2)  # (B, L, H, E) underneath: no copy
    # per thread 2·64·256 floats (attention and its gradient), and the calling thread's 64-float dsum
    # (the one the profiler records: test_cpu_flash_backward_temporaries_are_what_the_profiler_records)
    assert flash_backward_temporaries(grad, q, q, threads=2) == 2 * 2 * 64 * 256 * 4 + 64 * 4
    contiguous = torch.empty(8, 4, 256, 64, device="meta")  # copied into (B, L, H, E) first
    assert flash_backward_temporaries(contiguous, q, q, threads=2) == 262_400 + 8 * 4 * 256 * 64 * 4


@pytest.mark.parametrize("shape", [(2, 4, 8, 16), (8, 4, 256, 64)])
def test_cpu_flash_backward_temporaries_are_what_the_profiler_records(shape: tuple[int, int, int, int]) -> None:
    # the real backward's peak beyond its three gradients, one thread's dsum however many threads work
    from memcalc.measure.step import _profiler_peak

    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d).transpose(1, 2) for _ in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    for grad in (torch.randn_like(out), torch.randn(b, h, s, d)):  # (B, L, H, E) underneath, and copied into it
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, True)
            del grads
        threads = torch.get_num_threads()
        assert _profiler_peak(prof) == 3 * q.numel() * 4 + flash_backward_temporaries(grad, q, k, threads)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _t(*shape: int, **kw: object) -> torch.Tensor:
    return torch.randn(*shape, **kw)  # type: ignore[call-overload]


SDPA_CALLS = {
    "plain": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16), {}),
    "causal": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16), {"is_causal": True}),
    "gqa": lambda: (_t(2, 4, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16), {"enable_gqa": True}),
    "dropout": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16), {"dropout_p": 0.1}),
    "bool-mask": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16),
                          {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}),
    "3-d-mask": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16), {"attn_mask": torch.zeros(4, 8, 8)}),
    "mask-requires-grad": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 16),
                                   {"attn_mask": torch.zeros(8, 8, requires_grad=True)}),
    "3-d-inputs": lambda: (_t(4, 8, 16), _t(4, 8, 16), _t(4, 8, 16), {}),
    "value-head-size": lambda: (_t(2, 4, 8, 16), _t(2, 4, 8, 16), _t(2, 4, 8, 32), {}),
    "strided-last-dim": lambda: (_t(2, 4, 16, 8).transpose(-1, -2), _t(2, 4, 8, 16), _t(2, 4, 8, 16), {}),
    "bf16": lambda: (_t(2, 4, 8, 16, dtype=torch.bfloat16), _t(2, 4, 8, 16, dtype=torch.bfloat16),
                     _t(2, 4, 8, 16, dtype=torch.bfloat16), {}),
}


@pytest.mark.parametrize("name", list(SDPA_CALLS))
def test_cpu_sdpa_choice_is_the_dispatchers(name: str) -> None:
    q, k, v, kwargs = SDPA_CALLS[name]()
    with _Ops() as ops:
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    runs_flash = "_scaled_dot_product_flash_attention_for_cpu.default" in ops.names
    refusal = cpu_flash_refusal(q, k, v, kwargs.get("attn_mask"), float(kwargs.get("dropout_p", 0.0)),
                                bool(kwargs.get("enable_gqa", False)))
    assert (refusal is None) == runs_flash, refusal


# ---- the CPU target reports the CPU's figure (issue 32, item 5) ------------------------------------
def test_cpu_target_reports_what_the_cpu_allocator_counts():
    # fc-32-16, batch 100, eval: weight 32·16·4 = 2,048 + input 100·32·4 = 12,800 + output
    # 100·16·4 = 6,400 = 21,248 B, the article's worked example to the byte. A CUDA GPU rounds each
    # block to 512 B and adds a context; the CPU allocator does neither.
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none", gpu="cpu")
    assert r.bytes.peak_allocated == r.peak_requested == 2_048 + 12_800 + 6_400
    assert r.bytes.rounding == 0 and r.bytes.workspace == 0
    assert r.peak_reserved == r.bytes.peak_allocated and r.cuda_context == 0
    assert r.device_total == r.bytes.peak_allocated
    data = r.to_dict()
    assert data["gpu"] == "cpu" and data["bytes"]["cuda_context"] == 0 and data["cuda_version"] == ""
    # the JSON contract: the same keys as a CUDA estimate's, only the values differ
    cuda = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none").to_dict()
    assert list(data) == list(cuda) and list(data["bytes"]) == list(cuda["bytes"])


def test_cpu_target_cli_text_and_json(golden):
    # mlp, batch 4, adam: the header names the CPU, no rounding row, no CUDA context
    result = CliRunner().invoke(main, ["mlp", "--batch", "4", "--gpu", "cpu", "--depth", "0"])
    assert result.exit_code == 0, result.output
    assert "CUDA GPU" not in result.output and "allocator block rounding" not in result.output
    golden(result.output)
    data = json.loads(CliRunner().invoke(main, ["mlp", "--batch", "4", "--gpu", "cpu", "--format", "json"]).output)
    assert data["gpu"] == "cpu" and data["bytes"]["cuda_context"] == 0
    assert data["bytes"]["peak_reserved"] == data["bytes"]["peak_allocated"]


def test_cpu_target_measure_compares_its_own_figure():
    # --measure on the CPU target compares the figure the report prints, not a second estimate's
    step = build_step("mlp", batch_size=8, gpu="cpu")
    report = memcalc.estimate("mlp", batch_size=8, gpu="cpu")
    measured = attach_measurement(report, step).measurement
    assert measured is not None and measured.compared_with == report.bytes.peak_allocated
    assert abs(measured.relative_error() or 1.0) <= TOLERANCE


@pytest.mark.quick_cases("mlp")
@pytest.mark.parametrize("name, options", [
    pytest.param("mlp", {"batch_size": 16, "optimizer": "adam"}, id="mlp"),
    pytest.param("llama-tiny", {"batch_size": 2, "seq_len": 64, "optimizer": "adamw"}, id="llama-tiny"),
    pytest.param("gpt2", {"batch_size": 1, "seq_len": 32, "optimizer": "adamw"}, id="gpt2"),
])
def test_cpu_target_printed_peak_matches_a_real_cpu_step(name, options):
    # the figure the report prints (before: CUDA-rounded, up to +16.7% off) against the real CPU
    # step under torch.profiler, within 1%
    printed = memcalc.estimate(name, gpu="cpu", **options).bytes.peak_allocated
    real = measure_cpu(build_step(name, gpu="cpu", **options)).peak_allocated
    assert real is not None and abs(printed - real) / real <= 0.01, (printed, real)
