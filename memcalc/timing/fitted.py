"""The step-time model's coefficients, measured on an NVIDIA H200: WRITTEN BY
``scripts/fit_step_time.py`` from ``tests/data/gpu/2026-11-26-h200-profile/`` (profile.json, times.jsonl);
do not edit, run the script (``--check`` tells whether this file is current)."""

from memcalc.core.throughput import OpClass

GPU = "h200"
DEVICE = "NVIDIA H200"
TORCH = "2.11.0"
#: fraction of the binding datasheet peak a large kernel of each class reaches
EFFICIENCY: dict[OpClass, float] = {
    OpClass.MATMUL: 0.7691,
    OpClass.MATMUL_UNALIGNED: 0.1281,
    OpClass.CONV: 0.2836,
    OpClass.ATTENTION: 0.2046,
    OpClass.NORMALIZATION: 0.227,
    OpClass.MEMORY: 0.81,
    OpClass.MULTI_TENSOR: 0.8572,
}
#: seconds each kernel of a class takes besides its roofline time
KERNEL_SECONDS: dict[OpClass, float] = {
    OpClass.MATMUL: 4.965e-06,
    OpClass.MATMUL_UNALIGNED: 4.965e-06,
    OpClass.CONV: 4.965e-06,
    OpClass.ATTENTION: 4.965e-06,
    OpClass.NORMALIZATION: 4.965e-06,
    OpClass.MEMORY: 4.965e-06,
    OpClass.MULTI_TENSOR: 4.965e-06,
}
#: seconds between kernels (launch and host-side dispatch), per kernel
GAP_SECONDS = 1.835e-06
#: the host's seconds per kernel (eager dispatch): a step is never shorter than its kernels × this
HOST_SECONDS = 2.5e-05
#: the largest |measured / predicted - 1| on the timed steps below: predicted × (1 ± this) covers them
SPREAD = 0.2428
#: the timed steps the spread is measured on
TIMED: tuple[str, ...] = (
    "resnet50 b64 sgd-momentum amp-bf16",
    "resnet50 b256 sgd-momentum amp-bf16",
    "vit_b_16 b64 adamw amp-bf16",
    "gpt2 b8 s1024 adamw amp-bf16",
    "gpt2 b16 s1024 adamw amp-bf16 + checkpoint",
    "bert-base b32 s512 adamw amp-bf16",
    "gpt2-medium b8 s1024 adamw bf16",
    "resnet50 b64 adam fp32",
    "resnet50 b16 sgd-momentum amp-bf16",
    "gpt2 b2 s512 adamw amp-bf16",
    "llama-tiny b16 s1024 adamw amp-bf16",
    "mobilenet_v2 b128 sgd-momentum amp-fp16",
)
#: predicted / measured on a healthy H100's steps, not fitted (2026-11-26-steps/h100-times.jsonl),
#: timed with the H100's datasheet peaks: the check of the datasheet scaling
RECHECK_GPU = "h100-80gb"
RECHECK_STEPS = 8
RECHECK_RATIO = 1.121
RECHECK_RANGE = (1.067, 1.275)
RECHECK_DATE = "2026-11-26"
#: per catalogue key, the factor on the datasheet bandwidth fitted to that GPU's own steps above
#: (the H200's coefficients kept); its predicted / measured on them, and each left out of the fit
MEASURED_BANDWIDTH: dict[str, float] = {"h100-80gb": 1.226}
MEASURED_STEPS = 8
MEASURED_RANGE = (0.9439, 1.086)
MEASURED_HELD_OUT_RANGE = (0.9384, 1.11)
#: the profiled steps the kernel coefficients are fitted to
PROFILED: tuple[str, ...] = (
    "resnet50 b64 sgd-momentum amp-bf16",
    "resnet50 b256 sgd-momentum amp-bf16",
    "vit_b_16 b64 adamw amp-bf16",
    "gpt2 b8 s1024 adamw amp-bf16",
    "gpt2 b16 s1024 adamw amp-bf16 + checkpoint",
    "bert-base b32 s512 adamw amp-bf16",
    "gpt2-medium b8 s1024 adamw bf16",
    "resnet50 b64 adam fp32",
)
