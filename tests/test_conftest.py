"""The shared test machinery of tests/conftest.py itself.

* The ``golden`` fixture: a missing file fails instead of passing, ``--overwrite`` writes what
  the test printed, another torch reads as the recorded one, and every file in tests/golden/
  belongs to a test that still exists.
* ``quick_cases``: the named cases stay in the quick run, the others are slow, and a name that
  matches no case is an error.
* ``--dist loadgroup``: a worker, configured by xdist's own code, puts a module fixture's users
  in one group.
* The collector, off while conftest.py imports and pytest collects, is on for the tests.
* A quick test runs on one CPU thread, a slow one or one of golden output on the process's own
  count, and the gloo ranks on their test's.
* OpenMP threads wait passively (``OMP_WAIT_POLICY``), set before anything imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import conftest
import pytest
from conftest import GOLDEN, GOLDEN_TORCH, TESTS, Golden, as_recorded, golden_name

pytest_plugins = ("pytester",)


def test_a_missing_golden_file_fails_and_says_how_to_record_it(request: pytest.FixtureRequest,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.setattr(conftest, "GOLDEN", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"no golden output .* --overwrite") as failure:
        Golden(request.node, overwrite=False)("anything")
    assert request.node.nodeid in str(failure.value)
    assert not list(tmp_path.iterdir())  # comparing never writes


def test_overwrite_writes_the_output_and_a_later_run_compares_it(request: pytest.FixtureRequest,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(conftest, "GOLDEN", tmp_path)
    monkeypatch.setattr(conftest, "_CLAIMED", {})
    Golden(request.node, overwrite=True)("line one\n")
    written = tmp_path / f"{golden_name(request.node)}.out"
    assert written.read_text() == "line one\n"
    Golden(request.node, overwrite=False)("line one\n")  # the same text passes
    with pytest.raises(AssertionError, match="output differs"):
        Golden(request.node, overwrite=False)("line two\n")


def test_one_test_cannot_compare_the_same_file_twice(request: pytest.FixtureRequest,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(conftest, "GOLDEN", tmp_path)
    monkeypatch.setattr(conftest, "_CLAIMED", {})
    golden = Golden(request.node, overwrite=True)
    golden("text")
    with pytest.raises(AssertionError, match="compared twice"):
        golden("text")
    golden("{}", suffix=".json")  # a second output under its own suffix is its own file


def test_another_torch_reads_as_the_recorded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "installed_torch", lambda: "2.11")
    text = ('assumed: torch 2.11, CUDA 13.0\n"torch_version": "2.11"\n'
            "assumed: torch 2.4's kernel rules (traced with the installed torch 2.11)\nrequires torch 2.11, or newer")
    # only where the estimate states its torch; other mentions are the output's own words
    assert as_recorded(text) == (f'assumed: torch {GOLDEN_TORCH}, CUDA 13.0\n"torch_version": "{GOLDEN_TORCH}"\n'
                                 f"assumed: torch 2.4's kernel rules (traced with the installed torch {GOLDEN_TORCH})\n"
                                 "requires torch 2.11, or newer")
    assert as_recorded(f"error in {TESTS / 'fixtures' / 'm.py'}") == "error in <tests>/fixtures/m.py"


def test_golden_names_follow_the_test_and_its_parameters() -> None:
    class Node:
        name = "test_usage_errors[mlp --batch 0]"

    assert golden_name(Node()) == "usage_errors[mlp_--batch_0]"  # type: ignore[arg-type]


def test_every_golden_file_belongs_to_a_test() -> None:
    # a test renamed or removed leaves its file behind; the file's stem names the test function
    defined = {match for path in TESTS.rglob("test_*.py")
               for match in re.findall(r"^def test_(\w+)\(", path.read_text(), flags=re.MULTILINE)}
    orphans = [path.name for path in sorted(GOLDEN.iterdir()) if path.name.split("[")[0].split(".")[0] not in defined]
    assert not orphans, f"golden files no test compares (delete them, or rename them with their test): {orphans}"


QUICK_CASES_TEST = """
import pytest

@pytest.mark.quick_cases({keep})
@pytest.mark.parametrize("n", [1, 2, 3], ids=["one", "two", "three"])
def test_family(n):
    assert n > 0
"""


def _family(pytester: pytest.Pytester, keep: str) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    quick_cases(*ids): kept in the quick run\n")
    pytester.makepyfile(QUICK_CASES_TEST.format(keep=keep))


def test_quick_cases_keeps_the_named_cases_and_marks_the_others_slow(pytester: pytest.Pytester) -> None:
    _family(pytester, '"two"')
    quick = pytester.runpytest("-m", "not slow", "-p", "no:cacheprovider", plugins=[conftest])
    quick.assert_outcomes(passed=1, deselected=2)
    slow = pytester.runpytest("-m", "slow", "-p", "no:cacheprovider", "-v", plugins=[conftest])
    slow.assert_outcomes(passed=2, deselected=1)
    slow.stdout.fnmatch_lines(["*test_family?one? PASSED*", "*test_family?three? PASSED*"])


def test_quick_cases_naming_no_case_is_an_error(pytester: pytest.Pytester) -> None:
    _family(pytester, '"four"')
    result = pytester.runpytest("-m", "not slow", "-p", "no:cacheprovider", plugins=[conftest])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_family: quick_cases names no case ?'four'?; its cases:*"])


def test_quick_cases_run_by_id_need_not_name_a_kept_case(pytester: pytest.Pytester) -> None:
    # the full suite's cases of a family, named on the command line (as a failing run lists them)
    _family(pytester, '"two"')
    result = pytester.runpytest("-p", "no:cacheprovider", "test_quick_cases_run_by_id_need_not_name_a_kept_case.py"
                                "::test_family[one]", "test_quick_cases_run_by_id_need_not_name_a_kept_case.py"
                                "::test_family[three]", plugins=[conftest])
    result.assert_outcomes(passed=2)
    renamed = pytester.runpytest("-p", "no:cacheprovider", "-m", "not slow", plugins=[conftest])
    renamed.assert_outcomes(passed=1, deselected=2)  # the whole family collected: still checked


WIDE_FIXTURE_TEST = """
import pytest

@pytest.fixture(scope="module")
def shared():
    return 1

def test_shares(shared):
    assert shared == 1

def test_alone():
    pass
"""


class _AsAnXdistWorker:
    """Configures the run as pytest-xdist configures a worker, the process that collects under
    ``-n``: xdist's own ``setup_config`` sets ``dist`` to ``"no"`` and keeps ``--dist loadgroup``
    in ``option.loadgroup``."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        remote = pytest.importorskip("xdist.remote")
        remote.setup_config(config, None)


def test_a_worker_collecting_for_loadgroup_groups_a_module_fixtures_users(pytester: pytest.Pytester) -> None:
    # the groups were lost in the workers, whose dist is "no": the gloo group and the module-fixture
    # groups split over both workers, test_gloo_pipeline.py's real runs made in each
    pytester.makepyfile(test_wide=WIDE_FIXTURE_TEST)
    worker = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "--dist", "loadgroup",
                                plugins=[conftest, _AsAnXdistWorker()])
    worker.stdout.fnmatch_lines(["test_wide.py::test_shares@test_wide.py", "test_wide.py::test_alone"])
    assert "test_alone@" not in worker.stdout.str()
    # without loadgroup (-n with --dist load, or no xdist) no id changes
    plain = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", plugins=[conftest])
    assert "@" not in plain.stdout.str()


def test_the_collector_is_on_and_what_collection_made_is_frozen() -> None:
    """conftest.py switches the cyclic collector off while the suite is imported and collected:
    it must be on again for the tests (memcalc.engine.collector pauses and restores it; a test of
    a leak needs it), with collection's objects frozen out of its passes."""
    import gc
    assert gc.isenabled()
    # this function was made when collection imported this file: frozen, it is in none of the
    # collector's generations (gc.get_objects lists those, not the permanent one)
    this = test_the_collector_is_on_and_what_collection_made_is_frozen
    assert gc.is_tracked(this) and gc.get_freeze_count() > 0
    assert not any(tracked is this for tracked in gc.get_objects())


THREADS_TEST = """
import pytest
import torch

def test_quick():
    assert torch.get_num_threads() == 1

@pytest.mark.slow
def test_slow():
    assert torch.get_num_threads() == 3

def test_golden_output(golden):
    assert torch.get_num_threads() == 3

def test_quick_again():
    assert torch.get_num_threads() == 1

@pytest.mark.slow
def test_given_back():
    assert torch.get_num_threads() == 3
"""


def test_a_quick_test_runs_on_one_thread_and_gives_the_process_its_count_back(pytester: pytest.Pytester) -> None:
    import torch

    # this test is quick itself: the count it was given, then 3 for the run (a count no default gives)
    assert torch.get_num_threads() == conftest.QUICK_TEST_THREADS == 1
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_threads=THREADS_TEST)
    torch.set_num_threads(3)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[conftest])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(conftest.QUICK_TEST_THREADS)
    result.assert_outcomes(passed=5)
    assert after == 3


def test_a_gloo_rank_runs_on_the_threads_its_test_gave_it() -> None:
    import torch
    from gloo_runs import _rank

    seen: list[tuple[int, int, str]] = []

    def worker(rank: int, word: str) -> None:
        seen.append((rank, torch.get_num_threads(), word))

    saved = torch.get_num_threads()
    try:
        _rank(1, 3, worker, "args")  # in this process, as a forked rank would run it
    finally:
        torch.set_num_threads(saved)
    assert seen == [(1, 3, "args")]


@pytest.mark.slow  # a fresh interpreter that imports pytest: about a second on this host
def test_openmp_threads_wait_passively_and_conftest_imports_no_torch() -> None:
    """conftest.py sets ``OMP_WAIT_POLICY`` (kept where it was exported) before any test imports
    torch: libgomp reads it once, when torch loads it, so the setting only takes if importing
    conftest.py imports no torch. Checked in a fresh interpreter, where nothing else did."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    probe = ("import json, os, sys; import conftest; "
             "print(json.dumps(['torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY')]))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, "PASSIVE"]
