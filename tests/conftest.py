"""Fixtures shared by several test files (helpers they share: tests/support.py).

* ``golden``: what a command prints, compared with ``tests/golden/<test name>.out`` — one file
  per scenario, as torchinfo keeps its ``tests/test_output/*.out``. ``pytest --overwrite`` (or
  ``MEMCALC_REGEN_GOLDEN=1``, the older spelling) rewrites the files from this run's output, for
  review in ``git diff``. docs/testing.md says when to use it and when an assertion is better.
* ``@pytest.mark.quick_cases("id", ...)``: of a parametrized family, the cases the quick run
  (``-m "not slow"``) keeps; every other case is marked slow (``pytest_collection_modifyitems``).
* ``fake_process_group``: a fake process group for the distributed tests (and
  ``without_gloo_copies``, which it uses).
* Under pytest-xdist's ``--dist loadgroup`` (``.ci/run``: ``-n 2``), the tests of a module that use
  one of its module- or session-scoped fixtures run in one worker, so that a real run they
  share (a gloo reference, a snapshot) is made once; the tests that run gloo ranks run in one
  worker, first (one forkserver for their ranks: tests/gloo_runs.py); every other test goes where
  a worker is free. (pytest-xdist 3.8 writes the group into ``item._nodeid``, which pytest 9.2 no
  longer reads: ``_group_ids`` puts it in pytest 9.2's structured id.)
* A quick test (not ``slow``) runs on one CPU thread (:data:`QUICK_TEST_THREADS`), and the gloo
  ranks it starts on as many as it has (tests/gloo_runs.py): two workers on two cores, a second
  OpenMP thread per process only spun. Slow tests and golden outputs keep the process's own count.
* The cyclic collector is off from this file's import to the end of collection, then frozen with
  what collection made (``pytest_collection_finish``): collection's full passes would scan torch's
  and transformers' objects again and again, and each real step's ``gc.collect()`` then scans what
  the tests make, not every imported module.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

# Off until collection ends (pytest_collection_finish, pytest_runtestloop): importing torch,
# transformers and PEFT and rewriting the asserts of every test module make millions of objects,
# and each of the collector's full passes over them while they are made costs a worker about
# 3.5 of its 11 CPU-s of start (issue 36 item 7); one pass at the end (gc.collect) finds the same.
gc.disable()

# OpenMP threads that sleep while they wait at a parallel region's barrier, instead of spinning
# (libgomp's default spins first), in every test process and what it starts (the gloo forkserver, a
# Jupyter kernel, Inductor's compile workers). A slow test keeps the process's thread count (two on
# CI's 2 cores; ``cpu_threads`` below) for its real steps, beside the other xdist worker and gloo
# ranks: a thread spinning for its sibling holds the core that sibling needs. On 2026-12-07 (the
# 2-core AMD EPYC host, load 10-11) three real Adam steps of llama-tiny (2 x 128 tokens) on two
# threads took 68.1 and 46.4 s by default, 15.3 and 12.8 s passive, alternating
# (benchmarks/omp_wait.py). The thread count, and so every per-thread buffer and measured byte, is
# unchanged. libgomp reads it once, when torch loads it: set here, before any test imports torch
# (this file imports none; ``test_conftest.py`` checks that the setting took). A value exported by
# whoever runs the tests is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# torch, support and memcalc are imported where they are used, not here: pytest-xdist's controller
# loads this file too but runs no test, and importing torch and torch._dynamo (support's CPU
# capabilities) there cost it about 2 CPU-s of the run's (issue 36 item 7). The workers import
# them with the test modules anyway.

TESTS = Path(__file__).parent
GOLDEN = TESTS / "golden"

#: The torch the golden files were recorded with. CI's version matrix runs them on other
#: releases too: there the installed release, named in the header's "assumed:" line and in the
#: JSON's torch_version, is read as this one, and every other character must be equal.
GOLDEN_TORCH = "2.13"

#: The test directory as the golden files spell it: commands that name a file under tests/
#: (a model file, a snapshot) print its absolute path, which differs between checkouts.
TESTS_PLACEHOLDER = "<tests>"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--overwrite", action="store_true", default=False,
                     help="rewrite tests/golden/*.out from this run's output instead of comparing "
                          "(review with git diff); MEMCALC_REGEN_GOLDEN=1 does the same")


def overwriting_golden(config: pytest.Config) -> bool:
    """Whether this run rewrites golden files: ``--overwrite``, or ``MEMCALC_REGEN_GOLDEN`` set
    (the older spelling, kept so that notes and habits that use it still work)."""
    return bool(config.getoption("overwrite") or os.environ.get("MEMCALC_REGEN_GOLDEN"))


def installed_torch() -> str:
    """The installed torch's ``"major.minor"`` (``"2.13"`` for ``2.13.0+cpu``), read here rather
    than from memcalc so that the normalisation does not trust the code it checks."""
    import torch
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def as_recorded(text: str) -> str:
    """``text`` as the golden files hold it: the installed torch named as :data:`GOLDEN_TORCH`
    where an estimate states the torch it assumed, and the tests directory as
    :data:`TESTS_PLACEHOLDER`."""
    text = text.replace(str(TESTS), TESTS_PLACEHOLDER)
    installed = installed_torch()
    if installed == GOLDEN_TORCH:
        return text
    for said_by_memcalc in ("assumed: torch {},", "assumed: torch {} (CPU target)",
                            "(traced with the installed torch {})", '"torch_version": "{}"'):
        text = text.replace(said_by_memcalc.format(installed), said_by_memcalc.format(GOLDEN_TORCH))
    return text


def golden_name(node: pytest.Item) -> str:
    """The file stem of a test's golden output: its name without ``test_``, with the
    parametrized id (``test_estimate[mlp_bf16_v100]`` → ``estimate[mlp_bf16_v100]``). Characters a
    file name should not hold become ``_``."""
    name = node.name.removeprefix("test_")
    return re.sub(r"[^\w.\[\]=,+-]", "_", name)


#: Golden file → the test that compared it in this session: two tests on one file would each
#: overwrite the other's output.
_CLAIMED: dict[Path, str] = {}


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it (as a failure message names it)."""
    return str(path.relative_to(TESTS.parent)) if path.is_relative_to(TESTS.parent) else str(path)


class Golden:
    """Compares a scenario's output with its golden file (module docstring)."""

    def __init__(self, node: pytest.Item, overwrite: bool) -> None:
        self._node = node
        self._overwrite = overwrite
        self.checked: list[Path] = []

    def path(self, suffix: str = ".out") -> Path:
        """The golden file of this test for ``suffix`` (``.out``, or ``.json`` for JSON output)."""
        return GOLDEN / f"{golden_name(self._node)}{suffix}"

    def __call__(self, output: str, *, suffix: str = ".out") -> None:
        """Assert that ``output`` (normalised by :func:`as_recorded`) equals the golden file, or
        write it there when overwriting. A missing file fails: a new scenario is recorded on
        purpose, with ``--overwrite``, and reviewed."""
        path = self.path(suffix)
        owner = _CLAIMED.setdefault(path, self._node.nodeid)
        assert owner == self._node.nodeid, f"{path.name} is already the golden output of {owner}"
        assert path not in self.checked, f"{path.name} compared twice in one test: give the second a suffix"
        self.checked.append(path)
        text = as_recorded(output)
        if self._overwrite:
            GOLDEN.mkdir(exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"no golden output {_shown(path)} for this test: record it with "
                        f"`python -m pytest {self._node.nodeid} --overwrite` and review the new file",
                        pytrace=False)
        expected = path.read_text()
        assert text == expected, (f"output differs from {_shown(path)}; if the change is "
                                  "intended, rewrite it with --overwrite and review the diff")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    """Compare a CLI scenario's output with ``tests/golden/<test name>.out`` (:class:`Golden`)."""
    return Golden(request.node, overwriting_golden(request.config))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the slow marks added here must count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.quick_cases("id", ...)`` on a parametrized test keeps those cases in the
    quick run and marks every other case ``slow``: one representative of a family of real-CPU or
    real-distributed comparisons runs in ``-m "not slow"``, the whole family in the full suite."""
    families: dict[tuple[str, str], list[pytest.Function]] = {}
    for item in items:
        if isinstance(item, pytest.Function) and item.get_closest_marker("quick_cases") is not None:
            families.setdefault((item.nodeid.split("::")[0], item.originalname), []).append(item)
    for (path, name), members in families.items():
        marker = members[0].get_closest_marker("quick_cases")
        assert marker is not None
        keep = set(marker.args)
        if not all(hasattr(item, "callspec") for item in members):
            raise pytest.UsageError(f"{path}::{name}: quick_cases needs a parametrized test")
        ids = {item.callspec.id for item in members}
        unknown = keep - ids
        if unknown and len(members) > 1 and name not in _named_by_case(config):
            raise pytest.UsageError(f"{path}::{name}: quick_cases names no case {sorted(unknown)}; "
                                    f"its cases: {sorted(ids)}")
        for item in members:
            if item.callspec.id not in keep:
                item.add_marker(pytest.mark.slow)
    for item in items:
        if _spawns_gloo_ranks(item):
            item.add_marker(pytest.mark.xdist_group(GLOO_GROUP))
        elif _shares_a_wide_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if _distributing_by_group(config):
        _group_ids(items)
    # the gloo runs first: the longest unit of work, started while the other worker takes the rest
    # rather than left to the end of the run with one worker idle (a stable sort: order kept within)
    items.sort(key=lambda item: not _spawns_gloo_ranks(item))


def _named_by_case(config: pytest.Config) -> set[str]:
    """The test functions whose cases the command line names by id (``path::test[id]``): only those
    cases are collected, so a kept case missing among them is no renaming (the moved cases of a
    family, run by id, would otherwise be refused)."""
    return {arg.split("[", 1)[0].rsplit("::", 1)[-1] for arg in config.args if "::" in arg and "[" in arg}


#: The CPU threads (``torch.set_num_threads``) of a quick test, its real steps and its estimates
#: alike (the CPU target sizes the flash kernels' per-thread buffers by the same count). With two
#: xdist workers on two cores, and two to four gloo ranks, a process's second OpenMP thread found
#: no free core and spun at every parallel region's barrier: on 2026-12-07 (load 7-11) the quick
#: suite took 162.1 → 129.1 CPU-s of tests under ``OMP_NUM_THREADS=1``, the GPipe/1F1B gloo ranks
#: 3.9 → 0.4 CPU-s each (issue 36 item 7). The slow tests keep the process's count, so that the
#: full suite still checks the per-thread buffers against real steps at the machine's count, and
#: so do tests of golden output, recorded with it.
QUICK_TEST_THREADS = 1


def cpu_threads(item: pytest.Item) -> int | None:
    """The CPU threads ``item`` runs on: :data:`QUICK_TEST_THREADS` for a quick test, None (the
    process's own count) for a slow one or one that compares golden output."""
    if item.get_closest_marker("slow") is not None or "golden" in getattr(item, "fixturenames", ()):
        return None
    return QUICK_TEST_THREADS


@pytest.hookimpl(hookwrapper=True)  # the old-style wrapper: pyproject admits pytest 7
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run ``item`` (its fixtures' setup and teardown included) on :func:`cpu_threads`'s count,
    then give the process its own count back."""
    threads = cpu_threads(item)
    if threads is None:
        yield
        return
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _distributing_by_group(config: pytest.Config) -> bool:
    """Whether this process collects for ``--dist loadgroup``. In an xdist worker, the process
    that collects, xdist sets ``dist`` to ``"no"`` and keeps the choice in ``loadgroup``
    (xdist/remote.py's ``setup_config``); the controller, which does not collect, has ``dist``."""
    return bool(getattr(config.option, "loadgroup", False)) or config.getoption("dist", None) == "loadgroup"


def _group_ids(items: list[pytest.Item]) -> None:
    """Put each item's ``xdist_group`` in its node id (``path::test@group``), as pytest-xdist's
    ``loadgroup`` reads it, where pytest keeps the id as a structured ``NodeId`` (pytest 9.2):
    xdist 3.8 writes the suffixed id to ``item._nodeid``, which that pytest no longer reads, so its
    groups were ignored. An older pytest reads ``_nodeid``, and xdist's own hook serves it."""
    try:
        from _pytest.nodeid import NodeId  # private: pytest 9.2's structured node id
    except ImportError:
        return
    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        if names and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


#: The xdist group of every test that runs gloo ranks: one worker, so one forkserver imports what
#: the ranks import (tests/gloo_preload.py) for all of them.
GLOO_GROUP = "gloo-ranks"


def _spawns_gloo_ranks(item: pytest.Item) -> bool:
    """Whether ``item`` is in a module whose tests run real gloo ranks (``tests/test_gloo_*.py``,
    ``tests/test_trl_gloo.py``)."""
    name = item.path.name
    return name.startswith("test_gloo_") or name == "test_trl_gloo.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (torch, transformers and every test module, imported; the
    items): it lives to the end of the session, and the real steps' ``gc.collect()`` calls
    (memcalc/measure/step.py, the gloo helpers) then scan only what the tests make, not the
    interpreter's whole heap again each time (issue 36, item 7: about a third of a second per call
    in a worker that has imported the suite). Runs in each xdist worker, which collects for itself.
    The collector, off since this file's import, is switched on again here."""
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """The collector on for the run in every process, including pytest-xdist's controller, which
    collects nothing (so ``pytest_collection_finish`` never runs there)."""
    gc.enable()


def _shares_a_wide_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or session-scoped fixture: pytest-xdist's ``loadgroup``
    then keeps it with its module's other users of it (a wide fixture is made once per worker)."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.nodeid.split("::")[0]
    if info is None:
        return False
    # the module's own fixtures only: pytest's tmp_path_factory is session-scoped and cheap
    return any(definitions[-1].scope in ("module", "session") and definitions[-1].baseid == module
               for definitions in info.name2fixturedefs.values() if definitions)


@pytest.fixture
def without_gloo_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimates on the CPU target without the copies gloo makes in FSDP's collectives
    (:meth:`memcalc.distributed.fsdp.ShardedProgram._gloo_copy`): FSDP's own buffers alone."""
    from memcalc.distributed.fsdp import ShardedProgram
    monkeypatch.setattr(ShardedProgram, "gloo_copies", False)


@pytest.fixture
def fake_process_group(without_gloo_copies: None) -> Iterator[int]:
    """A process group of :data:`support.FAKE_WORLD` ranks in which this process is rank 0 and
    collectives do nothing (``torch.testing``'s fake backend); yields the world size. Its
    collectives allocate nothing, so the estimates compared with its runs leave gloo's copies
    out (tests/test_gloo_runs.py compares them with real gloo runs)."""
    import torch.distributed as dist
    from support import FAKE_WORLD
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=FAKE_WORLD, store=fake_pg.FakeStore())
    try:
        yield FAKE_WORLD
    finally:
        dist.destroy_process_group()
