"""Hugging Face models by name: ``hf:MODEL_TYPE``, ``hf:ORG/NAME[@revision]``, a local
``config.json`` or a folder holding one — and :class:`HuggingFace`, the same as an object.

memcalc needs a model's *architecture*, never its weights: for a Hub id it fetches
``config.json`` alone with ``huggingface_hub.hf_hub_download`` and builds the model from it on
meta (:mod:`memcalc.sources.resolve`). ``generation_config.json`` is not needed: it holds
decoding defaults, none of which changes a training or forward step.

The Hub client does the fetching as it does for transformers, so it honours ``HF_TOKEN``,
``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``. memcalc also reads ``HF_HUB_OFFLINE``
itself at each call, so that setting it in a notebook after huggingface_hub was imported still
keeps memcalc off the network.

Without a network the client retries for 25 s to minutes, which no call can configure. So
memcalc first asks once itself (:func:`_unreachable`: one HEAD, no retry, a short timeout); no
answer means no network, and the config is read from the cache alone (``local_files_only``).

Every failure becomes one :class:`HubError` (a :class:`~memcalc.core.errors.ModelSourceError`)
whose ``problem`` says which: gated, missing repository, missing revision, no config.json,
not cached while offline, no network (:func:`_hub_error` maps the client's exceptions).

How the client reads each variable, lays out its cache and retries: docs/notes/hf-hub.md.
"""

from __future__ import annotations

import copy
import enum
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError, ModelSourceError
from memcalc.stacks.transformers.config_check import check_config_file, config_error
from memcalc.stacks.transformers.heads import Head

__all__ = (
    "HF_EXTRA_HINT",
    "HfAttention",
    "HubError",
    "HubProblem",
    "HuggingFace",
    "config_from_values",
    "download_config",
    "import_hf",
    "load_config",
    "quiet_optional_kernels",
    "with_attention",
)

#: What to install for the ``hf:`` source (the ``hf`` extra of pyproject.toml).
HF_EXTRA_HINT = "pip install 'memcalc[hf]'"
#: The file a Hub model repository describes its architecture in.
CONFIG_NAME = "config.json"
#: Where to log in for a gated or private repository (both CLIs write the same token file).
_LOGIN_HINT = "log in with `hf auth login` (or `huggingface-cli login`), or set HF_TOKEN to a token with access"
_HUB_URL = "https://huggingface.co"
#: Seconds the one probe of the Hub (:func:`_unreachable`) waits for an answer; the client's own
#: first request waits 10 (``constants.DEFAULT_ETAG_TIMEOUT``). ``HF_HUB_ETAG_TIMEOUT``, when the
#: user sets it, is used instead: a slow link asked for longer.
PROBE_TIMEOUT_S = 5.0


class HfAttention(str, enum.Enum):
    """``attn_implementation`` of a transformers model (``--attn``); :mod:`memcalc.stacks.transformers.attention`
    says what memcalc runs for each."""

    EAGER = "eager"
    SDPA = "sdpa"
    FLASH_ATTENTION_2 = "flash_attention_2"


@dataclass(frozen=True)
class HuggingFace:
    """A Hugging Face model for :func:`memcalc.estimate`: ``HuggingFace("meta-llama/Meta-Llama-3-8B")``
    is ``"hf:meta-llama/Meta-Llama-3-8B"``, with room for the options a string has not.

    Args:
        model_id: a Hub id ``ORG/NAME``, a model type known to transformers (``"llama"``: its
            config class defaults), a local ``config.json`` or a folder holding one.
        revision: a branch, tag or commit sha of a Hub id (or ``model_id="ORG/NAME@REV"``, as in
            the string ``"hf:ORG/NAME@REV"``).
        attn: ``"eager"``, ``"sdpa"`` or ``"flash_attention_2"``; None: what transformers picks
            (``sdpa`` where the model supports it).
        task: the head to build (``"causal-lm"``, ``"masked-lm"``, ``"seq2seq"``,
            ``"sequence-classification"``, ``"token-classification"``, ``"question-answering"``);
            None: the one the config's ``architectures`` names (else a causal LM, else the bare
            model). A training step computes that head's own loss from the labels it takes.

    Only ``config.json`` is fetched from the Hub; the model is built on meta tensors.
    """

    model_id: str
    revision: str | None = None
    attn: HfAttention | str | None = None
    task: Head | str | None = None

    def __post_init__(self) -> None:
        given = self.model_id
        if given.startswith("hf:"):  # the string form's prefix, written out of habit
            object.__setattr__(self, "model_id", given[len("hf:"):])
        if "@" in self.model_id and not Path(self.model_id).exists():  # ORG/NAME@REV, as in a string
            model_id, _, revision = self.model_id.rpartition("@")
            if self.revision is not None:
                raise InvalidInputError(f"{given}: give the revision once, in the id or as revision=")
            object.__setattr__(self, "model_id", model_id)
            object.__setattr__(self, "revision", revision)
        if not self.model_id or self.model_id != self.model_id.strip():
            raise InvalidInputError(f"not a Hugging Face model id: {given!r}")
        if self.revision is not None and not self.revision.strip():
            raise InvalidInputError(f"{self.model_id}: an empty revision (give a branch, a tag or a commit sha)")
        if self.attn is not None:
            object.__setattr__(self, "attn", _attention(self.attn))
        if self.task is not None:
            object.__setattr__(self, "task", _head(self.task))

    @classmethod
    def parse(cls, spec: str, attn: HfAttention | str | None = None, task: Head | str | None = None) -> HuggingFace:
        """What follows ``hf:`` in a model string: ``ORG/NAME@REV`` splits at the last ``@``
        (a local path that exists is taken whole, ``@`` or not)."""
        return cls(spec, None, attn, task)

    @property
    def spec(self) -> str:
        """The model as a string (``hf:ORG/NAME@REV``): its name in reports."""
        return f"hf:{self.model_id}" + (f"@{self.revision}" if self.revision else "")

    @property
    def attention(self) -> HfAttention | None:
        """``attn`` as the enum (``__post_init__`` converted it)."""
        return None if self.attn is None else _attention(self.attn)

    @property
    def head(self) -> Head | None:
        """``task`` as the enum (``__post_init__`` converted it)."""
        return None if self.task is None else _head(self.task)


_Choice = TypeVar("_Choice", HfAttention, Head)


def _one_of(kind: type[_Choice], value: _Choice | str, what: str) -> _Choice:
    """``value`` as a member of ``kind``; else an error naming ``what`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidInputError(f"unknown {what} {value!r}: choose one of {choices}") from None


def _attention(value: HfAttention | str) -> HfAttention:
    return _one_of(HfAttention, value, "attention implementation")


def _head(value: Head | str) -> Head:
    return _one_of(Head, value, "task")


def with_attention(model: str, attn: str | None, task: str | None = None) -> str | HuggingFace:
    """The CLI's ``MODEL`` with ``--attn`` and ``--task``: an ``hf:`` string becomes a
    :class:`HuggingFace`; either option with any other model is refused (it would be ignored)."""
    if attn is None and task is None:
        return model
    if not model.startswith("hf:"):
        given = f"--attn {attn}" if attn is not None else f"--task {task}"
        raise InapplicableOptionError(
            f"{given} applies to Hugging Face models only, not to {model!r}",
            hint="Give an hf: model (hf:ORG/NAME, hf:llama, hf:config.json), or leave it out: other models run "
                 "their own code (their attention, their head).")
    return HuggingFace.parse(model[len("hf:"):], attn, task)


# ---- optional packages ----------------------------------------------------------------------
def import_hf(package: str, purpose: str) -> ModuleType:
    """``transformers`` or ``huggingface_hub``, or a :class:`MissingPackageError` naming the
    ``hf`` extra that installs them both."""
    quiet_optional_kernels()
    try:
        with warnings.catch_warnings():
            # tqdm.auto, which transformers and peft import, warns in a notebook without ipywidgets that its
            # progress bars will be plain text: memcalc shows none of theirs
            warnings.filterwarnings("ignore", message="IProgress not found")
            return importlib.import_module(package)
    except ImportError as exc:
        error = MissingPackageError(package, purpose)
        error.hint = f"Install it with: {HF_EXTRA_HINT} (or pip install {package})"
        raise error from exc


#: What bitsandbytes logs at import (through peft and transformers, which import it when it is
#: installed) on a CPU with AVX512-BF16 when the optional ``kernels`` package, which would
#: fetch a faster 4-bit GEMM from the Hub, is missing. memcalc runs no bitsandbytes kernel, so
#: the warning says nothing about the estimate; it would be printed into every command's output.
_BNB_OPTIONAL_KERNEL = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _drops_optional_kernel_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_OPTIONAL_KERNEL)


#: What torchao logs on import (transformers imports it whenever it is installed, for its torchao
#: quantizer): each CUDA extension it cannot load on a CPU-only torch, and torch's deprecation of
#: the Enums it registers with pytree. Logger → the start of the one message dropped from it.
_TORCHAO_IMPORT_NOISE = {"torchao": "Failed to load ",
                         "torch.utils._pytree": "%s is an Enum subclass and is now natively supported"}


def _drops_torchao_import_noise(record: logging.LogRecord) -> bool:
    start = _TORCHAO_IMPORT_NOISE.get(record.name)
    return start is None or not str(record.msg).startswith(start)


def quiet_optional_kernels() -> None:
    """Filter those warnings, and nothing else, out of bitsandbytes' CPU backend logger and the
    loggers torchao's import writes to."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if _drops_optional_kernel_warning not in logger.filters:
        logger.addFilter(_drops_optional_kernel_warning)
    for name in _TORCHAO_IMPORT_NOISE:
        logger = logging.getLogger(name)
        if _drops_torchao_import_noise not in logger.filters:
            logger.addFilter(_drops_torchao_import_noise)


# ---- the config --------------------------------------------------------------------------------
def load_config(transformers: ModuleType, source: HuggingFace) -> Any:
    """The ``PretrainedConfig`` of ``source``: a model type's defaults, a local file or folder,
    or a Hub repository's ``config.json`` (downloaded alone, or read from the cache)."""
    name = source.model_id
    path = Path(name)
    if name.endswith(".json"):
        _no_revision(source, "a local config file")
        if not path.is_file():
            raise ModelSourceError(f"config file not found: {path}")
        return _auto_config(transformers, path, source)
    if path.is_dir():
        _no_revision(source, "a local folder")
        if not (path / CONFIG_NAME).is_file():
            raise ModelSourceError(f"the folder {path} has no {CONFIG_NAME}",
                                   hint="Give the folder a Hugging Face model was saved to, or its config.json.")
        return _auto_config(transformers, path / CONFIG_NAME, source)
    if "/" not in name and source.revision is None:
        return _model_type_config(transformers, name)
    return _auto_config(transformers, download_config(name, source.revision), source)


def config_from_values(transformers: ModuleType, values: Mapping[str, object], name: str) -> Any:
    """The ``PretrainedConfig`` of a ``config.json``'s values held in memory (a zoo entry's
    released config): the config class of their ``model_type``, through its ``from_dict``, as
    ``AutoConfig.from_pretrained`` reads a file. The values are copied: transformers keeps (and may
    change) what it is given.

    Raises:
        ModelSourceError: the installed transformers has no such model type.
    """
    model_type = values.get("model_type")
    mapping = transformers.CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in mapping:
        raise ModelSourceError(f"{name}: transformers {transformers.__version__} has no model type {model_type!r}",
                               hint="Upgrade transformers (pip install -U transformers).")
    return mapping[model_type].from_dict(copy.deepcopy(dict(values)))


def _no_revision(source: HuggingFace, what: str) -> None:
    if source.revision is not None:
        raise InvalidInputError(f"{source.model_id} is {what}: @{source.revision} applies to Hub ids (ORG/NAME) only")


def _model_type_config(transformers: ModuleType, model_type: str) -> Any:
    import difflib

    from memcalc.core.errors import UnknownModelError

    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, list(mapping.keys()), n=3, cutoff=0.5)
        error = UnknownModelError(f"hf:{model_type}", [f"hf:{n}" for n in close])
        error.hint = (f"{error.hint} A Hugging Face Hub model is named ORG/NAME (hf:meta-llama/Meta-Llama-3-8B); "
                      f"a bare name must be a transformers model type (hf:llama, hf:gpt2).")
        raise error
    return mapping[model_type]()


def _auto_config(transformers: ModuleType, path: Path, source: HuggingFace) -> Any:
    """``AutoConfig`` from a local file: no network. A config whose class lives in the
    repository's own code (``auto_map``, ``trust_remote_code``) is refused: memcalc runs no code
    from the Hub."""
    check_config_file(path, source.spec)
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        remote = "trust_remote_code" in str(exc) or "auto_map" in str(exc)
        raise ModelSourceError(
            f"transformers cannot read the config of {source.spec}: {str(exc).splitlines()[0]}",
            hint="Its model class is defined in the repository's own code (trust_remote_code), which memcalc "
                 "does not run; estimate that code as file.py:factory instead." if remote else
                 "Check that the file is a transformers config.json, and that transformers is recent enough "
                 "for its model_type.") from exc
    except Exception as exc:  # transformers' own validation (a field's type, a dtype): one line, not its frames
        raise config_error(source.spec, f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc


# ---- the Hub ---------------------------------------------------------------------------------
class HubProblem(str, enum.Enum):
    """Why a Hub model id could not be read."""

    GATED = "gated"
    NOT_FOUND = "repository not found"
    REVISION_NOT_FOUND = "revision not found"
    NO_CONFIG = "no config.json"
    UNAUTHORIZED = "unauthorized"
    NOT_CACHED_OFFLINE = "not in the cache (offline)"
    REVISION_NOT_CACHED_OFFLINE = "revision not in the cache (offline)"
    NO_NETWORK = "no network"
    HUB_ERROR = "hub error"


class HubError(ModelSourceError):
    """A Hub model id whose ``config.json`` could not be read; ``problem`` says why."""

    def __init__(self, message: str, *, problem: HubProblem, hint: str, bad_input: bool = False):
        super().__init__(message, hint=hint)
        self.problem = problem
        if bad_input:  # a name or revision that does not exist: the user's input, as for an unknown model
            self.exit_code = 2


def download_config(repo_id: str, revision: str | None = None) -> Path:
    """The local path of ``repo_id``'s ``config.json`` at ``revision`` (default ``main``),
    from the cache or downloaded into it — never another file of the repository."""
    hub = import_hf("huggingface_hub", f"the model source hf:{repo_id}")
    errors = importlib.import_module("huggingface_hub.errors")
    importlib.import_module("huggingface_hub.constants")  # hub.constants: a lazy package loads it on import only
    offline = _offline(hub)
    no_network = None if offline else _unreachable(hub, errors, repo_id, revision)
    try:
        path = hub.hf_hub_download(repo_id, CONFIG_NAME, revision=revision, library_name="memcalc",
                                   local_files_only=offline or no_network is not None)
    except errors.HFValidationError as exc:
        raise InvalidInputError(f"{repo_id!r} is not a Hugging Face Hub id: {exc}",
                                hint="A Hub id is ORG/NAME (hf:meta-llama/Meta-Llama-3-8B).") from exc
    except Exception as exc:
        problem = _hub_error(hub, errors, exc, repo_id, revision, offline, no_network)
        if problem is None:
            raise
        raise problem from exc
    return Path(path)


def _offline(hub: ModuleType) -> bool:
    """``HF_HUB_OFFLINE`` as the client read it at import, or as it is set now."""
    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(hub.constants.is_offline_mode()) or now.strip().upper() in ("1", "ON", "YES", "TRUE")


def _unreachable(hub: ModuleType, errors: ModuleType, repo_id: str, revision: str | None) -> str | None:
    """Why the Hub cannot be reached — the client's error on one line — or None when it answered.

    One HEAD of the config's URL through the client's own HTTP stack (so ``HF_ENDPOINT``, proxies
    and certificates are the client's), without retries, waiting :data:`PROBE_TIMEOUT_S`. Only a
    request that got no answer counts: an HTTP error is an answer, and anything else unexpected is
    left to ``hf_hub_download`` (None), which then behaves as it always did.
    """
    constants = hub.constants
    user_timeout = constants.HF_HUB_ETAG_TIMEOUT != constants.DEFAULT_ETAG_TIMEOUT
    try:
        hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, CONFIG_NAME, revision=revision),
                                 timeout=constants.HF_HUB_ETAG_TIMEOUT if user_timeout else PROBE_TIMEOUT_S)
    except errors.HfHubHTTPError:  # the Hub answered (0.x's is a requests.HTTPError, an OSError: tested first)
        return None
    except _transport_errors() as exc:
        lines = str(exc).splitlines()
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    except Exception:  # not a network failure: the client's own call will say what it is
        return None
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a request that got no answer, in the HTTP library the client loaded:
    httpx2's or httpx's ``TransportError`` (connect, read, timeouts, proxy), or an ``OSError``
    (socket errors; requests' ``ConnectionError`` and ``Timeout``, huggingface_hub 0.x)."""
    found: list[type[BaseException]] = [OSError]
    for library in ("httpx2", "httpx"):
        error = getattr(sys.modules.get(library), "TransportError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _hub_error(hub: ModuleType, errors: ModuleType, exc: Exception, repo_id: str, revision: str | None,
               offline: bool, no_network: str | None = None) -> HubError | None:
    """The :class:`HubError` for one of the client's exceptions (None: not the Hub's).
    ``no_network``: why :func:`_unreachable` found the Hub unreachable (the cache was asked alone)."""
    at = f"{repo_id}@{revision}" if revision else repo_id
    page = f"{_HUB_URL}/{repo_id}"
    if isinstance(exc, errors.GatedRepoError):  # before RepositoryNotFoundError, its base class
        return HubError(f"{repo_id} is a gated repository: its config.json needs an account with access",
                        problem=HubProblem.GATED, hint=f"Accept its terms on {page}, then {_LOGIN_HINT}.")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"no Hugging Face repository {repo_id} (or it is private)", problem=HubProblem.NOT_FOUND,
                        hint=f"Check the id on {_HUB_URL}; for a private repository, {_LOGIN_HINT}.", bad_input=True)
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r}", problem=HubProblem.REVISION_NOT_FOUND,
                        hint=f"Give a branch, a tag or a commit sha of {page} (see its 'Files and versions').",
                        bad_input=True)
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return HubError(f"{at} has no {CONFIG_NAME}: it is not a transformers model", problem=HubProblem.NO_CONFIG,
                        hint="memcalc reads the architecture from config.json; estimate other models as "
                             "file.py:factory.", bad_input=True)
    if isinstance(exc, errors.LocalEntryNotFoundError):
        return _not_cached(hub, repo_id, revision, offline, no_network)
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return HubError(f"the Hub refused the token for {repo_id} (HTTP 401)", problem=HubProblem.UNAUTHORIZED,
                            hint=f"The token is invalid or expired: {_LOGIN_HINT}.")
        return HubError(f"the Hub could not serve {at}/{CONFIG_NAME}: {str(exc).splitlines()[0]}",
                        problem=HubProblem.HUB_ERROR, hint="Try again later, or use a local config.json.")
    return None


def _not_cached(hub: ModuleType, repo_id: str, revision: str | None, offline: bool,
                no_network: str | None = None) -> HubError:
    """``LocalEntryNotFoundError``: the Hub could not be asked and the cache has no answer —
    tell a missing repository from a missing revision by what the cache holds. ``no_network``:
    the probe's error, named in the message."""
    cache = Path(hub.constants.HF_HUB_CACHE)
    folder = cache / ("models--" + repo_id.replace("/", "--"))  # file_download.repo_folder_name's layout
    fetch_later = (f"Run once with network access (memcalc fetches only {CONFIG_NAME}), or copy the model's "
                   f"{CONFIG_NAME} here and give hf:path/to/{CONFIG_NAME}.")
    if not offline:
        why = f" ({no_network})" if no_network else ""
        return HubError(f"cannot reach the Hugging Face Hub{why}, and {repo_id} is not in the cache ({cache})",
                        problem=HubProblem.NO_NETWORK,
                        hint="Check the network connection (or HF_ENDPOINT / proxy settings). " + fetch_later)
    if folder.is_dir():
        return HubError(f"revision {revision or 'main'!r} of {repo_id} is not in the cache ({cache}) and "
                        f"HF_HUB_OFFLINE is set",
                        problem=HubProblem.REVISION_NOT_CACHED_OFFLINE,
                        hint=f"Cached revisions are the folders of {folder / 'snapshots'} and the branches of "
                             f"{folder / 'refs'}; or unset HF_HUB_OFFLINE to fetch it.")
    return HubError(f"{repo_id} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set",
                    problem=HubProblem.NOT_CACHED_OFFLINE,
                    hint="Unset HF_HUB_OFFLINE to fetch its config.json, or point HF_HOME at the cache that holds it. "
                         + fetch_later)
