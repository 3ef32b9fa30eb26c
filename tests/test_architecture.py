"""The shape of the package, as promised in docs/architecture.md: a small public API, a lazily
loaded top-level package, no import cycle through it, and a layers contract that covers every
package. (The layers themselves are checked by `lint-imports` in .ci/run; module sizes and
estimate()'s keywords are reviewed, not capped: docs/architecture.md, "Sizes are reviewed, not
capped".)"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

import pytest

import memcalc

PACKAGE = Path(memcalc.__file__).parent


def test_estimate_keeps_internal_hooks_out_of_its_signature():
    parameters = inspect.signature(memcalc.estimate).parameters
    assert "on_trace" not in parameters  # an internal hook, not part of the public signature
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in parameters.items() if name != "model")


def test_every_public_name_resolves_and_is_documented():
    for name in memcalc.__all__:
        value = getattr(memcalc, name)
        if callable(value) and not isinstance(value, type(memcalc)):
            assert inspect.getdoc(value), f"memcalc.{name} has no docstring"
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        memcalc.nonsense  # noqa: B018


@pytest.mark.parametrize("first", ["models_zoo", "memcalc.core.losses", "memcalc.sources.resolve", "memcalc.cli"])
@pytest.mark.slow  # a fresh interpreter (torch imported again) per case
def test_any_module_imports_first_in_a_fresh_interpreter(first: str):
    # the zoo takes its vocabulary from memcalc.core; memcalc.sources imports the zoo: whichever
    # comes first, no half-initialised module may be reached
    done = subprocess.run([sys.executable, "-c", f"import {first}; import memcalc; memcalc.estimate"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_importing_memcalc_loads_no_engine():
    code = "import sys, memcalc; print(sorted(m for m in sys.modules if m.startswith('memcalc.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_layers_contract_names_every_package():
    # a package the layers contract leaves out escapes lint-imports' direction checks: a new
    # room must be placed among the layers when it is made
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    contracts = pyproject["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers" and "containers" not in c)["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    rooms = {f"memcalc.{path.name}" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    rooms |= {f"memcalc.{path.stem}" for path in PACKAGE.glob("*.py") if not path.name.startswith("__")}
    assert rooms == named


def _type_checking_imports() -> dict[str, str]:
    """``name → module`` of the imports under ``if TYPE_CHECKING:`` in memcalc/__init__.py."""
    import ast

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    found: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: 'import X as X' re-exports it under mypy --strict"
            found[alias.name] = node.module
    return found


def test_the_public_api_is_one_table_and_the_type_checkers_see_the_same():
    table = memcalc._PUBLIC
    assert memcalc.__all__ == ("__version__", *table)
    assert _type_checking_imports() == table
    # a small surface (memcalc.plan made it 26, register_optimizer and its OptimizerSpec 28): the rest stays
    # importable from its module
    assert len(table) <= 28
    for name, module in table.items():
        assert getattr(memcalc, name) is getattr(__import__(module, fromlist=[name]), name)


# A module docstring says what the module does and why; research notes (sources, derivations,
# measurements) live in docs/notes/, linked from it by path (STYLE.md, issue 37).
MAX_MODULE_DOCSTRING_LINES = 30


def test_every_module_docstring_is_at_most_30_lines_and_its_notes_exist():
    import ast
    import re

    repo = PACKAGE.parent
    files = sorted([*PACKAGE.rglob("*.py"), *(repo / "models_zoo").rglob("*.py")])
    assert len(files) > 100
    too_long: list[str] = []
    for path in files:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc is None:
            continue
        lines = doc.count("\n") + 1
        if lines > MAX_MODULE_DOCSTRING_LINES:
            too_long.append(f"{path.relative_to(repo)}: {lines} lines")
        for note in re.findall(r"docs/notes/[\w.-]+\.md", doc):
            assert (repo / note).is_file(), f"{path.relative_to(repo)} links {note}, which does not exist"
    assert not too_long, "module docstrings over 30 lines (move the detail to docs/notes/):\n" + "\n".join(too_long)
