"""A real ``torch.cuda.memory._snapshot()`` beside memcalc's simulated step of the same configuration.

Someone debugging an out-of-memory error has two things: the snapshot of the run that failed (or
nearly did), and memcalc's estimate of the same step. This module says where they part:

* the peaks — allocated and reserved — of each, and the run's own allocation stream replayed
  through memcalc's allocator model (:mod:`memcalc.measure.snapshot`), which splits the
  reserved difference into what the *stream* does (which tensors, which workspaces) and what the
  *allocator* does (nothing, on every real snapshot here, given the real addresses);
* the allocations of each phase (setup, forward, loss, backward, optimizer, zero_grad): how many,
  how many bytes;
* the blocks one side has and the other lacks, matched by phase and request (rounded as the
  allocator rounds, and above 1 MiB to 4 KiB: a cuDNN workspace carries a tail of 16 to about
  700 bytes that the rule does not follow to the byte): for the run's, the call site that made
  most of them; for memcalc's, the op and its category.

A real trace names no phase: it is read from the Python stack of each allocation. No Python
frame means the autograd engine's thread (backward); ``torch/optim`` the optimizer; a loss
function the loss; a module's ``forward`` the forward; anything else — building the model,
the inputs, the cuBLAS warm-up — is setup. memcalc's own snapshot (``--snapshot``) names the
phase in its one frame (``<memcalc>:0 forward layer1.0.conv1 aten.convolution.default``), and
is read so, on either side.

A snapshot of another model says so (:attr:`SnapshotComparison.mismatch`, one line): for
memcalc's own snapshot, when most of its allocations come from frames (phase, module, op) the
model's step never makes; for a real one, when its forward runs code (a ``forward`` frame outside
torch) that is not the model's (``model_code``: where the ``forward`` of each of the model's
classes lies): none of it, or a ``forward`` of the model's own files that none of its classes has
(resnet18's ``BasicBlock`` beside resnet50's ``Bottleneck``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from typing import Any

from memcalc.core.categories import Phase
from memcalc.core.report import MemoryReport
from memcalc.core.snapshot_comparison import BlockDifference, PhaseRow, SnapshotComparison
from memcalc.engine.allocator import round_size
from memcalc.measure.snapshot import RealAllocation, RealSnapshot, read_snapshot, replay_snapshot
from memcalc.measure.snapshot_export import FRAME_FILENAME, snapshot_dict

__all__ = ("BlockDifference", "CodeSpan", "PhaseRow", "SnapshotComparison", "compare_snapshot", "is_memcalc_snapshot",
           "real_phase")

#: The block differences listed on each side, largest first.
SHOWN = 10
#: How a frame of memcalc's own snapshot begins (``"<memcalc>:0 phase module op"``).
_MEMCALC_FRAME = f"{FRAME_FILENAME}:0 "
#: The share of a memcalc snapshot's allocations from frames the model's step does not make above
#: which the snapshot is said to be of another model (the same model at another batch: none).
_FOREIGN_SHARE = 0.5
#: Frames of torch's own code: a module's forward there is not the model's (``nn.Linear``'s).
_TORCH_CODE = ("/torch/",)
#: What marks a loss function in a frame: torch's loss modules and functions, memcalc's losses.
_LOSS_MARKS = ("torch/nn/modules/loss.py", "memcalc/engine/losses.py", " cross_entropy", " mse_loss", " nll_loss")


def real_phase(frames: Iterable[str]) -> str:
    """The phase of a real allocation, from its Python frames (innermost first)."""
    frames = tuple(frames)
    if not frames:
        return Phase.BACKWARD.value  # the autograd engine's own thread runs no Python
    if frames[0].startswith(_MEMCALC_FRAME):  # memcalc's own snapshot names its phase
        return frames[0][len(_MEMCALC_FRAME):].split(" ", 1)[0] or Phase.SETUP.value
    text = "\n".join(frames)
    if "torch/optim/" in text:
        return Phase.ZERO_GRAD.value if " zero_grad" in text else Phase.OPTIMIZER.value
    if "torch/autograd/" in text or ("_tensor.py" in text and " backward" in text):
        return Phase.BACKWARD.value
    if any(mark in text for mark in _LOSS_MARKS):
        return Phase.LOSS.value
    if any(frame.endswith(" forward") for frame in frames):
        return Phase.FORWARD.value
    return Phase.SETUP.value


def is_memcalc_snapshot(snapshot: RealSnapshot) -> bool:
    """Whether ``snapshot`` is memcalc's own (``--snapshot``): its frames are ``<memcalc>``'s."""
    return any(a.frames and a.frames[0].startswith(_MEMCALC_FRAME) for a in snapshot.allocations)


def _site(allocation: RealAllocation) -> str:
    """The innermost frame, as ``dir/file.py:line function``; the autograd engine without one."""
    if not allocation.frames:
        return "(autograd engine thread)"
    if allocation.frames[0].startswith(_MEMCALC_FRAME):  # "phase module op": the module and op
        return allocation.frames[0][len(_MEMCALC_FRAME):].partition(" ")[2]
    path, _, rest = allocation.frames[0].partition(":")
    return "/".join(path.split("/")[-2:]) + ":" + rest


def _memcalc_phase(allocation: RealAllocation) -> str:
    return real_phase(allocation.frames) if allocation.frames else Phase.SETUP.value


def _memcalc_frames(data: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """memcalc's snapshot: per trace index of an ``alloc``, its frame name and category."""
    return {i: (e["frames"][0]["name"] if e["frames"] else "", str(e.get("category", "")))
            for i, e in enumerate(data["device_traces"][0]) if e["action"] == "alloc"}


#: Above this size two requests match when they agree to :data:`_LARGE_MATCH` bytes.
_LARGE = 1 << 20
_LARGE_MATCH = 4096


def _matched_size(nbytes: int) -> int:
    """The size a block is matched by: the allocator's rounding, and above 1 MiB 4 KiB (library
    workspaces carry a tail of a few hundred bytes that the estimate does not follow exactly)."""
    if nbytes < _LARGE:
        return round_size(nbytes)
    return -(-nbytes // _LARGE_MATCH) * _LARGE_MATCH


#: Where a ``forward`` of the model lies: its source file and its first and last lines.
CodeSpan = tuple[str, int, int]


def compare_snapshot(real: RealSnapshot, report: MemoryReport,
                     model_code: Collection[CodeSpan] = ()) -> SnapshotComparison:
    """Compare a real snapshot (:func:`~memcalc.measure.snapshot.load_snapshot`) with the
    estimate of the same configuration.

    Args:
        real: the run's snapshot, read.
        report: memcalc's estimate of the same step (its step is replayed for the comparison).
        model_code: where the ``forward`` of each of the model's classes lies (torch's own left
            out), to tell a real snapshot of another model (empty: only torch's modules).

    Returns:
        A :class:`SnapshotComparison`.
    """
    data = snapshot_dict(report)
    simulated = read_snapshot(data)
    named = _memcalc_frames(data)
    real_groups: dict[tuple[str, int], list[RealAllocation]] = defaultdict(list)
    for allocation in real.allocations:
        real_groups[(real_phase(allocation.frames), _matched_size(allocation.nbytes))].append(allocation)
    sim_groups: dict[tuple[str, int], list[RealAllocation]] = defaultdict(list)
    for allocation in simulated.allocations:
        sim_groups[(_memcalc_phase(allocation), _matched_size(allocation.nbytes))].append(allocation)
    missing, extra = [], []
    for key in set(real_groups) | set(sim_groups):
        ours, theirs = sim_groups.get(key, []), real_groups.get(key, [])
        if len(theirs) > len(ours):
            site = Counter(_site(a) for a in theirs).most_common(1)[0][0]
            missing.append(BlockDifference(key[0], key[1], len(theirs) - len(ours), site))
        elif len(ours) > len(theirs):
            label = Counter(named.get(a.alloc_index, ("", "")) for a in ours).most_common(1)[0][0]
            site = label[0].split(" ", 1)[1] if " " in label[0] else label[0]
            extra.append(BlockDifference(key[0], key[1], len(ours) - len(theirs), site, label[1]))
    order = [p.value for p in Phase]
    phases = []
    for phase in order:
        real_in = [a for (p, _), group in real_groups.items() if p == phase for a in group]
        sim_in = [a for (p, _), group in sim_groups.items() if p == phase for a in group]
        if real_in or sim_in:
            phases.append(PhaseRow(phase, len(real_in), sum(a.nbytes for a in real_in),
                                   len(sim_in), sum(a.nbytes for a in sim_in)))
    missing.sort(key=_largest_first)
    extra.sort(key=_largest_first)
    replayed = replay_snapshot(real, real_addresses=False)
    return SnapshotComparison(
        real_peak_allocated=_real_peak_allocated(real), real_peak_reserved=real.peak_reserved,
        memcalc_peak_allocated=report.bytes.peak_allocated, memcalc_peak_reserved=report.peak_reserved,
        replayed_peak_reserved=replayed.stats.peak_reserved, phases=tuple(phases),
        missing=tuple(missing[:SHOWN]), extra=tuple(extra[:SHOWN]),
        missing_total=sum(d.nbytes for d in missing), extra_total=sum(d.nbytes for d in extra),
        mismatch=_mismatch(real, simulated, report.model, model_code))


def _mismatch(real: RealSnapshot, simulated: RealSnapshot, model: str,
              model_code: Collection[CodeSpan]) -> str | None:
    """One line when the snapshot's modules are not the model's (module docstring), else None."""
    ours = [a for a in real.allocations if a.frames and a.frames[0].startswith(_MEMCALC_FRAME)]
    if ours:
        made = {a.frames[0] for a in simulated.allocations if a.frames}
        foreign = [_site(a) for a in ours if a.frames[0] not in made]
        if len(foreign) <= _FOREIGN_SHARE * len(ours):
            return None
        named = list(dict.fromkeys(site.split(" ", 1)[0] for site in foreign))[:3]
        return (f"this memcalc snapshot is not of {model}'s step: {len(foreign)} of its {len(ours)} allocations "
                f"come from modules and ops {model}'s step does not run ({', '.join(named)}, ...)")
    forwards = {frame for a in real.allocations for frame in a.frames
                if frame.endswith(" forward") and not any(mark in frame for mark in _TORCH_CODE)}
    ours_at = [frame for frame in forwards if any(_within(frame, span) for span in model_code)]
    files = {_short(span[0]) for span in model_code}
    foreign = sorted(frame for frame in forwards if frame not in ours_at
                     and (not ours_at or _short(frame.partition(":")[0]) in files))
    if not forwards or not foreign:
        return None
    shown = ", ".join(_short(frame) for frame in foreign[:3])
    return (f"this snapshot's forward runs code that is not {model}'s ({shown}): it looks like a snapshot of "
            f"another model, so its differences say little about {model}")


def _short(path: str) -> str:
    """A path (or a frame) by its last two components (``models_zoo/resnet.py:75 forward``)."""
    return "/".join(path.replace("\\", "/").split("/")[-2:])


def _within(frame: str, span: CodeSpan) -> bool:
    """Whether a frame (``path:line forward``) runs inside ``span``'s lines of the same file."""
    path, _, rest = frame.partition(":")
    line = rest.split(" ", 1)[0]
    return (line.isdigit() and _short(path) == _short(span[0]) and span[1] <= int(line) <= span[2])


def _largest_first(difference: BlockDifference) -> tuple[int, str, int]:
    return -difference.nbytes, difference.phase, difference.size


def _real_peak_allocated(real: RealSnapshot) -> int:
    """The run's peak of allocated block bytes over its trace (the seed's live blocks included)."""
    return replay_snapshot(real, real_addresses=True).stats.peak_allocated

