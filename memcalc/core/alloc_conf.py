"""The CUDA caching allocator's settings a job runs under: :class:`AllocConf`.

A real job sets them in ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), e.g.
torchtitan's ``expandable_segments:True``; they change reserved memory, which is what decides an
out-of-memory error. :func:`parse_alloc_conf` reads that string as PyTorch does (the tokenizer and
the checks of ``c10/core/AllocatorConfig.cpp`` ``AcceleratorAllocatorConfig::parseArgs`` and
``c10/cuda/CUDAAllocatorConfig.cpp`` ``CUDAAllocatorConfig::parseArgs``, torch 2.9–2.11), and
:func:`alloc_conf_from_environment` reads the variables in PyTorch's order. Vocabulary only: the
allocator model (:mod:`memcalc.engine.allocator`) applies them.

The keys PyTorch knows fall in three groups here:

* modelled: ``expandable_segments``, ``max_split_size_mb``, ``roundup_power2_divisions``,
  ``garbage_collection_threshold`` (and ``backend:native``, the default);
* without effect on the device memory of a step (pinned host memory, the allocator's lock):
  accepted and named in :attr:`AllocConf.ignored`;
* changing device memory in a way memcalc does not model (``backend:cudaMallocAsync``,
  ``large_segment_size_mb``, ``max_non_split_rounding_mb``): refused by name, rather than
  estimated as if absent.

A key PyTorch does not know is refused as PyTorch refuses it ("Unrecognized key ... in CUDA
allocator config").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from memcalc.core.errors import InvalidInputError

__all__ = ("ALLOC_CONF_VARIABLES", "AllocConf", "alloc_conf_from_environment", "parse_alloc_conf")

#: The environment variables PyTorch reads, in its order: the first one set wins
#: (``AcceleratorAllocatorConfig::instance``; the HIP spelling is ROCm's).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_MIB = 1048576
# AllocatorConfig.cpp `kRoundUpPowerOfTwoIntervals`: one divisions entry per power of two from
# 1 MiB (`kRoundUpPowerOfTwoStart`) to 64 GiB (`kRoundUpPowerOfTwoEnd`)
ROUNDUP_INTERVALS = 16
# AllocatorConfig.h `large_segment_size_{20971520}`: max_split_size_mb must be at least this (in MiB)
_MIN_MAX_SPLIT_MB = 20

#: Keys that leave the device memory of a step as it is: pinned host memory and whether the
#: allocator's lock is held over cudaMalloc.
_NO_DEVICE_EFFECT = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                     "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
                     "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")
#: Keys that take True or False.
_SWITCHES = ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
             "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_use_background_threads",
             "graph_capture_record_stream_reuse")
#: Keys PyTorch knows whose effect on device memory memcalc does not model.
_NOT_MODELLED = ("large_segment_size_mb", "max_non_split_rounding_mb")


@dataclass(frozen=True)
class AllocConf:
    """``memcalc.estimate(model, alloc_conf="expandable_segments:True")``: the allocator's settings.

    Attributes:
        expandable_segments: one growing segment per stream and pool, mapped page by page.
        max_split_size: bytes; blocks this large or larger are never split (None: no limit).
        roundup_power2_divisions: per power-of-two interval from 1 MiB up, the divisions a
            request is rounded up to (0: plain 512-byte rounding), 16 entries.
        garbage_collection_threshold: the fraction of the allowed memory above which cached
            blocks are freed before a new segment is allocated (0: never).
        text: the setting as given ("" when none).
        source: where it came from: ``"--alloc-conf"``/``"alloc_conf"`` or the variable's name.
        ignored: the keys given that do not change a step's device memory.
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    text: str = ""
    source: str = ""
    ignored: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # PyTorch refuses a smaller max_split_size_mb when it parses the setting; the allocator model
        # relies on it too (a 20 MiB segment is always splittable), so a directly built one is checked.
        if self.max_split_size is not None and self.max_split_size < _MIN_MAX_SPLIT_MB * _MIB:
            raise InvalidInputError(f"max_split_size must be at least {_MIN_MAX_SPLIT_MB} MiB "
                                    f"({_MIN_MAX_SPLIT_MB * _MIB} bytes), as PyTorch requires; "
                                    f"got {self.max_split_size} bytes")

    @property
    def is_default(self) -> bool:
        """Whether the modelled settings are PyTorch's defaults (the replay is then the default one)."""
        return (not self.expandable_segments and self.max_split_size is None and not any(self.roundup_power2_divisions)
                and self.garbage_collection_threshold == 0.0)

    def divisions_for(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the entry of the
        power-of-two interval ``size`` lies in, those under 1 MiB taking the first."""
        index = max(size.bit_length() - 1 - 20, 0)  # log2(size) − log2(1 MiB)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def describe(self) -> str:
        """The modelled settings in PyTorch's spelling (``""`` for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MIB}")
        if any(self.roundup_power2_divisions):
            parts.append(f"roundup_power2_divisions:{_describe_divisions(self.roundup_power2_divisions)}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts)


def _describe_divisions(divisions: tuple[int, ...]) -> str:
    if len(set(divisions)) == 1:
        return str(divisions[0])
    return "[" + ",".join(f"{1 << i}:{d}" for i, d in enumerate(divisions)) + "]"


def alloc_conf_from_environment(environ: Mapping[str, str] | None = None) -> AllocConf:
    """The settings the job launched from this environment runs under: the first of
    :data:`ALLOC_CONF_VARIABLES` that is set, as PyTorch reads them."""
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARIABLES:
        text = env.get(name)
        if text is not None:
            return parse_alloc_conf(text, source=name)
    return AllocConf()


def parse_alloc_conf(text: str, source: str = "alloc_conf") -> AllocConf:
    """``text`` as PyTorch parses ``PYTORCH_CUDA_ALLOC_CONF``: ``key:value`` pairs separated
    by commas, spaces ignored; ``roundup_power2_divisions`` also takes ``[256:1,512:2,>:4]``
    (interval starts in MiB).

    Raises:
        InvalidInputError: a key PyTorch does not know, a value it refuses, or a key whose
            effect memcalc does not model; each named, with ``source``.
    """
    if not isinstance(text, str):
        raise InvalidInputError(f"{source} must be a string such as 'expandable_segments:True', "
                                f"got {type(text).__name__}")
    tokens = _lex(text)
    values: dict[str, object] = {}
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        key = tokens[i]
        i = _expect(tokens, i + 1, ":", key, source)
        if key == "roundup_power2_divisions":
            values[key], i = _parse_divisions(tokens, i + 1, source)
        else:
            values[key] = _parse_scalar(key, _value(tokens, i + 1, key, source), source)
            i += 1
            if key in _NO_DEVICE_EFFECT:
                ignored.append(key)
        if i + 1 < len(tokens):
            i = _expect(tokens, i + 1, ",", key, source)
        i += 1
    return AllocConf(
        expandable_segments=bool(values.get("expandable_segments", False)),
        max_split_size=_as_int(values["max_split_size_mb"]) * _MIB if "max_split_size_mb" in values else None,
        roundup_power2_divisions=values.get("roundup_power2_divisions", (0,) * ROUNDUP_INTERVALS),  # type: ignore[arg-type]
        garbage_collection_threshold=float(values.get("garbage_collection_threshold", 0.0)),  # type: ignore[arg-type]
        text=text, source=source, ignored=tuple(ignored))


def _as_int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _lex(text: str) -> list[str]:
    """``AllocatorConfig::lexArgs``/``ConfigTokenizer``: ``,``, ``:``, ``[`` and ``]`` are
    tokens of their own, spaces are dropped, everything else joins into words."""
    tokens: list[str] = []
    word = ""
    for char in text:
        if char in ",:[]":
            if word:
                tokens.append(word)
                word = ""
            tokens.append(char)
        elif char != " ":
            word += char
    if word:
        tokens.append(word)
    return tokens


def _error(source: str, message: str, hint: str | None = None) -> InvalidInputError:
    return InvalidInputError(f"{source}: {message}", hint=hint)


def _expect(tokens: list[str], i: int, token: str, key: str, source: str) -> int:
    if i >= len(tokens) or tokens[i] != token:
        raise _error(source, f"error parsing the allocator settings after {key!r}: expected {token!r}",
                     hint="The form is key:value,key:value, e.g. expandable_segments:True,max_split_size_mb:512.")
    return i


def _value(tokens: list[str], i: int, key: str, source: str) -> str:
    if i >= len(tokens) or tokens[i] in ",:[]":
        raise _error(source, f"expecting a value for {key}")
    return tokens[i]


def _parse_scalar(key: str, value: str, source: str) -> object:
    """One ``key:value`` with PyTorch's checks on the value."""
    if key == "backend":
        if value == "native":
            return value
        if value == "cudaMallocAsync":
            raise _error(source, "backend:cudaMallocAsync is CUDA's own stream-ordered allocator, whose reserved "
                                 "memory memcalc does not model (it models PyTorch's native caching allocator)",
                         hint="Estimate with backend:native (the default), or leave the backend out.")
        raise _error(source, "Unknown allocator backend, options are native and cudaMallocAsync")
    if key in _SWITCHES:
        if value not in ("True", "False"):
            raise _error(source, f"Expected a single True/False argument for {key}, got {value!r}")
        return value == "True"
    if key == "max_split_size_mb":
        size = _integer(key, value, source)
        if size < _MIN_MAX_SPLIT_MB:
            raise _error(source, f"CachingAllocator option max_split_size_mb too small, must be >= {_MIN_MAX_SPLIT_MB}")
        return size
    if key == "garbage_collection_threshold":
        threshold = _number(key, value, source)
        if not 0.0 < threshold < 1.0:
            raise _error(source, f"garbage_collect_threshold is invalid, set it in (0.0, 1.0), got {value}")
        return threshold
    if key in _NO_DEVICE_EFFECT:
        return _integer(key, value, source)
    if key in _NOT_MODELLED:
        raise _error(source, f"{key} is a PyTorch allocator setting whose effect memcalc does not model",
                     hint="Leave it out to estimate with its default (20 MiB).")
    raise _error(source, f"Unrecognized key '{key}' in CUDA allocator config",
                 hint="PyTorch's keys: backend, expandable_segments, max_split_size_mb, roundup_power2_divisions, "
                      "garbage_collection_threshold, " + ", ".join((*_NOT_MODELLED, *_NO_DEVICE_EFFECT)) + ".")


def _integer(key: str, value: str, source: str) -> int:
    if not value.isdigit():
        raise _error(source, f"{key} takes a whole number, got {value!r}")
    return int(value)


def _number(key: str, value: str, source: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _error(source, f"{key} takes a number, got {value!r}") from None
    if not math.isfinite(number):
        raise _error(source, f"{key} takes a finite number, got {value!r}")
    return number


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _parse_divisions(tokens: list[str], i: int, source: str) -> tuple[tuple[int, ...], int]:
    """``AcceleratorAllocatorConfig::parseRoundUpPower2Divisions``: one number for every size,
    or ``[start_mib:divisions,...,>:divisions]``; returns the 16 entries and the last token read."""
    key = "roundup_power2_divisions"
    first = _value(tokens, i, key, source) if i < len(tokens) and tokens[i] != "[" else "["
    if first != "[":
        divisions = _integer(key, first, source)
        if not _power_of_two(divisions):
            raise _error(source, f"For roundups, the divisions has to be power of 2, got {divisions}")
        return (divisions,) * ROUNDUP_INTERVALS, i
    entries = [0] * ROUNDUP_INTERVALS
    first_value, last_index = True, 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        boundary = tokens[i]
        i = _expect(tokens, i + 1, ":", key, source)
        divisions = _integer(key, _value(tokens, i + 1, key, source), source)
        i += 1
        if divisions != 0 and not _power_of_two(divisions):
            raise _error(source, "For roundups, the divisions has to be power of 2 or 0 to disable roundup")
        if boundary == ">":
            entries[last_index + 1:] = [divisions] * (ROUNDUP_INTERVALS - last_index - 1)
        else:
            start = _integer(key, boundary, source)
            if not _power_of_two(start):
                raise _error(source, f"For roundups, the intervals have to be power of 2, got {start}")
            index = min(start.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first_value:
                entries[:index] = [divisions] * index
                first_value = False
            entries[index] = divisions
            last_index = index
        if i + 1 < len(tokens) and tokens[i + 1] != "]":
            i = _expect(tokens, i + 1, ",", key, source)
        i += 1
    if i >= len(tokens):
        raise _error(source, "error parsing roundup_power2_divisions: expected ']'")
    return tuple(entries), i
