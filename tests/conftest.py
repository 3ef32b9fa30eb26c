"""Fixtures shared by several test files (helpers they share: tests/support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from support import FAKE_WORLD


@pytest.fixture
def fake_process_group() -> Iterator[int]:
    """A process group of :data:`support.FAKE_WORLD` ranks in which this process is rank 0 and
    collectives do nothing (``torch.testing``'s fake backend); yields the world size."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=FAKE_WORLD, store=fake_pg.FakeStore())
    try:
        yield FAKE_WORLD
    finally:
        dist.destroy_process_group()
