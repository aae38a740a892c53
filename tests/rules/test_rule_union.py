"""``sdadapt.rules.Rule`` is one static union for type checkers and the same union at run time,
both the classes of the rule-kind table's plain (not quantized) kinds, in its order."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import sdadapt.rules
from sdadapt._base.rule_kinds import QUANTIZED, RULE_KINDS
from sdadapt.rules import _union

TABLE = [cls for cls, module, _ in RULE_KINDS if module not in QUANTIZED]


def _union_names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_names(node.left) + _union_names(node.right)
    assert isinstance(node, ast.Name), ast.dump(node)
    return [node.id]


def test_the_static_union_is_the_table():
    tree = ast.parse(Path(_union.__file__).read_text())
    aliases = [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "Rule"]
    assert len(aliases) == 1, "one static spelling of Rule"
    annotated = aliases[0].value
    assert isinstance(annotated, ast.Subscript) and isinstance(annotated.slice, ast.Tuple)
    assert _union_names(annotated.slice.elts[0]) == TABLE


def test_the_runtime_union_is_the_table():
    union, discriminator = typing.get_args(sdadapt.rules.Rule)
    assert [c.__name__ for c in typing.get_args(union)] == TABLE
    assert discriminator.discriminator == "kind"


def test_each_plain_kind_documents_its_function_and_its_example_runs():
    import inspect

    import sdadapt

    for name, fn in ((cls, fn) for cls, module, fn in RULE_KINDS if module not in QUANTIZED):
        doc = inspect.cleandoc(getattr(sdadapt.rules, name).__doc__)
        assert f":func:`sdadapt.{fn}`" in doc, name
        example = doc.split("Example::\n", 1)[1]
        scope = {"sdadapt": sdadapt, "hidden": 8}
        exec(inspect.cleandoc(example), scope)  # noqa: S102 - the docstring's own example
        assert type(scope["rule"]).__name__ == name


def test_every_built_in_kind_is_in_a_table_and_imported_on_first_use():
    """Each class of the tables lives in its row's module with its row's kind, and asking for any
    built-in kind by name imports that module (the on-use map is derived from the tables)."""
    import importlib

    from sdadapt._base.rule_kinds import BUILT_IN
    from sdadapt.rules._custom import _IMPORTED_ON_USE

    for cls, module, kind, _ in BUILT_IN:
        found = getattr(importlib.import_module(f"sdadapt.rules.{module}"), cls)
        assert found.model_fields["kind"].default == kind, (cls, kind)
        assert _IMPORTED_ON_USE.get(kind, f"sdadapt.rules.{module}") == f"sdadapt.rules.{module}", kind
    assert {kind for _, _, kind, public in BUILT_IN if not public} <= set(_IMPORTED_ON_USE)
