"""Real measurements, the independent check of every estimate: the real step run on this
machine (:mod:`~memcalc.measure.step`: CUDA's peak counters, or the CPU profiler's allocations)
and a real ``torch.cuda.memory._snapshot()`` read as an allocation stream the allocator model
replays (:mod:`~memcalc.measure.snapshot`). How they are shown, and the comparison of a snapshot
with the simulated step, are :mod:`memcalc.report`'s."""
