"""The model's inputs: what the user gave (``inputs=``: a tensor, positional arguments or a
dict of keyword arguments), an input shape or sequence length, or a file's
``example_inputs`` — which wins, and the note that says which was used."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import torch

from memcalc.core.counts import tensor_bytes_problem
from memcalc.core.errors import InvalidInputError, ModelSourceError, user_frame
from memcalc.engine.model import ModelInputs
from memcalc.sources.user_code import Example

__all__ = ("Asked", "InputPlan", "as_inputs", "check_batch_fits", "input_maker", "requested_shape")

_Shape: TypeAlias = tuple[int, ...]


@dataclass(frozen=True)
class Asked:
    """What the user asked about the inputs: a batch size, one sample's shape (from
    ``input_shape``, or ``(seq_len,)``), whether that shape is a sequence of token ids, and
    the inputs themselves when given."""

    batch_size: int
    shape: _Shape | None
    tokens: bool
    user_inputs: ModelInputs | None


class InputPlan(NamedTuple):
    """How the inputs are made on a device (meta for the estimate, the real one for
    ``--measure``), the report's notes on where they came from, and the user's code that made
    them (``example_inputs(2) in models.py``; None: memcalc made them from a shape, or the user
    gave them)."""

    make: Callable[[torch.device], ModelInputs]
    notes: tuple[str, ...]
    source: str | None = None


def input_maker(name: str, asked: Asked, example: Example | None, where: str | None) -> InputPlan:
    """How the inputs of ``name`` are made, from what the user asked and the ``example_inputs``
    found in ``where`` (or a source's own, ``where`` None: no note).

    Precedence: the inputs given; then an explicit input shape or sequence length (the user
    said what they meant; a file's ``example_inputs`` serves every factory of the file and may
    fit another one), unless ``example_inputs`` takes a ``seq_len`` to build itself at that
    length; then ``example_inputs``; else the user must say.
    """
    user_inputs, batch_size, shape = asked.user_inputs, asked.batch_size, asked.shape
    if user_inputs is not None:
        ignored = (f"example_inputs in {where} ignored: the inputs given are used",) if example and where else ()
        return InputPlan(lambda device: user_inputs.map(lambda t: t.detach().to(device)), ignored)
    keywords: dict[str, int] = {}
    if example is not None and shape is not None:
        if asked.tokens and _accepts_keyword(example, "seq_len"):
            keywords = {"seq_len": shape[0]}
        else:
            if where is not None:
                given = (f"the sequence length given, {shape[0]:,}, is used (token ids; an "
                         f"example_inputs(batch_size, seq_len) would be called with it)" if asked.tokens
                         else f"the input shape given, {shape}, is used")
                return InputPlan(_shaped_inputs(batch_size, shape, asked.tokens),
                                 (f"example_inputs in {where} ignored: {given}",))
            example = None  # a source's own example at a length it did not choose: the shape wins
    if example is not None:
        call = f"example_inputs({', '.join([str(batch_size), *(f'{k}={v}' for k, v in keywords.items())])})"
        user_example = example

        def from_example(device: torch.device) -> ModelInputs:
            with device:
                try:
                    produced = user_example(batch_size, **keywords)
                except Exception as exc:
                    raise ModelSourceError(f"{call} of {name} raised {type(exc).__name__}: {exc}"
                                           f"{user_frame(exc)}") from exc
            inputs = as_inputs(produced, f"the inputs from {call} of {name}", error=ModelSourceError)
            if inputs is None:
                raise ModelSourceError(f"{call} of {name} returned None, not inputs",
                                       hint="Return a tensor, a tuple of tensors, or a dict of keyword arguments.")
            return inputs.map(lambda t: t.detach().to(device))

        if where is None:
            return InputPlan(from_example, ())
        return InputPlan(from_example, (f"inputs from {call} in {where}",), f"{call} in {where}")
    if shape is None:
        raise InvalidInputError(
            f"memcalc does not know what {name} takes as input",
            hint="Give the shape of one sample, e.g. --input-shape 3,224,224 (input_shape=(3, 224, 224)), "
                 "or --seq-len N for token ids, or pass inputs=..., or define example_inputs(batch_size) "
                 "beside the factory.")
    return InputPlan(_shaped_inputs(batch_size, shape, asked.tokens), ())


#: Bytes of one element of the inputs memcalc makes: int64 token ids, float32 features.
TOKEN_BYTES, FEATURE_BYTES = 8, 4


def check_batch_fits(batch_size: int, shape: _Shape, *, tokens: bool) -> None:
    """The input batch ``(batch_size, *shape)`` can exist: its bytes fit PyTorch's int64 sizes.
    Checked before the model is built, so that an overflowing batch is refused naming the batch
    size instead of failing inside torch with its C++ frames."""
    problem = tensor_bytes_problem((batch_size, *shape), TOKEN_BYTES if tokens else FEATURE_BYTES)
    if problem is not None:
        raise InvalidInputError(f"batch_size (--batch) is too large for this input: {problem}",
                                hint="Give a smaller --batch (or --input-shape, --seq-len).")


def _shaped_inputs(batch_size: int, shape: _Shape, tokens: bool) -> Callable[[torch.device], ModelInputs]:
    """One positional input of ``(batch_size, *shape)``: token ids for a sequence length (id 0
    exists in every vocabulary), random floats for an input shape."""
    if tokens:
        return lambda device: ModelInputs((torch.zeros(batch_size, *shape, dtype=torch.long, device=device),))
    return lambda device: ModelInputs((torch.randn(batch_size, *shape, device=device),))


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return any((p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or p.kind is p.VAR_KEYWORD
               for p in parameters)


def requested_shape(input_shape: Sequence[int] | None, seq_len: int | None) -> _Shape | None:
    """One sample's shape from ``input_shape``, else ``(seq_len,)``; None when neither is given."""
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


def as_inputs(inputs: object, what: str = "inputs", *,
              error: type[InvalidInputError] | type[ModelSourceError] = InvalidInputError) -> ModelInputs | None:
    """The user's inputs as the forward's arguments: a tensor; a tuple or list of positional
    arguments; a dict (any mapping with string keys) as keyword arguments, ``model(**inputs)`` —
    which the resolver turns into the forward's one argument, ``model(inputs)``, where the keys
    do not bind as the forward's parameters (:func:`~memcalc.engine.model.bind_inputs`).
    Arguments may nest tuples, lists and dicts of tensors and hold plain values (``None``,
    numbers, strings); at least one tensor is needed, and the first gives the batch size."""
    if inputs is None:
        return None
    if isinstance(inputs, torch.Tensor):
        return ModelInputs((inputs,))
    if isinstance(inputs, Mapping):
        keys = [k for k in inputs if not isinstance(k, str)]
        if keys:
            raise error(f"{what}: the keys of a dict of inputs are strings, the forward's parameters or the "
                        f"keys of the dict it takes; got {keys[0]!r}", hint=_INPUTS_FORMS)
        call = ModelInputs((), dict(inputs))
    elif isinstance(inputs, (tuple, list)):
        call = ModelInputs(tuple(inputs))
    else:
        raise error(f"{what} must be a tensor, a tuple of tensors or a dict of them, "
                    f"not a {type(inputs).__name__}", hint=_INPUTS_FORMS)
    odd = _odd_value([*call.args, *call.kwargs.values()])
    if odd is not None:
        raise error(f"{what} hold a value of type {type(odd).__name__}, which memcalc cannot copy to meta",
                    hint=_INPUTS_FORMS)
    if not len(call):
        raise error(f"{what} hold no tensor", hint=_INPUTS_FORMS)
    return call


_INPUTS_FORMS = ("Inputs are a tensor, a tuple of positional arguments, or a dict: keyword arguments "
                 "(model(**inputs), e.g. {\"input_ids\": ..., \"attention_mask\": ...}), or the forward's one "
                 "argument (model(inputs)) when its keys are not the forward's parameters; arguments are tensors, "
                 "tuples, lists or dicts of them, or plain values (None, numbers, strings).")


def _odd_value(values: Sequence[object]) -> object | None:
    """The first value that is neither a tensor, a container of them, nor a plain value."""
    for value in values:
        if isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
            continue
        if isinstance(value, (tuple, list)):
            inner = _odd_value(value)
        elif isinstance(value, Mapping):
            inner = _odd_value(list(value.values()))
        else:
            return value
        if inner is not None:
            return inner
    return None
