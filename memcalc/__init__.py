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

__version__ = "0.1.0"

#: The public API, listed once: each name and the module that defines it. ``__all__`` and the
#: lazy loader come from this table; the imports for type checkers below repeat it, and
#: tests/test_architecture.py keeps the two equal. Every other name stays importable from its
#: module (``memcalc.core.categories.Phase``, ``memcalc.core.precision.Precision``, ...).
_PUBLIC: dict[str, str] = {
    # what memcalc answers
    "estimate": "memcalc.api",
    "max_batch_size": "memcalc.api",
    "sweep": "memcalc.api",
    "iter_sweep": "memcalc.api",
    "fastest_setting": "memcalc.api",
    "plan": "memcalc.api",
    "step_time": "memcalc.timing.performance",
    # the step it answers for
    "Step": "memcalc.engine.step_spec",
    "CPU": "memcalc.fields",
    "GpuProfile": "memcalc.core.gpu",
    "Distributed": "memcalc.distributed.setting",
    "Loop": "memcalc.core.loop",
    "Stack": "memcalc.core.stack",
    "FineTune": "memcalc.core.finetune",
    "LoRA": "memcalc.core.finetune",
    "HuggingFace": "memcalc.stacks.transformers.hub",
    # what it returns
    "MemoryReport": "memcalc.core.report",
    "Category": "memcalc.core.categories",
    "FitResult": "memcalc.search.fit_result",
    "SweepPoint": "memcalc.search.sweep",
    # what it raises: the base class, and the errors a caller catches
    "MemcalcError": "memcalc.core.errors",
    "InvalidInputError": "memcalc.core.errors",
    "InapplicableOptionError": "memcalc.core.errors",
    "UnknownModelError": "memcalc.core.errors",
    "SymbolicExecutionError": "memcalc.core.errors",
    "DoesNotFitError": "memcalc.search.fit_result",
    # how another package extends it
    "register_optimizer": "memcalc.engine.optimizers",
    "OptimizerSpec": "memcalc.engine.optimizers",
}

if TYPE_CHECKING:  # the table above, for type checkers (``as``: re-exported under mypy --strict)
    from memcalc.api import estimate as estimate
    from memcalc.api import fastest_setting as fastest_setting
    from memcalc.api import iter_sweep as iter_sweep
    from memcalc.api import max_batch_size as max_batch_size
    from memcalc.api import plan as plan
    from memcalc.api import sweep as sweep
    from memcalc.core.categories import Category as Category
    from memcalc.core.errors import InapplicableOptionError as InapplicableOptionError
    from memcalc.core.errors import InvalidInputError as InvalidInputError
    from memcalc.core.errors import MemcalcError as MemcalcError
    from memcalc.core.errors import SymbolicExecutionError as SymbolicExecutionError
    from memcalc.core.errors import UnknownModelError as UnknownModelError
    from memcalc.core.finetune import FineTune as FineTune
    from memcalc.core.finetune import LoRA as LoRA
    from memcalc.core.gpu import GpuProfile as GpuProfile
    from memcalc.core.loop import Loop as Loop
    from memcalc.core.report import MemoryReport as MemoryReport
    from memcalc.core.stack import Stack as Stack
    from memcalc.distributed.setting import Distributed as Distributed
    from memcalc.engine.optimizers import OptimizerSpec as OptimizerSpec
    from memcalc.engine.optimizers import register_optimizer as register_optimizer
    from memcalc.engine.step_spec import Step as Step
    from memcalc.fields import CPU as CPU
    from memcalc.search.fit_result import DoesNotFitError as DoesNotFitError
    from memcalc.search.fit_result import FitResult as FitResult
    from memcalc.search.sweep import SweepPoint as SweepPoint
    from memcalc.stacks.transformers.hub import HuggingFace as HuggingFace
    from memcalc.timing.performance import step_time as step_time

__all__ = ("__version__", *_PUBLIC)


if not TYPE_CHECKING:  # hidden from type checkers, which see the imports above: any other name is an error

    def __getattr__(name: str) -> Any:
        module = _PUBLIC.get(name)
        if module is None:
            raise AttributeError(f"module 'memcalc' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
