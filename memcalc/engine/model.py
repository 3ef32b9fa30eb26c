"""A model ready to trace: the engine's input, whatever the user named (the resolution of
names, files, hubs and the zoo is :mod:`memcalc.sources`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, overload

import torch
from torch import nn

from memcalc.core.categories import Mode
from memcalc.core.errors import InvalidInputError
from memcalc.core.losses import LossChoice, LossKind
from memcalc.engine.trace import ReadOracle, tensors_of

__all__ = ("CheckpointFn", "Checkpointer", "GenerateFn", "InputsLike", "LabelsMaker", "ModelInputs", "ModelResolver",
           "ReadsFn", "ResolvedModel", "StaticCacheFn", "bind_inputs")

#: What a user may give as a model's inputs: a tensor, a sequence of positional arguments, or a
#: mapping — keyword arguments (``model(**batch)``, a Hugging Face batch) or the forward's one
#: argument (``model(batch)``), as :func:`bind_inputs` decides. Arguments are tensors or nested
#: tuples / lists / dicts of them; plain values (``None``, numbers, strings) pass as given.
InputsLike: TypeAlias = "torch.Tensor | Sequence[Any] | Mapping[str, Any]"
#: The labels a model computes its own loss from, made from a batch's inputs (on their device)
#: and passed as keyword arguments (a Hugging Face head's: :mod:`memcalc.stacks.transformers.heads`).
LabelsMaker: TypeAlias = "Callable[[ModelInputs], dict[str, torch.Tensor]]"
#: Resolves what the user named into a :class:`ResolvedModel` on meta, at a batch:
#: ``resolver(model, batch_size=, input_shape=, seq_len=, inputs=)``. The API hands it to the
#: :class:`~memcalc.engine.step_spec.Step` it builds (``memcalc.sources.resolve.resolve``), so the
#: layers below resolve a model through the step and never import the resolver.
ModelResolver: TypeAlias = "Callable[..., ResolvedModel]"
#: ``checkpoint(forward, *args, **kwargs)``: memcalc's checkpoint of one block, non-reentrant unless
#: the step says reentrant (:func:`memcalc.engine.prepare.checkpointed`).
CheckpointFn: TypeAlias = "Callable[..., Any]"
#: A model's own way to checkpoint its blocks, given memcalc's checkpoint function and which blocks
#: to checkpoint (their 0-based index in model order → whether); returns the number of blocks
#: checkpointed (a Hugging Face model's gradient checkpointing: :mod:`memcalc.stacks.transformers.checkpointing`).
Checkpointer: TypeAlias = "Callable[[nn.Module, CheckpointFn, Callable[[int], bool]], int]"
#: The answers to a model's own reads of tensor values in a step of a mode (and a generation's
#: new tokens, else None): a Hugging Face model's checks for padding and packing, generate()'s stop
#: checks (:mod:`memcalc.stacks.transformers.reads`).
ReadsFn: TypeAlias = "Callable[[Mode, int | None], ReadOracle]"
#: A model's own generation run on meta: ``(module, prompt, new_tokens, mark_cache) -> sequences``,
#: telling ``mark_cache`` the tensors of its KV cache after each forward (a Hugging Face causal
#: LM's ``generate()``: :mod:`memcalc.stacks.transformers.generate`).
GenerateFn: TypeAlias = (
    "Callable[[nn.Module, ModelInputs, int, Callable[[Iterable[torch.Tensor]], None]], torch.Tensor]")
#: A model's own static KV cache: ``(module, max_cache_len) -> (keywords, tensors)``, the forward's
#: keyword arguments that hand it the cache and, once the forward has filled it, its keys and values
#: (a Hugging Face causal LM's ``StaticCache``: :func:`memcalc.stacks.transformers.generate.static_cache`).
StaticCacheFn: TypeAlias = "Callable[[nn.Module, int], tuple[dict[str, Any], Callable[[], Iterable[torch.Tensor]]]]"


class ModelInputs(Sequence[torch.Tensor]):
    """The arguments of one forward call, ``module(*args, **kwargs)``.

    As a sequence it is every input tensor in call order (the positional arguments', then
    the keyword arguments' in insertion order), so code that only needs the tensors (their
    bytes, their shapes) reads it as a tuple.
    """

    __slots__ = ("_tensors", "args", "kwargs")

    def __init__(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None):
        self.args: tuple[Any, ...] = tuple(args)
        self.kwargs: dict[str, Any] = dict(kwargs or {})
        self._tensors = (*tensors_of(self.args), *tensors_of(tuple(self.kwargs.values())))

    @classmethod
    def of(cls, inputs: ModelInputs | Sequence[torch.Tensor]) -> ModelInputs:
        """``inputs`` as :class:`ModelInputs` (a plain sequence: positional arguments)."""
        return inputs if isinstance(inputs, ModelInputs) else cls(tuple(inputs))

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        return self._tensors[index]

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._tensors)

    def __repr__(self) -> str:
        return f"ModelInputs({self.description})"

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelInputs:
        """The same call with ``fn`` applied to every tensor (containers rebuilt as they were)."""
        return ModelInputs(tuple(_map(a, fn) for a in self.args), {k: _map(v, fn) for k, v in self.kwargs.items()})

    def call(self, module: Callable[..., Any]) -> Any:
        """``module(*args, **kwargs)``."""
        return module(*self.args, **self.kwargs)

    @property
    def batch_size(self) -> int:
        """Samples per step: the first tensor's leading dimension (1 for a scalar)."""
        first = self._tensors[0] if self._tensors else None
        return int(first.shape[0]) if first is not None and first.dim() else 1

    @property
    def description(self) -> str:
        """Shapes and dtypes in call order, keyword arguments by name: ``(8, 3, 224, 224) float32``,
        ``input_ids=(8, 128) int64, attention_mask=(8, 128) int64``."""
        parts = [_describe(a) for a in self.args]
        parts += [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


@dataclass
class ResolvedModel:
    """A model ready to estimate: a module and its inputs on meta, and how to build the
    same thing for real (``build_real``) when the step is measured."""

    name: str
    module: nn.Module
    #: The forward's arguments (``inputs.args``, ``inputs.kwargs``); as a sequence, every input tensor.
    inputs: ModelInputs
    loss: LossKind | LossChoice
    build_real: Callable[[torch.device], tuple[nn.Module, ModelInputs]]
    #: Paths of the containers of repeated blocks (checkpointing, FSDP units): a zoo entry's, or ().
    block_containers: tuple[str, ...] = ()
    #: Submodules a data-parallel strategy prepares as frozen models of their own, outside the trained
    #: one (TRL's reference model: accelerate's ``prepare_fsdp`` shards it on its root alone); or ().
    separate_models: tuple[str, ...] = ()
    #: The submodule that is the trained model (TRL's policy, inside the module whose forward is TRL's
    #: ``compute_loss``): what accelerate prepares — DDP wraps it, ``fsdp2_prepare_model`` lays its
    #: units over it (:mod:`memcalc.distributed.accelerate_fsdp`); under memcalc's own FSDP2 layout it
    #: is the root, sharded as ``fully_shard(model, reshard_after_forward=True)`` (an older accelerate's
    #: explicit root). None: the module itself.
    trained_root: str | None = None
    #: What resolving decided that the report should say (where the inputs came from, a grown model).
    notes: tuple[str, ...] = ()
    #: Whether the model is a decoder language model (a KV cache applies); None: not known.
    decoder: bool | None = None
    #: The user's code that made the inputs (``example_inputs(2) in models.py``); None: memcalc
    #: made them from a shape or a zoo entry, or the user passed them.
    inputs_from: str | None = None
    #: The labels a training step adds to the batch when the user chose no loss, so that the model
    #: computes its own (``output.loss``, as ``Trainer.compute_loss`` trains); None: memcalc's loss.
    labels: LabelsMaker | None = None
    #: How the model checkpoints its blocks itself (``checkpoint=True``); None: memcalc wraps the
    #: blocks of ``block_containers``.
    checkpointing: Checkpointer | None = None
    #: What the model's code reads from tensors, answered for the estimated run; None: nothing.
    reads: ReadsFn | None = None
    #: How the model generates tokens (``mode="generate"``); None: it has no generate() memcalc runs.
    generate: GenerateFn | None = None
    #: The model's own static KV cache (``kv_cache``); None: memcalc adds one beside the forward.
    static_cache: StaticCacheFn | None = None
    #: Whether the decode steps of :attr:`generate` (of the prompt in these inputs and that many new
    #: tokens) repeat over a cache one token longer (None) or why not, from what the model's source
    #: knows of it (:mod:`memcalc.engine.steady`); None: it knows nothing, and every decode step is traced.
    steady_decoding: Callable[[nn.Module, ModelInputs, int], str | None] | None = None
    #: The user passed a module they had compiled (``torch.compile(module)``): the step is
    #: estimated compiled, as ``compile=True`` estimates it.
    compiled: bool = False
    #: Wrapper tensor subclasses made by the model's libraries (torchao's ``Float8TrainingTensor``)
    #: whose own dispatch the tracer lets run first, so that it sees the ops they run inside
    #: (:attr:`memcalc.engine.trace.StorageTracer.defer_to`).
    defer_to: tuple[type[torch.Tensor], ...] = ()
    #: The module's forward opens its own autocast regions (those of accelerate's prepared forwards
    #: inside a TRL trainer's step), from :func:`memcalc.engine.step_backend.available_autocast_region`:
    #: the loop then opens none around it.
    opens_autocast: bool = False

    def step_inputs(self, inputs: ModelInputs, *, own_loss: bool) -> ModelInputs:
        """``inputs`` (this model's, on any device) as the step passes them: with the labels of
        :attr:`labels` added when ``own_loss`` (a training step whose loss the user did not
        choose), except those the inputs carry already."""
        if not own_loss or self.labels is None:
            return inputs
        added = {k: v for k, v in self.labels(inputs).items() if k not in inputs.kwargs}
        return ModelInputs(inputs.args, {**inputs.kwargs, **added}) if added else inputs

    @property
    def trained_model(self) -> nn.Module:
        """The model accelerate prepares (:attr:`trained_root`): what the Trainer decides its DDP
        arguments from (a ``PreTrainedModel`` or not)."""
        return self.module if self.trained_root is None else self.module.get_submodule(self.trained_root)

    @property
    def batch_size(self) -> int:
        """Samples per step: the first input tensor's leading dimension (1 for a scalar input)."""
        return self.inputs.batch_size

    @property
    def input_description(self) -> str:
        """The inputs' shapes and dtypes, e.g. ``(8, 3, 224, 224) float32`` (keyword inputs by name)."""
        return self.inputs.description


def bind_inputs(forward: Callable[..., Any], inputs: ModelInputs, name: str = "the model") -> ModelInputs:
    """A dict of inputs bound to ``forward`` the way Python would call it: as keyword arguments,
    ``forward(**inputs)``, when that call binds (the keys name its parameters, or it takes
    ``**kwargs``, and no required parameter is missing) — a Hugging Face batch; else as its one
    positional argument, ``forward(inputs)`` (``def forward(self, batch)``, common outside
    Hugging Face). Keywords come first: a dict that binds both ways is a batch of named
    arguments. Other inputs (a tensor, positional arguments) are returned as they are.

    One function for every way inputs arrive (``inputs=``, a file's ``example_inputs``), called by
    the resolver on the model it estimates and on the real one ``--measure`` builds, so the two
    call the model alike.

    Raises:
        InvalidInputError: the dict binds neither way (both of Python's complaints are named).
    """
    if inputs.args or not inputs.kwargs:
        return inputs
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): keywords, as model(**inputs)
        return inputs
    try:
        signature.bind(**inputs.kwargs)
        return inputs
    except TypeError as exc:
        as_keywords = str(exc)
    try:
        signature.bind(inputs.kwargs)
    except TypeError as exc:
        raise InvalidInputError(
            f"the forward{signature} of {name} takes its dict of inputs (keys {', '.join(inputs.kwargs)}) "
            f"neither as keyword arguments ({as_keywords}) nor as its one argument ({exc})",
            hint="Give a dict whose keys name the forward's parameters (model(**inputs)), a dict the forward "
                 "takes whole (model(inputs)), or a tuple of positional arguments.") from None
    return ModelInputs((inputs.kwargs,))


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)
