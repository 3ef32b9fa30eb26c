"""memcalc: how much GPU memory will this PyTorch training step take, and where is the peak?

The model is built on meta tensors and one step runs symbolically under a dispatch mode that
tracks storage lifetimes; the alloc/free sequence is replayed the way the CUDA caching
allocator counts it. See README.md and docs/architecture.md.
"""

from memcalc.api import CPU, estimate, iter_sweep, max_batch_size, sweep
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import (
    InvalidInputError,
    MemcalcError,
    MissingPackageError,
    ModelSourceError,
    SymbolicExecutionError,
    UnknownModelError,
)
from memcalc.core.gpu import GpuProfile
from memcalc.core.losses import LossChoice
from memcalc.core.precision import Precision
from memcalc.core.report import ByteBreakdown, Measurement, MemoryReport, ModuleRow, RoleReport, Textbook
from memcalc.distributed.options import Distributed, FsdpSharding, Strategy
from memcalc.engine.optimizers import Optimizer
from memcalc.search.budget import BatchLimitError, Budget, DoesNotFitError, FitResult
from memcalc.search.sweep import SweepPoint

__version__ = "0.1.0"

__all__ = (
    "CPU",
    "BatchLimitError",
    "Budget",
    "ByteBreakdown",
    "Category",
    "Distributed",
    "DoesNotFitError",
    "FitResult",
    "FsdpSharding",
    "GpuProfile",
    "InvalidInputError",
    "LossChoice",
    "Measurement",
    "MemcalcError",
    "MemoryReport",
    "MissingPackageError",
    "Mode",
    "ModelSourceError",
    "ModuleRow",
    "Optimizer",
    "Phase",
    "Precision",
    "RoleReport",
    "Strategy",
    "SweepPoint",
    "SymbolicExecutionError",
    "Textbook",
    "UnknownModelError",
    "__version__",
    "estimate",
    "iter_sweep",
    "max_batch_size",
    "sweep",
)
