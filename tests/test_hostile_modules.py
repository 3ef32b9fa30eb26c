"""Hostile models a user may bring (issue 32, items 8-11): each one either estimates within 1% of
a real CPU step (the profiler's allocation events, :func:`memcalc.measure.step.measure_cpu`), or
is refused with a :class:`MemcalcError` that names the module and what to do; and the user's
objects come back as they were."""

from __future__ import annotations

import gc
import re
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import memcalc
from memcalc.core.errors import ModelSourceError, RefusedStepError
from memcalc.engine.trainable import EMPTY_PARAMETERS, NO_GRAD_FN
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu
from memcalc.sources.twin import meta_twin

#: How far an estimate for the CPU may be from the real CPU step's peak.
TOLERANCE = 0.01
MIB = 1 << 20


# ---- user_frame: a user's file under a folder named memcalc ---------------------------------
def test_a_users_file_under_a_folder_named_memcalc_keeps_its_line(tmp_path: Path) -> None:
    # git clone puts memcalc in a folder named memcalc; a user's model may live in one too:
    # the frame is the user's by the package its file is in, not by the words in its path
    folder = tmp_path / "memcalc"
    folder.mkdir()
    model = folder / "model.py"
    model.write_text(textwrap.dedent("""\
        from torch import nn

        def make():
            raise ValueError("no such layer")
        """))
    with pytest.raises(ModelSourceError) as caught:
        memcalc.estimate(f"{model}:make", batch_size=2, input_shape=(8,))
    assert f"(at {model}, line 4)" in str(caught.value)


# ---- the model's own copy: modules passed as objects ------------------------------------------
def _pruned() -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    prune.l1_unstructured(model[0], "weight", amount=0.3)  # weight = weight_orig * weight_mask, not a leaf
    return model


def _old_weight_norm() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations.weight_norm
        layer = nn.utils.weight_norm(nn.Linear(256, 512))  # weight = g * v / |v|, not a leaf
    return nn.Sequential(layer, nn.ReLU(), nn.Linear(512, 10))


def _lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(512), nn.ReLU(), nn.Linear(512, 10))


MODULES: dict[str, Callable[[], nn.Module]] = {
    "pruned": _pruned,
    "weight-norm": _old_weight_norm,
    "parametrized-weight-norm": lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(256, 512)),
                                                      nn.ReLU(), nn.Linear(512, 10)),
    "lazy": _lazy,
}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.quick_cases("pruned-adam")
def test_a_module_object_estimates_as_the_real_cpu_step(name: str, optimizer: str) -> None:
    # before: the deepcopy of the meta twin refused the pruned and weight-norm modules ("Only
    # Tensors created explicitly by the user (graph leaves) support the deepcopy protocol") and
    # the lazy one failed on its uninitialised parameter
    make = MODULES[name]
    model = make()
    step = dict(batch_size=8, input_shape=(256,), optimizer=optimizer)
    estimate = memcalc.estimate(model, gpu="cpu", **step)  # type: ignore[arg-type]
    torch.manual_seed(0)
    measured = measure_cpu(build_step(make(), **step)).peak_allocated  # type: ignore[arg-type]
    error = (estimate.peak_requested - measured) / measured
    assert abs(error) <= TOLERANCE, f"{name}: {estimate.peak_requested:,} B vs real {measured:,} B ({error:+.2%})"
    # the same weights as the real model: 256·512 + 512 + 512·10 + 10, plus weight norm's g (512)
    extra = 512 if "weight-norm" in name else 0
    assert estimate.parameters == 256 * 512 + 512 + 512 * 10 + 10 + extra


def test_a_lazy_module_stays_lazy_for_its_user() -> None:
    model = _lazy()
    memcalc.estimate(model, batch_size=2, input_shape=(256,))
    assert isinstance(model[0], nn.LazyLinear) and model[0].has_uninitialized_params()


class _UnusedLazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.spare = nn.LazyLinear(4)  # never called: its weight never gets a shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_lazy_module_the_forward_never_calls_is_named() -> None:
    with pytest.raises(ModelSourceError, match=r"module 'spare' of _UnusedLazy is lazy \(LazyLinear\) and the model's "
                                               r"forward does not call it"):
        memcalc.estimate(_UnusedLazy(), batch_size=2, input_shape=(8,))


def test_a_tensor_attribute_is_never_copied_into_memory() -> None:
    # README: a module passed as an object is never copied to memory. Before, deepcopy copied a
    # plain tensor attribute (not a parameter or buffer) into real memory: +256 MiB for this one.
    model = nn.Sequential(nn.Linear(64, 64))
    model.table = torch.ones(64 * MIB)  # type: ignore[assignment]  # 64 Mi float32: 256 MiB
    model.tables = [torch.ones(4)]  # type: ignore[assignment]  # in a container too
    twin = meta_twin(model)
    assert twin.table.device.type == "meta" and twin.tables[0].device.type == "meta"
    memcalc.estimate(nn.Sequential(nn.Linear(64, 64)), batch_size=2, input_shape=(64,))  # imports and caches first
    grew = _peak_rss_growth(lambda: memcalc.estimate(model, batch_size=2, input_shape=(64,)))
    assert grew < 32 * MIB, f"the estimate's peak memory grew by {grew / MIB:.0f} MiB"
    assert model.table.device.type == "cpu" and model.tables[0].device.type == "cpu"


def _peak_rss_growth(run: Callable[[], object]) -> int:
    """How far this process's peak resident memory (VmHWM) rose during ``run()``: Linux's
    /proc/self/clear_refs resets the peak (writing 5) so that it counts from now."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs Linux's /proc/self/status")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("cannot reset the peak resident memory here")
    gc.collect()
    before = _resident_kib("VmRSS")
    run()
    return (_resident_kib("VmHWM") - before) * 1024


def _resident_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def test_hooks_of_the_users_module_record_nothing_during_the_estimate() -> None:
    # a forward hook whose closure holds a list, one that appends to the user's module's list,
    # and a hook object's own list: the meta twin (and the measured copy) run their own copies
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    seen: list[tuple[int, ...]] = []
    model.shapes = []  # type: ignore[assignment]
    model[0].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    model[2].register_forward_hook(lambda m, i, o: model.shapes.append(tuple(o.shape)))
    recorder = _Recorder()
    model[1].register_forward_hook(recorder)
    model(torch.zeros(2, 8))  # the user's own forward: one entry each
    memcalc.estimate(model, batch_size=2, input_shape=(8,))
    measure_cpu(build_step(model, batch_size=2, input_shape=(8,)))
    assert (seen, model.shapes, recorder.calls) == ([(2, 16)], [(2, 4)], 1)


#: Appended to by a hook written at the top of a module, as in a notebook or a script.
RECORDED: list[tuple[int, ...]] = []


def _record_globally(module: nn.Module, args: object, output: torch.Tensor) -> None:
    RECORDED.append(tuple(output.shape))


def test_a_hook_appending_to_a_global_list_records_nothing_during_the_estimate() -> None:
    # no closure: the hook reads the module-level list; the twin's copy reads a copy of it
    RECORDED.clear()
    model = nn.Sequential(nn.Linear(8, 4))
    model[0].register_forward_hook(_record_globally)
    memcalc.estimate(model, batch_size=2, input_shape=(8,))  # (the measured copy: the test above)
    assert RECORDED == []
    model(torch.zeros(3, 8))  # the user's own forward still records, in the user's list
    assert RECORDED == [(3, 4)]


class _Recorder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        self.calls += 1


def test_a_hook_holding_what_cannot_be_copied_still_runs() -> None:
    # a lock cannot be deep-copied: the closure's cell stays shared (as deepcopy leaves a function)
    lock = threading.Lock()
    model = nn.Sequential(nn.Linear(8, 4))
    calls: list[int] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        with lock:
            calls.append(1)

    model[0].register_forward_hook(hook)
    memcalc.estimate(model, batch_size=2, input_shape=(8,))
    assert calls == []


def test_a_scripted_module_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.Linear(8, 16), torch.jit.script(nn.Linear(16, 4)))
    with pytest.raises(ModelSourceError, match=r"module '1' of Sequential is a TorchScript module"):
        memcalc.estimate(model, batch_size=2, input_shape=(8,))
    with pytest.raises(ModelSourceError, match=r"is a TorchScript module \(RecursiveScriptModule"):
        memcalc.estimate(torch.jit.script(nn.Linear(8, 4)), batch_size=2, input_shape=(8,))


class _Tokens(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(1000, 64, sparse=sparse)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids).mean(1))


def test_a_sparse_embedding_is_refused_for_training_naming_it() -> None:
    ids = torch.zeros(8, 12, dtype=torch.long)
    with pytest.raises(RefusedStepError, match=r"module 'tokens' \(Embedding\(sparse=True\)\) makes a sparse"):
        memcalc.estimate(_Tokens(sparse=True), inputs=ids)


@pytest.mark.slow  # a real CPU step under the profiler, beyond the family's representative
def test_a_sparse_embedding_in_eval_estimates_as_the_real_cpu_step() -> None:
    # no gradient, nothing sparse: the forward is the dense one's
    step = dict(inputs=torch.zeros(8, 12, dtype=torch.long), mode="eval")
    estimate = memcalc.estimate(_Tokens(sparse=True), gpu="cpu", **step)  # type: ignore[arg-type]
    measured = measure_cpu(build_step(_Tokens(sparse=True), **step)).peak_allocated  # type: ignore[arg-type]
    assert abs(estimate.peak_requested - measured) <= TOLERANCE * measured, (estimate.peak_requested, measured)


# ---- steps PyTorch itself refuses -----------------------------------------------------------
class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).detach()


def _frozen() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4)).requires_grad_(False)


REFUSED: dict[str, tuple[Callable[[], nn.Module], dict[str, Any], str]] = {
    # name: (model, the step, what PyTorch says)
    "frozen-adam": (_frozen, {}, EMPTY_PARAMETERS),
    "frozen-no-optimizer": (_frozen, {"optimizer": "none"}, NO_GRAD_FN),
    "freeze-everything": (lambda: nn.Sequential(nn.Linear(8, 4)), {"finetune": memcalc.FineTune(freeze=("*",))},
                          EMPTY_PARAMETERS),
    "no-parameters-sgd": (nn.ReLU, {"optimizer": "sgd"}, EMPTY_PARAMETERS),
    "detached-output": (_Detached, {}, NO_GRAD_FN),
    "detached-loss": (lambda: nn.Linear(8, 4), {"loss": lambda output: output.detach().sum()}, NO_GRAD_FN),
    "detached-output-tutorial-loop": (_Detached, {"loop": memcalc.Loop("tutorial")}, NO_GRAD_FN),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_step_pytorch_refuses_is_refused_with_its_reason(name: str) -> None:
    make, step, says = REFUSED[name]
    with pytest.raises(RefusedStepError, match=re.escape(says)) as caught:
        memcalc.estimate(make(), batch_size=2, input_shape=(8,), **step)
    assert caught.value.exit_code == 2  # the user can change the model or the mode
    assert "--mode eval" in (caught.value.hint or "")


def test_pytorch_says_what_the_refusals_quote() -> None:
    # the words quoted are torch's own, for the same steps run for real
    with pytest.raises(ValueError, match=re.escape(EMPTY_PARAMETERS)):
        torch.optim.Adam([p for p in _frozen().parameters() if p.requires_grad])
    with pytest.raises(RuntimeError, match=re.escape(NO_GRAD_FN)):
        _Detached()(torch.zeros(2, 8)).sum().backward()


def test_a_frozen_model_still_estimates_a_forward() -> None:
    report = memcalc.estimate(_frozen(), batch_size=2, input_shape=(8,), mode="eval")
    assert report.parameters == 8 * 4 + 4
