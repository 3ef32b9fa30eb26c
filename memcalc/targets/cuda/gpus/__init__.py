"""GPUs: the catalogue of known cards (:mod:`memcalc.targets.cuda.gpus.catalogue`: capacity, CUDA
context, cuBLAS workspace, lookup by a forgiving name) and the discovery of the GPUs of this
machine (:mod:`memcalc.targets.cuda.gpus.local`: NVML, nvidia-smi or torch, ``CUDA_VISIBLE_DEVICES``).
:class:`~memcalc.core.gpu.GpuProfile` itself lives in :mod:`memcalc.core.gpu`."""
