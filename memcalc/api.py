"""The public API: :func:`estimate`, :func:`max_batch_size`, :func:`sweep` (and
:func:`iter_sweep`, :func:`fastest_setting`).

A thin facade. Every user value is converted once, by the table of :mod:`memcalc.fields`,
into the :class:`~memcalc.engine.step_spec.Step` the layers below work with: strings to enums,
GPU names to catalogue profiles, byte counts such as ``"16GiB"`` to integers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Mode
from memcalc.core.checkpointing import Checkpointing, SacPolicy
from memcalc.core.counts import as_integer
from memcalc.core.errors import InvalidInputError, internal_errors_named
from memcalc.core.finetune import FineTune
from memcalc.core.gpu import GpuProfile
from memcalc.core.loop import Loop, LoopFn, LoopPreset
from memcalc.core.losses import LossChoice, LossFn
from memcalc.core.precision import Precision, WeightDtype
from memcalc.core.report import MemoryReport
from memcalc.core.stack import Stack
from memcalc.core.units import format_bytes
from memcalc.distributed.collectives import DEFAULT_NETWORK, Network
from memcalc.distributed.launch.read import hidden_size_of, launch_distributed, read_launch
from memcalc.distributed.launch.setup import LaunchSetup, merged
from memcalc.distributed.launch.trainer_mesh import check_plan_source, with_trainer_mesh
from memcalc.distributed.setting import Distributed
from memcalc.engine.model import InputsLike
from memcalc.engine.optimizers import DEFAULT_OPTIMIZER, Optimizer
from memcalc.engine.step_spec import Step
from memcalc.estimation import run_estimate
from memcalc.fields import DISTRIBUTED, FIELDS, build_step, check_keywords, positive_int
from memcalc.search.fit import MAX_BATCH, find_max_batch
from memcalc.search.fit_result import FitResult, check_margin
from memcalc.search.margins import CPU_MARGIN, CPU_MARGIN_BASIS, measured_margin, step_class
from memcalc.search.sweep import SweepPoint, sweep_configurations, sweep_requests
from memcalc.search.throughput import ThroughputChoice, find_fastest
from memcalc.targets.budget import Budget, resolve_budget
from memcalc.targets.cuda.gpus.catalogue import catalogue
from memcalc.timing.performance import check_timeable, check_timeable_mode, with_time

if TYPE_CHECKING:
    from memcalc.search.plan import PlanResult

__all__ = ("estimate", "estimate_step", "fastest_setting", "iter_sweep", "max_batch_size", "plan", "sweep")

GpuLike = str | GpuProfile | None
LossLike = LossChoice | str | LossFn | None
LoopLike = Loop | LoopPreset | str | LoopFn | None


@internal_errors_named("in estimate")
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
    weight_dtype: WeightDtype | str | None = None,
    gpu: GpuLike = None,
    checkpoint: bool | str | Checkpointing | SacPolicy = False,
    compile: bool = False,
    float8: str | Any = None,
    float8_all_gather: bool = False,
    liger: bool = False,
    accum_steps: int = 1,
    kv_cache: int | None = None,
    new_tokens: int | None = None,
    capacity: int | str | None = None,
    distributed: Distributed | None = None,
    loop: LoopLike = None,
    stack: Stack | None = None,
    finetune: FineTune | None = None,
    trainer_args: Any = None,
    time: bool = False,
    alloc_conf: str | AllocConf | None = None,
    accelerate_config: Any = None,
    deepspeed: Any = None,
    world_size: int | None = None,
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
        optimizer: ``sgd``, ``sgd-momentum``, ``sgd-nesterov``, ``adam`` (None: the default),
            ``adamw``, ``rmsprop``, ``adagrad``, ``adafactor``, ``adamw-8bit``,
            ``paged-adamw-8bit``, ``paged-adamw-32bit`` (bitsandbytes', emulated), ``none``, or
            one a package registered (:func:`memcalc.register_optimizer`); its state comes from
            the real ``torch.optim`` class. Training only: an eval or inference step refuses one
            (``none`` aside).
        mode: ``train``, ``eval`` (forward under ``no_grad``), ``inference`` or ``generate``
            (the model's own ``generate(prompt, max_new_tokens=new_tokens)``: a Hugging Face causal
            LM; ``seq_len`` is the prompt's length).
        loss: ``auto`` (the default), ``cross-entropy``, ``lm-cross-entropy``, ``mean``,
            ``mse``, or your own ``loss(output) -> scalar`` (simulated too). Training only.
        precision: ``fp32``, ``amp-fp16``, ``amp-bf16`` (CUDA autocast, emulated op by op),
            ``fp16`` or ``bf16`` (the whole model in that dtype).
        weight_dtype: ``fp32``, ``bf16`` or ``fp16``: the dtype the parameters are stored in
            (their gradients and optimizer state follow it); None: what ``precision`` implies.
            ``weight_dtype="bf16", precision="amp-bf16"`` is a model loaded in bf16 and trained
            under autocast (Hugging Face Trainer's ``bf16=True``).
        gpu: a catalogue name (``"h100-80gb"``) or a ``GpuProfile``: it drives the attention
            kernel choice and workspaces, adds its CUDA context, and makes ``fits`` and
            ``headroom`` answer for its memory. None: a generic sm80-class GPU without a
            capacity. :data:`CPU` (``"cpu"``): what a CPU run allocates, to compare with one.
            ``"auto"`` (the one with the most free memory), ``"cuda"`` or ``"cuda:N"``: a GPU
            of this machine, found as ``memcalc gpus`` finds it — its catalogue profile (the
            generic one for a card the catalogue lacks) and, as capacity, its free memory less
            the CUDA context a new process creates (``max_batch_size(device=...)``'s budget);
            a note in the report names the GPU, the profile and the capacity.
        checkpoint: activation checkpointing of a zoo model's blocks (a Hugging Face model's
            layers): ``True`` or ``"full"`` every block; ``"every:N"`` every Nth block
            (torchtitan's per-layer rule); ``"selective-op"`` every block, saving the outputs of
            torchtitan's op list (matmuls but every second one, attention, max) and recomputing
            the rest; or a policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``,
            given to ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
        compile: the step as ``torch.compile(model)`` runs it with Inductor: torch's own Dynamo,
            AOTAutograd partitioner (``min_cut_rematerialization_partition``, under
            ``torch._functorch.config.activation_memory_budget``) and Inductor's wrapper code run
            on meta, so the saved activations, fused kernels' buffers and their reuse are the
            compiled step's. A module the user already compiled (an ``OptimizedModule``) is
            estimated compiled without it. Training steps.
        float8: float8 training of the ``nn.Linear`` layers by torchao's own
            ``convert_to_float8_training`` (``pip install 'memcalc[float8]'``): ``"tensorwise"``
            or ``"rowwise"`` (its recipes), or a ``torchao.float8.Float8LinearConfig``. The casts,
            what is saved for backward and ``torch._scaled_mm`` are traced as torchao runs them
            (eager). Needs an sm89+ ``gpu``; the CPU target only with ``emulate=True``.
        float8_all_gather: with ``float8="tensorwise"`` (or a config) under ``strategy="fsdp"``: torchao's
            ``enable_fsdp_float8_all_gather``, FSDP2 all-gathering the weights in float8 through
            torchao's own ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``. A config with that flag
            set needs no switch.
        liger: Liger kernels (``use_liger_kernel=True``) on a Hugging Face Llama, Mistral or Qwen2/3
            causal LM: the fused linear cross-entropy (the logits made one chunk at a time, the
            gradients computed in the forward), RMSNorm and SwiGLU, modelled from Liger-Kernel's
            code (it runs on Triton only, so it is not traced). One GPU, training.
        accum_steps: micro-batches of ``batch_size`` per optimizer step.
        kv_cache: tokens to generate with a KV cache (``mode="inference"``, decoder LLMs).
        new_tokens: ``mode="generate"``: the tokens generated after the prompt (the peak is that of
            the whole call: ``report.peak_phase`` is ``prefill`` or ``decode``, ``report.peak_step``
            the decode step).
        capacity: bytes the caching allocator may reserve (an int, or ``"16GiB"``),
            overriding the GPU's.
        distributed: the multi-GPU setting (:class:`Distributed`); None: one GPU.
        loop: the training loop around the model: a preset name (``"minimal"``, the default;
            ``"tutorial"``, ``"trainer"``, ``"zero-grad-late"``), your own
            ``fn(model, optimizer, batches)``, or a :class:`Loop` that adds ``keep_grads`` and
            ``optimizer_impl`` (``auto``, ``for-loop``, ``foreach``, ``fused``).
        stack: the PyTorch and CUDA versions assumed (:class:`Stack`); None: the installed torch.
        finetune: frozen parameters, LoRA adapters and a quantized base (:class:`FineTune`).
        trainer_args: the Hugging Face Trainer's arguments: a ``transformers.TrainingArguments``,
            a dict of its arguments, or the path of a ``.json`` (``to_json_string()``) or
            ``.yaml`` file of them. They imply ``loop="trainer"`` and set what they decide:
            ``per_device_train_batch_size`` the batch, ``gradient_accumulation_steps`` the
            accumulation, ``bf16``/``fp16`` the precision (``amp-bf16``/``amp-fp16``: autocast
            over the weights as loaded; add ``weight_dtype="bf16"`` for a model loaded in bf16),
            ``gradient_checkpointing`` (``activation_checkpointing``) the checkpointing,
            ``optim`` (and ``optim_args``) the optimizer and its implementation, ``use_cpu`` the
            CPU as the target. A keyword given here with a value other than its default replaces
            theirs (the report's note names what it replaced). Arguments that change memory in
            ways memcalc does not model (``torch_compile``, ``deepspeed``, ``fsdp``, evaluation
            during training, ...) are refused, naming them. ``loop="trainer"`` without them
            takes the installed ``TrainingArguments`` defaults' ``optim`` and accumulation.
        time: also time the step on ``gpu`` (a catalogue GPU with figures) and fill
            ``report.time`` (:func:`memcalc.step_time`). Every kernel's FLOPs and bytes are then
            recorded while the step is traced, which costs 10–26% more; without it they are
            recorded only if :func:`memcalc.step_time` is called on the report (one more trace).
        alloc_conf: the CUDA caching allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` spells
            them (``"expandable_segments:True,max_split_size_mb:512"``); None: the environment's
            ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, as the real job would read them.
        accelerate_config: accelerate's config file (``.yaml``, as ``accelerate config`` writes it):
            its ``distributed_type`` (DDP, FSDP2, DeepSpeed ZeRO), ``num_processes``,
            ``mixed_precision`` and ``fsdp_config`` / ``deepspeed_config`` decide the multi-GPU
            setting and the precision (docs/launch-configs.md). Not with ``distributed``.
        deepspeed: a DeepSpeed config (a ``.json`` file or a dict): the ZeRO stage, buckets,
            ``offload_optimizer``, ``offload_param`` and ZeRO-3's ``stage3_*`` settings, the 16-bit
            precision, the batch and accumulation it fixes.
        world_size: the number of GPUs of a DeepSpeed config that does not say it (its
            ``train_batch_size`` is ``"auto"``).

    Returns:
        A :class:`MemoryReport`: the breakdown at the peak, where it happens, the textbook
        comparison, per-module rows and, under a strategy, one row per kind of GPU in
        ``roles`` (the report's own fields describe the busiest). A step larger than every
        GPU in the catalogue says so in ``notes`` (and warns).

    Raises:
        MemcalcError: a subclass naming what was wrong and what to do.
    """
    # every keyword but the model and the strategy is a field of the step, converted by its converter
    fields = {name: value for name, value in locals().items() if name in FIELDS}
    launch = read_launch(accelerate_config, deepspeed, world_size)  # a bad file is said before the model is built
    if launch is None:
        return estimate_step(build_step(model, **fields), _distributed(distributed))
    return estimate_step(*launched_step(model, launch, fields, distributed))


def launched_step(model: Any, launch: LaunchSetup, fields: dict[str, Any], distributed: Any = None,
                  given: Callable[[str], bool] | None = None) -> tuple[Step, Distributed]:
    """The step and the multi-GPU setting of a launch configuration (:func:`read_launch`), its
    options laid under ``fields`` (:func:`memcalc.distributed.launch.setup.merged`: an option
    the user gave, ``given(name)``, that disagrees with the file is refused). DeepSpeed's
    ``"auto"`` bucket is filled from the model's ``hidden_size``, as transformers fills it."""
    given_ = given if given is not None else (lambda name: _given_option(fields, name))
    step = build_step(model, **merged(launch, fields, distributed, given_))
    if launch.auto_hidden:
        launch = launch.with_hidden_size(hidden_size_of(step.resolved(1).module, launch.source))
    distributed_ = launch_distributed(launch)
    check_plan_source(step, distributed_, f"{launch.source} parallelism_config")  # tp comes from that section only
    return replace(step, accelerate_prepared=launch.accelerate_prepares,
                   notes=(*step.notes, launch.describe())), distributed_


def _given_option(fields: dict[str, Any], name: str) -> bool:
    """Whether the user gave option ``name`` a value other than its default."""
    value, default = fields.get(name), FIELDS[name].default
    return value is not None and (default is None or getattr(value, "value", value) != getattr(default, "value",
                                                                                               default))


@internal_errors_named("in estimate_step")
def estimate_step(step: Step, distributed: Distributed | None = None) -> MemoryReport:
    """Estimate a step already built by :func:`memcalc.fields.build_step`: what :func:`estimate`
    does once it has converted its arguments (the CLI builds the step itself, to measure the
    same step after estimating it).

    Args:
        step: the step; ``record_costs`` (``time=True``) also times it on its GPU.
        distributed: the multi-GPU setting; None: one GPU. The mesh of the step's Trainer
            arguments (``parallelism_config``) is laid over it (:func:`with_trainer_mesh`).

    Returns:
        The report, as :func:`estimate` returns it.

    Raises:
        MemcalcError: a subclass naming what was wrong and what to do.
    """
    if step.record_costs:
        _check_timeable(step)
    report = _note_beyond_every_gpu(run_estimate(step, with_trainer_mesh(step, distributed)))
    return with_time(report) if step.record_costs else report


@internal_errors_named("in max_batch_size")
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
    accelerate_config: Any = None,
    deepspeed: Any = None,
    world_size: int | None = None,
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
        accelerate_config, deepspeed, world_size: a launch configuration, as for :func:`estimate`
            (it sets the multi-GPU setting and the step's options it decides; its batch, if it
            names one, is what the search varies).
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
    max_batch = positive_int(max_batch, "max_batch", None)
    count = as_integer(neighbours)
    if count is None or count < 0:
        raise InvalidInputError(f"neighbours must be an integer ≥ 0, got {neighbours!r}")
    neighbours = count
    check_keywords("max_batch_size", estimate_options, own=("gpu",))
    launch = read_launch(accelerate_config, deepspeed, world_size)  # a bad file is said before the model is built
    resolved = resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
    step, distributed = _search_step(model, resolved, optimizer=optimizer, precision=precision,
                                     options=estimate_options, launch=launch)
    chosen, basis = _margin(given, step, resolved)
    result = find_max_batch(step, resolved, distributed=distributed, margin=chosen, neighbours=neighbours,
                            max_batch=max_batch)
    return replace(result, margin_basis=basis)


def _margin(given: float | None, step: Step, budget: Budget) -> tuple[float, str]:
    """The margin given, or the one measured for the step's class, and its basis."""
    if given is not None:
        return given, ""
    if step.gpu.is_cpu:
        return CPU_MARGIN, CPU_MARGIN_BASIS
    kind = step_class(step.model, step.precision, bool(step.checkpoint), step.mode)
    measured = measured_margin(kind, budget.capacity)
    return measured.fraction, measured.explain()


@internal_errors_named("in fastest_setting")
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
    target_batch = positive_int(target_batch, "target_batch", "--target-batch")
    for chosen in ("checkpoint", "accum_steps"):
        if chosen in estimate_options:
            raise InvalidInputError(f"fastest_setting chooses {chosen} itself; leave it out")
    check_keywords("fastest_setting", estimate_options, own=("gpu",))
    resolved = resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
    step, distributed = _search_step(model, resolved, optimizer=optimizer, precision=precision,
                                     options=estimate_options)
    held, _basis = _margin(given, step, resolved)
    return find_fastest(step, resolved, distributed=distributed, margin=held, target_batch=target_batch,
                        max_batch=max_batch)


@internal_errors_named("in iter_sweep")
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
        batch_sizes, optimizers, precisions: the grid, each a list (``optimizers`` None: the
            step's, adam unless ``trainer_args`` or ``loop="trainer"`` chose another; None in
            ``precisions``: the step's, fp32 by default); every item is checked before the first
            estimate.
        budget, gpu, device: at most one; with it, every point says whether it fits.
        time: also time every point on the GPU (``report.time``), as :func:`estimate` does.
        **estimate_options: the other arguments of :func:`estimate`.

    Returns:
        An iterator of :class:`SweepPoint`, series by series, batches ascending.
    """
    configs = sweep_configurations(batch_sizes, (DEFAULT_OPTIMIZER,) if optimizers is None else optimizers, precisions)
    check_keywords("iter_sweep", estimate_options, own=("gpu",))
    resolved = (resolve_budget(budget, gpu, device, stack=estimate_options.get("stack"))
                if any(x is not None for x in (budget, gpu, device)) else None)
    # optimizers given for an eval sweep are refused as estimate() refuses one: name a real one if any
    named = None if optimizers is None else next((o for _b, o, _p in configs if o != Optimizer.NONE.value),
                                                 Optimizer.NONE.value)
    step, distributed = _search_step(model, resolved, optimizer=named, precision=None, options=estimate_options)
    if optimizers is None:  # the step's own: adam, or the one the Trainer's arguments chose
        configs = sweep_configurations(batch_sizes, (step.optimizer_key,), precisions)
    if not time:
        return sweep_requests(step, configs, distributed=distributed)
    _check_timeable(step)
    recording = replace(step, record_costs=True)
    return (replace(point, report=with_time(point.report))
            for point in sweep_requests(recording, configs, distributed=distributed))


@internal_errors_named("in sweep")
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
    check_keywords("sweep", estimate_options, own=("gpu",))  # named as the user called it
    return list(iter_sweep(model, batch_sizes=batch_sizes, optimizers=optimizers, precisions=precisions,
                           budget=budget, gpu=gpu, device=device, time=time, **estimate_options))


def _search_step(model: Any, budget: Budget | None, *, optimizer: Optimizer | str | None,
                 precision: Precision | str | None, options: Mapping[str, Any],
                 launch: LaunchSetup | None = None) -> tuple[Step, Distributed]:
    """The step a search varies — the user's options, the budget's GPU (its kernels and
    workspaces) and the budget as capacity — and the multi-GPU setting (``launch``'s, when a
    launch configuration was given: :func:`launched_step`)."""
    given = {k: v for k, v in options.items() if v is not None}
    user_distributed = given.pop(DISTRIBUTED, None)
    if budget is not None and budget.gpu is not None:
        given["gpu"] = budget.gpu
    if precision is not None:
        given["precision"] = precision
    if launch is not None:
        # the search varies the batch: a micro-batch the file names is its starting point, not a fixed option
        launch = replace(launch, values={k: v for k, v in launch.values.items() if k != "batch_size"})
        step, distributed = launched_step(model, launch, {"optimizer": optimizer, **given}, user_distributed)
    else:
        distributed = _distributed(user_distributed)
        step = build_step(model, optimizer=optimizer, **given)
    distributed = with_trainer_mesh(step, distributed)  # the Trainer arguments' parallelism_config, as estimate's
    return replace(step, capacity=budget.capacity if budget is not None else None), distributed


def _check_timeable(step: Step) -> None:
    """Refuse a step time now, before any estimate: a GPU without figures, or a generation
    (whose prefill and decode steps the roofline does not time)."""
    check_timeable(step.gpu if step.gpu_named else None)
    check_timeable_mode(step.mode)


def _distributed(distributed: Any) -> Distributed:
    """The multi-GPU setting (None: one GPU), validated when it was made."""
    if distributed is not None and not isinstance(distributed, Distributed):
        raise InvalidInputError(f"distributed must be a memcalc.Distributed(...), got {type(distributed).__name__}",
                                hint='e.g. distributed=memcalc.Distributed("ddp", world_size=4)')
    return distributed or Distributed()


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


@internal_errors_named("in plan")
def plan(
    model: Any,
    *,
    gpus: int,
    gpu: str | GpuProfile,
    global_batch: int,
    seq_len: int | None = None,
    input_shape: Sequence[int] | None = None,
    optimizer: Optimizer | str | None = None,
    precision: Precision | str = Precision.AMP_BF16,
    gpus_per_node: int = DEFAULT_NETWORK.gpus_per_node,
    intra_node_gbps: float = DEFAULT_NETWORK.intra_node_gbps,
    inter_node_gbps: float = DEFAULT_NETWORK.inter_node_gbps,
    top: int = 5,
    checkpoint: str = "search",
    on_estimate: Callable[[str], None] | None = None,
    context_parallel: bool | None = None,
    expert_parallel: bool | None = None,
) -> PlanResult:
    """The fastest ways to train ``model`` on ``gpus`` GPUs that fit: device meshes of the modelled
    dimensions, micro-batches and activation checkpointing, ranked by estimated step time (the
    roofline of the traced step plus a collective cost model); :mod:`memcalc.search.plan`.

    Args:
        model: as for :func:`estimate`.
        gpus: the GPUs (the mesh's world size).
        gpu: a catalogue GPU with figures (``"h100-80gb"``): its capacity decides what fits, its
            peaks time the kernels.
        global_batch: samples per optimizer step over every GPU (micro-batch × data-parallel size
            × accumulation).
        seq_len, input_shape, optimizer: as for :func:`estimate`.
        precision: as for :func:`estimate` (default ``amp-bf16``, as large models are trained).
        gpus_per_node, intra_node_gbps, inter_node_gbps: the network (GB/s per GPU, each way):
            groups within a node use NVLink's bandwidth, others the network's.
        top: how many configurations to return.
        checkpoint: ``"search"`` (off, selective-op and full, each tried), ``"auto"`` (the
            checkpointing ``--checkpoint auto`` chooses, per configuration), or one of ``"off"``,
            ``"selective-op"``, ``"full"``.
        on_estimate: called with a description before each estimate (progress).
        context_parallel: search context-parallel meshes (True) or not (False); None (the
            default) searches them from 16,384 tokens a sample, where a ring pays for itself and
            below which its meshes multiply the traces (``memcalc.search.plan.LONG_CONTEXT``).
        expert_parallel: search expert-parallel meshes of a mixture of experts (None, the
            default, or True) or not (False: fewer traces); a model without experts has none.

    Returns:
        A :class:`~memcalc.search.plan.PlanResult`: the best, fastest first (empty if nothing
        fits), and what was searched and pruned.

    Raises:
        MemcalcError: a subclass naming what was wrong and what to do.
    """
    gpus = positive_int(gpus, "gpus", None)
    global_batch = positive_int(global_batch, "global_batch", None)
    top = positive_int(top, "top", None)
    network = Network(gpus_per_node=positive_int(gpus_per_node, "gpus_per_node", None),
                      intra_node_gbps=float(intra_node_gbps), inter_node_gbps=float(inter_node_gbps))
    step = build_step(model, batch_size=1, seq_len=seq_len, input_shape=input_shape, optimizer=optimizer,
                      precision=precision, gpu=gpu, time=True)
    if step.capacity is None:
        raise InvalidInputError("plan needs a GPU with a memory capacity", hint="give a catalogue GPU, e.g. h100-80gb")
    _check_timeable(step)
    # the search imports on first use: it imports the pipeline's and tensor parallelism's modules,
    # which no other request reads (issue 36)
    from memcalc.search.plan import find_plan, model_facts

    return find_plan(step, gpus, global_batch, model_facts(step), network=network, top=top, on_estimate=on_estimate,
                     checkpoint=checkpoint, context_parallel=context_parallel, expert_parallel=expert_parallel)
