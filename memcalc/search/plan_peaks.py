"""A memory bound ``memcalc plan`` takes from its traces: what a traced configuration holds at its
peak says what a smaller micro-batch of the same kin holds at least, so it may be ruled out
untraced (:class:`Peaks`).

Why it is sound: a configuration without a pipeline traces the same program at every
micro-batch (one micro-batch when there is no accumulation, two when there is: its ``family``),
so at the event of a traced configuration's peak another micro-batch ``m`` has the same storages
alive, each of its size at ``m``. A storage either does not depend on the batch (parameters,
gradients, optimizer state, buffers: the model states) or grows with it at most linearly
(activations, the inputs, temporaries such as activation gradients; those of a fixed size, like a
kernel workspace, only shrink less): with ``M`` the traced micro-batch, the other holds at least
``states + (m / M) × (activations + inputs + workspace)`` at that event, whatever the allocator
rounds (the categories are the bytes the tensors asked for). Less sharding or less checkpointing
holds more still: the ordering plan's rule for what does not fit already takes (a configuration
that does not fit rules out its family's with less sharding, less checkpointing, a larger
micro-batch). Above the GPU's capacity, the bound rules a configuration out as a trace that did
not fit would: allocated bytes above the capacity never fit.

A pipeline's trace is not recorded: it stops at its first rank that does not fit, and a stage's
program changes with the microbatches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memcalc.core.report import ByteBreakdown

__all__ = ("Peaks", "scaled_floor")


def scaled_floor(peak: ByteBreakdown, traced_micro: int, micro: int) -> float:
    """Bytes a configuration of ``micro`` samples per micro-batch holds at least at the event of
    ``peak``, the breakdown of the same program traced at ``traced_micro`` (module docstring)."""
    states = peak.parameters + peak.gradients + peak.optimizer_state + peak.buffers
    batch = peak.activations + peak.inputs + peak.workspace
    return states + batch * micro / traced_micro


@dataclass
class Peaks:
    """The traced peaks without a pipeline, per family (plan's ``_Config.family``), and the floor
    they give another configuration of the family with as much sharding or less, as much
    checkpointing or less and a micro-batch as large or smaller."""

    traced: dict[tuple[Any, ...], list[tuple[int, int, int, ByteBreakdown, str]]] = field(default_factory=dict)

    def record(self, family: tuple[Any, ...], dp_shard: int, ckpt: int, micro: int, peak: ByteBreakdown,
               label: str) -> None:
        """A traced configuration's breakdown at its peak (``label``: how it is named in notes)."""
        self.traced.setdefault(family, []).append((dp_shard, ckpt, micro, peak, label))

    def floor(self, family: tuple[Any, ...], dp_shard: int, ckpt: int, micro: int) -> tuple[float, str]:
        """The largest lower bound of the peak allocated bytes the traces give, and the traced
        configuration it came from (``0.0, ""``: none applies)."""
        best = (0.0, "")
        for shards, checkpoint, traced_micro, peak, label in self.traced.get(family, []):
            if shards >= dp_shard and checkpoint >= ckpt and traced_micro >= micro:
                bound = scaled_floor(peak, traced_micro, micro)
                if bound > best[0]:
                    best = (bound, label)
        return best
