"""memcalc: how much GPU memory will this PyTorch training step take, and where is the peak?

The model is built on meta tensors and one step runs symbolically under a dispatch mode that
tracks storage lifetimes; the alloc/free sequence is replayed the way the CUDA caching
allocator counts it. See README.md and docs/architecture.md.

Importing ``memcalc`` is cheap: the public names below are loaded on first use (PEP 562), so
that importing a vocabulary module (``memcalc.core.losses``, which the model zoo does) never
drags in the whole package — and never closes an import cycle through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memcalc.api import estimate, fastest_setting, iter_sweep, max_batch_size, sweep
    from memcalc.core.categories import Category, Mode, Phase
    from memcalc.core.errors import (
        DataDependentError,
        InvalidInputError,
        LoopFunctionError,
        MemcalcError,
        MissingPackageError,
        ModelSourceError,
        PlotPathError,
        RejectedShapesError,
        SymbolicExecutionError,
        UnknownModelError,
    )
    from memcalc.core.finetune import FineTune, LoRA, Quant
    from memcalc.core.gpu import GpuProfile
    from memcalc.core.loop import Loop, LoopPreset, OptimizerImpl
    from memcalc.core.losses import LossChoice
    from memcalc.core.precision import Precision
    from memcalc.core.report import ByteBreakdown, Measurement, MemoryReport, ModuleRow, RoleReport, Textbook
    from memcalc.core.stack import Stack
    from memcalc.core.throughput import DataLoaderSetup, LoaderAdvice, StepFlops, StepTime
    from memcalc.cuda.gpus.performance import loader_advice, step_time, with_time
    from memcalc.distributed.options import Distributed, FsdpSharding, Strategy
    from memcalc.engine.optimizers import Optimizer
    from memcalc.fields import CPU
    from memcalc.search.budget import BatchLimitError, Budget, DoesNotFitError, FitResult
    from memcalc.search.sweep import SweepPoint
    from memcalc.search.throughput import ThroughputChoice
    from memcalc.sources.hub import HuggingFace

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CPU": "memcalc.fields",
    "estimate": "memcalc.api",
    "fastest_setting": "memcalc.api",
    "iter_sweep": "memcalc.api",
    "max_batch_size": "memcalc.api",
    "sweep": "memcalc.api",
    "Category": "memcalc.core.categories",
    "Mode": "memcalc.core.categories",
    "Phase": "memcalc.core.categories",
    "DataDependentError": "memcalc.core.errors",
    "InapplicableOptionError": "memcalc.core.errors",
    "InvalidInputError": "memcalc.core.errors",
    "LossFunctionError": "memcalc.core.errors",
    "LoopFunctionError": "memcalc.core.errors",
    "PlotPathError": "memcalc.core.errors",
    "RejectedShapesError": "memcalc.core.errors",
    "MemcalcError": "memcalc.core.errors",
    "MissingPackageError": "memcalc.core.errors",
    "ModelSourceError": "memcalc.core.errors",
    "SymbolicExecutionError": "memcalc.core.errors",
    "UnknownModelError": "memcalc.core.errors",
    "GpuProfile": "memcalc.core.gpu",
    "FineTune": "memcalc.core.finetune",
    "LoRA": "memcalc.core.finetune",
    "Quant": "memcalc.core.finetune",
    "Loop": "memcalc.core.loop",
    "LoopPreset": "memcalc.core.loop",
    "OptimizerImpl": "memcalc.core.loop",
    "Stack": "memcalc.core.stack",
    "LossChoice": "memcalc.core.losses",
    "Precision": "memcalc.core.precision",
    "ByteBreakdown": "memcalc.core.report",
    "Measurement": "memcalc.core.report",
    "MemoryReport": "memcalc.core.report",
    "ModuleRow": "memcalc.core.report",
    "RoleReport": "memcalc.core.report",
    "Textbook": "memcalc.core.report",
    "Distributed": "memcalc.distributed.options",
    "FsdpSharding": "memcalc.distributed.options",
    "Strategy": "memcalc.distributed.options",
    "Optimizer": "memcalc.engine.optimizers",
    "BatchLimitError": "memcalc.search.budget",
    "Budget": "memcalc.search.budget",
    "DoesNotFitError": "memcalc.search.budget",
    "FitResult": "memcalc.search.budget",
    "SweepPoint": "memcalc.search.sweep",
    "StepFlops": "memcalc.core.throughput",
    "StepTime": "memcalc.core.throughput",
    "DataLoaderSetup": "memcalc.core.throughput",
    "LoaderAdvice": "memcalc.core.throughput",
    "ThroughputChoice": "memcalc.search.throughput",
    "loader_advice": "memcalc.cuda.gpus.performance",
    "step_time": "memcalc.cuda.gpus.performance",
    "with_time": "memcalc.cuda.gpus.performance",
    "HuggingFace": "memcalc.sources.hub",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memcalc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = (
    "CPU",
    "BatchLimitError",
    "Budget",
    "ByteBreakdown",
    "Category",
    "DataDependentError",
    "DataLoaderSetup",
    "Distributed",
    "DoesNotFitError",
    "FineTune",
    "FitResult",
    "FsdpSharding",
    "GpuProfile",
    "HuggingFace",
    "InapplicableOptionError",
    "InvalidInputError",
    "LoRA",
    "LoaderAdvice",
    "Loop",
    "LoopFunctionError",
    "LoopPreset",
    "LossChoice",
    "LossFunctionError",
    "Measurement",
    "MemcalcError",
    "MemoryReport",
    "MissingPackageError",
    "Mode",
    "ModelSourceError",
    "ModuleRow",
    "Optimizer",
    "OptimizerImpl",
    "Phase",
    "PlotPathError",
    "Precision",
    "Quant",
    "RejectedShapesError",
    "RoleReport",
    "Stack",
    "StepFlops",
    "StepTime",
    "Strategy",
    "SweepPoint",
    "SymbolicExecutionError",
    "Textbook",
    "ThroughputChoice",
    "UnknownModelError",
    "__version__",
    "estimate",
    "fastest_setting",
    "iter_sweep",
    "loader_advice",
    "max_batch_size",
    "step_time",
    "sweep",
    "with_time",
)
