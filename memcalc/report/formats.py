"""The output formats every command shares (tabulate's table formats, and JSON), apart from the
report's rendering so that ``memcalc --help``, ``zoo`` and ``gpus`` load neither torch nor the
report model to offer them."""

from __future__ import annotations

import json
from typing import Any

__all__ = ("TABLE_FORMATS", "render_json")

# tabulate's formats that read well for a breakdown; "json" is handled separately.
TABLE_FORMATS = ("simple", "plain", "github", "grid", "pipe", "rst", "orgtbl", "psql", "presto",
                 "fancy_grid", "rounded_grid", "heavy_grid", "simple_grid", "html", "latex", "tsv")


def render_json(data: Any) -> str:
    """``data`` as indented JSON (the ``--format json`` output)."""
    return json.dumps(data, indent=2)
