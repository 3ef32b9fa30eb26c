"""The CPU target: what PyTorch's own CPU kernels run and allocate (:mod:`~memcalc.targets.cpu.kernels`)
and the sizes oneDNN takes inside them (:mod:`~memcalc.targets.cpu.onednn`)."""
