"""One record per GPU (memcalc/targets/cuda/gpus/gpus.toml): every row holds every fact memcalc
uses about the card, a row missing one (or holding an unknown one) is refused at import, and the
consumers (the catalogue's profiles, the assumed or measured context, the step time's peaks,
the fused kernels' SM count) all read the same row."""

from __future__ import annotations

import copy
import sys
from importlib import resources
from pathlib import Path

import pytest

from memcalc.core.gpu import GENERIC
from memcalc.targets.cuda.gpus import catalogue as cat
from memcalc.timing.performance import PERFORMANCE, device_rates

MiB = 1024**2
KiB = 1024
ROOT = Path(__file__).parent.parent
tomllib = cat.tomllib  # the stdlib module, or its backport on Python 3.10
RAW = tomllib.loads(resources.files(cat.__package__).joinpath(cat.GPUS_FILE).read_text(encoding="utf-8"))


@pytest.mark.parametrize("key", list(RAW))
def test_every_row_is_complete(key: str) -> None:
    row = RAW[key]
    assert set(row) == cat.RECORD_FIELDS
    record = next(r for r in cat.records() if r.key == key)
    profile = record.profile
    assert profile.total_memory is not None and profile.smi_total_mib is not None
    # CUDA hands out less than nvidia-smi shows: the driver's reserve (0.1-3 % on these cards)
    assert 0.9 * profile.smi_total_mib * MiB < profile.total_memory < profile.smi_total_mib * MiB
    assert profile.sm_count > 0 and record.max_threads_per_sm in (1024, 1536, 2048)
    assert record.memory_source
    if record.measured_context is None:
        assert profile.cuda_context == 256 * MiB + profile.sm_count * record.max_threads_per_sm * KiB
        assert not profile.context_measured
    else:
        assert profile.cuda_context == record.measured_context.lazy < record.measured_context.eager
    if record.performance is None:
        assert record.no_performance and key not in PERFORMANCE
    else:
        assert PERFORMANCE[key] is record.performance and record.no_performance == ""
        assert all(peak > 0 for _, peak in record.performance.peaks) and record.performance.source
        assert device_rates(profile).peaks == record.performance.peaks


def test_records_are_the_catalogue() -> None:
    assert [r.profile for r in cat.records()] == cat.catalogue()
    assert cat.record(GENERIC) is None
    assert set(cat.MEASURED_CONTEXTS) == {r.key for r in cat.records() if r.measured_context is not None}


def test_worked_contexts() -> None:
    # assumed, L4: 256 MiB + 58 SMs x 1,536 threads x 1 KiB = 256 + 87 MiB = 343 MiB
    assert cat.get_gpu("l4").cuda_context == 343 * MiB
    # assumed, T4: 256 MiB + 40 x 1,024 x 1 KiB = 296 MiB
    assert cat.get_gpu("t4").cuda_context == 296 * MiB
    # measured, H100: ctx.json's LAZY 726,663,168 B; the formula would give 256 + 132 x 2 = 520 MiB
    assert cat.get_gpu("h100-80gb").cuda_context == 726_663_168


@pytest.mark.parametrize("field", sorted(cat.RECORD_FIELDS))
def test_a_missing_field_is_refused(field: str) -> None:
    row = copy.deepcopy(RAW["h100-80gb"])
    del row[field]
    with pytest.raises(cat.GpuRecordError, match=f"missing {field}"):
        cat.read_record("h100-80gb", row)


def test_unknown_and_mistyped_fields_are_refused() -> None:
    row = copy.deepcopy(RAW["l4"])
    with pytest.raises(cat.GpuRecordError, match="unknown max_threads"):
        cat.read_record("l4", {**row, "max_threads": 1536})
    with pytest.raises(cat.GpuRecordError, match="sm_count must be int"):
        cat.read_record("l4", {**row, "sm_count": True})
    with pytest.raises(cat.GpuRecordError, match="missing where"):
        cat.read_record("l4", {**row, "cuda_context": {"lazy": 1, "eager": 2, "cuda": [13, 0]}})
    with pytest.raises(cat.GpuRecordError, match="say why"):
        cat.read_record("l4", {**row, "performance": " "})
    with pytest.raises(cat.GpuRecordError, match="bandwidth_gb_s must be positive"):
        cat.read_record("l4", {**row, "performance": {**row["performance"], "bandwidth_gb_s": 0}})


def test_the_data_file_installs() -> None:
    """The record file ships as package data: a wheel without it could not import the catalogue."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["memcalc"]
    assert "targets/cuda/gpus/gpus.toml" in shipped
    assert all((ROOT / "memcalc" / path).is_file() for path in shipped)
    assert sys.version_info >= (3, 11) or any("tomli" in d for d in pyproject["project"]["dependencies"])
