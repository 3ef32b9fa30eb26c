"""The step-time model's coefficients for the NVIDIA H100 80GB (SXM): WRITTEN BY
``scripts/fit_step_time.py`` from ``tests/data/gpu/2026-11-25-h100/`` (profile.json, times.jsonl);
do not edit, run the script (``--check`` tells whether this file is current)."""

from memcalc.core.throughput import OpClass

GPU = "h100-80gb"
DEVICE = "NVIDIA H100 80GB HBM3"
TORCH = "2.11.0"
#: fraction of the binding datasheet peak a large kernel of each class reaches
EFFICIENCY: dict[OpClass, float] = {
    OpClass.MATMUL: 0.3704,
    OpClass.MATMUL_UNALIGNED: 0.06513,
    OpClass.CONV: 0.1509,
    OpClass.ATTENTION: 0.1182,
    OpClass.NORMALIZATION: 0.1458,
    OpClass.MEMORY: 0.4535,
    OpClass.MULTI_TENSOR: 0.4438,
}
#: seconds each kernel of a class takes besides its roofline time
KERNEL_SECONDS: dict[OpClass, float] = {
    OpClass.MATMUL: 8.274e-06,
    OpClass.MATMUL_UNALIGNED: 8.274e-06,
    OpClass.CONV: 8.274e-06,
    OpClass.ATTENTION: 8.274e-06,
    OpClass.NORMALIZATION: 8.274e-06,
    OpClass.MEMORY: 8.274e-06,
    OpClass.MULTI_TENSOR: 8.274e-06,
}
#: seconds between kernels (launch and host-side dispatch), per kernel
GAP_SECONDS = 7.417e-06
#: the largest relative error left on the timed steps below
SPREAD = 0.08818
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
)
#: predicted / measured on the same steps measured again on another H100 (2026-11-26-steps/h100-times.jsonl)
RECHECK_RATIO = 2.072
RECHECK_RANGE = (1.956, 2.25)
RECHECK_DATE = "2026-11-26"
#: the profiled steps the kernel coefficients are fitted to
PROFILED: tuple[str, ...] = (
    "resnet50 b64 sgd-momentum amp-bf16",
    "vit_b_16 b64 adamw amp-bf16",
    "gpt2 b8 s1024 adamw amp-bf16",
    "bert-base b32 s512 adamw amp-bf16",
    "gpt2-medium b8 s1024 adamw bf16",
    "resnet50 b64 adam fp32",
    "llama-tiny b16 s1024 adamw amp-bf16",
    "mobilenet_v2 b128 sgd-momentum amp-fp16",
)
