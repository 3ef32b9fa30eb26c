"""What a launch configuration decides (:class:`LaunchSetup`), the helpers its readers share
(reading the file, refusing an unknown key by name with the closest known one), and how it is laid
under the options the user gave (:func:`merged`): a value the user set that disagrees with the
file's is refused, not silently preferred, since the file is what the real job will run."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError

__all__ = ("AUTO_FROM_HIDDEN", "LaunchSetup", "load_mapping", "merged", "refuse_unknown")

#: The ZeRO-3 keys transformers' ``trainer_config_finalize`` fills from the model's hidden size when
#: ``"auto"`` (``reduce_bucket_size`` aside): → (:class:`~memcalc.distributed.vocabulary.ZeroStage3`
#: field, value).
AUTO_FROM_HIDDEN: dict[str, tuple[str, Callable[[int], int]]] = {
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": ("param_persistence_threshold", lambda h: 10 * h),
}


@dataclass(frozen=True)
class LaunchSetup:
    """A launch configuration as memcalc options.

    Attributes:
        source: what was read (``accelerate config fsdp.yaml``), for messages and the note.
        distributed: :class:`~memcalc.distributed.setting.Distributed`'s keywords.
        values: the step's options the file decides (``precision``, ``checkpoint``, ``batch_size``,
            ``accum_steps``, ``optimizer``).
        notes: what was read, ignored or approximated, for the report.
        auto_hidden: DeepSpeed keys left ``"auto"`` that Hugging Face's integration fills from the
            model's ``hidden_size`` (``reduce_bucket_size`` → hidden_size²).
        accelerate_prepares: ``accelerate launch`` runs the job and the model is the one
            ``Accelerator.prepare`` returns, as accelerate prepares it under this setting (FSDP2 with
            ``fsdp2_prepare_model``'s units and policy; DDP or one GPU with ``prepare_model``'s
            autocast and float32 outputs): :attr:`memcalc.engine.step_spec.Step.accelerate_prepared`.
    """

    source: str
    distributed: Mapping[str, Any]
    values: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    auto_hidden: tuple[str, ...] = ()
    accelerate_prepares: bool = False

    def describe(self) -> str:
        """One note for the report: the source and what it became."""
        return f"{self.source}: " + "; ".join(self.notes)

    def with_hidden_size(self, hidden_size: int) -> LaunchSetup:
        """The ``"auto"`` keys filled as ``transformers.integrations.deepspeed.trainer_config_finalize``
        fills them: ``reduce_bucket_size = hidden_size * hidden_size``."""
        if not self.auto_hidden:
            return self
        distributed = dict(self.distributed)
        notes = list(self.notes)
        if "reduce_bucket_size" in self.auto_hidden:
            distributed["reduce_bucket_size"] = bucket = hidden_size * hidden_size
            notes.append(f"reduce_bucket_size auto → hidden_size² = {bucket:,} elements (transformers' DeepSpeed "
                         f"integration)")
        for key, (name, fill) in AUTO_FROM_HIDDEN.items():
            if key in self.auto_hidden:
                value = fill(hidden_size)
                distributed["stage3"] = dataclasses.replace(distributed["stage3"], **{name: value})
                notes.append(f"{key} auto → {value:,} elements from hidden_size {hidden_size:,} (transformers)")
        return dataclasses.replace(self, distributed=distributed, notes=tuple(notes), auto_hidden=())


def load_mapping(path: Any, what: str, suffixes: tuple[str, ...]) -> dict[str, Any]:
    """The mapping in a ``.json`` or ``.yaml`` file; :class:`InvalidInputError` for a missing,
    unreadable or malformed file (read before anything else, so a bad file is said at once)."""
    file = Path(path)
    if file.suffix.lower() not in suffixes:
        raise InvalidInputError(f"{what} {file}: a {' or '.join(suffixes)} file, got "
                                f"{file.suffix or 'no extension'}")
    if not file.is_file():
        raise InvalidInputError(f"{what} not found: {file}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{what} {file} cannot be read: {type(exc).__name__}") from None
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{what} {file} is not valid JSON: {exc}") from None
    else:
        try:
            import yaml
        except ImportError as exc:
            raise MissingPackageError("pyyaml", f"reading the {what} {file}") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidInputError(f"{what} {file} is not valid YAML: {reason}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise InvalidInputError(f"{what} {file} must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def refuse_unknown(given: Iterable[str], known: Iterable[str], where: str) -> None:
    """:class:`InvalidInputError` naming the first key of ``given`` not in ``known`` (and the
    closest known one), as accelerate refuses a config file's unknown keys."""
    known_ = sorted(set(known))
    unknown = [key for key in given if key not in known_]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], known_, n=1)
    others = f" (and {', '.join(repr(k) for k in unknown[1:])})" if unknown[1:] else ""
    raise InvalidInputError(f"{where} has no key {unknown[0]!r}{others}"
                            + (f"; did you mean {close[0]!r}?" if close else ""),
                            hint=f"The keys memcalc reads there: {', '.join(known_)}.")


def merged(setup: LaunchSetup, values: Mapping[str, Any], distributed: Any,
           given: Callable[[str], bool]) -> dict[str, Any]:
    """``values`` with the file's step options laid under them. An option the user gave
    (``given(name)``) that disagrees with the file is refused; so is a multi-GPU setting given
    beside the file (``distributed`` not None), which the file decides.

    Raises:
        InapplicableOptionError: a conflict, naming the option and the file's value.
    """
    if distributed is not None:
        raise InapplicableOptionError(f"{setup.source} decides the multi-GPU setting; it was given too "
                                      f"(--strategy, --mesh, --world-size or distributed=)",
                                      hint="Leave out the multi-GPU options, or the launch configuration.")
    out = dict(values)
    for name, value in setup.values.items():
        if given(name) and not _alike(values[name], value):
            raise InapplicableOptionError(f"{name} {_plain(values[name])!r} disagrees with {setup.source}, which "
                                          f"says {_plain(value)!r}",
                                          hint=f"Leave out {name} (the file decides it), or change the file.")
        out[name] = value
    return out


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)


def _alike(a: Any, b: Any) -> bool:
    return bool(_plain(a) == _plain(b))
