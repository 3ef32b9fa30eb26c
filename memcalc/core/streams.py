"""The CUDA streams a step allocates on: :class:`Stream`.

PyTorch's caching allocator keeps a freed block in the pool of the stream it was allocated on,
and a request on one stream never takes a block cached for another (``get_free_block`` in
``c10/cuda/CUDACachingAllocator.cpp``). One stream, the compute stream, is all a single-GPU step
uses; FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, ``FSDPCommContext``)
adds its own streams for the collectives, whose buffers then live in pools of their own that the
compute stream cannot reuse. The allocator model (:mod:`memcalc.engine.allocator`) takes a stream
as a number; these are the ones memcalc's programs allocate on. Vocabulary only.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("Stream",)


class Stream(IntEnum):
    """A stream a storage is allocated on. The order is the one the allocator's pools sort
    streams in (``BlockComparatorSize`` compares the stream handles first): the default stream,
    a null handle, before the side streams FSDP2's lazy init creates, in their creation order."""

    #: The current stream of the step: forward, backward, the optimizer (the default stream).
    COMPUTE = 0
    #: FSDP2's ``all_gather_copy_in_stream``: the cast all-gather inputs and the all-gather output
    #: are allocated on it (``foreach_all_gather``: ``with device_handle.stream(all_gather_copy_in_stream)``).
    ALL_GATHER_COPY_IN = 1
    #: FSDP2's ``reduce_scatter_stream``: the reduce-scatter output, this rank's sharded gradients
    #: (``foreach_reduce``: ``with device_handle.stream(reduce_scatter_stream)``).
    REDUCE_SCATTER = 2

    @property
    def label(self) -> str:
        """The name people know it by (``all-gather copy-in``)."""
        return self.name.lower().replace("_", "-").replace("-copy-in", " copy-in")
