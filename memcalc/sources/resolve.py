"""One resolver for every way a user names a model, in the CLI and the Python API alike.

Forms accepted by :func:`resolve`:

- a zoo name (``resnet50``, ``ResNet_50``, ``gpt2-xl``; case-insensitive, ``_``/``-`` alike);
- an ``nn.Module`` (left untouched: memcalc works on a meta twin) or a zero-argument factory;
- ``path/to/file.py:factory`` and ``package.module:factory`` — the factory returns an
  ``nn.Module``; an optional ``example_inputs(batch_size)`` beside it supplies the inputs;
- ``torchvision:resnet50``, ``timm:convnext_tiny``, ``hf:gpt2``, ``hf:path/to/config.json``
  when those packages are installed (never a download: Hugging Face models come from their
  config class defaults or a local config file).

Every model is built under ``torch.device("meta")``: no weights are ever allocated.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import itertools
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

import torch
from torch import nn

import models_zoo
from memcalc.core.errors import InvalidInputError, MissingPackageError, ModelSourceError, UnknownModelError
from memcalc.core.losses import LossChoice, LossKind
from memcalc.engine.model import ResolvedModel
from models_zoo.registry import InputKind, ZooEntry

__all__ = ("ModelLike", "ResolvedModel", "meta_twin", "resolve")

#: What :func:`resolve` accepts as a model (see the module docstring for the string forms).
ModelLike: TypeAlias = "str | nn.Module | Callable[[], nn.Module]"
META = torch.device("meta")

_Shape: TypeAlias = tuple[int, ...]
_Inputs: TypeAlias = tuple[torch.Tensor, ...]
#: Builds the model and its inputs on a device (``ResolvedModel.build_real``).
_Builder: TypeAlias = Callable[[torch.device], tuple[nn.Module, _Inputs]]
#: A user's ``example_inputs(batch_size)``: a tensor or a sequence of tensors (user code: unchecked).
_Example: TypeAlias = Callable[[int], Any]
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
    inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
) -> ResolvedModel:
    """Turn whatever the user gave into a :class:`ResolvedModel` on meta.

    Args:
        model: a zoo name or another string form (module docstring), an ``nn.Module`` or a
            zero-argument factory (:data:`ModelLike`); anything else is refused.
        batch_size: samples per step; taken from ``inputs`` when they are given.
        input_shape: the shape of one sample (``(C, H, W)``, or ``(seq_len,)`` for tokens).
        seq_len: the sequence length of a token model (when ``input_shape`` is not given).
        inputs: the model's inputs themselves (copied to meta).

    Returns:
        The module and its inputs on meta, with a builder of the real ones.
    """
    if batch_size is not None and batch_size < 1:
        raise InvalidInputError(f"batch size must be at least 1, got {batch_size}")
    shape = _requested_shape(input_shape, seq_len)
    user_inputs = _as_tuple(inputs)
    if user_inputs is not None:
        batch_size = int(user_inputs[0].shape[0]) if user_inputs[0].dim() else 1
    if batch_size is None:
        raise InvalidInputError("give a batch size (or inputs to take it from)")

    seq_len_only = seq_len if input_shape is None else None
    if isinstance(model, str):
        return _resolve_string(model, batch_size, shape, seq_len_only, user_inputs)
    if isinstance(model, nn.Module):
        return _resolve_module(model, _display_name(model), batch_size, shape, user_inputs, None)
    if callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        return _resolve_factory(model, name, batch_size, shape, user_inputs, None)
    raise InvalidInputError(
        f"cannot estimate a {type(model).__name__}: give a zoo name, an nn.Module or a factory")


# ---- strings ---------------------------------------------------------------------------
def _resolve_string(spec: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                    user_inputs: _Inputs | None) -> ResolvedModel:
    entry = models_zoo.get(spec)
    if entry is not None:
        return _resolve_entry(entry, batch_size, shape, seq_len, user_inputs)
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in _PACKAGE_SOURCES:
        return _PACKAGE_SOURCES[prefix](rest, batch_size, shape, seq_len, user_inputs)
    if sep and (prefix.endswith(".py") or "/" in prefix or "\\" in prefix):
        factory, example = _load_from_file(Path(prefix), rest)
        return _resolve_factory(factory, spec, batch_size, shape, user_inputs, example)
    if sep and prefix.replace(".", "").replace("_", "").isalnum():
        factory, example = _load_from_module(prefix, rest)
        return _resolve_factory(factory, spec, batch_size, shape, user_inputs, example)
    if spec.endswith(".py"):
        raise InvalidInputError(f"{spec!r}: name the factory too, as {spec}:make_model")
    raise UnknownModelError(spec, models_zoo.closest(spec))


def _resolve_entry(entry: ZooEntry, batch_size: int, shape: _Shape | None, seq_len: int | None,
                   user_inputs: _Inputs | None) -> ResolvedModel:
    if entry.input_kind is InputKind.TOKENS:
        if shape is not None and len(shape) != 1:
            raise InvalidInputError(
                f"{entry.name} takes token ids; give --seq-len N (not an image shape {shape})")
        per_sample = shape or entry.default_shape
    else:
        if seq_len is not None:
            raise InvalidInputError(f"{entry.name} takes {entry.input_kind.value} inputs; "
                                    f"give --input-shape (e.g. {','.join(map(str, entry.default_shape))})")
        per_sample = shape or entry.default_shape

    def build(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        with device:
            module = entry.build(per_sample)
        if user_inputs is not None:
            return module, tuple(t.to(device) for t in user_inputs)
        return module, entry.example_inputs(batch_size, per_sample, device=device)

    module, inputs = _build_on_meta(build, entry.name)
    return ResolvedModel(entry.name, module, inputs, entry.loss, build, entry.block_containers)


# ---- modules and factories --------------------------------------------------------------
def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on meta — without copying any
    data: each tensor is pre-seeded in ``deepcopy``'s memo with its meta counterpart, so the
    deep copy never touches real storage. Tied weights stay tied (one memo entry each)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in memo:
            continue
        meta = tensor.detach().to(META)
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    twin = copy.deepcopy(module, memo)
    return twin


def _has_real_storage(module: nn.Module) -> bool:
    return any(t.device.type != "meta" for t in itertools.chain(module.parameters(), module.buffers()))


def _resolve_module(module: nn.Module, name: str, batch_size: int, shape: _Shape | None,
                    user_inputs: _Inputs | None, example: _Example | None) -> ResolvedModel:
    twin = meta_twin(module)
    inputs = _inputs_for(name, batch_size, shape, user_inputs, example)

    def build(device: torch.device) -> tuple[nn.Module, _Inputs]:
        real = copy.deepcopy(module).to(device)
        if user_inputs is not None:
            return real, tuple(t.to(device) for t in user_inputs)
        if example is not None:
            return real, tuple(t.to(device) for t in _as_tuple(example(batch_size)) or ())
        assert shape is not None  # without inputs or example_inputs, _inputs_for required a shape
        return real, (torch.randn(batch_size, *shape, device=device),)

    return ResolvedModel(name, twin, inputs, LossChoice.AUTO, build)


def _resolve_factory(factory: Callable[[], object], name: str, batch_size: int, shape: _Shape | None,
                     user_inputs: _Inputs | None, example: _Example | None) -> ResolvedModel:
    def make(device: torch.device) -> nn.Module:
        with device:
            try:
                module = factory()
            except Exception as exc:
                raise ModelSourceError(f"the factory {name} raised {type(exc).__name__}: {exc}"
                                       f"{_user_frame(exc)}") from exc
        if not isinstance(module, nn.Module):
            raise ModelSourceError(
                f"the factory {name} returned a {type(module).__name__}, not an nn.Module",
                hint="A factory must return the model (an nn.Module instance).")
        return module

    module = make(META)
    if _has_real_storage(module):  # the factory chose a device itself: estimate on a twin
        module = meta_twin(module)
    inputs = _inputs_for(name, batch_size, shape, user_inputs, example)

    def build(device: torch.device) -> tuple[nn.Module, _Inputs]:
        real = make(device)
        if user_inputs is not None:
            return real, tuple(t.to(device) for t in user_inputs)
        if example is not None:
            with device:
                return real, tuple(t.to(device) for t in _as_tuple(example(batch_size)) or ())
        assert shape is not None  # without inputs or example_inputs, _inputs_for required a shape
        return real, (torch.randn(batch_size, *shape, device=device),)

    return ResolvedModel(name, module, inputs, LossChoice.AUTO, build)


def _inputs_for(name: str, batch_size: int, shape: _Shape | None, user_inputs: _Inputs | None,
                example: _Example | None) -> _Inputs:
    if user_inputs is not None:
        return tuple(t.detach().to(META) for t in user_inputs)
    if example is not None:
        with META:
            try:
                produced = _as_tuple(example(batch_size))
            except Exception as exc:
                raise ModelSourceError(f"example_inputs({batch_size}) of {name} raised "
                                       f"{type(exc).__name__}: {exc}{_user_frame(exc)}") from exc
        if not produced:
            raise ModelSourceError(f"example_inputs of {name} returned no tensors")
        return tuple(t.detach().to(META) for t in produced)
    if shape is None:
        raise InvalidInputError(
            f"memcalc does not know what {name} takes as input",
            hint="Give the shape of one sample, e.g. --input-shape 3,224,224 (input_shape=(3, 224, 224)), "
                 "or pass inputs=..., or define example_inputs(batch_size) beside the factory.")
    return (torch.empty(batch_size, *shape, device=META),)


def _build_on_meta(build: _Builder, name: str) -> tuple[nn.Module, _Inputs]:
    try:
        return build(META)
    except Exception as exc:
        raise ModelSourceError(f"building {name} failed: {type(exc).__name__}: {exc}") from exc


# ---- user code: files and modules --------------------------------------------------------
def _load_from_file(path: Path, attr: str) -> tuple[Callable[[], object], _Example | None]:
    if not path.is_file():
        raise ModelSourceError(f"model file not found: {path}",
                               hint="Check the path (relative to the current directory).")
    module_name = f"memcalc_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelSourceError(f"cannot load {path} as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ModelSourceError(f"syntax error in {exc.filename or path}, line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise ModelSourceError(f"importing {path} raised {type(exc).__name__}: {exc}{_user_frame(exc)}") from exc
    return _factory_from(module, attr, str(path))


def _load_from_module(module_path: str, attr: str) -> tuple[Callable[[], object], _Example | None]:
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name and module_path.startswith(exc.name):
            raise UnknownModelError(f"{module_path}:{attr}", models_zoo.closest(module_path)) from exc
        raise ModelSourceError(f"importing {module_path} raised ModuleNotFoundError: {exc}") from exc
    except SyntaxError as exc:
        raise ModelSourceError(f"syntax error in {exc.filename}, line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise ModelSourceError(f"importing {module_path} raised {type(exc).__name__}: {exc}{_user_frame(exc)}") from exc
    return _factory_from(module, attr, module_path)


def _factory_from(module: ModuleType, attr: str, where: str) -> tuple[Callable[[], object], _Example | None]:
    if not attr:
        raise InvalidInputError(f"name the factory after the colon: {where}:make_model")
    factory = getattr(module, attr, None)
    if factory is None:
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ModelSourceError(f"{where} has no attribute {attr!r}",
                               hint=f"Callables defined there: {', '.join(public[:10]) or 'none'}")
    example = getattr(module, "example_inputs", None)
    if isinstance(factory, nn.Module):
        instance = factory
        factory = lambda: instance  # a module object named directly
    if not callable(factory):
        raise ModelSourceError(f"{where}:{attr} is a {type(factory).__name__}, not a factory")
    return factory, example if callable(example) else None


def _user_frame(exc: BaseException) -> str:
    """' (at file.py, line N)' for the innermost frame outside torch and memcalc."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/memcalc/" not in frame.filename:
            return f" (at {frame.filename}, line {frame.lineno})"
    return ""


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
    return _resolve_factory(factory, f"torchvision:{name}", batch_size, shape or (3, 224, 224), user_inputs, None)


def _timm_source(name: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
                 user_inputs: _Inputs | None) -> ResolvedModel:
    timm = _import_optional("timm", f"the model source timm:{name}")
    if name not in timm.list_models():
        raise UnknownModelError(f"timm:{name}", [f"timm:{n}" for n in _close(name, timm.list_models())])
    factory = lambda: timm.create_model(name, pretrained=False)
    if shape is None:
        config = timm.get_pretrained_cfg(name)
        shape = tuple(getattr(config, "input_size", None) or (3, 224, 224))
    return _resolve_factory(factory, f"timm:{name}", batch_size, shape, user_inputs, None)


def _hf_source(spec: str, batch_size: int, shape: _Shape | None, seq_len: int | None,
               user_inputs: _Inputs | None) -> ResolvedModel:
    transformers = _import_optional("transformers", f"the model source hf:{spec}")
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise ModelSourceError(f"config file not found: {path}")
        config = transformers.AutoConfig.from_pretrained(str(path))  # a local file: no download
    else:
        mapping = transformers.CONFIG_MAPPING
        if spec not in mapping:
            raise UnknownModelError(f"hf:{spec}", [f"hf:{n}" for n in _close(spec, list(mapping.keys()))])
        config = mapping[spec]()
    factory = lambda: _hf_model_from_config(transformers, config)
    length = (shape[0] if shape else None) or seq_len or min(
        getattr(config, "max_position_embeddings", _HF_DEFAULT_SEQ_LEN) or _HF_DEFAULT_SEQ_LEN, _HF_DEFAULT_SEQ_LEN)
    vocab = getattr(config, "vocab_size", None) or 32000

    def example(b: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, vocab, (b, length)),)

    resolved = _resolve_factory(factory, f"hf:{spec}", batch_size, None, user_inputs, example)
    resolved.loss = LossKind.LM_CROSS_ENTROPY if _is_causal_lm(resolved.module) else LossChoice.AUTO
    return resolved


def _hf_model_from_config(transformers: ModuleType, config: Any) -> nn.Module:
    for auto in ("AutoModelForCausalLM", "AutoModel"):
        try:
            model: nn.Module = getattr(transformers, auto).from_config(config)
            return model
        except ValueError:
            continue
    raise ModelSourceError(f"transformers has no model class for config {type(config).__name__}")


def _is_causal_lm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("ForCausalLM") or type(module).__name__.endswith("LMHeadModel")


def _close(name: str, candidates: list[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)


_PACKAGE_SOURCES: dict[str, _PackageSource] = {
    "torchvision": _torchvision_source,
    "timm": _timm_source,
    "hf": _hf_source,
}


# ---- small helpers -----------------------------------------------------------------------
def _requested_shape(input_shape: Sequence[int] | None, seq_len: int | None) -> _Shape | None:
    if input_shape is not None:
        shape = tuple(int(d) for d in input_shape)
        if not shape or any(d < 1 for d in shape):
            raise InvalidInputError(f"input shape must be positive integers, got {input_shape!r}")
        return shape
    if seq_len is not None:
        if seq_len < 1:
            raise InvalidInputError(f"sequence length must be at least 1, got {seq_len}")
        return (int(seq_len),)
    return None


def _as_tuple(inputs: Iterable[object] | torch.Tensor | None) -> _Inputs | None:
    if inputs is None:
        return None
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    values = tuple(inputs)
    tensors = tuple(t for t in values if isinstance(t, torch.Tensor))
    if not values or len(tensors) != len(values):
        raise InvalidInputError("inputs must be a tensor or a sequence of tensors")
    return tensors


def _display_name(module: nn.Module) -> str:
    return type(module).__name__
