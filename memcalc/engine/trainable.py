"""Training steps that PyTorch itself refuses to run, refused here with PyTorch's reason rather
than estimated as if they ran (issue 32, item 9), and the one that memcalc cannot follow:

- nothing trains (every parameter frozen, ``--freeze '*'``, or a model without parameters):
  ``torch.optim.Adam([])`` raises "optimizer got an empty parameter list", and without an
  optimizer ``loss.backward()`` raises "element 0 of tensors does not require grad and does not
  have a grad_fn";
- the loss does not depend on any trainable parameter (the model returns ``output.detach()``,
  computes under ``torch.no_grad()``, or a loss function detaches): the same ``backward()``
  error;
- an embedding with ``sparse=True``: its backward makes a sparse gradient, whose storage the
  tracer cannot follow (``SparseTensorImpl`` has none).

Each is :class:`RefusedStepError` (exit 2: the user can change the model or the mode),
naming the model, or the module, and what to do.
"""

from __future__ import annotations

import torch
from torch import nn

from memcalc.core.errors import RefusedStepError
from memcalc.core.loop import OptimizerImpl
from memcalc.engine.optimizers import OptimizerSpec

__all__ = ("NO_GRAD_FN", "build_optimizer", "check_loss_trains")

#: What ``loss.backward()`` says of a loss that does not require grad (torch/csrc/autograd/engine.cpp).
NO_GRAD_FN = "element 0 of tensors does not require grad and does not have a grad_fn"
#: What ``torch.optim.Optimizer.__init__`` says of no parameters.
EMPTY_PARAMETERS = "optimizer got an empty parameter list"
_EVAL_HINT = "estimate a forward only (--mode eval, or mode=\"eval\")"


def build_optimizer(model: nn.Module, spec: OptimizerSpec, impl: OptimizerImpl) -> torch.optim.Optimizer | None:
    """The step's optimizer over ``model``'s trainable parameters (None for ``none``), after
    refusing what the real step would refuse before its first forward.

    Raises:
        RefusedStepError: no parameter requires a gradient; an embedding makes sparse gradients.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise _nothing_trains(model, spec)
    _refuse_sparse_gradients(model)
    return spec.build(params, impl)


def check_loss_trains(loss: torch.Tensor) -> None:
    """Refuses ``loss.backward()`` on a loss that does not require grad, as PyTorch does.

    Raises:
        RefusedStepError: the loss has no ``grad_fn``.
    """
    if loss.requires_grad:
        return
    raise RefusedStepError(
        f"the training step's loss does not require grad, and loss.backward() raises \"{NO_GRAD_FN}\": the "
        f"model's output (or the loss computed from it) is detached from its trainable parameters (a .detach(), "
        f".data or torch.no_grad() in the forward or in the loss function)",
        hint=f"Return the output without detaching it, or {_EVAL_HINT}.")


def _nothing_trains(model: nn.Module, spec: OptimizerSpec) -> RefusedStepError:
    name = type(model).__name__
    why = (f"the model ({name}) has no parameters" if next(model.parameters(), None) is None
           else f"no parameter of the model ({name}) requires a gradient (every one is frozen: --freeze '*', or "
                f"requires_grad=False)")
    if spec.factory is not None:
        built = f"torch.optim.{spec.torch_class}([])" if spec.torch_class else f"the optimizer {spec.display} over []"
        refusal = f"{built} raises \"{EMPTY_PARAMETERS}\""
    else:
        refusal = f"its loss has no grad_fn, and loss.backward() raises \"{NO_GRAD_FN}\""
    return RefusedStepError(f"the training step cannot run: {why}, so {refusal}",
                            hint=f"Leave some parameters trainable (freeze fewer), or {_EVAL_HINT}.")


def _refuse_sparse_gradients(model: nn.Module) -> None:
    for path, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            where = f"module {path!r}" if path else "the model"
            raise RefusedStepError(
                f"{where} ({type(module).__name__}(sparse=True)) makes a sparse gradient in the backward, which "
                f"memcalc cannot follow: a sparse tensor's memory is not one storage",
                hint=f"Estimate the model with sparse=False (the dense gradient is the size of the weight: an upper "
                     f"bound on the sparse one), freeze that embedding, or {_EVAL_HINT}.")
