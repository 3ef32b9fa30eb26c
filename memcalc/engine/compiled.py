"""A compiled step (``torch.compile``) on meta tensors: torch's own Dynamo, AOTAutograd and
Inductor decide what the step saves and allocates; only the C++ kernels are left out.

What a compiled step keeps for backward is decided by AOTAutograd's partitioner
(``min_cut_rematerialization_partition``, which Inductor uses, under
``torch._functorch.config.activation_memory_budget``), and what it allocates in between by
Inductor: a fused kernel writes only its outputs, and its wrapper code allocates each buffer
(``empty_strided_cpu``), reuses freed ones and ``del``s each at its last use. So memcalc runs
the real stack: :class:`MetaInductor` is a Dynamo backend that hands the captured graph to
``torch._inductor.compile_fx.compile_fx`` with fake *CPU* tensors (Inductor has no code
generation for meta), with the C++ kernels' build stubbed out (their bodies would only write
data). The wrapper code Inductor generates is then run as it is, on meta tensors, its
allocation helpers pointed at meta: under the storage tracer it allocates, reuses and frees
exactly the buffers the real compiled step does, and its extern kernels (matmuls,
convolutions, attention) run as aten ops the CPU and CUDA targets' rules already follow.

The code is Inductor's CPU code generation: the CUDA target gets the same graph, partition and
buffers (the scheduler's fusion and memory planning are shared), not Triton's kernel choices.

Dynamo compiles the model's ``forward`` at a warm-up call on meta outside the tracer
(:func:`warm_up`: one forward and backward, so that both graphs exist); the traced step then
runs the cached compiled code, under a tracer Dynamo lets compiled code run under
(:class:`CompiledStepTracer`). A guard that failed there would run the model eagerly:
:meth:`MetaInductor.check_ran` refuses a trace in which the compiled code did not run.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

from memcalc.core.errors import InternalError
from memcalc.engine.model import ModelInputs
from memcalc.engine.step_backend import CompiledAutocast, outside_autocast_regions
from memcalc.engine.trace import StorageTracer, tensors_of

__all__ = ("CompiledForward", "CompiledForwards", "CompiledStepTracer", "MetaInductor", "budget_note",
           "compile_forward", "fresh_forward", "is_compiled_module", "uncompiled", "warm_up")

#: Dynamo's limit of compiled versions per code object (``recompile_limit``), raised while memcalc
#: compiles: every estimate compiles a fresh copy of the forward, and a graph break's inner frames
#: (shared code) are compiled once per estimate of a search.
_RECOMPILE_LIMIT = 1024


class CompiledStepTracer(StorageTracer):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """The storage tracer of a compiled step: Dynamo runs compiled code only under dispatch modes
    that ignore its internals (any other makes it run the frame eagerly), and turns this one off
    while it compiles and back on for the compiled artifact's runtime, so that the tracer sees
    the wrapper code's allocations and its extern kernels, as the device does."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _random_kernels_traced() -> None:
    """The compiled code of a checkpointed region runs its random kernels (attention, with its
    dropout) through ``run_and_save_rng_state`` and, recomputing in backward,
    ``run_with_rng_state``: higher-order ops that a dispatch mode must implement. Under the
    tracer each runs its kernel, seen by the tracer; the generator state it saves is the CPU's,
    a host tensor of about 5 KB the tracer does not count (a CUDA step keeps it on the host)."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if CompiledStepTracer in run_and_save_rng_state.python_key_table:
        return

    @run_and_save_rng_state.py_impl(CompiledStepTracer)  # type: ignore[untyped-decorator]  # untyped in torch
    def _save(mode: CompiledStepTracer, op: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return torch.get_rng_state(), op(*args, **kwargs)

    @run_with_rng_state.py_impl(CompiledStepTracer)  # type: ignore[untyped-decorator]  # untyped in torch
    def _replay(mode: CompiledStepTracer, rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return op(*args, **kwargs)


def is_compiled_module(model: object) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    if not isinstance(model, nn.Module):
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``_orig_mod``), through nested wrappers."""
    while is_compiled_module(model):
        inner = model._orig_mod
        assert isinstance(inner, nn.Module)
        model = inner
    return model


class MetaInductor:
    """A Dynamo backend: Inductor's ``compile_fx`` on the captured graph, whose generated wrapper
    code then runs on meta tensors. Counts the graphs compiled and the runs of each.
    ``autocast``: how an autocast step's casts get into the graph (its ``trace`` region is
    entered while AOTAutograd traces, and left for Inductor's lowering)."""

    def __init__(self, autocast: CompiledAutocast | None = None) -> None:
        self.graphs = 0
        self.runs = 0
        self.autocast = autocast
        _random_kernels_traced()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        _devices_to_cpu(gm)
        fakes = _cpu_fakes(example_inputs)

        # no compiled graph read from or written to AOTAutograd's cache: its kernels are stubs
        trace: Callable[[], AbstractContextManager[Any]] = (
            self.autocast.trace if self.autocast is not None and self.autocast.trace is not None else nullcontext)
        with functorch_config.patch(enable_autograd_cache=False), _kernels_unbuilt(), trace():
            compiled: Callable[..., Any] = compile_fx(gm, fakes, inner_compile=_inner_on_meta)  # type: ignore[assignment]
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run

    def check_ran(self, runs_before: int) -> None:
        """The compiled graphs ran since ``runs_before``; else the step ran eagerly (Dynamo
        skipped the frame) and the trace is not the compiled step's. (A guard that fails inside
        the tracer recompiles, with this backend, while the tracer is off.)"""
        if self.runs == runs_before:
            raise InternalError(RuntimeError("the compiled forward did not run while the step was traced "
                                             "(Dynamo's guards failed and it ran eagerly)"),
                                stage="while tracing the compiled step")


def _inner_on_meta(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's own ``compile_fx_inner`` (post-grad passes, lowering, scheduling, fusion,
    memory planning, wrapper code), its wrapper's allocations pointed at meta."""
    from torch._inductor.compile_fx import compile_fx_inner

    # the backward graph is compiled at the first backward, here too; an emulated autocast policy
    # (a function mode, MetaInductor.autocast) casts the joint graph's ops only, not Inductor's
    with _kernels_unbuilt(), _no_function_modes():
        out = compile_fx_inner(gm, example_inputs, **kwargs)
    call = getattr(out, "current_callable", None)
    scope = _globals_of(call)
    if scope is None:
        raise InternalError(RuntimeError(f"Inductor's compiled graph has no wrapper code ({type(out).__name__})"),
                            stage="while compiling the step")
    for name in [n for n in scope if n.startswith("empty_strided")]:
        scope[name] = _empty_on_meta
    scope["device"] = _meta_device  # `device(type='cpu')` in the wrapper's own tensor creations
    # meta kernels pick their own layouts (a convolution on meta is not channels-last where
    # oneDNN's is): the sizes must match, the strides (same bytes, dense) need not
    scope["assert_size_stride"] = _assert_size
    return out


def _globals_of(call: Any) -> dict[str, Any] | None:
    """The module namespace of Inductor's ``call`` (a function or the bound ``Runner.call``)."""
    while call is not None:
        if isinstance(call, types.FunctionType):
            return call.__globals__
        call = getattr(call, "__func__", None) or getattr(call, "__wrapped__", None)
    return None


def _empty_on_meta(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, *_: Any, **__: Any) -> torch.Tensor:
    """``empty_strided_cpu(size, stride, dtype)`` of the wrapper code, on meta."""
    return torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device="meta")


def _assert_size(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int], *_: Any) -> None:
    """The wrapper code's check of an input's or an extern kernel's output's size (strides: see
    :func:`_inner_on_meta`)."""
    if tuple(tensor.shape) != tuple(size):
        raise AssertionError(f"expected size {tuple(size)}, got {tuple(tensor.shape)}")


def _meta_device(*_: Any, **__: Any) -> torch.device:
    return torch.device("meta")


@contextmanager
def _kernels_unbuilt() -> Iterator[None]:
    """Inductor's C++ kernels generated but not built: each is a function that does nothing (it
    would only write the data of buffers its wrapper allocated). No graph is read from or
    written to Inductor's caches, so that no stubbed kernel is ever reused by a real compile,
    nor a real one run on meta."""
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    def stub(*_: Any, **__: Any) -> Callable[..., None]:
        return _no_kernel

    with (mock.patch.object(AsyncCompile, "cpp_pybinding", stub), mock.patch.object(AsyncCompile, "cpp", stub),
          inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False,
                                compile_threads=1)):
        yield


def _no_kernel(*_: Any, **__: Any) -> None:
    return None


def _cpu_fakes(example_inputs: Sequence[Any]) -> list[Any]:
    """Fake CPU tensors of the example inputs' sizes, strides, dtypes and ``requires_grad``
    (Parameters stay Parameters), in a fake mode of their own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes: list[Any] = []
    with mode:
        for value in example_inputs:
            if not isinstance(value, torch.Tensor):
                fakes.append(value)
                continue
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
            if isinstance(value, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=value.requires_grad)
            elif value.requires_grad:
                fake.requires_grad_(True)
            fakes.append(fake)
    return fakes


def _devices_to_cpu(gm: torch.fx.GraphModule) -> None:
    """Tensors the graph creates on meta (``torch.arange(n, device=x.device)``) created on the
    CPU, where Inductor generates code; the wrapper's allocations go back to meta."""

    def on_cpu(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        if isinstance(value, tuple):
            return tuple(on_cpu(v) for v in value)
        if isinstance(value, list):
            return [on_cpu(v) for v in value]
        if isinstance(value, dict):
            return {k: on_cpu(v) for k, v in value.items()}
        return value

    for node in gm.graph.nodes:
        node.args = on_cpu(node.args)
        node.kwargs = on_cpu(node.kwargs)
    gm.recompile()


@dataclass
class CompiledForward:
    """A module whose ``forward`` is compiled on this instance; :meth:`restore` undoes it."""

    module: nn.Module
    backend: Any
    previous: Any  # the instance's own ``forward`` before (None: the class's)
    undo: Callable[[], None] | None = None  # what compiling on meta changed in torch

    def restore(self) -> None:
        """The module's ``forward`` as it was (and torch as it was)."""
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous
        if self.undo is not None:
            self.undo()
            self.undo = None


@dataclass
class CompiledForwards:
    """The modules compiled for one step (the model, or each of its blocks) by one backend."""

    backend: Any
    forwards: list[CompiledForward]

    def restore(self) -> None:
        """Every module's ``forward`` as it was (last compiled first)."""
        for forward in reversed(self.forwards):
            forward.restore()


def _rng_state_on_meta() -> Callable[[], None]:
    """A checkpointed region's random kernels (attention with its dropout) run in compiled code
    as ``run_and_save_rng_state(op, ...)``, which picks the device's generator by the arguments'
    device and knows no meta: on meta, the CPU's (the state, a CPU tensor of about 5 KB per
    call, is outside the tracer: a CUDA step keeps it on the host too). Returns the undo."""
    from torch._prims import rng_prims

    device_of = rng_prims.get_device

    def on_meta_as_cpu(args: Any, kwargs: Any) -> Any:
        device = device_of(args, kwargs)  # type: ignore[no-untyped-call]  # untyped in torch
        return "cpu" if device == "meta" else device

    patch = mock.patch.object(rng_prims, "get_device", on_meta_as_cpu)
    patch.start()
    return patch.stop


def _meta_tensor_literals_lifted() -> Callable[[], None]:
    """``torch.tensor(data, device=...)`` in traced code is a node of the graph, which Dynamo
    runs on fake tensors to learn its output. On a real device ``torch.tensor`` ends in
    ``aten.lift_fresh``, which the fake mode turns into a fake tensor; on meta it returns early,
    before that call (``internal_new_from_data``'s meta shortcut), and Dynamo then meets a plain
    meta tensor among fake ones ("Please convert all Tensors to FakeTensors first").
    transformers' ``DynamicCache`` makes one in each layer's first ``update`` (its empty keys and
    values, then ``torch.cat``). So while Dynamo runs such a node on meta, its output is lifted as
    a real device's would be: the graph is unchanged, a factory call Inductor then compiles.
    Returns the undo."""
    from torch._dynamo import utils as dynamo_utils

    run_node = dynamo_utils.run_node

    def lifted(tracer: Any, node: torch.fx.Node, args: Any, kwargs: Any, nnmodule: Any) -> Any:
        out = run_node(tracer, node, args, kwargs, nnmodule)
        if (node.op == "call_function" and node.target is torch.tensor and type(out) is torch.Tensor
                and out.device.type == "meta"):
            return torch.ops.aten.lift_fresh.default(out)  # under Dynamo's fake mode: a fake tensor
        return out

    patch = mock.patch.object(dynamo_utils, "run_node", lifted)
    patch.start()
    return patch.stop


def _on_meta() -> Callable[[], None]:
    """What compiling on meta changes in torch (:func:`_rng_state_on_meta`,
    :func:`_meta_tensor_literals_lifted`); returns the undo of both."""
    undo_rng = _rng_state_on_meta()
    undo_literals = _meta_tensor_literals_lifted()

    def undo() -> None:
        undo_literals()
        undo_rng()

    return undo


def compile_forward(module: nn.Module, backend: Any, *, function: Any = None) -> CompiledForward:
    """Compile ``module.forward`` on this instance with ``backend`` (a :class:`MetaInductor`, or
    ``"inductor"`` for a real run), as ``torch.compile(module)`` compiles it: hooks of the module
    itself run outside the graph, its submodules inside. The forward is a fresh copy of its
    function (``function``: one made by :func:`fresh_forward` and shared by modules of one
    class, whose graph Dynamo then compiles once for all of them, as for blocks compiled one by
    one), so that Dynamo's cache of it lives and dies with this compile."""
    previous = module.__dict__.get("forward")
    if previous is not None:
        forward = previous
    else:
        forward = types.MethodType(function if function is not None else fresh_forward(type(module)), module)
    compiled: Callable[..., Any] = torch.compile(forward, backend=backend, dynamic=False)
    autocast = getattr(backend, "autocast", None)
    ambient: Callable[[], AbstractContextManager[Any]] = (
        autocast.call if isinstance(autocast, CompiledAutocast) and autocast.call is not None else nullcontext)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _no_function_modes(), outside_autocast_regions(), ambient(), _side_effects_not_replayed():
            return compiled(*args, **kwargs)

    module.forward = run
    return CompiledForward(module, backend, previous,
                           undo=_on_meta() if isinstance(backend, MetaInductor) else None)


def _side_effects_not_replayed() -> AbstractContextManager[Any]:
    """Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``: a checkpointed region that
    sets a Python variable outside itself stays in the graph (the side effect not replayed when
    backward recomputes). transformers' layers set one in each forward (the ``kernels`` hub's
    ``_ACTIVE_KERNEL_FUNCS``, ``use_kernelized_func``), which would otherwise break every
    checkpointed layer out of the compiled graph into eager code; it selects kernels only.
    Estimated and real compiled steps (:mod:`memcalc.measure.step`) both run with it."""
    from torch._dynamo import config as dynamo_config

    patch: AbstractContextManager[Any] = dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    return patch


@contextmanager
def _no_function_modes() -> Iterator[None]:
    """The compiled graph runs outside the torch-function modes active around it (memcalc's
    emulated kernel choices, :mod:`memcalc.targets`), and outside their autocast region, which
    memcalc's checkpoint wrapper reads: Dynamo compiled it without them, and would see them as a
    changed state to recompile for. They are back for the loss, backward and optimizer."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def fresh_forward(cls: type[nn.Module]) -> Any:
    """A fresh copy of ``cls.forward`` (:func:`compile_forward`)."""
    return _fresh(cls.forward)


def _fresh(function: Any) -> Any:
    """A copy of ``function`` with a code object of its own (Dynamo keys its cache on code)."""
    if not isinstance(function, types.FunctionType):
        return function
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(copy, function)


def warm_up(module: nn.Module, inputs: ModelInputs, *, train: bool, reads: Any = None) -> None:
    """One forward (and, training, one backward) of the compiled module, outside the tracer:
    Dynamo compiles the forward graph and AOTAutograd the backward one. The gradients it makes
    are dropped (each parameter's ``.grad`` as it was). ``reads``: the model's read oracle
    (:class:`~memcalc.engine.trace.StorageTracer`'s ``read_values``), for the code that runs
    eagerly around blocks compiled one by one (a mask built from ``.item()``): the warm-up then
    runs under a throwaway tracer that answers those reads."""
    from torch._dynamo import config as dynamo_config

    grads = {p: p.grad for p in module.parameters()}
    limits = dynamo_config.patch(recompile_limit=_RECOMPILE_LIMIT, accumulated_recompile_limit=_RECOMPILE_LIMIT)
    answering = CompiledStepTracer("meta", read_values=reads) if reads is not None else nullcontext()
    with limits, answering, torch.enable_grad() if train else torch.no_grad():
        out = module(*inputs.args, **inputs.kwargs)
        if train:
            outputs = [t for t in tensors_of(out) if t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    del out
    for p, grad in grads.items():
        p.grad = grad


def budget_note() -> str | None:
    """The report's note when ``torch._functorch.config.activation_memory_budget`` is not 1
    (the partitioner then recomputes more, to keep the saved activations under that fraction)."""
    from torch._functorch import config as functorch_config

    budget = functorch_config.activation_memory_budget
    if budget >= 1.0:
        return None
    return (f"torch._functorch.config.activation_memory_budget = {budget:g}: the partitioner saves at most that "
            f"fraction of the activations a full save would keep, recomputing the rest")
