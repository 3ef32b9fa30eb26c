"""Training loops run as written (memcalc.engine.loops): each preset and two loops a user wrote,
estimated on meta tensors for this CPU and run for real on it under the profiler — the same
function both times; the default fast path against the minimal preset traced; how the loops
differ (the last logits kept, the gradients kept); what a user's loop does wrong, said as the
loop's; the CLI's ``--loop FILE.py:fn``.

The real run builds its optimizer in the implementation the estimate resolved
(``report.optimizer_impl``, through ``resolve_impl`` in both), whatever the CPU's default is.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Phase
from memcalc.core.errors import DataDependentError, InapplicableOptionError, LoopFunctionError
from memcalc.engine.run import build_report, trace_model
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import CpuBackend
from models_zoo.gpt2 import GPT2Config, GPT2LMHeadModel

USER_LOOPS_FILE = Path(__file__).parent / "fixtures" / "user_loops.py"
_spec = importlib.util.spec_from_file_location("user_loops", USER_LOOPS_FILE)
assert _spec is not None and _spec.loader is not None
user_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(user_loops)

# The bar is 1 %; on torch 2.13 these agree within ~0.001 % (the CPU step counters of
# torch.optim, which the estimate leaves out as a GPU would not hold them), so 0.5 % catches
# regressions.
TOLERANCE = 0.005
VOCAB, BATCH, SEQ = 1000, 4, 32


def small_lm() -> nn.Module:
    """The zoo's GPT-2, scaled down: 2 layers, d 64, a 1,000-token vocabulary."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(64, 2, 4, vocab_size=VOCAB, n_positions=64))


def _lm_inputs(batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch, seq)),)


MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "mlp": ("mlp", dict(batch_size=32)),  # the zoo's MLP: 784 → 10 classes, cross-entropy
    "lm": (small_lm, dict(inputs=_lm_inputs())),
}
LOOPS: dict[str, memcalc.Loop] = {
    "minimal": memcalc.Loop("minimal"),
    "tutorial": memcalc.Loop("tutorial"),
    "trainer": memcalc.Loop("trainer"),
    "zero-grad-late": memcalc.Loop("zero-grad-late"),
    "minimal+keep_grads": memcalc.Loop("minimal", keep_grads=True),
    "user:keeps_logits": memcalc.Loop(user_loops.keeps_logits),
    "user:zero_grad_late": memcalc.Loop(user_loops.zero_grad_late),
}


def _options(model: str, loop: memcalc.Loop, **extra: Any) -> dict[str, Any]:
    # a user's loop computes its own loss; a preset trains the LM with next-token cross-entropy
    loss = "lm-cross-entropy" if model == "lm" and loop.preset is not None else None
    return dict(optimizer="adam", loop=loop, loss=loss, **extra)


def _traced_report(model: Any, size: dict[str, Any], **options: Any) -> memcalc.MemoryReport:
    """The CPU estimate with the loop traced as written (also the default loop, which
    ``memcalc.estimate`` synthesises instead)."""
    opts = build_step(model, gpu="cpu", **size, **options)
    resolved = resolve(model, **size)
    return build_report(resolved, trace_model(resolved, opts, CpuBackend(opts), traced_loop=True), opts)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.quick_cases("mlp-tutorial")
def test_loop_estimate_matches_the_real_cpu_run(model: str, loop: str) -> None:
    source, size = MODELS[model]
    options = _options(model, LOOPS[loop])
    report = _traced_report(source, size, **options)
    torch.manual_seed(0)
    measured = measure_cpu(build_step(source, gpu="cpu", **size, **options), traced_loop=True).peak_allocated
    assert measured
    error = (report.peak_requested - measured) / measured
    assert abs(error) <= TOLERANCE, f"{model}/{loop}: {report.peak_requested:,} B vs real {measured:,} B ({error:+.3%})"
    assert report.peak_iteration in (1, 2) and report.first_iteration_peak <= report.bytes.peak_allocated


@pytest.mark.parametrize("case", [
    dict(model="mlp", size=dict(batch_size=64), options={}),
    dict(model="gpt2", size=dict(batch_size=2, seq_len=128), options={}),
    dict(model=small_lm, size=dict(inputs=_lm_inputs()),
         options=dict(precision="amp-fp16", accum_steps=2, loss="lm-cross-entropy")),
    dict(model=small_lm, size=dict(inputs=_lm_inputs()),
         options=dict(precision="amp-bf16", optimizer="sgd-momentum", loss="lm-cross-entropy")),
])
@pytest.mark.quick_cases("case0")
def test_the_fast_path_and_the_traced_minimal_loop_agree_to_the_byte(case: dict[str, Any]) -> None:
    # The fast path traces one step and synthesises the second; the minimal preset runs both
    # (fresh batches, the first one dropped when the second is drawn). Same live set at the
    # peak, so the same peak, on the generic CUDA GPU (its workspaces, autocast, GradScaler).
    resolved = resolve(case["model"], **case["size"])
    opts = build_step(case["model"], **case["size"], **case["options"])
    fast = memcalc.estimate(case["model"], **case["size"], **case["options"])
    from memcalc.targets.backend import CudaBackend
    traced = build_report(resolved, trace_model(resolved, opts, CudaBackend(opts), traced_loop=True), opts)
    assert traced.bytes.peak_allocated == fast.bytes.peak_allocated
    assert traced.first_iteration_peak == fast.first_iteration_peak
    assert (traced.peak_iteration, traced.peak_phase) == (fast.peak_iteration, fast.peak_phase)
    assert traced.bytes.optimizer_state == fast.bytes.optimizer_state
    assert traced.bytes.gradients == fast.bytes.gradients


def test_tutorial_keeps_the_last_logits_past_backward() -> None:
    # pred = model(X) is alive from one iteration's backward until the next forward rebinds it:
    # through the optimizer step. With foreach Adam at a small batch the peak is in that step,
    # and the tutorial loop's is higher by the B×T×V float32 logits (and its 4-byte loss).
    # (Where the peak is in backward, both loops hold the same there: the gap is 0.)
    size = dict(inputs=_lm_inputs(1, 8))
    loops = {name: memcalc.Loop(name, optimizer_impl="foreach") for name in ("minimal", "tutorial")}
    minimal, tutorial = (memcalc.estimate(small_lm, gpu="cpu", loop=loop, loss="lm-cross-entropy", **size)
                         for loop in loops.values())
    logits = 1 * 8 * VOCAB * 4
    assert minimal.peak_phase is Phase.OPTIMIZER
    assert tutorial.peak_requested - minimal.peak_requested >= logits
    for name in MODELS:  # never below the minimal loop
        source, model_size = MODELS[name]
        low, high = (memcalc.estimate(source, gpu="cpu", **_options(name, memcalc.Loop(loop)), **model_size)
                     for loop in ("minimal", "tutorial"))
        assert high.peak_requested >= low.peak_requested


def test_keep_grads_holds_the_gradients_through_the_forward() -> None:
    # zero_grad(set_to_none=False): every gradient is allocated at the minimal loop's peak (the
    # start of backward, where it holds none), so the peak grows by the gradients' bytes.
    source, size = MODELS["lm"]
    minimal = memcalc.estimate(source, gpu="cpu", **_options("lm", memcalc.Loop("minimal")), **size)
    kept = memcalc.estimate(source, gpu="cpu", **_options("lm", memcalc.Loop("minimal", keep_grads=True)), **size)
    gradient_bytes = sum(p.numel() * p.element_size() for p in small_lm().parameters())  # tied weight once
    assert minimal.bytes.gradients == 0  # its peak holds no gradient
    assert kept.bytes.gradients == gradient_bytes and kept.keep_grads
    assert kept.peak_requested - minimal.peak_requested >= gradient_bytes


def test_trainer_drops_the_outputs_before_backward() -> None:
    # Trainer.compute_loss returns the loss only: the logits die before backward (the minimal
    # loop keeps its output through backward), so at a backward peak it holds the logits less.
    source, size = MODELS["lm"]
    minimal, trainer = (memcalc.estimate(source, gpu="cpu", **_options("lm", memcalc.Loop(loop)), **size)
                        for loop in ("minimal", "trainer"))
    # It holds four float32 scalars the minimal loop does not: tr_loss, the last step's
    # detached loss (tr_loss_step) and the last grad norm (both alive until rebound), and
    # accelerator.backward's loss / gradient_accumulation_steps (alive through backward).
    assert minimal.peak_phase is Phase.BACKWARD
    assert minimal.peak_requested - trainer.peak_requested == BATCH * SEQ * VOCAB * 4 - 4 * 4


def test_a_traced_loop_reports_its_iterations_and_phases() -> None:
    report = memcalc.estimate("mlp", batch_size=16, loop="tutorial", accum_steps=2)
    spans = report.timeline().spans
    assert {s.iteration for s in spans} == {1, 2}
    phases = [s.phase for s in spans if s.iteration == 2]
    # each micro-batch: drawn, forward, loss, backward; then the step and zero_grad
    assert phases == [Phase.SETUP, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD] * 2 + [
        Phase.OPTIMIZER, Phase.ZERO_GRAD]
    assert report.loop == "tutorial" and report.bytes.optimizer_state > 0


def test_a_user_loop_is_named_and_its_loss_is_its_own() -> None:
    report = memcalc.estimate("mlp", batch_size=16, loop=user_loops.zero_grad_late)
    assert report.loop == "zero_grad_late"
    assert report.loss == "computed by the loop (zero_grad_late)"
    assert report.bytes.gradients + report.bytes.optimizer_state > 0 and not report.notes[:-1]


def test_a_loop_that_raises_is_reported_as_the_loop() -> None:
    with pytest.raises(LoopFunctionError, match=r"the loop function raises raised AttributeError: .*stepp.*"
                                                r"user_loops\.py, line \d+") as caught:
        memcalc.estimate("mlp", batch_size=8, loop=user_loops.raises)
    assert caught.value.exit_code == 2
    with pytest.raises(LoopFunctionError, match="drew more than the 2 batches"):
        memcalc.estimate("mlp", batch_size=8, loop=user_loops.draws_too_many)


def test_a_loop_reading_a_value_says_so_once_with_its_line() -> None:
    """One message, about the loop and its line: not "the model reads tensor values during
    backward in the model's own code" followed by a hint that contradicts it."""
    with pytest.raises(DataDependentError) as caught:
        memcalc.estimate("mlp", batch_size=8, loop=user_loops.reads_the_loss)
    line = next(number for number, text in enumerate(Path(user_loops.__file__).read_text().splitlines(), 1)
                if "loss.item()" in text)
    message = str(caught.value).splitlines()[0]
    assert message.startswith("the loop function reads_the_loss reads a tensor's value "
                              f"(at {user_loops.__file__}, line {line}): .item()")
    assert "the model" not in str(caught.value) and "during backward" not in str(caught.value)
    assert "Leave such lines" in (caught.value.hint or "")


class Picky(nn.Module):
    """A model that refuses its input in Python (not in an op)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 8:
            raise ValueError(f"wants 8 features, got {x.shape[-1]}")
        return self.fc(x)


def test_a_forward_that_fails_inside_a_loop_is_the_forward_s() -> None:
    with pytest.raises(memcalc.InvalidInputError, match=r"the forward of Picky failed on input .*wants 8 features"):
        memcalc.estimate(Picky(), input_shape=(16,), batch_size=8, loop=user_loops.keeps_logits)


@pytest.mark.parametrize("loop, fragment", [
    (user_loops.forward_only, "never called backward()"),
    (user_loops.makes_its_own_batch, "drew no batch from `batches`"),
    (user_loops.cpu_autocast, "inside torch.autocast, which memcalc does not follow"),
])
def test_a_loop_that_skips_part_of_the_step_still_gets_a_report(loop: Any, fragment: str) -> None:
    report = memcalc.estimate("mlp", batch_size=8, loop=loop)
    assert any(fragment in note for note in report.notes), report.notes
    assert report.bytes.peak_allocated > 0


def test_what_a_user_loop_cannot_honour_is_refused() -> None:
    with pytest.raises(InapplicableOptionError, match="computes its own loss"):
        memcalc.estimate("mlp", batch_size=8, loop=user_loops.keeps_logits, loss="mse")
    with pytest.raises(InapplicableOptionError, match="amp-bf16 is memcalc's autocast"):
        memcalc.estimate("mlp", batch_size=8, loop=user_loops.keeps_logits, precision="amp-bf16")
    with pytest.raises(InapplicableOptionError, match="calls its own zero_grad"):
        memcalc.estimate("mlp", batch_size=8, loop=memcalc.Loop(user_loops.keeps_logits, keep_grads=True))
    with pytest.raises(InapplicableOptionError, match="one GPU only for now"):
        memcalc.estimate("mlp", batch_size=8, loop="tutorial",
                         distributed=memcalc.Distributed("ddp", world_size=2))


def test_the_cli_takes_a_loop_function_from_a_file() -> None:
    result = CliRunner().invoke(main, ["mlp", "--batch", "16", "--loop", f"{USER_LOOPS_FILE}:keeps_logits",
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["loop"] == "keeps_logits"
    api = memcalc.estimate("mlp", batch_size=16, loop=user_loops.keeps_logits)
    assert data["bytes"]["peak_allocated"] == api.bytes.peak_allocated


@pytest.mark.parametrize("spec, fragment", [
    ("tests/fixtures/no_such_loops.py:fn", "loop file not found"),
    (f"{USER_LOOPS_FILE}:nothing_here", "has no attribute 'nothing_here'"),
    (f"{USER_LOOPS_FILE}:DEVICE", "user_loops.py:DEVICE is a str, not a loop function"),
    ("tests/fixtures/broken_syntax.py:fn", "syntax error in"),
])
def test_the_cli_s_loop_errors_speak_of_a_loop(spec: str, fragment: str) -> None:
    result = CliRunner().invoke(main, ["mlp", "--batch", "16", "--loop", spec])
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    assert "model file" not in result.output
