"""The public API: :func:`estimate`, :func:`max_batch_size`, :func:`sweep` (and
:func:`iter_sweep`).

A thin facade. Every user value is converted here, once, into the validated
:class:`~memcalc.distributed.estimate.EstimateRequest` the layers below work with: strings to
enums, GPU names to catalogue profiles, byte counts such as ``"16GiB"`` to integers.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from memcalc.core.categories import Mode
from memcalc.core.choices import parse_choice
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.gpu import GENERIC, GpuProfile
from memcalc.core.loop import Loop, LoopFn, LoopPreset
from memcalc.core.losses import LossChoice, LossFn
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport
from memcalc.core.stack import Stack
from memcalc.core.units import BYTES_FORMS, format_bytes, parse_bytes
from memcalc.cuda.gpus.catalogue import catalogue, get_gpu
from memcalc.cuda.gpus.local import names_local_gpu
from memcalc.cuda.gpus.performance import check_timeable, check_timeable_mode, with_time
from memcalc.cuda.stack import resolve_stack
from memcalc.distributed.estimate import EstimateRequest, run_estimate
from memcalc.distributed.options import Distributed
from memcalc.engine.model import InputsLike
from memcalc.engine.optimizers import Optimizer
from memcalc.engine.options import EstimateOptions, Target
from memcalc.search.budget import Budget, FitResult, check_margin, resolve_budget
from memcalc.search.fit import MAX_BATCH, find_max_batch
from memcalc.search.margins import measured_margin, step_class
from memcalc.search.sweep import SweepPoint, sweep_configurations, sweep_requests
from memcalc.search.throughput import ThroughputChoice, find_fastest

__all__ = ("CPU", "estimate", "fastest_setting", "iter_sweep", "max_batch_size", "sweep")

#: ``gpu=memcalc.CPU``: estimate what a CPU run of the step allocates (no CUDA kernel choice,
#: no CUDA workspaces) — the figure to compare with a real CPU run.
CPU = "cpu"

GpuLike = str | GpuProfile | None
LossLike = LossChoice | str | LossFn | None
LoopLike = Loop | LoopPreset | str | LoopFn | None


def estimate(
    model: Any,
    *,
    batch_size: int | None = None,
    input_shape: Sequence[int] | None = None,
    inputs: InputsLike | None = None,
    seq_len: int | None = None,
    optimizer: Optimizer | str | None = None,
    mode: Mode | str = Mode.TRAIN,
    loss: LossLike = None,
    precision: Precision | str = Precision.FP32,
    gpu: GpuLike = None,
    checkpoint: bool = False,
    accum_steps: int = 1,
    kv_cache: int | None = None,
    capacity: int | str | None = None,
    distributed: Distributed | None = None,
    loop: LoopLike = None,
    stack: Stack | None = None,
    finetune: FineTune | None = None,
    time: bool = False,
    new_tokens: int | None = None,
) -> MemoryReport:
    """Estimate the GPU memory of one training (or eval / inference) step of ``model``.

    The peak covers two training iterations, so optimizer state created at the first
    ``step()`` is counted with the activations of the next forward and backward.

    Args:
        model: a zoo name (``"resnet50"``), a source string (``"my.py:make_model"``,
            ``"hf:gpt2"``), an ``nn.Module`` (never modified, never copied to memory:
            memcalc works on a meta twin) or a factory returning one.
        batch_size: samples per step (per GPU under a strategy, unless
            ``Distributed(batch_is_global=True)``).
        input_shape: one sample's shape, without the batch dimension.
        inputs: tensors whose shapes are used as they are (batch included): a tensor, a tuple of
            positional arguments, or a dict — keyword arguments (``model(**inputs)``) when its keys
            name the forward's parameters, else the forward's one argument (``model(inputs)``).
        seq_len: the sequence length of a token model.
        optimizer: ``sgd``, ``sgd-momentum``, ``adam`` (None: the default), ``adamw``,
            ``rmsprop``, ``adagrad`` or ``none``; its state comes from the real ``torch.optim``
            class. Training only: an eval or inference step refuses one (``none`` aside).
        mode: ``train``, ``eval`` (forward under ``no_grad``), ``inference`` or ``generate``
            (the model's own ``generate(prompt, max_new_tokens=new_tokens)``: a Hugging Face causal
            LM; ``seq_len`` is the prompt's length).
        loss: ``auto`` (the default), ``cross-entropy``, ``lm-cross-entropy``, ``mean``,
            ``mse``, or your own ``loss(output) -> scalar`` (simulated too). Training only.
        precision: ``fp32``, ``amp-fp16``, ``amp-bf16`` (CUDA autocast, emulated op by op),
            ``fp16`` or ``bf16`` (the whole model in that dtype).
        gpu: a catalogue name (``"h100-80gb"``) or a ``GpuProfile``: it drives the attention
            kernel choice and workspaces, adds its CUDA context, and makes ``fits`` and
            ``headroom`` answer for its memory. None: a generic sm80-class GPU without a
            capacity. :data:`CPU` (``"cpu"``): what a CPU run allocates, to compare with one.
            ``"auto"`` (the one with the most free memory), ``"cuda"`` or ``"cuda:N"``: a GPU
            of this machine, found as ``memcalc gpus`` finds it — its catalogue profile (the
            generic one for a card the catalogue lacks) and, as capacity, its free memory less
            the CUDA context a new process creates (``max_batch_size(device=...)``'s budget);
            a note in the report names the GPU, the profile and the capacity.
        checkpoint: activation checkpointing per block of a zoo model.
        accum_steps: micro-batches of ``batch_size`` per optimizer step.
        kv_cache: tokens to generate with a KV cache (``mode="inference"``, decoder LLMs).
        capacity: bytes the caching allocator may reserve (an int, or ``"16GiB"``),
            overriding the GPU's.
        distributed: the multi-GPU setting (:class:`Distributed`); None: one GPU.
        loop: the training loop around the model: a preset name (``"minimal"``, the default;
            ``"tutorial"``, ``"trainer"``, ``"zero-grad-late"``), your own
            ``fn(model, optimizer, batches)``, or a :class:`Loop` that adds ``keep_grads`` and
            ``optimizer_impl`` (``auto``, ``for-loop``, ``foreach``, ``fused``).
        stack: the PyTorch and CUDA versions assumed (:class:`Stack`); None: the installed torch.
        finetune: frozen parameters, LoRA adapters and a quantized base (:class:`FineTune`).
        time: also time the step on ``gpu`` (a catalogue GPU with figures) and fill
            ``report.time`` (:func:`memcalc.step_time`). Every kernel's FLOPs and bytes are then
            recorded while the step is traced, which costs 10–26% more; without it they are
            recorded only if :func:`memcalc.step_time` is called on the report (one more trace).
        new_tokens: ``mode="generate"``: the tokens generated after the prompt (the peak is that of
            the whole call: ``report.peak_phase`` is ``prefill`` or ``decode``, ``report.peak_step``
            the decode step).

    Returns:
        A :class:`MemoryReport`: the breakdown at the peak, where it happens, the textbook
        comparison, per-module rows and, under a strategy, one row per kind of GPU in
        ``roles`` (the report's own fields describe the busiest). A step larger than every
        GPU in the catalogue says so in ``notes`` (and warns).

    Raises:
        MemcalcError: a subclass naming what was wrong and what to do.
    """
    gpu, capacity, local_note = _local_gpu(gpu, capacity, stack)  # found once: the note says what was found
    request = make_request(model, batch_size=batch_size, input_shape=input_shape, inputs=inputs, seq_len=seq_len,
                           optimizer=optimizer, mode=mode, loss=loss, precision=precision, gpu=gpu,
                           checkpoint=checkpoint, accum_steps=accum_steps, kv_cache=kv_cache, capacity=capacity,
                           distributed=distributed, loop=loop, stack=stack, finetune=finetune, new_tokens=new_tokens)
    if not isinstance(time, bool):
        raise InvalidInputError(f"time must be True or False, got {time!r}")
    if time:
        request = _recording_costs(request)
    report = run_estimate(request)
    if local_note is not None:
        report = replace(report, notes=(local_note, *report.notes))
    report = _note_beyond_every_gpu(report)
    return with_time(report) if time else report


def make_request(model: Any, *, batch_size: int | None = None, input_shape: Sequence[int] | None = None,
                 inputs: InputsLike | None = None, seq_len: int | None = None,
                 optimizer: Optimizer | str | None = None, mode: Mode | str = Mode.TRAIN, loss: LossLike = None,
                 precision: Precision | str = Precision.FP32, gpu: GpuLike = None, checkpoint: bool = False,
                 accum_steps: int = 1, kv_cache: int | None = None, capacity: int | str | None = None,
                 distributed: Distributed | None = None, loop: LoopLike = None, stack: Stack | None = None,
                 finetune: FineTune | None = None, new_tokens: int | None = None) -> EstimateRequest:
    """:func:`estimate`'s arguments, validated into an :class:`EstimateRequest`.

    Args:
        model, batch_size, input_shape, inputs, seq_len, optimizer, mode, loss, precision, gpu,
            checkpoint, accum_steps, kv_cache, capacity, distributed, loop, stack, finetune,
            new_tokens: as for :func:`estimate`.

    Returns:
        The request, with the capacity of the named GPU when none is given.

    Raises:
        MemcalcError: a subclass naming what was wrong and what to do.
    """
    batch_size = _positive_int(batch_size, "batch_size", "--batch")
    seq_len = _positive_int(seq_len, "seq_len", "--seq-len")
    shape = _input_shape(input_shape)
    _check_inputs_batch(inputs, batch_size)
    _check_training_only(mode, optimizer, loss)
    gpu, capacity, _note = _local_gpu(gpu, capacity, stack)
    profile, target = _gpu(gpu)
    loss_choice, loss_fn = _loss(loss)
    options = EstimateOptions.create(optimizer=Optimizer.ADAM if optimizer is None else optimizer, mode=mode,
                                     precision=precision, gpu=profile, loss=loss_choice, loss_fn=loss_fn,
                                     accum_steps=accum_steps, checkpoint=checkpoint, kv_cache=kv_cache, target=target,
                                     loop=loop, stack=stack, finetune=finetune, new_tokens=new_tokens)
    # the stack, resolved once: concrete versions, and the GPU's context under them
    versions = resolve_stack(options.stack)
    options = replace(options, stack=versions.core, gpu=versions.apply(options.gpu))
    if distributed is not None and not isinstance(distributed, Distributed):
        raise InvalidInputError(f"distributed must be a memcalc.Distributed(...), got {type(distributed).__name__}",
                                hint='e.g. distributed=memcalc.Distributed("ddp", world_size=4)')
    limit = _capacity(capacity)
    if limit is None and options.gpu_named:
        limit = options.gpu.usable_memory
    return EstimateRequest(model=model, options=options, distributed=distributed or Distributed(),
                           batch_size=batch_size, input_shape=shape, seq_len=seq_len, inputs=inputs, capacity=limit)


def max_batch_size(
    model: Any,
    *,
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    optimizer: Optimizer | str | None = None,
    precision: Precision | str | None = None,
    margin: float | None = None,
    neighbours: int = 0,
    max_batch: int = MAX_BATCH,
    **estimate_options: Any,
) -> FitResult:
    """The largest batch whose step fits a memory budget less a safety margin.

    Every batch from ``FitResult.checked_from`` up to the answer was replayed through the
    allocator model and fits (fragmentation can make a batch fail below one that fits; the
    check walks down past each it meets): docs/architecture.md, "The batch search".

    Args:
        model: as for :func:`estimate`.
        budget: bytes the step may use (``"24GiB"``, ``"80GB"``, an int); nothing is
            subtracted. Give exactly one of ``budget``, ``gpu`` and ``device``.
        gpu: a catalogue GPU: its CUDA-reported memory minus its assumed CUDA context; its
            kernels and workspaces are used too. ``"auto"``, ``"cuda"`` or ``"cuda:N"`` are
            read as ``device`` (as :func:`estimate` reads them).
        device: a local GPU (``"cuda:1"``, ``"auto"``): its free memory.
        optimizer: as for :func:`estimate`.
        precision: as for :func:`estimate` (None: fp32).
        margin: the fraction of the budget held back (0 ≤ margin < 1): the answer must fit
            ``budget × (1 − margin)``. None (the default): the margin measured for this
            class of step on real GPU runs (:mod:`memcalc.search.margins`: the estimate's
            largest under-estimates of its family, precision and checkpointing, at least
            3%); ``FitResult.margin_basis`` says how it was derived. 0: the raw boundary.
        neighbours: also estimate the batches within this distance of the answer.
        max_batch: the largest batch tried.
        **estimate_options: the other arguments of :func:`estimate` (``input_shape``,
            ``seq_len``, ``mode``, ``loss``, ``distributed``, ...), not ``batch_size``,
            ``capacity`` or ``inputs``.

    Returns:
        A :class:`FitResult`: the batch, its report against the whole budget, the budget, the
        margin, the raw boundary (``raw_batch_size``: the boundary a search with no margin
        meets), the batches checked below the answer and every probe.

    Raises:
        DoesNotFitError: batch 1 does not fit the budget less the margin.
        BatchLimitError: ``max_batch`` still fits.
        InvalidInputError: a margin outside [0, 1), or another invalid option.
    """
    given = None if margin is None else check_margin(margin)
    max_batch = _positive_int(max_batch, "max_batch", None)
    if not _is_int(neighbours) or neighbours < 0:
        raise InvalidInputError(f"neighbours must be an integer ≥ 0, got {neighbours!r}")
    _check_estimate_options("max_batch_size", estimate_options)
    resolved = resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
    request = _search_request(model, resolved, optimizer=optimizer, precision=precision, options=estimate_options)
    chosen, basis = _margin(given, request, resolved)
    result = find_max_batch(request, resolved, margin=chosen, neighbours=neighbours, max_batch=max_batch)
    return replace(result, margin_basis=basis)


def _margin(given: float | None, request: EstimateRequest, budget: Budget) -> tuple[float, str]:
    """The margin given, or the one measured for the request's class of step, and its basis."""
    if given is not None:
        return given, ""
    options = request.options
    measured = measured_margin(step_class(request.model, options.precision, options.checkpoint, options.mode),
                               budget.capacity)
    return measured.fraction, measured.explain()


def fastest_setting(
    model: Any,
    *,
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    target_batch: int | None = None,
    optimizer: Optimizer | str | None = None,
    precision: Precision | str | None = None,
    margin: float | None = None,
    max_batch: int = MAX_BATCH,
    **estimate_options: Any,
) -> ThroughputChoice:
    """The training setting with the most samples per second whose step fits: checkpointing on
    or off, the micro-batch and, to reach ``target_batch`` samples per optimizer step, the
    accumulation (:mod:`memcalc.search.throughput`; ``memcalc fit --objective throughput``).

    Args:
        model, budget, gpu, device, optimizer, precision, margin, max_batch, **estimate_options:
            as for :func:`max_batch_size` (the GPU must have sourced figures, to be timed;
            ``checkpoint`` and ``accum_steps`` are the search's).
        target_batch: samples per optimizer step (per GPU) to reach exactly, as micro-batch ×
            accumulation (None: no accumulation).

    Returns:
        A :class:`~memcalc.search.throughput.ThroughputChoice`: the best setting and every one timed.

    Raises:
        DoesNotFitError: no setting fits.
        InvalidInputError: an invalid option, or a GPU the step cannot be timed on.
    """
    given = None if margin is None else check_margin(margin)
    target_batch = _positive_int(target_batch, "target_batch", "--target-batch")
    for chosen in ("checkpoint", "accum_steps"):
        if chosen in estimate_options:
            raise InvalidInputError(f"fastest_setting chooses {chosen} itself; leave it out")
    _check_estimate_options("fastest_setting", estimate_options)
    resolved = resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
    request = _search_request(model, resolved, optimizer=optimizer, precision=precision, options=estimate_options)
    held, _basis = _margin(given, request, resolved)
    return find_fastest(request, resolved, margin=held, target_batch=target_batch, max_batch=max_batch)


def iter_sweep(
    model: Any,
    *,
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] | None = None,
    precisions: Sequence[Precision | str | None] = (None,),
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    time: bool = False,
    **estimate_options: Any,
) -> Iterator[SweepPoint]:
    """Estimate every (batch, optimizer, precision), yielding each point as it is done.

    Args:
        model: as for :func:`estimate`.
        batch_sizes, optimizers, precisions: the grid, each a list (``optimizers`` None:
            adam; None in ``precisions``: fp32); every item is checked before the first estimate.
        budget, gpu, device: at most one; with it, every point says whether it fits.
        time: also time every point on the GPU (``report.time``), as :func:`estimate` does.
        **estimate_options: the other arguments of :func:`estimate`.

    Returns:
        An iterator of :class:`SweepPoint`, series by series, batches ascending.
    """
    configs = sweep_configurations(batch_sizes, (Optimizer.ADAM,) if optimizers is None else optimizers, precisions)
    _check_estimate_options("iter_sweep", estimate_options)
    resolved = (resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
                if any(x is not None for x in (budget, gpu, device)) else None)
    # optimizers given for an eval sweep are refused as estimate() refuses one: name a real one if any
    named = None if optimizers is None else next((o for _b, o, _p in configs if o != Optimizer.NONE.value),
                                                 Optimizer.NONE.value)
    request = _search_request(model, resolved, optimizer=named, precision=None, options=estimate_options)
    if not time:
        return sweep_requests(request, configs)
    recording = _recording_costs(request)
    return (replace(point, report=with_time(point.report)) for point in sweep_requests(recording, configs))


def sweep(
    model: Any,
    *,
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] | None = None,
    precisions: Sequence[Precision | str | None] = (None,),
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    time: bool = False,
    **estimate_options: Any,
) -> list[SweepPoint]:
    """:func:`iter_sweep`, collected: ``sweep("resnet50", batch_sizes=[1, 16, 64],
    optimizers=["sgd", "adam"], gpu="a100-40gb")``.

    Args:
        model, batch_sizes, optimizers, precisions, budget, gpu, device, time, **estimate_options:
            as for :func:`iter_sweep`.

    Returns:
        A list of :class:`SweepPoint`, series by series, batches ascending.
    """
    _check_estimate_options("sweep", estimate_options)  # named as the user called it
    return list(iter_sweep(model, batch_sizes=batch_sizes, optimizers=optimizers, precisions=precisions,
                           budget=budget, gpu=gpu, device=device, time=time, **estimate_options))


#: The arguments of estimate() that max_batch_size() and sweep() pass on (``**estimate_options``).
_ESTIMATE_OPTIONS = ("input_shape", "seq_len", "mode", "loss", "checkpoint", "accum_steps", "kv_cache", "distributed",
                     "loop", "stack", "finetune", "new_tokens")
#: estimate() arguments a search sets itself, or takes under another name.
_SEARCH_SETS = {"batch_size": "the search sets the batch size", "capacity": "the budget is the capacity",
                "inputs": "the search makes inputs at each batch size: give input_shape or seq_len",
                "optimizer": "give optimizers=[...]", "precision": "give precisions=[...]"}


def _check_estimate_options(function: str, options: Mapping[str, Any]) -> None:
    """Every keyword of ``**estimate_options`` is one :func:`estimate` takes and the search
    does not set itself; else :class:`InvalidInputError` naming it (and a close match)."""
    for name in options:
        if name in _SEARCH_SETS:
            raise InvalidInputError(f"{function}() does not take {name}: {_SEARCH_SETS[name]}")
        if name not in _ESTIMATE_OPTIONS:
            close = difflib.get_close_matches(name, _ESTIMATE_OPTIONS, n=1)
            raise InvalidInputError(f"{function}() got an unknown argument {name!r}"
                                    + (f"; did you mean {close[0]!r}?" if close else ""),
                                    hint=f"The estimate options it takes: {', '.join(_ESTIMATE_OPTIONS)}.")


def _search_request(model: Any, budget: Budget | None, *, optimizer: Optimizer | str | None,
                    precision: Precision | str | None, options: dict[str, Any]) -> EstimateRequest:
    """The request a search varies: the user's options, the budget's GPU (its kernels and
    workspaces) and the budget as capacity."""
    given = {k: v for k, v in options.items() if v is not None}
    if budget is not None and budget.gpu is not None and "gpu" not in given:
        given["gpu"] = budget.gpu
    if precision is not None:
        given["precision"] = precision
    request = make_request(model, optimizer=optimizer, **given)
    return replace(request, capacity=budget.capacity if budget is not None else None)


def _recording_costs(request: EstimateRequest) -> EstimateRequest:
    """``request`` for a step that will be timed: refused now, before any estimate, when its GPU
    cannot be timed; else with every kernel's costs recorded as the step is traced."""
    check_timeable(request.options.gpu if request.options.gpu_named else None)
    check_timeable_mode(request.options.mode)
    return replace(request, options=replace(request.options, record_costs=True))


def _local_gpu(gpu: GpuLike, capacity: int | str | None,
               stack: Stack | None) -> tuple[GpuLike, int | str | None, str | None]:
    """``gpu="auto"``, ``"cuda"`` or ``"cuda:N"``: this machine's GPU, as its catalogue profile
    (None, the generic one, when the catalogue lacks the card) and — unless ``capacity`` is
    given — its free memory less a new process's CUDA context, with a note saying which GPU,
    profile and capacity were used. Any other ``gpu`` comes back unchanged, with no note.

    The budget is :func:`~memcalc.search.budget.resolve_budget`'s for ``device=``, so that
    ``estimate(gpu="cuda:0")`` and ``max_batch_size(device="cuda:0")`` see one GPU the same way.
    """
    if not names_local_gpu(gpu):
        return gpu, capacity, None
    found = resolve_budget(gpu=gpu, stack=stack)
    profile = (f"the catalogue profile {found.gpu.key}" if found.gpu is not None
               else "the generic sm80-class profile, the catalogue lacking this card")
    note = f"estimated for this machine's GPU: kernel choices, workspaces and CUDA context of {profile}; "
    if capacity is None:
        return found.gpu, found.capacity, note + f"capacity {found.source}"
    return found.gpu, capacity, note + f"capacity as given, not {found.source}"


def _gpu(gpu: GpuLike) -> tuple[GpuProfile | None, str]:
    """The GPU profile (None: generic) and the target (CUDA, or the CPU)."""
    if gpu is None or isinstance(gpu, GpuProfile):
        return gpu, Target.CUDA
    if not isinstance(gpu, str):
        raise InvalidInputError(f"gpu must be a GPU name or a GpuProfile, got {type(gpu).__name__} {gpu!r}",
                                hint="Known GPUs: " + ", ".join(g.key for g in catalogue()) + ".")
    if gpu.strip().lower() == CPU:
        return GENERIC, Target.CPU
    return get_gpu(gpu), Target.CUDA


def _loss(loss: LossLike) -> tuple[LossChoice | str | None, LossFn | None]:
    """A loss name, or the user's own loss function."""
    if loss is None or isinstance(loss, str):
        return loss, None
    if callable(loss):
        return None, loss
    raise InvalidInputError(f"loss must be a loss name or a function of the output, got {type(loss).__name__}",
                            hint=f"one of: {', '.join(c.value for c in LossChoice)}, or loss=my_loss")


def _capacity(capacity: int | str | None) -> int | None:
    if capacity is None:
        return None
    try:
        return parse_bytes(capacity)
    except ValueError:
        raise InvalidInputError(f"capacity must be a positive number of bytes, got {capacity!r}",
                                hint=f"A capacity is {BYTES_FORMS}.") from None


def _is_int(value: object) -> bool:
    """An ``int`` proper: ``True`` and ``64.0`` are not counts."""
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, name: str, flag: str | None) -> Any:
    """``value`` when it is None or an integer ≥ 1; else :class:`InvalidInputError` naming it."""
    if value is None or (_is_int(value) and value >= 1):
        return value
    kind = "" if _is_int(value) else f" ({type(value).__name__})"
    raise InvalidInputError(f"{name}{f' ({flag})' if flag else ''} must be an integer, at least 1; "
                            f"got {value!r}{kind}")


def _input_shape(shape: Any) -> tuple[int, ...] | None:
    """One sample's shape as a tuple of positive integers (None: the model's default)."""
    if shape is None:
        return None
    dims = tuple(shape) if isinstance(shape, Iterable) and not isinstance(shape, (str, bytes)) else None
    if not dims or not all(_is_int(d) and d >= 1 for d in dims):
        raise InvalidInputError(f"input_shape must be one sample's shape, a sequence of positive integers without "
                                f"the batch dimension; got {shape!r}", hint="e.g. input_shape=(3, 224, 224) or (1024,)")
    return dims


def _inputs_batch(inputs: Any) -> int | None:
    """The batch (first dimension) of the first tensor in ``inputs``; None if there is none."""
    if isinstance(inputs, torch.Tensor):
        candidates: list[Any] = [inputs]
    elif isinstance(inputs, Mapping):
        candidates = list(inputs.values())
    elif isinstance(inputs, Sequence):
        candidates = list(inputs)
    else:
        return None  # not inputs at all: the model source says so
    first = next((t for t in candidates if isinstance(t, torch.Tensor)), None)
    if first is None:
        return None
    return int(first.shape[0]) if first.dim() else 1


def _check_inputs_batch(inputs: Any, batch_size: int | None) -> None:
    """``inputs`` carry their batch; a different ``batch_size`` beside them is a contradiction."""
    batch = None if inputs is None or batch_size is None else _inputs_batch(inputs)
    if batch is not None and batch != batch_size:
        raise InvalidInputError(f"batch_size={batch_size} disagrees with inputs, whose batch (first dimension) is "
                                f"{batch}", hint="Leave batch_size out (inputs carry their batch) or give inputs of "
                                                 f"batch {batch_size}.")


def _check_training_only(mode: Mode | str, optimizer: Optimizer | str | None, loss: LossLike) -> None:
    """An optimizer or a loss for an eval or inference step would be ignored: refused."""
    mode_ = parse_choice(Mode, mode, "mode")
    if mode_ is Mode.TRAIN:
        return
    if optimizer is not None and parse_choice(Optimizer, optimizer, "optimizer") is not Optimizer.NONE:
        raise InapplicableOptionError(f"optimizer (--optim) applies to training (mode train); a mode "
                                      f"{mode_.value} step runs no optimizer", hint="Leave the optimizer out.")
    if loss is not None:
        raise InapplicableOptionError(f"loss (--loss) applies to training (mode train); a mode {mode_.value} "
                                      f"step computes no loss", hint="Leave the loss out.")


def _note_beyond_every_gpu(report: MemoryReport) -> MemoryReport:
    """A peak no GPU of the catalogue holds (a batch of a billion) is said so, in the notes and
    as a warning: the figure is right, but no card exists to run it on."""
    largest = max(catalogue(), key=lambda g: g.usable_memory or 0)
    usable = largest.usable_memory
    peak = report.bytes.peak_allocated
    if usable is None or peak <= usable:
        return report
    note = (f"no GPU in the catalogue holds this step: its peak allocated, {format_bytes(peak)}, is "
            f"{peak / usable:,.1f}× what the largest, the {largest.name}, leaves usable "
            f"({format_bytes(usable)} after its CUDA context); it takes a smaller batch or input, or "
            f"sharding over more GPUs (--strategy fsdp or zero3, --world-size)")
    warnings.warn(note, stacklevel=3)
    return replace(report, notes=(*report.notes, note))
