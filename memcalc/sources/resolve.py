"""One resolver for every way a user names a model, in the CLI and the Python API alike.

Forms accepted by :func:`resolve`:

- a zoo name (``resnet50``, ``ResNet_50``, ``gpt2-xl``; case-insensitive, ``_``/``-`` alike). A
  zoo language model (Llama, Mistral, Qwen2.5, Gemma 2, GPT-2, BERT) is transformers' own model,
  built from the checkpoint's released config that the zoo holds, when transformers is installed
  (as an ``hf:`` model is: the class its ``architectures`` names, its own loss, PEFT's default
  LoRA targets, transformers' attention), and the zoo's plain-torch definition otherwise;
- ``torch:NAME``: the zoo's plain-torch definition of NAME whether transformers is installed or
  not — the models the real GPU measurements (``tests/data/gpu/``) were made with;
- an ``nn.Module`` (left untouched: memcalc works on a meta twin) or a zero-argument factory;
- ``path/to/file.py:factory`` and ``package.module:factory`` — the factory returns an
  ``nn.Module``; an optional ``example_inputs(batch_size)`` beside it supplies the inputs
  (a tensor, a tuple of positional arguments, or a dict: keyword arguments, or the forward's one
  argument when its keys are not the forward's parameters) unless an input shape or sequence
  length is given; the file's folder is importable while its code runs, as
  under ``python file.py``;
- ``torchvision:resnet50``, ``timm:convnext_tiny``, ``hf:gpt2``, ``hf:path/to/config.json``
  when those packages are installed (Hugging Face models come from their config class
  defaults or a local config file);
- ``hf:ORG/NAME[@revision]`` or a :class:`~memcalc.stacks.transformers.hub.HuggingFace` (which also picks
  the attention implementation): the repository's ``config.json`` alone, from the Hugging Face
  cache or the Hub (:mod:`memcalc.stacks.transformers.hub`) — never its weights.

Every model is built under ``torch.device("meta")``: no weights are ever allocated.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

import torch
from torch import nn

import models_zoo
from memcalc.core.errors import (
    InvalidInputError,
    MemcalcError,
    MissingPackageError,
    ModelSourceError,
    UnknownModelError,
    user_frame,
)
from memcalc.core.losses import LossChoice, LossKind
from memcalc.engine.compiled import is_compiled_module, uncompiled
from memcalc.engine.model import InputsLike, ModelInputs, ResolvedModel, bind_inputs
from memcalc.sources.inputs import Asked, as_inputs, check_batch_fits, input_maker, requested_shape
from memcalc.sources.meta_init import MetaRandomFillsSkipped
from memcalc.sources.twin import check_supported_modules, materialise_lazy, meta_twin, own_copy
from memcalc.sources.user_code import Example, load_from_file, load_from_module, name_the_factory
from memcalc.stacks.transformers.attention import attention_note, check_supported, implementation_name
from memcalc.stacks.transformers.checkpointing import hf_checkpointing, supports_checkpointing
from memcalc.stacks.transformers.config_check import check_config, config_error
from memcalc.stacks.transformers.generate import generate_on_meta, static_cache, steady_decoding
from memcalc.stacks.transformers.heads import (
    AUTO_CLASSES,
    Head,
    head_of,
    labels_maker,
    named_architecture,
    settle_loss_type,
)
from memcalc.stacks.transformers.hub import HfAttention, HuggingFace, config_from_values, import_hf, load_config
from memcalc.stacks.transformers.reads import hf_reads, routing_notes
from models_zoo.registry import TORCH_PREFIX, HfConfig, InputKind, ZooEntry

__all__ = ("ModelLike", "ResolvedModel", "builds_transformers", "meta_twin", "resolve")

#: What :func:`resolve` accepts as a model (see the module docstring for the string forms).
ModelLike: TypeAlias = "str | HuggingFace | nn.Module | Callable[[], nn.Module]"
META = torch.device("meta")

_Shape: TypeAlias = tuple[int, ...]
_Inputs: TypeAlias = ModelInputs
#: Builds the model and its inputs on a device (``ResolvedModel.build_real``).
_Builder: TypeAlias = Callable[[torch.device], tuple[nn.Module, _Inputs]]
#: ``(name, batch_size, shape, seq_len, user_inputs)`` of an optional package's model source.
_PackageSource: TypeAlias = Callable[[str, int, _Shape | None, int | None, _Inputs | None], ResolvedModel]

# Default sequence length for Hugging Face models built from a config without one.
_HF_DEFAULT_SEQ_LEN = 512


def resolve(
    model: object,
    *,
    batch_size: int | None = None,
    input_shape: Sequence[int] | None = None,
    seq_len: int | None = None,
    inputs: InputsLike | None = None,
) -> ResolvedModel:
    """Turn whatever the user gave into a :class:`ResolvedModel` on meta.

    Args:
        model: a zoo name or another string form (module docstring), a
            :class:`~memcalc.stacks.transformers.hub.HuggingFace`, an ``nn.Module`` or a zero-argument factory
            (:data:`ModelLike`); anything else is refused.
        batch_size: samples per step; taken from ``inputs`` when they are given.
        input_shape: the shape of one sample (``(C, H, W)``, or ``(seq_len,)`` for tokens).
        seq_len: the sequence length of a token model (when ``input_shape`` is not given):
            token ids ``(batch_size, seq_len)``.
        inputs: the model's inputs themselves (copied to meta): a tensor, a sequence of
            positional arguments, or a dict — keyword arguments (``model(**inputs)``) when its
            keys name the forward's parameters, else the forward's one argument (``model(inputs)``;
            :func:`~memcalc.engine.model.bind_inputs`, which binds a file's ``example_inputs`` too).

    An explicit ``input_shape`` or ``seq_len`` wins over a file's ``example_inputs`` (which
    may have been written for another factory of the file); the report's notes say which
    inputs were used.

    Returns:
        The module and its inputs on meta, with a builder of the real ones.
    """
    if batch_size is not None and batch_size < 1:
        raise InvalidInputError(f"batch size must be at least 1, got {batch_size}")
    shape = requested_shape(input_shape, seq_len)
    user_inputs = as_inputs(inputs)
    if user_inputs is not None:
        batch_size = user_inputs.batch_size
    if batch_size is None:
        raise InvalidInputError("give a batch size (or inputs to take it from)")

    seq_len_only = seq_len if input_shape is None else None
    if shape is not None and user_inputs is None:
        check_batch_fits(batch_size, shape, tokens=seq_len_only is not None)
    dtype = BUILD_DTYPE if _memcalc_builds(model) else None
    with _building(dtype):
        resolved = _bound(_resolve_any(model, batch_size, shape, seq_len_only, user_inputs))
    return dataclasses.replace(resolved, build_real=_built_real(resolved.build_real, dtype))


#: The default dtype memcalc builds the models it names in (the zoo, ``torch:``,
#: ``torchvision:``, ``timm:``, ``hf:``) and their inputs, whatever the caller's
#: ``torch.get_default_dtype()``: a step's dtype is the precision's cast of it
#: (:func:`~memcalc.engine.prepare.prepare_step`), so the report's precision is the parameters'.
BUILD_DTYPE = torch.float32


def _memcalc_builds(model: object) -> bool:
    """Whether memcalc builds ``model`` from a name (the zoo, a package, a Hugging Face config),
    rather than running the user's code (a module, a factory, a file's or a package's
    ``factory``), whose tensors have the dtype that code gives them."""
    if isinstance(model, HuggingFace):
        return True
    if not isinstance(model, str):
        return False
    prefix, sep, _rest = model.partition(":")
    return models_zoo.get(model) is not None or (bool(sep) and prefix in _PACKAGE_SOURCES)


@contextmanager
def _building(dtype: torch.dtype | None) -> Iterator[None]:
    """Tensors made here are normal ones, never inference tensors (a caller inside
    ``torch.inference_mode()`` would make every parameter one, and backward refuse them); with
    ``dtype``, floating ones are made in it by default. The caller's default dtype is back on
    the way out; it is set only where it differs (it is global to the process)."""
    previous = torch.get_default_dtype()
    with torch.inference_mode(False):
        if dtype is None or dtype == previous:
            yield
            return
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _built_real(build: _Builder, dtype: torch.dtype | None) -> _Builder:
    """``build`` (the real model and inputs of ``--measure``) under :func:`_building`."""

    def build_real(device: torch.device) -> tuple[nn.Module, _Inputs]:
        with _building(dtype):
            return build(device)

    return build_real


def _resolve_any(model: object, batch_size: int, shape: _Shape | None, seq_len: int | None,
                 user_inputs: _Inputs | None) -> ResolvedModel:
    if isinstance(model, str):
        return _resolve_string(model, batch_size, shape, seq_len, user_inputs)
    if isinstance(model, HuggingFace):
        return _hf_resolve(model, batch_size, shape, seq_len, user_inputs)
    asked = Asked(batch_size, shape, seq_len is not None, user_inputs)
    if is_compiled_module(model):  # torch.compile(module): its module, estimated compiled
        assert isinstance(model, nn.Module)
        original = uncompiled(model)
        resolved = _resolve_module(original, _display_name(original), asked)
        resolved.compiled = True
        return resolved
    if isinstance(model, nn.Module):
        return _resolve_module(model, _display_name(model), asked)
    if callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        return _resolve_factory(model, name, asked)
    raise InvalidInputError(
        f"cannot estimate a {type(model).__name__}: give a zoo name, an nn.Module or a factory")


def _bound(resolved: ResolvedModel) -> ResolvedModel:
    """``resolved`` with a dict of inputs bound to its forward as Python would
    (:func:`~memcalc.engine.model.bind_inputs`), on meta and in the real build of ``--measure``
    alike; a dict passed whole is noted in the report."""
    inputs = bind_inputs(resolved.module.forward, resolved.inputs, resolved.name)
    if inputs is resolved.inputs:
        return resolved
    build, name = resolved.build_real, resolved.name

    def build_bound(device: torch.device) -> tuple[nn.Module, _Inputs]:
        module, real = build(device)
        return module, bind_inputs(module.forward, real, name)

    note = ("the dict of inputs is the forward's one argument, model(inputs): its keys are not the forward's "
            "keyword arguments")
    return dataclasses.replace(resolved, inputs=inputs, build_real=build_bound, notes=(*resolved.notes, note))


# ---- strings ---------------------------------------------------------------------------
def _resolve_string(spec: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                    user_inputs: _Inputs | None) -> ResolvedModel:
    entry = models_zoo.get(spec)
    if entry is not None:
        return _resolve_entry(entry, batch_size, shape, seq_len, user_inputs)
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in _PACKAGE_SOURCES:
        return _PACKAGE_SOURCES[prefix](rest, batch_size, shape, seq_len, user_inputs)
    asked = Asked(batch_size, shape, seq_len is not None, user_inputs)
    if sep and (prefix.endswith(".py") or "/" in prefix or "\\" in prefix):
        factory, example = load_from_file(Path(prefix), rest)
        return _resolve_factory(factory, spec, asked, example, prefix)
    if sep and prefix.replace(".", "").replace("_", "").isalnum():
        factory, example = load_from_module(prefix, rest)
        return _resolve_factory(factory, spec, asked, example, prefix)
    if spec.endswith(".py"):
        raise name_the_factory(Path(spec))
    raise UnknownModelError(spec, models_zoo.closest(spec))


def _resolve_entry(entry: ZooEntry, batch_size: int, shape: _Shape | None, seq_len: int | None,
                   user_inputs: _Inputs | None) -> ResolvedModel:
    """A zoo name: transformers' model when the entry has a Hugging Face config and transformers
    is installed, else the plain-torch definition (with a note saying why, for a language model)."""
    per_sample = _entry_shape(entry, shape, seq_len)
    if user_inputs is None:
        check_batch_fits(batch_size, per_sample, tokens=entry.input_kind is InputKind.TOKENS)
    if entry.hf is not None and (builds_transformers(entry) or not entry.has_plain_torch):
        return _resolve_zoo_hf(entry, entry.hf, batch_size, per_sample, user_inputs)  # import_hf says what is missing
    resolved = _resolve_zoo_torch(entry, batch_size, per_sample, user_inputs, entry.name)
    if entry.hf is not None:
        resolved.notes += (f"transformers is not installed: {entry.name} is memcalc's plain-torch definition of "
                           f"{entry.hf.architecture} (the same parameters; the model's own loss and PEFT's default "
                           f"LoRA targets need transformers' model: pip install transformers)",)
    return resolved


def builds_transformers(entry: ZooEntry) -> bool:
    """Whether the zoo name ``entry.name`` builds transformers' model (the entry has a released
    Hugging Face config, and transformers is installed) rather than the plain-torch definition.

    Args:
        entry: a zoo entry.

    Returns:
        True where resolving the name builds transformers' model.
    """
    return entry.hf is not None and importlib.util.find_spec("transformers") is not None


def _torch_zoo_source(name: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                      user_inputs: _Inputs | None) -> ResolvedModel:
    """``torch:NAME``: the zoo's plain-torch definition, transformers installed or not."""
    entry = models_zoo.get(name)
    if entry is None:
        raise UnknownModelError(f"{TORCH_PREFIX}{name}", [f"{TORCH_PREFIX}{n}" for n in models_zoo.closest(name)])
    if not entry.has_plain_torch:
        raise InvalidInputError(f"{TORCH_PREFIX}{entry.name}: memcalc has no plain-torch definition of {entry.name}, "
                                f"only transformers' model of its released config",
                                hint=f"name it without {TORCH_PREFIX!r}: {entry.name}")
    per_sample = _entry_shape(entry, shape, seq_len)
    return _resolve_zoo_torch(entry, batch_size, per_sample, user_inputs, f"{TORCH_PREFIX}{entry.name}")


def _entry_shape(entry: ZooEntry, shape: _Shape | None, seq_len: int | None) -> _Shape:
    """One sample's shape for ``entry``: the one asked (checked against what the model takes),
    else the entry's default."""
    if entry.input_kind is InputKind.TOKENS:
        if shape is not None and len(shape) != 1:
            raise InvalidInputError(
                f"{entry.name} takes token ids; give --seq-len N (not an image shape {shape})")
        return shape or entry.default_shape
    if seq_len is not None:
        raise InvalidInputError(f"{entry.name} takes {entry.input_kind.value} inputs; "
                                f"give --input-shape (e.g. {','.join(map(str, entry.default_shape))})")
    if entry.input_kind is InputKind.IMAGE and shape is not None and len(shape) != len(entry.default_shape):
        raise _image_rank_error(entry, shape)
    return shape or entry.default_shape


def _resolve_zoo_torch(entry: ZooEntry, batch_size: int, per_sample: _Shape, user_inputs: _Inputs | None,
                       name: str) -> ResolvedModel:
    """The zoo's plain-torch model of ``entry``, reported as ``name``."""
    def build(device: torch.device) -> tuple[nn.Module, ModelInputs]:
        with device:
            module = entry.build(per_sample)
        if user_inputs is not None:
            return module, user_inputs.map(lambda t: t.detach().to(device))
        return module, ModelInputs(entry.example_inputs(batch_size, per_sample, device=device))

    module, inputs = _build_on_meta(build, name)
    notes = _context_notes(entry, per_sample, module, entry.reference_parameters)
    return ResolvedModel(name, module, inputs, entry.loss, build, entry.block_containers,
                         notes=notes, decoder=entry.decoder)


def _resolve_zoo_hf(entry: ZooEntry, hf: HfConfig, batch_size: int, per_sample: _Shape,
                    user_inputs: _Inputs | None) -> ResolvedModel:
    """transformers' model of ``entry``, built from its released config as an ``hf:`` model is
    (:func:`_hf_model`): the zoo gives the config, the default sequence length and, for a learned
    position table, its growth to a longer sequence (as the plain-torch model grows its own)."""
    transformers = import_hf("transformers", f"the zoo model {entry.name}")
    values = dict(hf.values)
    length = per_sample[0] if entry.input_kind is InputKind.TOKENS else None
    table = values.get(hf.position_table) if hf.position_table is not None else None
    if length is not None and isinstance(table, int) and length > table:
        values[str(hf.position_table)] = length
    config = config_from_values(transformers, values, entry.name)
    resolved = _hf_model(transformers, config, entry.name, None, batch_size, length or _HF_DEFAULT_SEQ_LEN,
                         user_inputs)
    resolved.decoder = entry.decoder
    plain = (f"{TORCH_PREFIX}{entry.name}: memcalc's plain-torch definition" if entry.has_plain_torch
             else "memcalc has no plain-torch definition of it")
    built = (f"{entry.name} is transformers' {type(resolved.module).__name__}, built from the released config of "
             f"{hf.repo} ({plain})")
    resolved.notes = (built, *resolved.notes,
                      *_context_notes(entry, per_sample, resolved.module, entry.hf_parameters))
    return resolved


def _image_rank_error(entry: ZooEntry, shape: _Shape) -> InvalidInputError:
    """A zoo image model given a shape of another rank: caught here, before the forward, where
    the first convolution would only say "Invalid channel dimensions" (two numbers) or complain
    of a 5-D input (the batch dimension included)."""
    example = entry.default_shape
    extra = " (the batch dimension is --batch, not part of the shape)" if len(shape) > len(example) else ""
    return InvalidInputError(
        f"{entry.name} takes images of shape C,H,W ({len(example)} numbers: channels, height, width); "
        f"the input shape given, {','.join(map(str, shape))}, has {len(shape)}{extra}",
        hint=f"Give one image's shape without the batch dimension: --input-shape {','.join(map(str, example))} "
             f"(input_shape={example} in Python).")


def _context_notes(entry: ZooEntry, per_sample: _Shape, module: nn.Module, released: int | None) -> tuple[str, ...]:
    """What a sequence longer than the released model's context does to the zoo's model: a
    learned position table (GPT-2, BERT) grows with it, and so does the parameter count
    (``released`` at the released context), which must not pass unremarked; rotary positions
    (Llama) just run past it."""
    limit = entry.context_length
    if entry.input_kind is not InputKind.TOKENS or limit is None or per_sample[0] <= limit:
        return ()
    length = per_sample[0]
    count = sum(p.numel() for p in module.parameters())
    if released is not None and count != released:
        return (f"{length:,} tokens exceed {entry.name}'s context of {limit:,}: its position table is grown to "
                f"{length:,} rows, so this model has {count:,} parameters, not the released {released:,} "
                f"(which cannot take more than {limit:,} tokens)",)
    return (f"{length:,} tokens exceed {entry.name}'s context of {limit:,} (max_position_embeddings); the model "
            f"runs them with the same {count:,} parameters (rotary positions, no position table)",)


# ---- modules and factories --------------------------------------------------------------
def _measured_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """A measured copy's tensors are real (deepcopy's own copies: None), except those that are
    not graph leaves — the ``weight`` that pruning and the old weight norm recompute in a forward
    pre-hook — which stay on meta: ``module.to(device)`` moves parameters and buffers, never a
    plain attribute, so the device holds only the one the first forward computes (and a CPU
    measurement must not see the stale copy freed)."""
    return None if tensor.is_leaf else torch.empty_like(tensor, device=META)


def _has_real_storage(module: nn.Module) -> bool:
    return any(t.device.type != "meta" for t in itertools.chain(module.parameters(), module.buffers()))


def _resolve_module(module: nn.Module, name: str, asked: Asked) -> ResolvedModel:
    """A module object: estimated on its meta twin, measured on its own copy (never the user's
    object, whose tensors, hooks and what they hold stay as they were)."""
    check_supported_modules(module, name)
    twin = meta_twin(module)
    plan = input_maker(name, asked, None, None)
    inputs = plan.make(META)
    materialise_lazy(twin, inputs, name)

    def build(device: torch.device) -> tuple[nn.Module, _Inputs]:
        real = own_copy(module, _measured_copy).to(device)
        real_inputs = plan.make(device)
        materialise_lazy(real, real_inputs, name)
        return real, real_inputs

    return ResolvedModel(name, twin, inputs, LossChoice.AUTO, build, notes=plan.notes,
                         decoder=_declared_decoder(twin))


def _resolve_factory(factory: Callable[[], object], name: str, asked: Asked, example: Example | None = None,
                     example_where: str | None = None) -> ResolvedModel:
    """A factory's model on meta. ``example`` is the ``example_inputs`` found beside a user's
    factory (in ``example_where``) or a source's own (``example_where`` None: no note)."""
    def make(device: torch.device) -> nn.Module:
        with device:
            try:
                module = factory()
            except MemcalcError:  # already says what went wrong (a source's own refusal)
                raise
            except Exception as exc:
                raise ModelSourceError(f"the factory {name} raised {type(exc).__name__}: {exc}"
                                       f"{user_frame(exc)}") from exc
        if not isinstance(module, nn.Module):
            raise ModelSourceError(
                f"the factory {name} returned a {type(module).__name__}, not an nn.Module",
                hint="A factory must return the model (an nn.Module instance).")
        return module

    with MetaRandomFillsSkipped():
        module = make(META)
    check_supported_modules(module, name)
    if _has_real_storage(module):  # the factory chose a device itself: estimate on a twin
        module = meta_twin(module)
    plan = input_maker(name, asked, example, example_where)
    inputs = plan.make(META)
    materialise_lazy(module, inputs, name)

    def build(device: torch.device) -> tuple[nn.Module, _Inputs]:
        real, real_inputs = make(device), plan.make(device)
        materialise_lazy(real, real_inputs, name)
        return real, real_inputs

    return ResolvedModel(name, module, inputs, LossChoice.AUTO, build, notes=plan.notes,
                         decoder=_declared_decoder(module), inputs_from=plan.source)


def _declared_decoder(module: nn.Module) -> bool | None:
    """Whether the model's attention says it is causal: Hugging Face attention modules carry
    ``is_causal`` (True in GPT-2's and Llama's, False in BERT's encoder). None: none says."""
    flags = [m.is_causal for m in module.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return any(flags) if flags else None


def _build_on_meta(build: _Builder, name: str) -> tuple[nn.Module, _Inputs]:
    try:
        with MetaRandomFillsSkipped():
            return build(META)
    except Exception as exc:
        raise ModelSourceError(f"building {name} failed: {type(exc).__name__}: {exc}") from exc


# ---- optional package sources -------------------------------------------------------------
def _import_optional(package: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise MissingPackageError(package, purpose) from exc


def _torchvision_source(name: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                       user_inputs: _Inputs | None) -> ResolvedModel:
    tv_models = _import_optional("torchvision", f"the model source torchvision:{name}").models
    try:
        builder = tv_models.get_model_builder(name)
    except ValueError as exc:
        raise UnknownModelError(f"torchvision:{name}", [f"torchvision:{n}" for n in
                                                        _close(name, tv_models.list_models())]) from exc
    factory = lambda: builder(weights=None)
    return _resolve_factory(factory, f"torchvision:{name}",
                            Asked(batch_size, shape or (3, 224, 224), seq_len is not None, user_inputs))


def _timm_source(name: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                 user_inputs: _Inputs | None) -> ResolvedModel:
    timm = _import_optional("timm", f"the model source timm:{name}")
    if name not in timm.list_models():
        raise UnknownModelError(f"timm:{name}", [f"timm:{n}" for n in _close(name, timm.list_models())])
    factory = lambda: timm.create_model(name, pretrained=False)
    if shape is None:
        config = timm.get_pretrained_cfg(name)
        shape = tuple(getattr(config, "input_size", None) or (3, 224, 224))
    return _resolve_factory(factory, f"timm:{name}", Asked(batch_size, shape, False, user_inputs))


def _hf_source(spec: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
               user_inputs: _Inputs | None) -> ResolvedModel:
    return _hf_resolve(HuggingFace.parse(spec), batch_size, shape, seq_len, user_inputs)


def _hf_resolve(source: HuggingFace, batch_size: int, shape: _Shape | None, seq_len: int | None,
                user_inputs: _Inputs | None) -> ResolvedModel:
    transformers = import_hf("transformers", f"the model source {source.spec}")
    config = load_config(transformers, source)
    check_config(transformers, config, source.spec)
    context = getattr(config, "max_position_embeddings", None)
    asked = (shape[0] if shape else None) or seq_len
    length = asked or min(context or _HF_DEFAULT_SEQ_LEN, _HF_DEFAULT_SEQ_LEN)
    if user_inputs is None:
        check_batch_fits(batch_size, (length,), tokens=True)
    resolved = _hf_model(transformers, config, source.spec, source.attention, batch_size, length, user_inputs,
                         source.head)
    if user_inputs is None and isinstance(context, int) and length > context:
        resolved.notes += (_hf_beyond_context(resolved, context, length),)
    return resolved


def _hf_model(transformers: ModuleType, config: Any, name: str, attn: HfAttention | None, batch_size: int,
              length: int, user_inputs: _Inputs | None, task: Head | None = None) -> ResolvedModel:
    """transformers' model of ``config`` on meta, as every Hugging Face model is estimated (an
    ``hf:`` model and a zoo language model alike): the class the config's ``architectures``
    names, token ids ``(batch, length)`` unless the user gave inputs, the labels of its head (so
    that a training step trains the model's own loss), its repeated blocks and its attention;
    ``task``: another head (``--task``), the class its Auto class builds."""
    factory = lambda: _hf_model_from_config(transformers, config, attn, name, task)
    vocab = getattr(config, "vocab_size", None) or 32000

    def example(b: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, vocab, (b, length)),)

    resolved = _resolve_factory(factory, name, Asked(batch_size, None, False, user_inputs), example)
    # memcalc's loss when the user names none is the model's own (labels in the batch, as Trainer
    # passes them); LM cross-entropy is memcalc's stand-in for a causal LM whose loss is chosen
    resolved.loss = LossKind.LM_CROSS_ENTROPY if _is_causal_lm(resolved.module) else LossChoice.AUTO
    resolved.labels = labels_maker(resolved.module)
    causal_lm = head_of(resolved.module) is Head.CAUSAL_LM
    resolved.generate = generate_on_meta if causal_lm else None
    resolved.static_cache = static_cache if causal_lm else None
    resolved.steady_decoding = steady_decoding if causal_lm else None
    resolved.reads = hf_reads
    resolved.notes += (attention_note(resolved.module, attn), *routing_notes(resolved.module))
    resolved.block_containers = hf_block_containers(resolved.module)
    resolved.checkpointing = hf_checkpointing if supports_checkpointing(resolved.module) else None
    return resolved


def hf_block_containers(module: nn.Module) -> tuple[str, ...]:
    """The containers of a Hugging Face model's repeated blocks (its decoder or encoder layers):
    the ``ModuleList`` containers whose children are all of the classes the model names in
    ``_no_split_modules`` — the classes transformers itself keeps whole when it shards a model,
    and whose instances ``gradient_checkpointing_enable()`` checkpoints
    (``GradientCheckpointingLayer``). Used by ``--checkpoint`` and the FSDP units."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return tuple(path for path, sub in module.named_modules()
                 if isinstance(sub, nn.ModuleList) and len(sub) > 0
                 and all(type(child).__name__ in names for child in sub))


def _hf_beyond_context(resolved: ResolvedModel, context: int, length: int) -> str:
    """A sequence longer than the config's ``max_position_embeddings``: refused when the model
    has a learned position table (the real model would index past it: there is no such step
    to estimate), else a note (rotary or relative positions run past the trained length)."""
    for name, sub in resolved.module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(sub, nn.Embedding) and ("position" in leaf or leaf in ("wpe", "pos_embed", "pos_emb")):
            raise InvalidInputError(
                f"{resolved.name} takes at most {context:,} tokens (max_position_embeddings): its position "
                f"embeddings {name} have {sub.num_embeddings:,} rows, so {length:,} tokens cannot run",
                hint=f"Give --seq-len {context} or less, or a config file with a larger max_position_embeddings "
                     f"(hf:path/to/config.json): the position table is then sized for it.")
    return (f"{length:,} tokens exceed {resolved.name}'s max_position_embeddings of {context:,}; the model runs "
            f"them with the same parameters (no position table)")


def _hf_model_from_config(transformers: ModuleType, config: Any, attn: HfAttention | None = None,
                          name: str = "", task: Head | None = None) -> nn.Module:
    implementation = implementation_name(transformers, attn)
    kwargs: dict[str, Any] = {} if implementation is None else {"attn_implementation": implementation}
    # float32 parameters whatever the config's torch_dtype says (the dtype the Hub stores weights
    # in, bfloat16 for most LLMs, which from_config would build in): --precision decides the step's.
    kwargs["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = torch.float32
    if task is not None:  # --task: that head, or an error (not another head in its place)
        return _hf_head(transformers, config, task, kwargs, attn, name)
    named = named_architecture(transformers, config)
    builders = [] if named is None else [named._from_config]  # type: ignore[attr-defined]  # PreTrainedModel's
    builders += [getattr(transformers, auto).from_config for auto in ("AutoModelForCausalLM", "AutoModel")]
    for build in builders:  # the config's head (stacks.transformers.heads), a causal LM, the bare model
        try:
            model: nn.Module = build(config, **kwargs)
        except ValueError as exc:
            if attn is not None and "Unrecognized configuration class" not in str(exc):
                raise InvalidInputError(f"{name} cannot run --attn {attn.value}: {str(exc).splitlines()[0]}",
                                        hint="Leave --attn out to run what transformers picks for it.") from exc
            continue
        except (ArithmeticError, AttributeError, TypeError, IndexError, KeyError) as exc:  # a field it did not check
            raise config_error(name, f"{type(exc).__name__} while building {getattr(build, '__qualname__', build)}: "
                                     f"{' '.join(str(exc).split())}") from exc
        check_supported(model, attn, name)
        settle_loss_type(model)
        return model
    raise ModelSourceError(f"transformers has no model class for config {type(config).__name__}")


def _hf_head(transformers: ModuleType, config: Any, task: Head, kwargs: dict[str, Any], attn: HfAttention | None,
             name: str) -> nn.Module:
    """The model with the head ``--task`` asks for, built by its Auto class; a model type
    without that head in the installed transformers is refused, naming the task."""
    try:
        model: nn.Module = getattr(transformers, AUTO_CLASSES[task]).from_config(config, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise InvalidInputError(
                f"{name} has no {task.value} head in transformers {transformers.__version__} "
                f"({AUTO_CLASSES[task]} does not know {type(config).__name__})",
                hint="Choose another --task, or leave it out to build the head the config's architectures "
                     "names.") from None
        raise InvalidInputError(f"{name} cannot run --attn {attn.value if attn else ''}: {str(exc).splitlines()[0]}",
                                hint="Leave --attn out to run what transformers picks for it.") from exc
    check_supported(model, attn, name)
    return model


def _is_causal_lm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("ForCausalLM") or type(module).__name__.endswith("LMHeadModel")


def _close(name: str, candidates: list[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)


_PACKAGE_SOURCES: dict[str, _PackageSource] = {
    "torchvision": _torchvision_source,
    "timm": _timm_source,
    "hf": _hf_source,
    "torch": _torch_zoo_source,
}


# ---- small helpers -----------------------------------------------------------------------
def _display_name(module: nn.Module) -> str:
    return type(module).__name__
