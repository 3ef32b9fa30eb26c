"""Float8 training: which of torchao's recipes converts the model's ``nn.Linear`` layers.

torchao's ``convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear`` whose
matmuls cast their operands to float8 (scales from the amax of each tensor, or of each row) and
run ``torch._scaled_mm``. memcalc applies torchao's own conversion to its meta model
(:mod:`memcalc.stacks.float8`) and traces it; this module is the vocabulary only: a user's
``float8`` (``"tensorwise"``, ``"rowwise"``, or a ``Float8LinearConfig`` of their own) becomes one
:class:`Float8` at the API boundary (:func:`parse_float8`). ``float8_all_gather``
(``--float8-all-gather``, torchtitan's ``float8.enable_fsdp_float8_all_gather``) turns on torchao's
``enable_fsdp_float8_all_gather`` in it (:meth:`Float8.with_all_gather`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memcalc.core.errors import InvalidInputError

__all__ = ("RECIPES", "Float8", "parse_float8")

#: torchao's named recipes memcalc offers (``Float8LinearConfig.from_recipe_name``): one scale per
#: tensor, or one per row (the more accurate recipe, torchtitan's ``rowwise``).
RECIPES = ("tensorwise", "rowwise")

#: The name of torchao's configuration class, recognised without importing torchao.
_CONFIG_CLASS = "Float8LinearConfig"


@dataclass(frozen=True)
class Float8:
    """A float8 training setting.

    Attributes:
        recipe: ``tensorwise`` or ``rowwise`` (torchao's recipe names), or ``config`` for a
            user's own ``Float8LinearConfig``.
        config: the user's ``torchao.float8.Float8LinearConfig`` (``recipe`` ``config`` only).
        all_gather: ``enable_fsdp_float8_all_gather`` asked for on top of the recipe or config.
    """

    recipe: str
    config: Any = None
    all_gather: bool = False

    @property
    def label(self) -> str:
        """How the report names it."""
        name = f"{self.recipe} recipe" if self.config is None else "the given Float8LinearConfig"
        return f"{name}, float8 all-gather" if self.fsdp_all_gather else name

    @property
    def emulated(self) -> bool:
        """torchao's ``emulate=True``: its matmuls in plain fp32 ``mm`` instead of ``torch._scaled_mm``
        (runs anywhere; its tests use it on the CPU)."""
        return bool(getattr(self.config, "emulate", False))

    @property
    def fsdp_all_gather(self) -> bool:
        """torchao's ``enable_fsdp_float8_all_gather``: FSDP all-gathers the weights in float8."""
        return self.all_gather or bool(getattr(self.config, "enable_fsdp_float8_all_gather", False))

    def with_all_gather(self) -> Float8:
        """This setting with torchao's ``enable_fsdp_float8_all_gather``, which torchao offers for one
        scale per weight tensor only (``Float8LinearConfig.__post_init__`` asserts it).

        Raises:
            InvalidInputError: the rowwise recipe, or a config whose weights are not scaled per tensor.
        """
        granularity = None
        if self.config is not None:
            granularity = getattr(self.config.cast_config_weight.scaling_granularity, "value", None)
        if self.recipe == "rowwise" or granularity not in (None, "tensorwise"):
            raise InvalidInputError(
                "float8_all_gather (--float8-all-gather) all-gathers weights scaled per tensor: torchao's "
                "enable_fsdp_float8_all_gather supports tensorwise scaling only",
                hint="Use --float8 tensorwise --float8-all-gather, or leave out --float8-all-gather.")
        return Float8(self.recipe, self.config, all_gather=True)


def parse_float8(value: object, name: str = "float8") -> Float8 | None:
    """A user's float8 setting: None (off), a recipe name, or a torchao ``Float8LinearConfig``.

    Raises:
        InvalidInputError: anything else, naming the recipes.
    """
    if isinstance(value, Float8):
        return value
    if value is None or value is False:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("off", "none"):
            return None
        if text in RECIPES:
            return Float8(text)
    elif type(value).__name__ == _CONFIG_CLASS:
        return Float8("config", value)
    raise InvalidInputError(f"{name} must be one of {', '.join(RECIPES)} (torchao's float8 training recipes), "
                            f"or a torchao.float8.Float8LinearConfig; got {value!r}",
                            hint="e.g. --float8 rowwise --precision bf16 --gpu h100-80gb")
