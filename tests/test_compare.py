"""``memcalc compare``: a real H100 snapshot (tests/data/gpu/2026-11-25-h100) beside memcalc's step."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.measure.snapshot import load_snapshot, read_snapshot
from memcalc.measure.snapshot_compare import compare_snapshot, real_phase
from memcalc.measure.snapshot_export import snapshot_dict

DATA = Path(__file__).parent / "data" / "gpu" / "2026-11-25-h100"
STEM = "resnet18-b1-sgd"
# the run's configuration: resnet18, batch 1, SGD, fp32, on the H100 with torch 2.11 (env.txt)
OPTIONS = ["resnet18", "--batch", "1", "--optim", "sgd", "--gpu", "h100-80gb", "--torch-version", "2.11"]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compare")
    with tarfile.open(DATA / "snapshots.tar.xz") as archive:
        archive.extractall(folder, members=[archive.getmember(f"{STEM}.pickle"), archive.getmember(f"{STEM}.json")],
                           filter="data")
    return folder / f"{STEM}.pickle"


def test_phases_from_the_stack() -> None:
    assert real_phase(()) == "backward"  # the autograd engine's thread runs no Python
    assert real_phase(("site-packages/torch/optim/sgd.py:100 _single_tensor_sgd",)) == "optimizer"
    assert real_phase(("site-packages/torch/nn/functional.py:3504 cross_entropy", "memcalc/engine/losses.py:66 f")) \
        == "loss"
    assert real_phase(("site-packages/torch/nn/modules/conv.py:548 _conv_forward",
                       "site-packages/torch/nn/modules/conv.py:553 forward")) == "forward"
    assert real_phase(("models_zoo/resnet.py:30 __init__",)) == "setup"


def test_comparison_of_a_real_snapshot(snapshot: Path) -> None:
    real = load_snapshot(snapshot)
    report = memcalc.estimate("resnet18", batch_size=1, optimizer="sgd", gpu="h100-80gb",
                              stack=memcalc.Stack(torch="2.11"))
    comparison = compare_snapshot(real, report)
    measured = json.loads(snapshot.with_suffix(".json").read_text())
    # the run's peak reserved is the one it reported; memcalc's are its report's
    assert comparison.real_peak_reserved == measured["peak_reserved"] == 207_618_048
    assert (comparison.memcalc_peak_allocated, comparison.memcalc_peak_reserved) == (
        report.bytes.peak_allocated, report.peak_reserved)
    # the run's own stream through the allocator model reserves what the run did: the whole
    # reserved difference is memcalc's stream
    assert comparison.allocator_part == 0
    assert comparison.stream_part == comparison.reserved_difference == report.peak_reserved - 207_618_048
    # every allocation of the trace is in one phase; 637 allocs in the trace
    assert sum(p.real_count for p in comparison.phases) == len(real.allocations) == 637
    assert [p.phase for p in comparison.phases] == ["setup", "forward", "loss", "backward"]
    # listed differences are the largest, each side's rows sorted by bytes
    for rows, total in ((comparison.missing, comparison.missing_total), (comparison.extra, comparison.extra_total)):
        assert [d.nbytes for d in rows] == sorted((d.nbytes for d in rows), reverse=True)
        assert 0 < sum(d.nbytes for d in rows) <= total
    # what it shows: memcalc's cuDNN workspaces are not the sizes cuDNN 9.19 chose on the H100
    assert any("cuDNN convolution workspace" in d.site for d in comparison.extra)
    assert any(d.site == "(autograd engine thread)" for d in comparison.missing)


def test_compare_resnet18_b1_h100(snapshot: Path, golden) -> None:
    # the golden file's name is the README's link to this output
    result = CliRunner().invoke(main, ["compare", str(snapshot), *OPTIONS])
    assert result.exit_code == 0, result.output
    golden(result.output)
    data = json.loads(CliRunner().invoke(main, ["compare", str(snapshot), *OPTIONS, "--format", "json"]).stdout)
    assert data["real_peak_reserved"] == 207_618_048 and data["allocator_part"] == 0


def test_compare_refuses_what_is_not_a_snapshot(tmp_path: Path) -> None:
    bogus = tmp_path / "run.pickle"
    bogus.write_bytes(b"not a pickle")
    result = CliRunner().invoke(main, ["compare", str(bogus), "resnet18"])
    assert result.exit_code != 0
    assert "is not a torch.cuda.memory._snapshot() pickle" in result.output


# ---- memcalc's own --snapshot, and snapshots of another model (issue 32, item 7) -------------------
def _own_snapshot(model: str, **options: object):
    return read_snapshot(snapshot_dict(memcalc.estimate(model, **options)))


def test_phases_from_memcalc_frames() -> None:
    assert real_phase(("<memcalc>:0 forward 1 aten.addmm.default",)) == "forward"
    assert real_phase(("<memcalc>:0 optimizer aten.zeros_like.default",)) == "optimizer"


def test_compare_of_memcalcs_own_snapshot_finds_no_difference() -> None:
    # before: the peaks agreed, then every block was filed under "setup" on the run's side and
    # listed as a difference (41 GiB on a large model)
    real = _own_snapshot("mlp", batch_size=8)
    comparison = compare_snapshot(real, memcalc.estimate("mlp", batch_size=8))
    assert comparison.real_peak_allocated == comparison.memcalc_peak_allocated
    assert comparison.reserved_difference == 0 and comparison.allocator_part == 0
    assert comparison.missing == comparison.extra == () and comparison.missing_total == comparison.extra_total == 0
    assert [p.phase for p in comparison.phases] == ["setup", "forward", "loss", "backward", "optimizer"]
    assert all((p.real_count, p.real_bytes) == (p.memcalc_count, p.memcalc_bytes) for p in comparison.phases)
    assert comparison.mismatch is None


def test_compare_warns_of_a_memcalc_snapshot_of_another_model(tmp_path: Path) -> None:
    path = tmp_path / "mlp.pickle"
    assert CliRunner().invoke(main, ["mlp", "--batch", "8", "--snapshot", str(path)]).exit_code == 0
    result = CliRunner().invoke(main, ["compare", str(path), "fc-32-16", "--batch", "8"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()[:2]
    assert first.startswith("warning: this memcalc snapshot is not of fc-32-16's step: ") and second == ""
    # the same model at another batch makes the same frames: sizes differ, not modules
    assert CliRunner().invoke(main, ["compare", str(path), "mlp", "--batch", "2"]).output.startswith(" ")


@pytest.mark.parametrize("model", ["mlp", "resnet50"])
def test_compare_warns_of_a_real_snapshot_of_another_model(snapshot: Path, model: str) -> None:
    # resnet18's run against mlp (only torch's modules) and against resnet50 (the same file,
    # but Bottleneck where the run's forward ran BasicBlock)
    result = CliRunner().invoke(main, ["compare", str(snapshot), model, "--batch", "1", "--optim", "sgd",
                                       "--gpu", "h100-80gb", "--format", "json"])
    assert result.exit_code == 0, result.output
    mismatch = json.loads(result.stdout)["mismatch"]
    assert mismatch.startswith(f"this snapshot's forward runs code that is not {model}'s (models_zoo/resnet.py:")
