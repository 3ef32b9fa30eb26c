"""Fixtures shared by several test files (helpers they share: tests/support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from support import FAKE_WORLD

from memcalc.distributed.fsdp import ShardedProgram


@pytest.fixture
def without_gloo_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimates on the CPU target without the copies gloo makes in FSDP's collectives
    (:meth:`memcalc.distributed.fsdp.ShardedProgram._gloo_copy`): FSDP's own buffers alone."""
    monkeypatch.setattr(ShardedProgram, "gloo_copies", False)


@pytest.fixture
def fake_process_group(without_gloo_copies: None) -> Iterator[int]:
    """A process group of :data:`support.FAKE_WORLD` ranks in which this process is rank 0 and
    collectives do nothing (``torch.testing``'s fake backend); yields the world size. Its
    collectives allocate nothing, so the estimates compared with its runs leave gloo's copies
    out (tests/test_gloo_runs.py compares them with real gloo runs)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=FAKE_WORLD, store=fake_pg.FakeStore())
    try:
        yield FAKE_WORLD
    finally:
        dist.destroy_process_group()
