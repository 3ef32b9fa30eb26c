"""Never lose a user's file (issue 32): every file memcalc writes — ``--timeline``,
``--snapshot``, ``--measure-snapshot``, ``sweep --plot``, and their Python functions — refuses
to replace an existing file unless ``--force`` (``force=True``) is given, and its path is
checked before the estimate: a file that cannot be written costs no estimate, and its error
names the user's path, never memcalc's temporary file."""

from __future__ import annotations

import os
import pickle
import secrets
from pathlib import Path

import pytest
from click.testing import CliRunner

import memcalc
from memcalc import api
from memcalc.cli import main
from memcalc.core.errors import OutputExistsError, PlotPathError
from memcalc.core.output import check_writable, write_atomically

#: What a user's file holds before memcalc is pointed at it: compared byte for byte after.
USERS_BYTES = b"the user's own file\x00\xff, not memcalc's\n"

#: Each option that writes a file: (the command line before it, the option, the file name, what
#: the error calls it). ``--measure-snapshot`` is checked before its "no CUDA GPU" refusal.
WRITERS = {
    "timeline": (["mlp"], "--timeline", "step.html", "timeline"),
    "snapshot": (["mlp"], "--snapshot", "step.pickle", "snapshot"),
    "measure-snapshot": (["mlp"], "--measure-snapshot", "run.pickle", "snapshot"),
    "plot": (["sweep", "mlp", "--batch", "1"], "--plot", "memory.svg", "plot"),
}


@pytest.fixture
def no_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any estimate (one step, or a sweep) fails the test: the path must be refused first."""

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("an estimate ran before the output path was checked")

    monkeypatch.setattr(api, "estimate_step", must_not_run)
    monkeypatch.setattr(api, "iter_sweep", must_not_run)


def _invoke(case: str, path: Path, *extra: str) -> tuple[int, str]:
    before, option, _name, _what = WRITERS[case]
    if case == "plot":
        pytest.importorskip("matplotlib")
    result = CliRunner().invoke(main, [*before, option, str(path), *extra])
    return result.exit_code, result.output


@pytest.mark.parametrize("case", list(WRITERS))
def test_an_existing_file_is_refused_before_the_estimate(case: str, tmp_path: Path, no_estimate: None) -> None:
    _before, _option, name, what = WRITERS[case]
    path = tmp_path / name
    path.write_bytes(USERS_BYTES)
    exit_code, output = _invoke(case, path)
    assert exit_code == 2, output
    assert output == (f"error: cannot write the {what} to {path}: the file exists; --force overwrites it "
                      f"(force=True in Python)\n")
    assert path.read_bytes() == USERS_BYTES
    assert os.listdir(tmp_path) == [name]  # no temporary or probe file left beside it


def _is_html(data: bytes) -> bool:
    return data.lstrip().lower().startswith(b"<!doctype html")


def _is_snapshot(data: bytes) -> bool:
    return set(pickle.loads(data)) == {"segments", "device_traces"}


def _is_svg(data: bytes) -> bool:
    return data.lstrip().startswith(b"<?xml")


@pytest.mark.quick_cases("timeline-_is_html", "snapshot-_is_snapshot")  # the plot draws for a second
@pytest.mark.parametrize(("case", "written"), [("timeline", _is_html), ("snapshot", _is_snapshot),
                                               ("plot", _is_svg)])
def test_force_overwrites(case: str, written: object, tmp_path: Path) -> None:
    _before, _option, name, _what = WRITERS[case]
    path = tmp_path / name
    path.write_bytes(USERS_BYTES)
    exit_code, output = _invoke(case, path, "--force")
    assert exit_code == 0, output
    assert f"wrote {path}" in output
    assert callable(written) and written(path.read_bytes())
    assert os.listdir(tmp_path) == [name]


@pytest.fixture
def refusing_folder(tmp_path: Path) -> Path:
    """A folder that exists and refuses new files: a read-only one, or (as root, whom permission
    bits do not stop) /sys, which refuses even root. Permission bits alone are not the test:
    the folder is tried with a real file."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (folder, Path("/sys")):
        probe = candidate / f".probe-{secrets.token_hex(4)}"
        try:
            probe.touch(exist_ok=False)
        except OSError:
            return candidate
        probe.unlink()
    pytest.skip("no folder here refuses a new file")


@pytest.mark.parametrize("case", list(WRITERS))
def test_a_folder_that_refuses_files_is_refused_before_the_estimate(case: str, refusing_folder: Path,
                                                                   no_estimate: None) -> None:
    _before, _option, name, what = WRITERS[case]
    path = refusing_folder / name
    exit_code, output = _invoke(case, path)
    assert exit_code == 2, output
    assert output.startswith(f"error: cannot write the {what} to {path}: the folder {refusing_folder} refuses "
                             f"new files (") and output.count("\n") == 1
    assert not path.exists()


def test_snapshot_and_measure_snapshot_may_not_share_a_file(tmp_path: Path, no_estimate: None) -> None:
    path = tmp_path / "step.pickle"
    result = CliRunner().invoke(main, ["mlp", "--snapshot", str(path), "--measure-snapshot", str(path)])
    assert result.exit_code == 2 and "both name" in result.output, result.output
    assert not path.exists()


# --- the Python functions that write files --------------------------------------------------


@pytest.fixture(scope="module")
def report() -> memcalc.MemoryReport:
    return memcalc.estimate("mlp", batch_size=1)


def _timeline(report: memcalc.MemoryReport, path: Path, force: bool) -> None:
    from memcalc.report.timeline_plot import write_timeline

    write_timeline(report, path, force=force)


def _snapshot(report: memcalc.MemoryReport, path: Path, force: bool) -> None:
    from memcalc.measure.snapshot_export import write_snapshot

    write_snapshot(report, path, force=force)


def _plot(report: memcalc.MemoryReport, path: Path, force: bool) -> None:
    pytest.importorskip("matplotlib")
    from memcalc.report.plot import plot_sweep
    from memcalc.search.sweep import SweepPoint

    plot_sweep([SweepPoint(batch_size=1, optimizer="adam", precision=None, report=report)], path,
               force=force)


@pytest.mark.quick_cases("write_timeline", "write_snapshot")  # the plot draws for a second
@pytest.mark.parametrize(("write", "name", "written"), [(_timeline, "step.html", _is_html),
                                                        (_snapshot, "step.pickle", _is_snapshot),
                                                        (_plot, "memory.svg", _is_svg)],
                         ids=["write_timeline", "write_snapshot", "plot_sweep"])
def test_the_api_refuses_an_existing_file_unless_forced(write, name, written, report, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_bytes(USERS_BYTES)
    with pytest.raises(OutputExistsError, match="the file exists; --force overwrites it"):
        write(report, path, False)
    assert path.read_bytes() == USERS_BYTES
    write(report, path, True)
    assert written(path.read_bytes())
    assert os.listdir(tmp_path) == [name]


def test_measure_refuses_an_existing_snapshot_before_the_step(tmp_path: Path, monkeypatch) -> None:
    from memcalc.fields import build_step
    from memcalc.measure import step as measure_step

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the step was measured before the snapshot path was checked")

    monkeypatch.setattr(measure_step, "measure_cuda", must_not_run)
    monkeypatch.setattr(measure_step, "measure_cpu", must_not_run)
    path = tmp_path / "run.pickle"
    path.write_bytes(USERS_BYTES)
    with pytest.raises(OutputExistsError):
        measure_step.measure(build_step("mlp"), device="cuda:0", snapshot=str(path))
    assert path.read_bytes() == USERS_BYTES


def test_the_real_snapshot_is_written_whole_and_never_over_a_file(tmp_path: Path, monkeypatch) -> None:
    """``--measure-snapshot``'s write (torch's ``_dump_snapshot``, a GPU's history here replaced
    by a fixed pickle): through a temporary file, refusing a file that appeared meanwhile."""
    import torch

    from memcalc.measure import step as measure_step

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda filename: Path(filename).write_bytes(pickle.dumps({"segments": []})))
    path = tmp_path / "run.pickle"
    path.write_bytes(USERS_BYTES)  # made while the step ran
    with pytest.raises(OutputExistsError):
        measure_step._write_snapshot(str(path), force=False)
    assert path.read_bytes() == USERS_BYTES and os.listdir(tmp_path) == ["run.pickle"]
    measure_step._write_snapshot(str(path), force=True)
    assert pickle.loads(path.read_bytes()) == {"segments": []} and os.listdir(tmp_path) == ["run.pickle"]


def test_a_failed_write_names_the_users_path_not_the_temporary(tmp_path: Path) -> None:
    path = tmp_path / "step.html"

    def refused(temporary: Path) -> None:
        raise PermissionError(13, "Permission denied", str(temporary))

    with pytest.raises(PlotPathError) as caught:
        write_atomically(path, "timeline", refused)
    assert str(caught.value) == f"cannot write the timeline to {path}: permission denied"
    assert os.listdir(tmp_path) == []


def test_check_writable_leaves_no_probe_behind(tmp_path: Path) -> None:
    check_writable(tmp_path / "step.html", "timeline")
    assert os.listdir(tmp_path) == []
    (tmp_path / "step.html").mkdir()
    with pytest.raises(PlotPathError, match="it is a folder"):
        check_writable(tmp_path / "step.html", "timeline", force=True)  # force replaces files, not folders
