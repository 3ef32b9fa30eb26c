"""No memcalc module imports another's private names (``from memcalc.x import _y``): a piece two
modules share gets a public home (expert parallelism's DTensor upkeep, once borrowed from tensor
parallelism's privates, lives in :mod:`memcalc.distributed.dtensor_upkeep`). lint-imports checks which
module may import which; this checks what crosses."""

from __future__ import annotations

import ast
from pathlib import Path

import memcalc

PACKAGE = Path(memcalc.__file__).parent


def _private_imports(source: str) -> list[str]:
    """``module.name`` for each leading-underscore name ``source`` imports from a memcalc module."""
    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module is not None and node.module.startswith("memcalc")
            for alias in node.names if alias.name.startswith("_")]


def test_the_check_sees_a_private_import() -> None:
    # the form expert_parallel.py had before the DTensor upkeep moved, deferred imports included
    source = ("from memcalc.distributed.tensor_parallel import (\n    TensorParallel,\n    _snapshot,\n)\n"
              "def f():\n    from memcalc.engine.trace import _hidden\n")
    assert _private_imports(source) == ["memcalc.distributed.tensor_parallel._snapshot", "memcalc.engine.trace._hidden"]
    assert _private_imports("from memcalc.distributed.dtensor_upkeep import snapshot_modules\n") == []


def test_no_memcalc_module_imports_another_modules_private_names() -> None:
    crossing = {str(path.relative_to(PACKAGE.parent)): names for path in sorted(PACKAGE.rglob("*.py"))
                if (names := _private_imports(path.read_text(encoding="utf-8")))}
    assert crossing == {}, "give the shared piece a public name (or a module of its own) and import that"
