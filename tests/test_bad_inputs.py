"""A battery of bad inputs: every mistake gets a clear answer.

* CLI (click's CliRunner), every command: each bad input exits non-zero (2: bad input, 1: it
  cannot be estimated) with one ``error:`` line — the message itself on one line; a
  ``MemcalcError``'s hint may follow it — and no traceback; nothing is written to the working
  folder.
* API, every public function: each wrong argument raises a ``MemcalcError`` subclass whose
  message names the argument.
* The items of the issue this battery came with: units above GiB and a note when no GPU holds
  the step; options the step would ignore are refused; a user's failing loss is blamed on the
  loss; ``--plot`` checks its file before the sweep and writes it whole or not at all; the
  sweep plot's style (linear batch axis, the budget, the largest batch that fits).
"""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.errors import (
    InapplicableOptionError,
    InvalidInputError,
    LossFunctionError,
    MemcalcError,
    ModelSourceError,
    PlotPathError,
)
from memcalc.core.units import format_bytes, parse_bytes
from memcalc.targets.cuda.gpus import local as local_gpus
from memcalc.targets.cuda.gpus.catalogue import catalogue

FIXTURES = Path(__file__).parent / "fixtures"

# ============================================================================================
# CLI
# ============================================================================================

# (arguments, exit code), grouped by command. What each prints is its golden file,
# tests/golden/bad_input[ARGUMENTS].out (the ``golden`` fixture).
CLI_CASES: list[tuple[str, int]] = [
    # memcalc MODEL (estimate)
    ("resnt50 --batch 2", 2),
    ("mlp --batch 0", 2),
    ("mlp --batch abc", 2),
    ("mlp --batch 2.5", 2),
    ("mlp --input-shape 0,3", 2),
    ("mlp --input-shape 3,a,224", 2),
    ("mlp --input-shape 3,-1", 2),
    ("mlp --optim lion", 2),
    ("mlp --optim adamax", 2),
    ("mlp --precision fp8", 2),
    ("mlp --gpu h1000", 2),
    ("mlp --gpu a100", 2),
    ("mlp --mode test", 2),
    ("mlp --mode sideways", 2),
    ("mlp --seq-len 0", 2),
    ("mlp --accum-steps 0", 2),
    ("mlp --kv-cache -1", 2),
    ("mlp --depth -1", 2),
    ("mlp --format xml", 2),
    ("mlp --format yaml", 2),
    ("mlp --units TB", 2),
    ("mlp --mode eval --checkpoint", 2),
    ("llama-tiny --checkpoint sometimes", 2),
    ("llama-tiny --checkpoint every:0", 2),
    ("mlp --mode eval --accum-steps 2", 2),
    ("gpt2 --seq-len 16 --mode eval --kv-cache 10", 2),
    ("mlp --mode inference --optim sgd", 2),
    ("mlp --mode eval --loss mean", 2),
    ("mlp --bucket-cap-mb 10", 2),
    ("mlp --gradient-as-bucket-view", 2),
    ("mlp --strategy zero3 --world-size 2 --fsdp-sharding shard_grad_op", 2),
    ("mlp --strategy zero3 --world-size 2 --fsdp-sharding full_shard", 2),  # the default value, given: still refused
    ("mlp --strategy ddp --world-size 2 --reduce-bucket-size 1000", 2),
    ("mlp --global-batch", 2),
    ("mlp --strategy ddp", 2),
    ("mlp --strategy tp --world-size 2", 2),
    ("mlp --strategy ddp --world-size 0", 2),
    ("mlp --strategy dp --device-ids 0,0", 2),
    ("mlp --strategy ddp --world-size 4 --global-batch --batch 6", 2),
    ("mlp --strategy ddp --world-size 2 --measure", 2),
    ("resnet50 --input-shape 3,224", 2),
    ("resnet50 --input-shape 8,3,224,224", 2),
    ("resnet18 --seq-len 128", 2),  # an image model given only a sequence length
    (f"{FIXTURES}/broken_syntax.py:make", 1),
    # steps PyTorch itself refuses (issue 32, item 9), and modules memcalc cannot trace (item 8)
    ("mlp --freeze *", 2),
    ("mlp --freeze * --optim none", 2),
    (f"{FIXTURES}/hostile_models.py:make_detached --input-shape 16", 2),
    (f"{FIXTURES}/hostile_models.py:make_sparse_embedding --input-shape 16", 2),
    (f"{FIXTURES}/hostile_models.py:make_scripted --input-shape 16", 1),
    (f"{FIXTURES}/missing.py:make", 1),
    # memcalc fit
    ("fit mlp", 2),
    ("fit mlp --gpu t4 --budget 1GiB", 2),
    ("fit mlp --budget lots", 2),  # each unreadable budget names the forms a budget takes
    ("fit mlp --budget '12 parsecs'", 2),
    ("fit mlp --budget 12 parsecs", 2),  # the unit as a separate word
    ("fit mlp --budget 0", 2),
    ("fit mlp --device banana", 2),
    ("fit mlp --device cuda:3", 2),
    ("fit mlp --gpu h1000", 2),
    ("fit mlp --gpu a100-40", 2),  # the name it may have meant
    ("fit mlp --budget 1GiB --strategy ddp", 2),
    ("fit mlp --budget 1KiB", 1),
    ("fit mlp --gpu t4 --mode eval --optim sgd", 2),
    ("fit mlp --gpu t4 --neighbours 99", 2),
    ("fit mlp --gpu t4 --batch 4", 2),
    ("fit mlp --gpu t4 --strategy zero2 --world-size 2 --bucket-cap-mb 10", 2),
    # memcalc sweep
    ("sweep mlp", 2),
    ("sweep mlp --batch 1,x", 2),
    ("sweep mlp --batch 1,0", 2),
    ("sweep mlp --batch 1 --optim sgd,lion", 2),
    ("sweep mlp --batch 1 --precision fp8", 2),
    ("sweep mlp --batch 1 --precision fp32,fp8", 2),
    ("sweep mlp --batch 1 --plot missing-folder/memory.png", 2),
    ("sweep mlp --batch 1 --plot memory", 2),
    ("sweep mlp --batch 1 --mode eval --optim sgd,adam", 2),
    ("sweep mlp --batch 1 --mode eval --loss mse", 2),
    ("sweep mlp --batch 1 --gpu t4 --budget 1GiB", 2),
    ("sweep mlp --batch 1 --device banana", 2),
    ("sweep mlp --batch 1 --mode eval --kv-cache 3", 2),
    # memcalc gpus, memcalc zoo
    ("gpus --format xml", 2),
    ("gpus extra", 2),
    ("gpus --units TB", 2),
    ("zoo --format xml", 2),
    ("zoo extra", 2),
]

# Bad inputs whose message quotes another library's words: the golden file would differ
# between that library's releases, so one fragment of the error line is checked instead.
WORDED_ELSEWHERE: list[tuple[str, int, str]] = [
    # torch's own error message: its words differ between the torch releases of CI's version matrix
    (f"{FIXTURES}/user_models.py:make_mlp --input-shape 3,224", 2, "op aten.addmm.default failed during forward"),
    # the formats listed are the installed matplotlib's
    ("sweep mlp --batch 1 --plot memory.xyz", 2,
     "cannot write the plot to memory.xyz: '.xyz' is not an image format matplotlib writes; end the name in one of"),
]


@pytest.fixture
def no_local_gpus(monkeypatch):
    """No GPU in this process's view (never probe the real machine's)."""
    monkeypatch.setattr(local_gpus, "list_local_gpus", lambda *a, **k: [])


def _case_id(args: str) -> str:
    """The case's id (and golden file name): its arguments, the fixtures folder by its name."""
    return args.replace(str(FIXTURES), "fixtures")[:60]


def _run_bad_input(args: str, exit_code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run ``memcalc ARGS`` in an empty folder; check what every bad input must do (the module
    docstring) and return its output."""
    pytest.importorskip("matplotlib")  # the --plot cases check the format list matplotlib writes
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, shlex.split(args))
    output = result.output
    assert result.exit_code == exit_code, output
    assert isinstance(result.exception, SystemExit), result.exception  # mapped, not leaked
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1, output
    # the message is that one line (a MemcalcError's hint may follow it, a usage error's usage precedes it)
    assert len([line for line in output.splitlines() if line.strip()]) <= 4, output
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing left behind
    return output


@pytest.mark.parametrize("args, exit_code", CLI_CASES, ids=[_case_id(c[0]) for c in CLI_CASES])
def test_bad_input(args, exit_code, no_local_gpus, tmp_path, monkeypatch, golden):
    golden(_run_bad_input(args, exit_code, tmp_path, monkeypatch))


@pytest.mark.parametrize("args, exit_code, fragment", WORDED_ELSEWHERE, ids=[_case_id(c[0]) for c in WORDED_ELSEWHERE])
def test_bad_input_worded_by_another_library(args, exit_code, fragment, no_local_gpus, tmp_path, monkeypatch):
    output = _run_bad_input(args, exit_code, tmp_path, monkeypatch)
    assert fragment in next(line for line in output.splitlines() if line.lower().startswith("error:")), output


def test_the_cli_battery_covers_every_command_and_is_large_enough():
    cases = [c[0] for c in [*CLI_CASES, *WORDED_ELSEWHERE]]
    commands = {c.split()[0] if c.split()[0] in ("fit", "sweep", "gpus", "zoo") else "estimate" for c in cases}
    assert commands == {"estimate", "fit", "sweep", "gpus", "zoo"}
    assert len(cases) + len(API_CASES) >= 40


def test_an_explicit_option_is_told_from_its_default():
    # the defaults of --optim, --bucket-cap-mb, --fsdp-sharding, --reduce-bucket-size are fine
    runner = CliRunner()
    assert runner.invoke(main, ["fc-32-16", "--batch", "2", "--mode", "eval"]).exit_code == 0
    assert runner.invoke(main, ["fc-32-16", "--batch", "2", "--mode", "eval", "--optim", "none"]).exit_code == 0
    zero = runner.invoke(main, ["fc-32-16", "--batch", "2", "--strategy", "zero3", "--world-size", "2",
                                "--reduce-bucket-size", "1024", "--format", "json"])
    assert zero.exit_code == 0, zero.output


# ============================================================================================
# API
# ============================================================================================


def _raising_loss(output):
    raise ValueError("my bug")


def _float_loss(output):
    return 1.0


def _unreduced_loss(output):
    return output * 2


# (id, call, exception class, fragments of the message)
API_CASES = [
    ("estimate batch_size='64'", lambda: memcalc.estimate("mlp", batch_size="64"), InvalidInputError,
     ["batch_size", "'64' (str)"]),
    ("estimate batch_size=64.0", lambda: memcalc.estimate("mlp", batch_size=64.0), InvalidInputError,
     ["batch_size", "64.0 (float)"]),
    ("estimate batch_size=True", lambda: memcalc.estimate("mlp", batch_size=True), InvalidInputError,
     ["batch_size", "True"]),
    ("estimate input_shape=1024", lambda: memcalc.estimate("mlp", batch_size=2, input_shape=1024), InvalidInputError,
     ["input_shape", "got 1024"]),
    ("estimate input_shape='784'", lambda: memcalc.estimate("mlp", batch_size=2, input_shape="784"),
     InvalidInputError, ["input_shape", "'784'"]),
    ("estimate seq_len='128'", lambda: memcalc.estimate("gpt2", batch_size=1, seq_len="128"), InvalidInputError,
     ["seq_len", "'128'"]),
    ("estimate capacity='lots'", lambda: memcalc.estimate("mlp", batch_size=2, capacity="lots"), InvalidInputError,
     ["capacity", "'lots'"]),
    ("estimate accum_steps='2'", lambda: memcalc.estimate("mlp", batch_size=2, accum_steps="2"), InvalidInputError,
     ["accum_steps", "'2'"]),
    ("estimate accum_steps=2.5", lambda: memcalc.estimate("mlp", batch_size=2, accum_steps=2.5), InvalidInputError,
     ["accum_steps", "2.5"]),
    ("estimate kv_cache='10'", lambda: memcalc.estimate("gpt2", batch_size=1, seq_len=8, mode="inference",
                                                         kv_cache="10"), InvalidInputError, ["kv_cache", "'10'"]),
    ("estimate kv_cache in eval", lambda: memcalc.estimate("gpt2", batch_size=1, seq_len=8, mode="eval", kv_cache=10),
     InapplicableOptionError, ["kv_cache", "needs mode inference", "eval"]),
    ("estimate checkpoint='yes'", lambda: memcalc.estimate("mlp", batch_size=2, checkpoint="yes"),
     InvalidInputError, ["checkpoint", "'yes'"]),
    ("estimate optimizer in inference", lambda: memcalc.estimate("mlp", batch_size=2, optimizer="sgd",
                                                                  mode="inference"),
     InapplicableOptionError, ["optimizer", "mode inference"]),
    ("estimate loss in eval", lambda: memcalc.estimate("mlp", batch_size=2, loss="mean", mode="eval"),
     InapplicableOptionError, ["loss", "mode eval"]),
    ("estimate optimizer='lion'", lambda: memcalc.estimate("mlp", batch_size=2, optimizer="lion"), InvalidInputError,
     ["optimizer", "'lion'"]),
    ("estimate mode='test'", lambda: memcalc.estimate("mlp", batch_size=2, mode="test"), InvalidInputError,
     ["mode", "'test'"]),
    ("estimate precision='fp8'", lambda: memcalc.estimate("mlp", batch_size=2, precision="fp8"), InvalidInputError,
     ["precision", "'fp8'"]),
    ("estimate gpu=80", lambda: memcalc.estimate("mlp", batch_size=2, gpu=80), InvalidInputError, ["gpu", "80"]),
    ("estimate loss=42", lambda: memcalc.estimate("mlp", batch_size=2, loss=42), InvalidInputError, ["loss", "int"]),
    ("estimate distributed='ddp'", lambda: memcalc.estimate("mlp", batch_size=2, distributed="ddp"),
     InvalidInputError, ["distributed", "memcalc.Distributed"]),
    ("estimate inputs of batch 4, batch_size=8",
     lambda: memcalc.estimate("mlp", batch_size=8, inputs=torch.zeros(4, 784)), InvalidInputError,
     ["batch_size=8", "inputs", "is 4"]),
    ("estimate failing loss", lambda: memcalc.estimate("mlp", batch_size=2, loss=_raising_loss), LossFunctionError,
     ["loss function _raising_loss", "raised ValueError: my bug"]),
    ("estimate loss returning a float", lambda: memcalc.estimate("mlp", batch_size=2, loss=_float_loss),
     LossFunctionError, ["loss function _float_loss", "returned float"]),
    ("estimate loss not reduced", lambda: memcalc.estimate("mlp", batch_size=2, loss=_unreduced_loss),
     LossFunctionError, ["loss function _unreduced_loss", "shape (2, 10)"]),
    ("Distributed world_size='8'", lambda: memcalc.Distributed("ddp", world_size="8"), InvalidInputError,
     ["world_size", "'8' (str)"]),
    ("Distributed world_size=2.0", lambda: memcalc.Distributed("ddp", world_size=2.0), InvalidInputError,
     ["world_size", "2.0 (float)"]),
    ("Distributed bucket_cap_mb='x'", lambda: memcalc.Distributed("ddp", world_size=2, bucket_cap_mb="x"),
     InvalidInputError, ["bucket_cap_mb", "'x'"]),
    ("Distributed reduce_bucket_size='x'", lambda: memcalc.Distributed("zero2", world_size=2, reduce_bucket_size="x"),
     InvalidInputError, ["reduce_bucket_size", "'x'"]),
    ("Distributed device_ids=3", lambda: memcalc.Distributed("dp", device_ids=3), InvalidInputError,
     ["device_ids", "3"]),
    ("Distributed bucket_cap_mb on one GPU", lambda: memcalc.Distributed(bucket_cap_mb=10),
     InapplicableOptionError, ["bucket_cap_mb", "only to strategy ddp", "strategy single"]),
    ("Distributed sharding with zero3", lambda: memcalc.Distributed("zero3", world_size=2, sharding="shard_grad_op"),
     InapplicableOptionError, ["sharding", "only to strategy fsdp", "strategy zero3"]),
    ("Distributed reduce_bucket_size with ddp", lambda: memcalc.Distributed("ddp", world_size=2,
                                                                           reduce_bucket_size=10),
     InapplicableOptionError, ["reduce_bucket_size", "zero1, zero2 or zero3"]),
    ("Distributed batch_is_global on one GPU", lambda: memcalc.Distributed(batch_is_global=True),
     InapplicableOptionError, ["batch_is_global", "multi-GPU"]),
    ("max_batch_size unknown keyword", lambda: memcalc.max_batch_size("mlp", gpu="t4", seq_length=8),
     InvalidInputError, ["max_batch_size()", "'seq_length'", "did you mean 'seq_len'"]),
    ("max_batch_size max_batch='10'", lambda: memcalc.max_batch_size("mlp", gpu="t4", max_batch="10"),
     InvalidInputError, ["max_batch", "'10'"]),
    ("max_batch_size neighbours=-1", lambda: memcalc.max_batch_size("mlp", gpu="t4", neighbours=-1),
     InvalidInputError, ["neighbours", "-1"]),
    ("max_batch_size batch_size=4", lambda: memcalc.max_batch_size("mlp", gpu="t4", batch_size=4),
     InvalidInputError, ["batch_size", "the search sets"]),
    ("max_batch_size no budget", lambda: memcalc.max_batch_size("mlp"), InvalidInputError,
     ["budget, gpu or device"]),
    ("max_batch_size gpu=3", lambda: memcalc.max_batch_size("mlp", gpu=3), InvalidInputError, ["gpu", "3"]),
    ("max_batch_size budget='x'", lambda: memcalc.max_batch_size("mlp", budget="x"), InvalidInputError,
     ["budget", "'x'"]),
    ("max_batch_size device='banana'", lambda: memcalc.max_batch_size("mlp", device="banana"), InvalidInputError,
     ["device 'banana' is not a device spec"]),
    ("max_batch_size device='cpu'", lambda: memcalc.max_batch_size("mlp", device="cpu"), InvalidInputError,
     ["device 'cpu' is not a device spec", "a CUDA GPU of this machine", "--gpu cpu"]),
    ("max_batch_size device=0", lambda: memcalc.max_batch_size("mlp", device=0), InvalidInputError,
     ["device 0 is not a device spec"]),
    ("max_batch_size optimizer in eval", lambda: memcalc.max_batch_size("mlp", gpu="t4", optimizer="adam",
                                                                        mode="eval"),
     InapplicableOptionError, ["optimizer", "mode eval"]),
    ("sweep batch_sizes=64", lambda: memcalc.sweep("mlp", batch_sizes=64), InvalidInputError,
     ["batch_sizes", "must be a list"]),
    ("sweep batch_sizes='64'", lambda: memcalc.sweep("mlp", batch_sizes="64"), InvalidInputError,
     ["batch_sizes", "must be a list"]),
    ("sweep batch_sizes=[0]", lambda: memcalc.sweep("mlp", batch_sizes=[0]), InvalidInputError,
     ["batch_sizes", "0"]),
    ("sweep optimizers='adam'", lambda: memcalc.sweep("mlp", batch_sizes=[1], optimizers="adam"), InvalidInputError,
     ["optimizers", "must be a list"]),
    ("sweep precisions=['fp8']", lambda: memcalc.sweep("mlp", batch_sizes=[1], precisions=["fp8"]),
     InvalidInputError, ["precision", "'fp8'"]),
    ("sweep unknown keyword", lambda: memcalc.sweep("mlp", batch_sizes=[1], foo=1), InvalidInputError,
     ["sweep()", "'foo'"]),
    ("sweep optimizer=", lambda: memcalc.sweep("mlp", batch_sizes=[1], optimizer="sgd"), InvalidInputError,
     ["optimizer", "optimizers=[...]"]),
    ("sweep optimizers in eval", lambda: memcalc.sweep("mlp", batch_sizes=[1], optimizers=["none", "sgd"],
                                                       mode="eval"),
     InapplicableOptionError, ["optimizer", "mode eval"]),
    ("iter_sweep unknown keyword", lambda: memcalc.iter_sweep("mlp", batch_sizes=[1], inputs=torch.zeros(1, 784)),
     InvalidInputError, ["iter_sweep() does not take inputs", "input_shape or seq_len"]),
]


@pytest.mark.parametrize("call, error, fragments", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input_raises_a_memcalc_error_naming_the_argument(call, error, fragments):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MemcalcError) as caught:
            call()
    assert isinstance(caught.value, error), repr(caught.value)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message


def test_the_api_battery_covers_every_public_function():
    names = {case[0].split()[0] for case in API_CASES}
    assert names == {"estimate", "max_batch_size", "sweep", "iter_sweep", "Distributed"}


def test_a_capacity_string_is_read_like_the_cli_budget():
    report = memcalc.estimate("mlp", batch_size=2, capacity="16GiB")
    assert report.capacity == 16 * 1024**3 and report.fits is True


def test_inputs_with_the_same_batch_as_batch_size_are_accepted():
    report = memcalc.estimate("mlp", batch_size=4, inputs=torch.zeros(4, 784))
    assert report.batch_size == 4


def test_a_failing_loss_is_blamed_on_the_loss_not_on_the_input():
    with pytest.raises(LossFunctionError) as caught:
        memcalc.estimate("mlp", batch_size=2, loss=_raising_loss)
    message = str(caught.value)
    assert "--input-shape" not in message and "the forward of" not in message
    assert caught.value.exit_code == 2
    assert isinstance(caught.value.__cause__, ValueError)  # the user's own exception, for --debug


# ============================================================================================
# Huge figures: units beyond GiB, a note when no GPU holds the step
# ============================================================================================


def test_units_go_up_to_exbibytes():
    assert format_bytes(86_708_136_333_288_960) == "77.01 PiB"  # 86,708,136,333,288,960 / 1024**5
    assert format_bytes(2 * 1024**4) == "2.00 TiB"
    assert format_bytes(3 * 1024**6) == "3.00 EiB"
    assert format_bytes(1023 * 1024**3) == "1,023.00 GiB"  # below 1 TiB stays in GiB
    assert format_bytes(5 * 1024**5, "TiB") == "5,120.00 TiB"
    assert parse_bytes("1.5PiB") == 3 * 1024**5 // 2 and parse_bytes("2PB") == 2 * 1000**5


def test_a_step_no_gpu_holds_says_so():
    largest = max(catalogue(), key=lambda g: g.usable_memory or 0)
    with pytest.warns(UserWarning, match="no GPU in the catalogue holds this step"):
        report = memcalc.estimate("mlp", batch_size=10**9)
    peak = report.bytes.peak_allocated
    assert peak > largest.usable_memory
    note = next(n for n in report.notes if n.startswith("no GPU in the catalogue"))
    assert format_bytes(peak) in note and largest.name in note and format_bytes(largest.usable_memory) in note
    assert format_bytes(peak).endswith(" TiB")  # 10⁹ samples of the mlp: tens of TiB, not thousands of GiB


def test_a_step_that_fits_some_gpu_has_no_such_note():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        report = memcalc.estimate("mlp", batch_size=64)
    assert not any("no GPU in the catalogue" in n for n in report.notes)


def test_cli_shows_the_note_and_the_large_unit():
    result = CliRunner().invoke(main, ["mlp", "--batch", "1000000000", "--depth", "0"])
    assert result.exit_code == 0, result.output
    assert "note: no GPU in the catalogue holds this step" in result.output
    assert " TiB" in result.output and "18,224.16 GiB" not in result.output


# ============================================================================================
# --plot: checked first, written whole or not at all, drawn in the README figure's style
# ============================================================================================


def test_plot_check_names_the_path_and_the_formats(tmp_path):
    pytest.importorskip("matplotlib")
    from memcalc.report.plot import check_plot_path

    with pytest.raises(PlotPathError, match=r"memory\.xyz.*\.png.*\.svg"):
        check_plot_path(tmp_path / "memory.xyz")
    missing = tmp_path / "nowhere" / "memory.png"
    with pytest.raises(PlotPathError, match=f"the folder {tmp_path / 'nowhere'} does not exist"):
        check_plot_path(missing)
    assert check_plot_path(tmp_path / "memory.PDF") == (tmp_path / "memory.PDF", "pdf")
    assert list(tmp_path.iterdir()) == []


def test_plot_is_checked_before_the_sweep(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from memcalc import api

    def must_not_run(*args, **kwargs):
        raise AssertionError("the sweep ran before the plot path was checked")

    monkeypatch.setattr(api, "iter_sweep", must_not_run)
    result = CliRunner().invoke(main, ["sweep", "mlp", "--batch", "1", "--plot", str(tmp_path / "no" / "m.png")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "no").exists()


_BATCHES = [1, 1024, 2048, 4096, 8192]


def _points():
    # a budget the mlp crosses between batch 4096 (138 / 170 MiB reserved with SGD / Adam) and
    # 8192 (260 / 292 MiB)
    return memcalc.sweep("mlp", batch_sizes=_BATCHES, optimizers=["sgd", "adam"], budget="176MiB")


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from memcalc.report.plot import plot_sweep

    def half_then_fail(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(PlotPathError, match=r"memory\.png: OSError: disk full"):
        plot_sweep(_points(), tmp_path / "memory.png")
    assert list(tmp_path.iterdir()) == []


def test_plot_writes_only_the_file(tmp_path):
    pytest.importorskip("matplotlib")
    from memcalc.report.plot import plot_sweep

    path = plot_sweep(_points(), tmp_path / "memory.svg")
    assert path == tmp_path / "memory.svg" and path.read_text().lstrip().startswith("<?xml")
    assert sorted(os.listdir(tmp_path)) == ["memory.svg"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not a private temporary's 0600


def test_sweep_plot_style_is_linear_with_budget_and_largest_fitting_batch():
    pytest.importorskip("matplotlib")
    from memcalc.report.plot import sweep_figure

    points = _points()
    budget = points[0].report.capacity
    assert budget == 176 * 1024**2
    figure = sweep_figure(points, capacity=budget, capacity_label="budget: 176 MiB")
    axes = figure.axes[0]
    assert axes.get_xscale() == "linear" and axes.get_yscale() == "linear"  # affine growth looks affine
    assert axes.get_xlim()[0] == 0 and axes.get_ylim()[0] == 0
    assert axes.get_ylabel() == "peak allocated (MiB, binary)"  # the unit of the largest figure (227 MiB)
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines["budget: 176 MiB"].get_ydata()) == [176.0, 176.0]  # the budget, drawn across
    for optimizer in ("sgd", "adam"):
        series = [p for p in points if p.optimizer == optimizer]
        assert [p.fits for p in series] == [True, True, True, True, False]
        mark = lines[f"{optimizer}: batch 4096, the largest swept that fits"]
        assert list(mark.get_xdata()) == [4096]
        assert list(mark.get_ydata()) == [series[3].report.bytes.peak_allocated / 1024**2]
        assert list(lines[optimizer].get_xdata()) == _BATCHES


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this backward cannot run")


class _ModelFailingInBackward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailsInBackward.apply(self.linear(x))


def test_a_failure_past_the_forward_names_its_phase_and_does_not_only_blame_the_input() -> None:
    # issue 22: a failure inside the step was reported as "the forward ... failed", blaming the input
    with pytest.raises(memcalc.InvalidInputError) as info:
        memcalc.estimate(_ModelFailingInBackward(), inputs=torch.randn(4, 8), loss="mean")
    assert "the backward of" in str(info.value) and "this backward cannot run" in str(info.value)
    assert "--debug" in (info.value.hint or "") and "model's code" in (info.value.hint or "")


# ============================================================================================
# Issue 32: values checked up front — counts beyond int64, shapes with a bad part, a budget
# without its unit, the Trainer's arguments before the model, Hugging Face configs transformers
# cannot build, model names that point nowhere, spellings of other tools
# ============================================================================================

_BAD_CONFIGS = FIXTURES / "hf_configs" / "bad"
_BIG = 10**30  # beyond int64: torch's C++ argument parser refuses it with its frames

# (arguments, exit code): every one is bad input (2), the README's exit-code table. What each
# prints is its golden file, tests/golden/bad_input_checked_up_front[ARGUMENTS].out.
CHECKED_UP_FRONT: list[tuple[str, int]] = [
    (f"mlp --batch {_BIG}", 2),
    (f"mlp --batch {2**63}", 2),  # one past int64
    (f"mlp --batch {2**62}", 2),  # fits int64, but 2**62 × 784 input elements do not
    (f"mlp --input-shape {10**20}", 2),
    (f"mlp --accum-steps {_BIG}", 2),
    (f"mlp --strategy ddp --world-size {_BIG}", 2),
    ("mlp --strategy ddp --world-size 2 --bucket-cap-mb inf", 2),
    ("mlp --input-shape 3,x,224", 2),
    ("mlp --input-shape 3,224,224,", 2),
    ("fit mlp --budget 10", 2),  # 10 what? not 10 bytes
    ("mlp --training-args missing.json", 2),
    (f"mlp --training-args {FIXTURES}/trainer_args_typo.json", 2),
    (f"hf:{_BAD_CONFIGS}/heads-0.json", 2),
    (f"hf:{_BAD_CONFIGS}/layers-minus-1.json", 2),
    (f"hf:{_BAD_CONFIGS}/hidden-size-string.json", 2),
    (f"hf:{_BAD_CONFIGS}/dtype-unknown.json", 2),
    (f"hf:{_BAD_CONFIGS}/t5-no-decoder-start.json", 2),
    (f"hf:{_BAD_CONFIGS}/architecture-unknown.json", 2),
    ("nosuchpkg.mod:make", 2),
    (f"{FIXTURES}/user_models.py", 2),  # which factory? those the file defines
    (f"compare {FIXTURES}/random_bytes.pickle mlp", 2),
    ("mlp --json", 2),
    ("fit mlp --gpu t4 --json", 2),
]


@pytest.mark.parametrize("args, exit_code", CHECKED_UP_FRONT, ids=[_case_id(c[0]) for c in CHECKED_UP_FRONT])
def test_bad_input_checked_up_front(args, exit_code, no_local_gpus, tmp_path, monkeypatch, golden):
    if args.startswith("hf:") or "--training-args" in args:
        pytest.importorskip("transformers")
    golden(_run_bad_input(args, exit_code, tmp_path, monkeypatch))


def test_the_training_arguments_file_is_read_before_transformers_is_imported(monkeypatch, tmp_path):
    # issue 32: a missing file took 12-15 s to report, the time of importing transformers and more
    from memcalc.stacks.transformers import training_args

    def no_import(*args, **kwargs):
        raise AssertionError("transformers was imported before the file was read")

    monkeypatch.setattr(training_args, "import_hf", no_import)
    with pytest.raises(InvalidInputError, match="training arguments file not found"):
        memcalc.estimate("mlp", trainer_args=str(tmp_path / "missing.json"))


# (id, call, exception class, fragments of the message)
API_CHECKED_UP_FRONT = [
    ("estimate batch_size=2**62", lambda: memcalc.estimate("mlp", batch_size=2**62), InvalidInputError,
     ["batch_size", "4,611,686,018,427,387,904 × 784", "more than a tensor can hold (2**63 - 1 B)"]),
    ("estimate batch_size=2**63", lambda: memcalc.estimate("mlp", batch_size=2**63), InvalidInputError,
     ["batch_size", "at most 9,223,372,036,854,775,807", "got 9,223,372,036,854,775,808"]),
    ("estimate seq_len=2**62", lambda: memcalc.estimate("gpt2", batch_size=4, seq_len=2**62), InvalidInputError,
     ["batch_size", "4 × 4,611,686,018,427,387,904", "8 B"]),
    ("estimate accum_steps=10**30", lambda: memcalc.estimate("mlp", batch_size=2, accum_steps=_BIG),
     InvalidInputError, ["accum_steps", "at most", "2**63 - 1"]),
    ("estimate input_shape=(10**20,)", lambda: memcalc.estimate("mlp", batch_size=2, input_shape=(10**20,)),
     InvalidInputError, ["input_shape", "100,000,000,000,000,000,000 is more than"]),
    ("estimate kv_cache=10**30", lambda: memcalc.estimate("gpt2", batch_size=1, seq_len=8, mode="inference",
                                                          kv_cache=_BIG), InvalidInputError, ["kv_cache", "at most"]),
    ("Distributed world_size=10**30", lambda: memcalc.Distributed("ddp", world_size=_BIG), InvalidInputError,
     ["world_size", "at most 1,048,576"]),
    ("Distributed bucket_cap_mb=inf", lambda: memcalc.Distributed("ddp", world_size=2, bucket_cap_mb=float("inf")),
     InvalidInputError, ["bucket_cap_mb", "at most 8,796,093,022,207", "got inf"]),
    ("Distributed reduce_bucket_size=2**63", lambda: memcalc.Distributed("zero2", world_size=2,
                                                                          reduce_bucket_size=2**63),
     InvalidInputError, ["reduce_bucket_size", "2**63 - 1"]),
    ("estimate trainer_args with a typo", lambda: memcalc.estimate("mlp", trainer_args={
        "gradient_accumulaton_steps": 4}), InvalidInputError,
     ["'gradient_accumulaton_steps'", "did you mean 'gradient_accumulation_steps'?"]),
    ("estimate a module that is not there", lambda: memcalc.estimate("nosuchpkg.mod:make", batch_size=1),
     memcalc.UnknownModelError, ["'nosuchpkg.mod:make'", "no module named 'nosuchpkg'"]),
]


@pytest.mark.parametrize("call, error, fragments", [c[1:] for c in API_CHECKED_UP_FRONT],
                         ids=[c[0] for c in API_CHECKED_UP_FRONT])
def test_api_bad_value_checked_up_front(call, error, fragments):
    if any("gradient_accumulaton" in fragment for fragment in fragments):
        pytest.importorskip("transformers")
    with pytest.raises(MemcalcError) as caught:
        call()
    assert isinstance(caught.value, error), repr(caught.value)
    assert caught.value.exit_code == 2
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message


def test_numpy_integers_are_integers():
    np = pytest.importorskip("numpy")
    report = memcalc.estimate("mlp", batch_size=np.int64(4), accum_steps=np.int32(2))
    assert report.batch_size == 4 and type(report.batch_size) is int
    assert memcalc.Distributed("ddp", world_size=np.int64(2)).world_size == 2
    assert memcalc.estimate("mlp", batch_size=2, input_shape=(np.int64(784),)).batch_size == 2
    assert [point.batch_size for point in memcalc.sweep("mlp", batch_sizes=[np.int64(2)])] == [2]
    with pytest.raises(InvalidInputError, match="batch_size"):
        memcalc.estimate("mlp", batch_size=np.bool_(True))  # a truth value is no count


def test_a_shape_spelled_with_x_still_reads():
    from memcalc.cli.options import ShapeType

    assert ShapeType().convert("3x224x224", None, None) == (3, 224, 224)
    assert ShapeType().convert("(3, 224, 224)", None, None) == (3, 224, 224)


def test_the_largest_batch_that_fits_int64_is_let_through_to_the_estimate():
    # 2**63 - 1 B of int64 token ids hold (2**63 - 1) // 8 of them: batch × seq_len at that bound
    from memcalc.sources.inputs import check_batch_fits

    check_batch_fits((2**63 - 1) // 8, (1,), tokens=True)
    with pytest.raises(InvalidInputError, match="too large"):
        check_batch_fits((2**63 - 1) // 8 + 1, (1,), tokens=True)
    check_batch_fits((2**63 - 1) // 4 // 784, (784,), tokens=False)
    with pytest.raises(InvalidInputError, match="too large"):
        check_batch_fits((2**63 - 1) // 4 // 784 + 1, (784,), tokens=False)


def test_an_unreadable_training_arguments_file_is_named(tmp_path):
    binary = tmp_path / "args.json"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(InvalidInputError, match=r"args\.json cannot be read: UnicodeDecodeError"):
        memcalc.estimate("mlp", trainer_args=str(binary))


# Bytes on which pickle raises each of its errors (found by feeding it random bytes): each is
# "not a snapshot pickle", exit 2, never a traceback.
_NOT_PICKLES = {
    "UnpicklingError": b"b\xc2",
    "ValueError": b"\x82?",  # unregistered extension code 63
    "OverflowError": b"\x8d\x16/\x9f f\xc9@\xf4z",  # a BINUNICODE8 longer than 2**63 - 1 bytes
    "UnicodeDecodeError": b"\x80\x04cd2\x06\x9a)\xc9\x0fjlU\xe5m\xcd\xb8a\nD\xecy\xa9\xf3\x92\x97\x03",
    "MemoryError": b"\x80\x04\x96\xab\xbc\xbb\xe5\x00\x15\xf1i\xc5E5\x1dV<U\xcc",  # a BYTEARRAY8 of exabytes
    "EOFError": b"\x80\x04\x88",
    "a pickle of a list": b"\x80\x04]\x94.",
}


@pytest.mark.parametrize("data", list(_NOT_PICKLES.values()), ids=list(_NOT_PICKLES))
def test_compare_on_bytes_that_are_not_a_snapshot_says_so(data, tmp_path):
    path = tmp_path / "run.pickle"
    path.write_bytes(data)
    result = CliRunner().invoke(main, ["compare", str(path), "mlp"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    output = result.output.replace(_CPYTHON_BYTEARRAY_LINE, "")
    assert output.startswith(f"error: {path} is not a torch.cuda.memory._snapshot() pickle ("), result.output


#: What CPython 3.11 itself prints (bytearray_dealloc, through PyErr_Print) when the bytearray the
#: failed BYTEARRAY8 load left with an exported buffer is freed: by the cyclic collector, whenever it
#: runs, so inside the command's captured output or not depending on what was imported before.
_CPYTHON_BYTEARRAY_LINE = "SystemError: deallocated bytearray object has exported buffers\n"


def test_a_mistyped_factory_is_answered_with_the_closest_the_file_defines():
    with pytest.raises(ModelSourceError) as caught:
        memcalc.estimate(f"{FIXTURES}/user_models.py:make_mpl", batch_size=1)
    assert "has no attribute 'make_mpl'; did you mean 'make_mlp'?" in str(caught.value)
    # the file's own factories, not what it imported (torch, nn) nor example_inputs
    assert caught.value.hint == ("Factories defined there (callables that take no argument): make_mlp, "
                                 "ValueBranching, make_branching, make_not_a_module, make_raises, make_wrong_width.")


def test_an_activation_past_int64_bytes_blames_the_batch():
    # the input (B, 784) fp32 fits 2**63 - 1 bytes, the first Linear's output (B, 1024) does not
    batch = (2**63 - 1) // 4 // 784
    assert batch * 1024 * 4 > 2**63 - 1
    with pytest.raises(InvalidInputError) as caught:
        memcalc.estimate("mlp", batch_size=batch)
    assert f"sizes=[{batch}, 1024]" in str(caught.value)
    assert "A tensor of these sizes would hold more than 2**63 - 1 bytes" in (caught.value.hint or "")
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("call, message, hint", [
    (lambda: memcalc.estimate("mlp", mesh="pp=2"), "estimate() has no argument 'mesh'",
     "distributed=memcalc.Distributed(dp_shard=8, tp=2) (the CLI's --mesh"),
    (lambda: memcalc.estimate("mlp", optimiser="adam"), "estimate() has no argument 'optimiser'",
     "did you mean optimizer=?; see help(memcalc.estimate)"),
    (lambda: memcalc.max_batch_size("mlp", gpu="t4", strategy="ddp"),
     "max_batch_size() got an unknown argument 'strategy'", "(the CLI's --strategy)"),
    (lambda: memcalc.estimate("mlp", 8, 16), "estimate(): too many positional arguments",
     "see help(memcalc.estimate)"),
])
def test_a_call_its_signature_refuses_is_the_callers_mistake(call, message, hint):
    """Python's own TypeError for an unknown keyword used to leave the API as "internal error in memcalc,
    please report it"; it is the caller's mistake, named with the closest keyword (or the API's form of the
    CLI's option), before any model is resolved."""
    with pytest.raises(InvalidInputError) as raised:
        call()
    assert str(raised.value).splitlines()[0] == message
    assert hint in str(raised.value)


def test_a_type_error_from_inside_a_call_that_fits_stays_an_internal_error(monkeypatch):
    """The signature is read only to tell the caller's mistake from memcalc's: a TypeError raised inside
    an estimate whose call fits the signature is still reported as memcalc's."""
    import memcalc.api as api
    from memcalc.core.errors import InternalError

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise TypeError("unsupported operand type(s)")

    monkeypatch.setattr(api, "estimate_step", broken)
    with pytest.raises(InternalError, match="please report it: TypeError: unsupported operand"):
        memcalc.estimate("mlp")
