"""Per-op rules, registered by op object.

The engine traces ops; what a device adds to an op (a kernel workspace, an emulated cast, a
fused kernel in place of a composite) is a *rule* keyed by the op itself — an aten
``OpOverload`` for rules that run below autograd, a Python callable such as
``torch.nn.functional.dropout`` for rules that run above it. One :class:`RuleRegistry` per
subject lives in the file of that subject, and adding a rule is one decorated function::

    WORKSPACE_RULES: RuleRegistry[WorkspaceRule] = RuleRegistry("kernel workspace")

    @WORKSPACE_RULES.register(aten.mm.default, aten.addmm.default)
    def cublas(model, call): ...

As in ``torch.utils.flop_counter.register_flop_formula``, registering an op twice is an
error (two rules for one op would silently shadow each other); :meth:`RuleRegistry.override`
replaces a rule on purpose, and hands back the previous one so a test can restore it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ("DuplicateRuleError", "RuleRegistry", "op_name")

R = TypeVar("R", bound=Callable[..., object])


class DuplicateRuleError(ValueError):
    """A second rule for an op that already has one (use :meth:`RuleRegistry.override`)."""


def op_name(op: object) -> str:
    """``aten.mm.default`` for an OpOverload, ``torch.nn.functional.dropout`` for a function."""
    name = getattr(op, "_name", None)  # OpOverload: "aten::mm"; the overload is its __name__
    if isinstance(name, str):
        return f"{name.replace('::', '.')}.{getattr(op, '_overloadname', 'default')}"
    module = getattr(op, "__module__", None) or ""
    return f"{module}.{getattr(op, '__qualname__', repr(op))}".lstrip(".")


class RuleRegistry(Generic[R]):
    """Rules of one subject, keyed by op object; duplicates refused."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self._rules: dict[object, R] = {}
        # the same rules by id(op), for get(): asked once per traced op, and an OpOverload hashes
        # in Python (torch/_ops.py). An op with a rule is a key of _rules, alive: its id is its own.
        self._by_id: dict[int, R] = {}

    def register(self, *ops: object) -> Callable[[R], R]:
        """Decorator: ``rule`` handles every op in ``ops``."""
        if not ops:
            raise ValueError(f"a {self.subject} rule needs at least one op")

        def decorate(rule: R) -> R:
            for op in ops:
                if op in self._rules:
                    raise DuplicateRuleError(
                        f"{op_name(op)} already has a {self.subject} rule "
                        f"({getattr(self._rules[op], '__qualname__', self._rules[op])}); use override()")
            for op in ops:
                self._rules[op] = rule
                self._by_id[id(op)] = rule
            return rule

        return decorate

    def override(self, op: object, rule: R | None) -> R | None:
        """Replace (or with ``None`` remove) the rule for ``op``; returns the previous one."""
        previous = self._rules.pop(op, None)
        self._by_id.pop(id(op), None)
        if rule is not None:
            self._rules[op] = rule
            self._by_id[id(op)] = rule
        return previous

    def get(self, op: object) -> R | None:
        """The rule for ``op``, or None (most ops have none). Looked up by identity: an op is
        one object (an ``OpOverload``, a function), and any callable can be asked about."""
        return self._by_id.get(id(op))

    def __contains__(self, op: object) -> bool:
        return op in self._rules

    def __iter__(self) -> Iterator[object]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)
