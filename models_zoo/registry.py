"""The zoo's name registry: one :class:`ZooEntry` per model, looked up by forgiving names.

Every entry knows how to build its model (always on whatever device is current, so
``with torch.device("meta"):`` builds it without memory), what one sample of input looks
like, which loss it trains with, and the parameter count of the reference implementation
it reproduces (tests assert the two are equal).

The language models also carry their released Hugging Face config (:class:`HfConfig`, plain
data): where transformers is installed, memcalc builds *transformers'* model from it, so that
PEFT's default targets, the model's own loss and generation are the library's
(:mod:`memcalc.sources.resolve`). The plain-torch definition here stays the model without
transformers, and is named explicitly with :data:`TORCH_PREFIX` (``torch:llama-tiny``).
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from memcalc.core.losses import LossKind

__all__ = (
    "TORCH_PREFIX",
    "HfConfig",
    "InputKind",
    "LossKind",
    "ZooEntry",
    "closest",
    "entries",
    "get",
    "names",
    "normalize",
    "plain_torch",
    "register",
)

#: ``torch:NAME``: the zoo's plain-torch definition of NAME, even where transformers is installed
#: (where NAME alone is transformers' model built from :attr:`ZooEntry.hf`).
TORCH_PREFIX = "torch:"


class InputKind(str, enum.Enum):
    """What the model's ``forward`` takes."""

    IMAGE = "image"  # float tensor (B, C, H, W); shape given as (C, H, W)
    FEATURES = "features"  # float tensor (B, *shape)
    TOKENS = "tokens"  # int64 token ids (B, seq_len); shape given as (seq_len,)


@dataclass(frozen=True)
class HfConfig:
    """A zoo entry's released Hugging Face config: the checkpoint's ``config.json``, written here
    as plain data (memcalc never downloads it), which transformers builds the model from.

    ``values`` holds ``model_type`` and ``architectures`` (the class transformers builds: its head
    and its loss) and the released values. ``parameters`` is the count of that class's model when
    it is not the entry's ``reference_parameters`` (BERT's checkpoint names ``BertForMaskedLM``,
    the zoo's plain-torch model is ``BertModel``). ``position_table`` names the value that sizes
    a learned position table (GPT-2's ``n_positions``), grown to a longer sequence as the
    plain-torch model grows its table; None: rotary positions, nothing to grow.
    """

    repo: str
    values: Mapping[str, object]
    parameters: int | None = None
    position_table: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.values.get("model_type"), str) or not self.values.get("architectures"):
            raise ValueError(f"{self.repo}: a config needs its model_type and architectures")
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))  # shared: read-only

    @property
    def architecture(self) -> str:
        """The model class ``architectures`` names first, e.g. ``LlamaForCausalLM``."""
        names = self.values["architectures"]
        assert isinstance(names, (list, tuple)) and names, self.repo
        return str(names[0])


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo.

    ``builder(input_shape)`` receives the per-sample input shape actually used (so a ViT can
    size its position embeddings, a GPT its position table) and returns an ``nn.Module``;
    it must create tensors on the current default device only (never ``.to(...)``), so that
    building under ``torch.device("meta")`` allocates nothing. None: the entry has no plain-torch
    definition and is transformers' model of its :attr:`hf` config only (the mixture-of-experts
    models, :mod:`models_zoo.moe`); its ``reference_parameters`` are then that model's.
    """

    name: str
    family: str
    builder: Callable[[tuple[int, ...]], nn.Module] | None
    input_kind: InputKind
    default_shape: tuple[int, ...]
    loss: LossKind
    reference_parameters: int | None = None
    vocab_size: int | None = None
    description: str = ""
    aliases: tuple[str, ...] = ()
    # Names of module lists whose items are the model's repeated blocks (used by
    # activation checkpointing): e.g. ("layer1", "layer2") or ("h",).
    block_containers: tuple[str, ...] = field(default=())
    # The longest sequence the released model takes (its position table, or the length it was
    # trained on); None: not a sequence model. A longer one is reported with what it changes.
    context_length: int | None = None
    # A decoder language model (causal self-attention, generates tokens): a KV cache applies.
    decoder: bool = False
    # The released Hugging Face config: with transformers installed, the model built from it.
    hf: HfConfig | None = None

    def build(self, input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """The model for one sample of ``input_shape`` (default: :attr:`default_shape`), built
        on the current default device."""
        if self.builder is None:
            raise LookupError(f"{self.name} has no plain-torch definition: it is transformers' "
                              f"{self.hf.architecture if self.hf else 'model'} only")
        return self.builder(tuple(input_shape or self.default_shape))

    @property
    def has_plain_torch(self) -> bool:
        """Whether the zoo defines this model in plain torch (``torch:NAME``), not only by its
        Hugging Face config."""
        return self.builder is not None

    def example_inputs(
        self,
        batch_size: int,
        input_shape: tuple[int, ...] | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """One batch of inputs; random values so that a real run (``--measure``) works too."""
        shape = tuple(input_shape or self.default_shape)
        if self.input_kind is InputKind.TOKENS:
            assert self.vocab_size is not None, f"{self.name}: token model without vocab_size"
            return (torch.randint(0, self.vocab_size, (batch_size, *shape), device=device),)
        return (torch.randn(batch_size, *shape, device=device),)

    @property
    def hf_parameters(self) -> int | None:
        """The parameter count of transformers' model of this entry (None: no Hugging Face config)."""
        if self.hf is None:
            return None
        return self.hf.parameters if self.hf.parameters is not None else self.reference_parameters

    @property
    def default_input_text(self) -> str:
        """Human-readable default input, e.g. ``3x224x224`` or ``seq 1024, vocab 50257``."""
        if self.input_kind is InputKind.TOKENS:
            return f"seq {self.default_shape[0]}, vocab {self.vocab_size}"
        return "x".join(str(d) for d in self.default_shape)


_REGISTRY: dict[str, ZooEntry] = {}
_ALIASES: dict[str, str] = {}


def normalize(name: str) -> str:
    """Case-insensitive, ``_`` and ``-`` and ``.`` interchangeable: ``ResNet_50`` → ``resnet-50``."""
    return name.strip().lower().replace("_", "-").replace(".", "-")


def register(entry: ZooEntry) -> ZooEntry:
    """Add an entry; refuses duplicates so two modules can't silently shadow each other."""
    keys = [normalize(entry.name), *(normalize(a) for a in entry.aliases)]
    for key in keys:
        if key in _ALIASES:
            raise ValueError(f"zoo name {key!r} registered twice ({_ALIASES[key]} and {entry.name})")
    _REGISTRY[entry.name] = entry
    for key in keys:
        _ALIASES[key] = entry.name
    # "resnet50" and "resnet-50" both work: also register the name with separators removed.
    for key in keys:
        squashed = key.replace("-", "")
        _ALIASES.setdefault(squashed, entry.name)
    return entry


def get(name: str) -> ZooEntry | None:
    """The entry registered under ``name`` or one of its aliases (forgiving spelling), or None.

    Args:
        name: a zoo name, e.g. ``resnet50``, ``ResNet_50`` or ``gpt2-xl``.

    Returns:
        The entry, or None when no name matches.
    """
    key = normalize(name)
    canonical = _ALIASES.get(key) or _ALIASES.get(key.replace("-", ""))
    return _REGISTRY[canonical] if canonical else None


def plain_torch(name: str) -> str:
    """The spelling of the zoo model ``name`` that always means its plain-torch definition
    (``torch:gpt2``): what the real GPU measurements were made with. A name whose entry has no
    Hugging Face config (``resnet50``) is that definition already, and passes unchanged, as do
    names outside the zoo.

    Args:
        name: a model name as a user gives it.

    Returns:
        ``torch:`` + the canonical name for a zoo language model, else ``name``.
    """
    entry = get(name)
    return f"{TORCH_PREFIX}{entry.name}" if entry is not None and entry.hf is not None and entry.has_plain_torch \
        else name


def names() -> list[str]:
    """Canonical names of every entry, in registration order."""
    return list(_REGISTRY)


def entries() -> list[ZooEntry]:
    """Every entry, in registration order."""
    return list(_REGISTRY.values())


def closest(name: str, n: int = 3) -> list[str]:
    """Canonical names close to ``name``, for "did you mean ...?" messages."""
    key = normalize(name)
    matches = difflib.get_close_matches(key, list(_ALIASES), n=n * 3, cutoff=0.5)
    seen: list[str] = []
    for m in matches:
        canonical = _ALIASES[m]
        if canonical not in seen:
            seen.append(canonical)
    return seen[:n]
