"""One rank of ``torch.nn.parallel.DistributedDataParallel``: the whole model, plus the
Reducer's gradient buckets, the per-forward broadcast of buffers and, with
``find_unused_parameters=True`` (what the Hugging Face Trainer passes for most models:
:func:`trainer_finds_unused`), the clones of the outputs DDP's ``_DDPSink`` makes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Category
from memcalc.distributed.program import RankProgram, coalesced_chunks, map_output
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import StorageTracer
from memcalc.stacks.kbit import is_transformers_model

__all__ = (
    "DDP_BROADCAST_BUCKET_BYTES",
    "DdpProgram",
    "trainer_finds_unused",
)

# DistributedDataParallel(broadcast_buffers=True) broadcasts buffers every forward through
# _distributed_broadcast_coalesced(..., self.broadcast_bucket_size) with this bucket size.
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class DdpProgram(RankProgram):
    """One DDP rank (checked against the real class on the CPU, tests/test_strategies.py):
    the whole model, its gradients and optimizer state, plus the Reducer's
    gradient buckets — flat buffers allocated when DDP is constructed, one per
    ``bucket_cap_mb`` of the parameters that require grad (``_build_params_for_reducer``:
    frozen ones get none) in reverse registration order (as
    ``dist._compute_bucket_assignment_by_size`` assigns them after the first iteration's
    rebuild), held for the life of the model. Each gradient autograd produces is copied into
    its bucket, all-reduced there and copied back: buckets and ``.grad`` both exist. With
    ``gradient_as_bucket_view=True`` the Reducer makes ``.grad`` a view of the bucket
    instead: the buckets *are* the gradients (the tensor autograd allocates after
    ``zero_grad(set_to_none=True)`` lives only until it is copied in)."""

    def __init__(self, bucket_cap_bytes: int, gradient_as_bucket_view: bool, training: bool,
                 find_unused_parameters: bool = False, wrapped: str | None = None):
        """``wrapped``: the submodule DDP wraps (TRL's policy: accelerate prepares the reference with
        ``evaluation_mode=True``, outside DDP, and TRL's ``compute_loss`` around both is no module of
        DDP's), whose outputs ``_DDPSink`` clones and whose buffers are broadcast; None: the model."""
        super().__init__()
        self.wrapped = wrapped
        self.bucket_cap_bytes = bucket_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.training = training
        self.find_unused_parameters = find_unused_parameters
        if find_unused_parameters and training:
            self.notes.append("DDP find_unused_parameters=True, as the Trainer passes it here (its "
                              "ddp_find_unused_parameters, else True unless a PreTrainedModel is checkpointed): "
                              "DDP's _DDPSink clones the model's outputs after each forward")
        self.bucket_bytes: list[int] = []
        self._views: dict[int, torch.Tensor] = {}

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            self._make_buckets(params)
        if self.wrapped is not None:
            module = module.get_submodule(self.wrapped)
        chunks = coalesced_chunks(list(module.buffers()), DDP_BROADCAST_BUCKET_BYTES)
        if chunks:
            def broadcast_buffers(_module: nn.Module, _args: Any) -> None:
                for chunk in chunks:
                    self._transient(chunk)

            self._handles.append(module.register_forward_pre_hook(broadcast_buffers))
        if self.find_unused_parameters and self.training:
            self._handles.append(module.register_forward_hook(_ddp_sink))

    def _make_buckets(self, params: list[nn.Parameter]) -> None:
        # torch.distributed re-exports this without declaring it (its stubs hide it); imported
        # here, as torch.distributed does, only where the distributed package is built in
        from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

        order: list[torch.Tensor] = list(reversed(params))
        assignment, _limits = _compute_bucket_assignment_by_size(order, [self.bucket_cap_bytes])
        category = Category.GRADIENTS if self.gradient_as_bucket_view else Category.WORKSPACE
        for indices in assignment:
            members = [order[i] for i in indices]
            bucket = self._buffer(sum(p.numel() for p in members), members[0].dtype, category,
                                  preexisting=True, communication=not self.gradient_as_bucket_view)
            self.bucket_bytes.append(bucket.numel() * bucket.element_size())
            offset = 0
            for p in members:
                self._views[id(p)] = bucket.narrow(0, offset, p.numel()).view_as(p)
                offset += p.numel()
        if self.gradient_as_bucket_view and self.training:
            for p in params:
                hook = p.register_post_accumulate_grad_hook(self._to_bucket_view)  # type: ignore[no-untyped-call]
                self._handles.append(hook)

    def _to_bucket_view(self, param: torch.Tensor) -> None:
        view = self._views[id(param)]
        if param.grad is not None and param.grad.untyped_storage() is not view.untyped_storage():
            self._tracer.track(param.grad, Category.GRADIENTS)
            view.copy_(param.grad)
            param.grad = view  # the gradient autograd allocated dies here, as in the Reducer


def _ddp_sink(_module: nn.Module, _args: Any, output: Any) -> Any:
    """``DistributedDataParallel._post_forward`` with ``find_unused_parameters=True`` (torch 2.13,
    not under ``static_graph``): every output tensor with a ``grad_fn`` goes through ``_DDPSink``,
    which clones it (``_ddp_sink_clone``, on by default), and the output is rebuilt from the clones;
    the originals live on only where autograd saved them. Its backward passes the gradients through."""
    return map_output(output, lambda t: t.clone() if t.grad_fn is not None and torch.is_grad_enabled() else t)


def trainer_finds_unused(module: nn.Module, step: Step) -> bool:
    """The ``find_unused_parameters`` the Hugging Face Trainer passes DDP (transformers 5.25,
    ``_build_accelerator_args``): ``ddp_find_unused_parameters`` when set; else, for a
    ``PreTrainedModel``, ``not`` activation checkpointing, and True for any other model (a
    ``PeftModel`` among them: the Trainer is handed it under LoRA)."""
    given = step.trainer_args.ddp_find_unused_parameters if step.trainer_args is not None else None
    if given is not None:
        return given
    if step.finetune.lora is not None or not is_transformers_model(module):
        return True
    return not step.checkpoint
