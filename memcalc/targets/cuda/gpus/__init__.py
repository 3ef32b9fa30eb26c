"""GPUs: the catalogue of known cards (:mod:`memcalc.targets.cuda.gpus.catalogue`, one record per
card in ``gpus.toml``: capacity, SMs, CUDA context, peaks, lookup by a forgiving name) and the
discovery of the GPUs of this machine (:mod:`memcalc.targets.cuda.gpus.local`: NVML, nvidia-smi or
torch, ``CUDA_VISIBLE_DEVICES``). :class:`~memcalc.core.gpu.GpuProfile` itself lives in
:mod:`memcalc.core.gpu`."""
