"""memcalc: how much GPU memory will this PyTorch training step take, and where is the peak?

The model is built on meta tensors and one step runs symbolically under a dispatch mode that
tracks storage lifetimes; the alloc/free sequence is replayed the way the CUDA caching
allocator counts it. See README.md.
"""

from .api import estimate
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import (
    InvalidInputError,
    MemcalcError,
    MissingPackageError,
    ModelSourceError,
    SymbolicExecutionError,
    UnknownModelError,
)
from memcalc.engine.losses import LossChoice
from memcalc.engine.optimizers import Optimizer
from memcalc.core.report import ByteBreakdown, Measurement, MemoryReport, ModuleRow, RoleReport, Textbook
from memcalc.search.fit import FitResult, max_batch_size, sweep

__version__ = "0.1.0"

__all__ = (
    "estimate",
    "max_batch_size",
    "FitResult",
    "sweep",
    "MemoryReport",
    "RoleReport",
    "ByteBreakdown",
    "ModuleRow",
    "Textbook",
    "Measurement",
    "Category",
    "Phase",
    "Mode",
    "Optimizer",
    "LossChoice",
    "MemcalcError",
    "UnknownModelError",
    "ModelSourceError",
    "InvalidInputError",
    "SymbolicExecutionError",
    "MissingPackageError",
    "__version__",
)
