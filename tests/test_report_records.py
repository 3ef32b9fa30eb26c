"""The report's nested records (``step``, ``distribution``, ``generation``, ``on_request``): every
field of a record is also the report's read-only attribute of the same name, the records are
what the estimate found, and the JSON contract reads the same values (docs/architecture.md)."""

from __future__ import annotations

import dataclasses

import pytest

import memcalc
from memcalc.core.report import Distribution, Generation, MemoryReport, StepDescription

RECORDS = {"step": StepDescription, "distribution": Distribution, "generation": Generation}


@pytest.fixture(scope="module")
def ddp() -> MemoryReport:
    return memcalc.estimate("mlp", batch_size=4, gpu="t4", distributed=memcalc.Distributed("ddp", world_size=2))


def test_every_record_field_is_a_flat_attribute(ddp: MemoryReport) -> None:
    names = set()
    for record, cls in RECORDS.items():
        for f in dataclasses.fields(cls):
            assert getattr(ddp, f.name) == getattr(getattr(ddp, record), f.name), f.name
            names.add(f.name)
    top = {f.name for f in dataclasses.fields(MemoryReport)}
    assert not names & top, "a field is both the report's and a record's"


def test_records_hold_what_the_estimate_found(ddp: MemoryReport) -> None:
    assert (ddp.step.model, ddp.step.batch_size, ddp.step.gpu.key) == ("mlp", 4, "t4")
    assert ddp.step.capacity == ddp.step.gpu.usable_memory
    assert (ddp.distribution.strategy, ddp.distribution.world_size, ddp.distribution.global_batch_size) == ("ddp", 2, 8)
    assert len(ddp.distribution.roles) == 1 and ddp.busiest_role is ddp.roles[0]
    assert ddp.generation == Generation()  # a training step that generates nothing
    data = ddp.to_dict()
    assert (data["model"], data["batch_size"], data["gpu"], data["strategy"], data["world_size"]) == (
        "mlp", 4, "t4", "ddp", 2)


def test_flat_attributes_are_read_only(ddp: MemoryReport) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ddp.batch_size = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        dataclasses.replace(ddp, batch_size=8)  # type: ignore[call-arg]
    changed = dataclasses.replace(ddp, step=dataclasses.replace(ddp.step, batch_size=8))
    assert (changed.batch_size, changed.to_dict()["batch_size"], ddp.batch_size) == (8, 8, 4)


def test_on_request_is_out_of_equality_and_explicit(ddp: MemoryReport) -> None:
    bare = dataclasses.replace(ddp, on_request=dataclasses.replace(ddp.on_request, timeline=None, costs=None))
    assert bare == ddp and bare.to_dict() == ddp.to_dict()
    with pytest.raises(ValueError, match="no step to replay"):
        bare.timeline()
    with pytest.raises(ValueError, match="no traced step"):
        bare.flops()
    assert max(ddp.timeline().allocated) == ddp.bytes.peak_allocated


def test_a_generation_fills_its_record() -> None:
    report = memcalc.estimate("gpt2", batch_size=1, seq_len=16, mode="generate", new_tokens=4)
    assert report.generation.new_tokens == report.new_tokens == 4
    assert report.generation.peak_step == report.peak_step is not None
    assert report.to_dict()["new_tokens"] == 4
