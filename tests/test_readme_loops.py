"""The "Which loop?" section (docs/loops.md, moved there from the README) quotes the code of each
loop preset; the quotes must be the presets' source (:mod:`memcalc.engine.loops`), less their
docstrings, so that a reader can trust them. tests/test_readme.py skips ``py`` blocks (they run
only inside memcalc); this file checks them instead."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from memcalc.engine import loops

LOOPS_DOC = Path(__file__).resolve().parent.parent / "docs" / "loops.md"
_PY_BLOCK = re.compile(r"^```py\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


def _quoted_functions() -> dict[str, str]:
    """Function name → its text, for every function defined in a ``py`` block of docs/loops.md."""
    found: dict[str, str] = {}
    for match in _PY_BLOCK.finditer(LOOPS_DOC.read_text()):
        body = match.group("body")
        lines = body.splitlines()
        for node in ast.parse(body).body:
            if isinstance(node, ast.FunctionDef):  # whole lines: a trailing comment is part of the quote
                found[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def _without_docstring(source: str) -> str:
    """``source`` of one function with its docstring lines removed."""
    tree = ast.parse(source)
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    lines = source.splitlines()
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        del lines[first.lineno - 1:first.end_lineno]
    return "\n".join(lines)


QUOTED = _quoted_functions()


def test_every_preset_is_quoted() -> None:
    assert {"minimal", "tutorial", "trainer", "zero_grad_late"} <= set(QUOTED), sorted(QUOTED)


@pytest.mark.parametrize("name", sorted(QUOTED))
def test_the_quote_is_the_source(name: str) -> None:
    function = getattr(loops, name, None)
    assert function is not None, f"docs/loops.md quotes {name}, which memcalc.engine.loops does not define"
    source = _without_docstring(textwrap.dedent(inspect.getsource(function)))
    assert QUOTED[name].strip() == source.strip(), f"docs/loops.md's {name} differs from memcalc/engine/loops.py"
