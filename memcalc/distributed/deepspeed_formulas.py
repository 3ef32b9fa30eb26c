"""DeepSpeed's published closed forms for ZeRO model-state memory, and the ZeRO paper's.

These are *not* how memcalc estimates (it simulates the rank's step, see
:mod:`memcalc.distributed.strategies`); they are the reference its ZeRO numbers are tested against.
Pure functions of parameter counts; bytes out.

Sources: DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (``stage_1_and_2.py``) and
``estimate_zero3_model_states_mem_needs`` (``stage3.py``), microsoft/DeepSpeed at 38327e07; the
ZeRO paper (Rajbhandari et al., SC'20, arXiv:1910.02054), section 5.1. DeepSpeed has no stage-1
estimator. The formulas as DeepSpeed writes them, and how they changed:
docs/notes/deepspeed-formulas.md.

The DeepSpeed functions count parameters once even when tied: ``model_to_params`` dedups by
``data_ptr()``; memcalc dedups by storage (on meta tensors every ``data_ptr()`` is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = (
    "ADDITIONAL_BUFFER_FACTOR",
    "ZERO_PAPER_K",
    "ZeroEstimate",
    "model_to_params",
    "zero2_model_states",
    "zero3_model_states",
    "zero_paper_model_states",
)

#: DeepSpeed's estimators' default ``additional_buffer_factor`` (applies to CPU memory only).
ADDITIONAL_BUFFER_FACTOR = 1.5
#: The ZeRO paper's K for mixed-precision Adam: fp32 params (4) + momentum (4) + variance (4).
ZERO_PAPER_K = 12


@dataclass(frozen=True)
class ZeroEstimate:
    """Bytes per GPU and per CPU (node) as DeepSpeed's estimator returns them."""

    gpu_bytes: int
    cpu_bytes: int
    largest_layer_bytes: int = 0  # ZeRO-3 only: 4 × largest_layer_params


def zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, *,
                       cpu_offload: bool = False,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> ZeroEstimate:
    """``estimate_zero2_model_states_mem_needs`` (stage_1_and_2.py). DeepSpeed's default
    argument is ``cpu_offload=True``; memcalc's is ``False`` (no offload)."""
    _check(total_params, num_gpus_per_node, num_nodes)
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return ZeroEstimate(gpu_bytes=int(gpu), cpu_bytes=int(cpu))


def zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, *, cpu_offload: bool = False, cpu_offload_params: bool = False,
                       zero_init: bool = True,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> ZeroEstimate:
    """``estimate_zero3_model_states_mem_needs`` (stage3.py). DeepSpeed's defaults offload
    both optimizer and parameters; memcalc's default is no offload."""
    _check(total_params, num_gpus_per_node, num_nodes)
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest_layer_memory
            cpu = (total_params * 18 * gpus_factor * additional_buffer_factor if zero_init else
                   total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor)
        else:
            gpu = largest_layer_memory + int(2 * total_params / total_gpus)
            cpu = (total_params * 16 * gpus_factor * additional_buffer_factor if zero_init else
                   total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor)
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor if zero_init else
               total_params * 4 * num_gpus_per_node * additional_buffer_factor)
    return ZeroEstimate(gpu_bytes=int(gpu), cpu_bytes=int(cpu), largest_layer_bytes=int(largest_layer_memory))


def zero_paper_model_states(stage: int, total_params: int, world_size: int, k: int = ZERO_PAPER_K) -> float:
    """Model-state bytes per GPU from the ZeRO paper (stage 0 is plain data parallelism)."""
    _check(total_params, world_size, 1)
    psi, n = total_params, world_size
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"ZeRO stage must be 0 to 3, got {stage}")


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` as DeepSpeed's ``model_to_params`` counts them."""
    storages: dict[int, int] = {}
    for p in model.parameters():
        storages[id(p.untyped_storage())] = p.numel()
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(p.numel() for p in module.parameters(recurse=False)))
    return sum(storages.values()), largest


def _check(total_params: int, gpus: int, nodes: int) -> None:
    if total_params < 0 or gpus < 1 or nodes < 1:
        raise ValueError(f"need total_params ≥ 0 and at least one GPU and node "
                         f"(got {total_params}, {gpus}, {nodes})")
