"""``--timeline`` and ``--snapshot``: the memory timeline drawn as HTML (checked in a real
headless Chromium when one is installed), PNG and SVG; the output paths checked before the
estimate; and the command end to end for a CNN, a checkpointed transformer and multi-GPU.

The drawing is tested on timelines built by hand (:func:`synthetic`: a small training step
whose every number is known), the command on real estimates.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from memcalc.cli import main
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import PlotPathError
from memcalc.core.output import check_output_path
from memcalc.core.timeline import Allocation, PhaseSpan, Timeline
from memcalc.core.units import format_bytes
from memcalc.report.timeline_chart import CATEGORY_STYLE, sample
from memcalc.report.timeline_html import timeline_html
from memcalc.report.timeline_plot import check_timeline_path, write_timeline

MIB = 1024**2
BLOCK = 512  # the caching allocator's rounding


# --- a timeline built by hand -------------------------------------------------------------

def synthetic(*, layers: int = 12, capacity: int | None = None, role: str = "") -> Timeline:
    """Two iterations of a toy training step: parameters and the batch, then per iteration a
    forward that keeps one activation per layer, a backward that frees them with a
    temporary each and makes the gradients, an optimizer step (its state created in the
    first) and zero_grad. Allocated is the live storages rounded to 512 B; reserved grows
    in 2 MiB segments and is never given back."""
    categories = tuple(Category)
    sizes: dict[int, tuple[int, Category]] = {}
    rows: list[tuple[int, bool, Phase, str, str]] = []  # storage, alloc, phase, module, op
    births: dict[int, tuple[Phase, str, str]] = {}
    spans: list[PhaseSpan] = []
    uid = 0

    def alloc(nbytes: int, category: Category, phase: Phase, module: str, op: str) -> int:
        nonlocal uid
        uid += 1
        sizes[uid] = (nbytes, category)
        births[uid] = (phase, module, op)
        rows.append((uid, True, phase, module, op))
        return uid

    def free(storage: int, phase: Phase, op: str) -> None:
        rows.append((storage, False, phase, births[storage][1], op))

    for _ in range(4):
        alloc(3 * MIB + 100, Category.PARAMETERS, Phase.SETUP, "", "")
    alloc(MIB, Category.INPUTS, Phase.SETUP, "", "")
    spans.append(PhaseSpan(Phase.SETUP, 1, 0, len(rows)))
    state: list[int] = []
    for iteration in (1, 2):
        start = len(rows)
        saved = [alloc((2 + i % 3) * MIB + 7, Category.ACTIVATIONS, Phase.FORWARD, f"layers.{i}", "aten.mm.default")
                 for i in range(layers)]
        spans.append(PhaseSpan(Phase.FORWARD, iteration, start, len(rows)))
        start = len(rows)
        grads = []
        for i, activation in reversed(list(enumerate(saved))):
            temporary = alloc(5 * MIB, Category.WORKSPACE, Phase.BACKWARD, f"layers.{i}", "aten.mm.default")
            grads.append(alloc(MIB // 2, Category.GRADIENTS, Phase.BACKWARD, f"layers.{i}", "aten.sum.dim_IntList"))
            free(temporary, Phase.BACKWARD, "aten.mm.default")
            free(activation, Phase.BACKWARD, "aten.threshold_backward.default")
        spans.append(PhaseSpan(Phase.BACKWARD, iteration, start, len(rows)))
        start = len(rows)
        if iteration == 1:
            state = [alloc(6 * MIB, Category.OPTIMIZER_STATE, Phase.OPTIMIZER, "", "aten.zeros_like.default")
                     for _ in range(2)]
        scratch = alloc(4 * MIB, Category.WORKSPACE, Phase.OPTIMIZER, "", "aten._foreach_mul.Scalar")
        free(scratch, Phase.OPTIMIZER, "aten._foreach_mul.Scalar")
        spans.append(PhaseSpan(Phase.OPTIMIZER, iteration, start, len(rows)))
        start = len(rows)
        for grad in grads:
            free(grad, Phase.ZERO_GRAD, "")
        spans.append(PhaseSpan(Phase.ZERO_GRAD, iteration, start, len(rows)))
    assert state

    n = len(rows)
    by_category = np.zeros((n, len(categories)), dtype=np.int64)
    allocated = np.zeros(n, dtype=np.int64)
    reserved = np.zeros(n, dtype=np.int64)
    current = np.zeros(len(categories), dtype=np.int64)
    used = held = 0
    for i, (storage, is_alloc, *_rest) in enumerate(rows):
        nbytes, category = sizes[storage]
        sign = 1 if is_alloc else -1
        current[categories.index(category)] += sign * nbytes
        used += sign * -(-nbytes // BLOCK) * BLOCK
        while held < used:
            held += 2 * MIB
        by_category[i], allocated[i], reserved[i] = current, used, held
    peak = int(np.argmax(allocated))
    live: set[int] = set()
    for storage, is_alloc, *_rest in rows[: peak + 1]:
        (live.add if is_alloc else live.discard)(storage)
    largest = sorted(live, key=lambda s: (-sizes[s][0], s))[:10]
    return Timeline(
        categories=categories, by_category=by_category, allocated=allocated, reserved=reserved,
        phase=tuple(births[s][0] for s, *_ in rows), module=tuple(m for _, _, _, m, _ in rows),
        op=tuple(op for *_, op in rows), is_alloc=np.array([a for _, a, *_ in rows]), spans=tuple(spans),
        peak_index=peak, capacity=capacity,
        largest_at_peak=tuple(Allocation(sizes[s][0], sizes[s][1], *births[s]) for s in largest), role=role)


def _nonempty_categories(timeline: Timeline) -> list[str]:
    return [c.value for c in timeline.categories if timeline.series(c).any()]


def test_the_synthetic_step_is_what_it_claims() -> None:
    t = synthetic()
    assert t.num_events == 5 + 12 + 48 + 2 + 2 + 12 + 12 + 48 + 2 + 12
    # the peak: second iteration's backward, its first temporary and gradient on top of all
    # activations, the parameters, the batch and the optimizer state
    assert t.phase[t.peak_index] is Phase.BACKWARD and t.peak_index > t.spans[5].start
    assert t.peak_allocated == sum(-(-b // BLOCK) * BLOCK for b in
                                   [3 * MIB + 100] * 4 + [MIB] + [(2 + i % 3) * MIB + 7 for i in range(12)]
                                   + [6 * MIB] * 2 + [5 * MIB, MIB // 2])
    assert _nonempty_categories(t) == ["parameters", "inputs", "gradients", "optimizer_state", "activations",
                                       "workspace"]


# --- what is drawn ------------------------------------------------------------------------

def test_sample_keeps_every_event_of_a_short_step_and_a_rounding_layer() -> None:
    t = synthetic()
    drawn = sample(t, columns=500)
    assert drawn.indices.tolist() == list(range(t.num_events))
    keys = [layer.key for layer in drawn.layers]
    # model states at the bottom, then what comes and goes, then the allocator's rounding
    assert keys == ["parameters", "inputs", "gradients", "optimizer_state", "activations", "workspace", "rounding"]
    stacked = sum(layer.values for layer in drawn.layers)
    assert np.array_equal(stacked, t.allocated)  # the stack's top is allocated memory, exactly


def test_sample_keeps_each_runs_highest_and_lowest_event() -> None:
    rng = np.random.default_rng(0)
    n, columns = 50_003, 300
    allocated = rng.integers(0, 10**9, n).astype(np.int64)
    t = Timeline(categories=(Category.ACTIVATIONS,), by_category=allocated[:, None].copy(), allocated=allocated,
                 reserved=allocated + 5, phase=(Phase.FORWARD,) * n, module=("",) * n, op=("",) * n,
                 is_alloc=np.ones(n, dtype=bool), spans=(), peak_index=int(allocated.argmax()))
    drawn = sample(t, columns=columns)
    assert len(drawn.indices) <= 2 * columns + 3 and np.all(np.diff(drawn.indices) > 0)
    assert t.peak_index in drawn.indices and 0 in drawn.indices and n - 1 in drawn.indices
    width = -(-n // columns)
    for start in range(0, n, width):
        run = allocated[start:start + width]
        kept = drawn.allocated[(drawn.indices >= start) & (drawn.indices < start + width)]
        assert kept.max() == run.max() and kept.min() == run.min()


# --- HTML ---------------------------------------------------------------------------------

def _areas(text: str) -> list[str]:
    return re.findall(r'<path class="area" data-category="([a-z_]+)"', text)


def test_html_is_one_self_contained_file_with_the_chart_drawn() -> None:
    t = synthetic(capacity=64 * MIB)
    text = timeline_html(t, title="toy step")
    assert _areas(text) == [*_nonempty_categories(t)[:3], "optimizer_state", "activations", "workspace",
                            "rounding"]
    assert text.count('<g class="peak"') == 1
    assert f'data-event="{t.peak_index}" data-bytes="{t.peak_allocated}"' in text
    assert f"capacity {format_bytes(64 * MIB, 'MiB')}" in text
    assert text.count('<rect class="phase"') == 8  # forward, backward, optimizer, zero_grad × 2
    # nothing fetched from anywhere: no external script, stylesheet, image, font or import
    assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", text)
    assert "url(" not in text and "@import" not in text and "https://" not in text
    # the ten largest at the peak, largest first, with module and op
    assert text.count("<tr><td>") == 10
    first = re.search(r"<tbody><tr>(.*?)</tr>", text)
    assert first is not None and re.sub(r"<[^>]+>", " ", first[1]).split() == [
        "1", "6.00", "MiB", "optimizer", "state", "top", "level", "aten.zeros_like.default", "optimizer"]
    assert "<code>layers.11</code>" in text


def test_html_escapes_names_from_user_code() -> None:
    t = synthetic()
    evil = "</script><script>alert(1)</script>"
    t = replace(t, module=tuple(evil for _ in t.module), role="<b>rank</b>")
    text = timeline_html(t)
    assert "<script>alert(1)" not in text and "</script><script>alert" not in text
    assert "&lt;b&gt;rank&lt;/b&gt;" in text


def test_html_draws_one_chart_per_role_on_one_axis() -> None:
    big, small = synthetic(layers=20, role="output device (cuda:0)"), synthetic(layers=6, role="other devices")
    text = timeline_html([big, small])
    assert text.count('<section class="role"') == 2
    assert "output device (cuda:0)" in text and "other devices" in text
    # one event axis: the shorter role's last event is left of the longer one's
    data = json.loads(re.search(r'<script type="application/json" id="memcalc-data">(.*?)</script>', text,
                                re.DOTALL)[1])
    assert data[1]["x"][-1] < data[0]["x"][-1]
    assert data[0]["event"][-1] == big.num_events - 1 and data[1]["event"][-1] == small.num_events - 1


# --- PNG and SVG --------------------------------------------------------------------------

@pytest.mark.slow  # matplotlib draws a PNG
def test_png_is_written_and_not_blank(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = write_timeline([synthetic(capacity=64 * MIB)], tmp_path / "t.png", title="toy step")
    assert path == tmp_path / "t.png" and os.listdir(tmp_path) == ["t.png"]
    assert 30_000 < path.stat().st_size < 1_000_000
    pixels = imread(path)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 1000
    # the category colours are in the picture
    for category in (Category.ACTIVATIONS, Category.OPTIMIZER_STATE, Category.PARAMETERS):
        rgb = np.array([int(CATEGORY_STYLE[category][1][i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum() > 500, category


def test_svg_names_the_categories_the_peak_and_the_roles(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = synthetic(capacity=64 * MIB)
    path = write_timeline([replace(t, role="rank 0"), replace(synthetic(layers=5), role="other devices")],
                          tmp_path / "t.svg")
    text = path.read_text()
    for label in ("parameters", "gradients", "optimizer state", "activations", "temporaries &amp; workspace",
                  "reserved", "capacity", "rank 0", "other devices", f"peak {format_bytes(t.peak_allocated, 'MiB')}",
                  "layers.11"):
        assert label in text, label
    assert 20_000 < path.stat().st_size < 3_000_000


# --- paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, message", [
    ("missing/t.html", "the folder {dir}/missing does not exist; create it first"),
    ("t.pdf", "'.pdf' is not a timeline format; end the name in .html, .png or .svg"),
    ("t", "the name has no extension; end the name in .html, .png or .svg"),
])
def test_timeline_path_errors_are_one_line(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(PlotPathError) as error:
        check_timeline_path(tmp_path / name)
    assert str(error.value) == f"cannot write the timeline to {tmp_path / name}: " + message.format(dir=tmp_path)
    (tmp_path / "folder.html").mkdir()
    with pytest.raises(PlotPathError, match="it is a folder; give a file name"):
        check_timeline_path(tmp_path / "folder.html")
    assert check_output_path(tmp_path / "s.PKL", "snapshot", ("pickle", "pkl")) == (tmp_path / "s.PKL", "pkl")


@pytest.mark.parametrize("args, message", [
    (["--timeline", "missing/t.png"], "error: cannot write the timeline to missing/t.png: the folder missing does not "
                                      "exist; create it first"),
    (["--timeline", "t.pdf"], "error: cannot write the timeline to t.pdf: '.pdf' is not a timeline format; end the "
                              "name in .html, .png or .svg"),
    (["--snapshot", "s.json"], "error: cannot write the snapshot to s.json: '.json' is not a snapshot format; end "
                               "the name in .pickle or .pkl"),
    (["--snapshot", "missing/s.pickle"], "error: cannot write the snapshot to missing/s.pickle: the folder missing "
                                         "does not exist; create it first"),
])
def test_bad_output_paths_exit_2_before_the_estimate(args: list[str], message: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from memcalc import api

    def no_estimate(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the estimate ran before the output path was checked")

    monkeypatch.setattr(api, "estimate", no_estimate)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["mlp", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == message
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "t.html"
    target.write_text("the old file")
    write_text = Path.write_text

    def disk_full(self: Path, text: str, *args: object, **kwargs: object) -> int:
        write_text(self, text[:100])  # a part written, then the failure
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(PlotPathError) as error:
        write_timeline([synthetic()], target, force=True)  # replacing it: the old file survives the failure
    assert str(error.value) == f"cannot write the timeline to {target}: OSError: No space left on device"
    assert os.listdir(tmp_path) == ["t.html"] and target.read_text() == "the old file"


# --- a real browser -----------------------------------------------------------------------

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
CHROMIUM = next((found for name in _BROWSERS if (found := shutil.which(name))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary on PATH (chromium, google-chrome): "
                                                             "install one (Debian: apt-get install chromium) to check "
                                                             "the HTML timeline in a real browser")

# Moves the pointer over the peak of the first chart, as a user would.
_HOVER = """<script>
(function () {
  var svg = document.querySelector("section.role svg.timeline");
  var peak = svg.querySelector(".peak path").getBoundingClientRect();
  svg.dispatchEvent(new MouseEvent("mousemove", {clientX: peak.left + peak.width / 2, clientY: peak.bottom + 20,
                                                  bubbles: true}));
})();
</script></body>"""


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


@needs_chromium
def test_chromium_renders_the_chart_and_the_hover(tmp_path: Path) -> None:
    t = synthetic(capacity=64 * MIB)
    page = tmp_path / "t.html"
    page.write_text(timeline_html([t, replace(synthetic(layers=5), role="other devices")]).replace("</body>", _HOVER))
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert 'data-ready="true"' in dom  # the inline script ran to its end
    assert dom.count('<section class="role"') == 2
    assert len(_areas(dom)) == 2 * 7 and dom.count('class="peak"') == 2
    # the hover: the tooltip names the event under the pointer — the peak — its op and module
    assert f'data-hover-event="{t.peak_index}"' in dom
    tooltip = re.search(r'<div class="tooltip"[^>]*>(.*?)</div></div>', dom, re.DOTALL)
    assert tooltip is not None and "hidden" not in tooltip[0].split(">", 1)[0]
    text = re.sub(r"<[^>]+>", " ", tooltip[1])
    assert f"event {t.peak_index:,}" in text and "backward, iteration 2" in text
    assert t.op[t.peak_index] in text and t.module[t.peak_index] in text
    assert format_bytes(t.peak_allocated) in text and "allocates" in text


@needs_chromium
def test_chromium_screenshot_shows_the_stack(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    page = tmp_path / "t.html"
    page.write_text(timeline_html(synthetic(capacity=64 * MIB)))
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "--window-size=1200,900", f"--screenshot={shot}", page.as_uri())
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (900, 1200) and pixels.std() > 0.1
    for category in (Category.ACTIVATIONS, Category.OPTIMIZER_STATE, Category.WORKSPACE):
        rgb = np.array([int(CATEGORY_STYLE[category][1][i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(axis=-1) < 0.02).sum() > 300, category


# --- the command end to end ---------------------------------------------------------------

def _run(tmp_path: Path, *args: str) -> dict[str, object]:
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])


def _peak_in_html(path: Path) -> list[int]:
    return [int(b) for b in re.findall(r'<g class="peak" data-event="\d+" data-bytes="(\d+)"', path.read_text())]


def test_cli_cnn_writes_html_png_and_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    html, png, snap = tmp_path / "t.html", tmp_path / "t.png", tmp_path / "s.pickle"
    args = ("resnet18", "--batch", "4", "--input-shape", "3,64,64", "--gpu", "t4")
    report = _run(tmp_path, *args, "--timeline", str(html), "--snapshot", str(snap))
    peak = report["bytes"]["peak_allocated"]  # type: ignore[index]
    assert _peak_in_html(html) == [peak]
    assert _areas(html.read_text())[:2] == ["parameters", "buffers"] and "capacity" in html.read_text()
    with snap.open("rb") as handle:
        snapshot = pickle.load(handle)
    assert set(snapshot) >= {"segments", "device_traces"} and snapshot["device_traces"][0]
    _run(tmp_path, *args, "--timeline", str(png))
    assert png.stat().st_size > 30_000
    assert sorted(os.listdir(tmp_path)) == ["s.pickle", "t.html", "t.png"]


@pytest.mark.slow  # HTML, PNG and snapshot of a checkpointed transformer
def test_cli_checkpointed_transformer(tmp_path: Path) -> None:
    plain, checkpointed = tmp_path / "plain.html", tmp_path / "checkpoint.html"
    first = _run(tmp_path, "gpt2", "--seq-len", "64", "--batch", "2", "--timeline", str(plain))
    second = _run(tmp_path, "gpt2", "--seq-len", "64", "--batch", "2", "--checkpoint", "--timeline",
                  str(checkpointed))
    assert _peak_in_html(plain) == [first["bytes"]["peak_allocated"]]  # type: ignore[index]
    assert _peak_in_html(checkpointed) == [second["bytes"]["peak_allocated"]]  # type: ignore[index]
    # checkpointing recomputes the blocks in backward: more events, fewer activations kept
    events = [int(re.search(r"over the ([\d,]+) allocator events", p.read_text())[1].replace(",", ""))
              for p in (plain, checkpointed)]
    assert events[1] > events[0]
    assert _peak_in_html(checkpointed)[0] < _peak_in_html(plain)[0]


@pytest.mark.parametrize("strategy, roles", [("fsdp", ["every rank (ranks 0, 1)"]),
                                             ("dp", ["output device (cuda:0)", "other devices"])])
@pytest.mark.quick_cases("fsdp-roles0")
def test_cli_multi_gpu_draws_one_chart_per_role(tmp_path: Path, strategy: str, roles: list[str]) -> None:
    html = tmp_path / "t.html"
    report = _run(tmp_path, "gpt2", "--seq-len", "64", "--batch", "2", "--strategy", strategy, "--world-size", "2",
                  "--timeline", str(html))
    text = html.read_text()
    assert re.findall(r'<section class="role" data-role="([^"]+)"', text) == roles
    assert _peak_in_html(html) == [r["peak_allocated"] for r in report["roles"]]  # type: ignore[attr-defined]


@pytest.mark.slow  # an SVG per role
def test_cli_multi_gpu_svg_has_a_panel_per_role(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    svg = tmp_path / "t.svg"
    _run(tmp_path, "gpt2", "--seq-len", "64", "--batch", "2", "--strategy", "dp", "--world-size", "2",
         "--timeline", str(svg))
    text = svg.read_text()
    assert "output device (cuda:0)" in text and "other devices" in text


def test_cli_eval_step_is_one_iteration(tmp_path: Path) -> None:
    html = tmp_path / "t.html"
    report = _run(tmp_path, "resnet18", "--batch", "2", "--input-shape", "3,32,32", "--mode", "eval",
                  "--timeline", str(html))
    text = html.read_text()
    assert "of the simulated step (one iteration)" in text and "iteration 2" not in text
    assert re.findall(r'<rect class="phase" data-phase="(\w+)" data-iteration="(\d)"', text) == [("forward", "1")]
    assert "<title>memcalc: resnet18, batch 2, eval, fp32</title>" in text  # no optimizer for a forward
    assert _peak_in_html(html) == [report["bytes"]["peak_allocated"]]  # type: ignore[index]
