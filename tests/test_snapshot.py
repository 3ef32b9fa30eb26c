"""The snapshot export (``memcalc.measure.snapshot_export``): the simulated step as a
``torch.cuda.memory._snapshot()`` pickle. PyTorch's own tool must open it, and the allocated
memory replayed from its trace must peak at the report's ``peak_allocated`` to the byte — for a
CNN, a transformer with activation checkpointing and an FSDP rank."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.cuda import _memory_viz

import memcalc
from memcalc.core.errors import PlotPathError
from memcalc.measure.snapshot_export import snapshot_dict, write_snapshot

CASES = {
    "cnn": ("resnet18", {"batch_size": 2, "input_shape": (3, 64, 64), "optimizer": "adam"}),
    "transformer-checkpointed": ("gpt2", {"batch_size": 2, "seq_len": 64, "checkpoint": True}),
    "fsdp": ("gpt2", {"batch_size": 2, "seq_len": 64, "distributed": memcalc.Distributed("fsdp", world_size=2)}),
}


@pytest.fixture(scope="module", params=list(CASES))
def report(request: pytest.FixtureRequest) -> memcalc.MemoryReport:
    model, options = CASES[request.param]
    return memcalc.estimate(model, **options)


def _replayed(trace: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(peak allocated, allocated at the end, reserved at the end) summed from the trace."""
    allocated = peak = reserved = 0
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            allocated += entry["size"]
            peak = max(peak, allocated)
        elif action == "free_completed":
            allocated -= entry["size"]
        elif action == "segment_alloc":
            reserved += entry["size"]
        elif action == "segment_free":
            reserved -= entry["size"]
    return peak, allocated, reserved


def test_trace_peaks_at_the_reports_peak(report):
    snapshot = snapshot_dict(report)
    assert list(snapshot) == ["segments", "device_traces"] and len(snapshot["device_traces"]) == 1
    peak, final_allocated, final_reserved = _replayed(snapshot["device_traces"][0])
    assert peak == report.bytes.peak_allocated
    timeline = report.timeline()
    assert final_allocated == int(timeline.allocated[-1])
    # the segments listed are those held at the end, and their blocks account for them exactly
    segments = snapshot["segments"]
    assert sum(s["total_size"] for s in segments) == final_reserved
    assert sum(s["allocated_size"] for s in segments) == final_allocated
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == address  # contiguous, as the viewer lays them out
            address += block["size"]
            assert block["requested_size"] <= block["size"]
        assert address == segment["address"] + segment["total_size"]
        assert segment["device"] == 0 and type(segment["stream"]) is int  # a plain int: the pickle needs no memcalc
    # FSDP2's rank holds segments of its all-gather copy-in (1) and reduce-scatter (2) streams too,
    # and every block of a stream's segment was allocated on that stream
    fsdp = report.strategy == "fsdp"
    assert {s["stream"] for s in segments} == ({0, 1, 2} if fsdp else {0})
    stream_at = {e["addr"]: e["stream"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"}
    assert all(stream_at[b["address"]] == s["stream"] for s in segments for b in s["blocks"]
               if b["state"] == "active_allocated")
    assert "total_reserved" in _memory_viz.segsum(snapshot)  # PyTorch's own accounting checks pass


def test_entries_are_trace_entries(report):
    trace = snapshot_dict(report)["device_traces"][0]
    actions = [e["action"] for e in trace]
    assert set(actions) <= {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"}
    assert actions[0] == "segment_alloc" and actions[1] == "alloc"
    for i, entry in enumerate(trace):
        # an alloc also carries its request (a real trace's size is the request; ours is the block's)
        extra = {"requested_size"} if entry["action"] == "alloc" else set()
        assert set(entry) == {"action", "addr", "size", "stream", "frames", "category"} | extra
        assert entry["stream"] in ((0, 1, 2) if report.strategy == "fsdp" else (0,)) and entry["size"] > 0
        if extra:
            assert 0 < entry["requested_size"] <= entry["size"]
        if entry["action"] == "free_completed":  # no record_stream: requested, then completed at once
            assert trace[i - 1] == entry | {"action": "free_requested"}
    # every alloc is freed at most once, at the address it was given
    live: set[int] = set()
    for entry in trace:
        if entry["action"] == "alloc":
            assert entry["addr"] not in live
            live.add(entry["addr"])
        elif entry["action"] == "free_completed":
            live.remove(entry["addr"])
    # MemoryViz.js throws on a snapshot whose categories lack "unknown": segments carry it
    categories = {e["category"] for e in trace}
    assert "unknown" in categories and "activations" in categories


def test_frames_name_phase_module_and_op():
    model, options = CASES["cnn"]
    r = memcalc.estimate(model, **options)
    trace = snapshot_dict(r)["device_traces"][0]
    names = [e["frames"][0]["name"] for e in trace if e["action"] == "alloc"]
    assert all(len(e["frames"]) == 1 and e["frames"][0]["filename"] == "<memcalc>" and e["frames"][0]["line"] == 0
               for e in trace)
    assert names[0] == "setup (parameters)"
    assert "forward conv1 aten.convolution.default" in names
    assert "forward layer4.1.conv2 aten.convolution.default" in names
    assert "backward layer1.0.conv1 synthetic: cuDNN convolution workspace (backward_data)" in names
    assert any(n.startswith("optimizer ") for n in names)


@pytest.mark.slow  # torch's _memory_viz in a subprocess per case
def test_trace_plot_opens_it(report, tmp_path: Path):
    path = tmp_path / "step.pickle"
    write_snapshot(report, path)
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"  # protocol 4: MemoryViz.js's unpickler reads no later one
    assert pickle.loads(raw) == snapshot_dict(report)
    html = tmp_path / "out.html"
    done = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(html)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = html.read_text()
    assert "MemoryViz.js" in text and '"name": "snapshot.pickle"' in text and len(text) > 10_000


def test_write_snapshot_into_a_missing_folder_fails_cleanly(tmp_path: Path):
    r = memcalc.estimate("fc-32-16", batch_size=4)
    with pytest.raises(PlotPathError, match="cannot write the snapshot"):
        write_snapshot(r, tmp_path / "missing" / "step.pickle")
    assert list(tmp_path.iterdir()) == []
