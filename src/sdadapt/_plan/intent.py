"""What a rank is about to do, as the parts the ranks agree on before any byte moves
(:func:`sdadapt._base.agreement.agree_on`): the adapter's rules, the plan (each output key's
shape, dtype and recipe) and the installed versions. Every collective entry point builds it
from what it planned; ranks whose parts differ raise before anything is read or written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._base import agreement
from .._base.schema import dtype_name
from .._recipes.nodes import Node
from .adapter import Adapter

PARTS = ("adapter", "plan", "versions")
"""The part names of every intent (a rank that failed passes them with ``None`` values)."""


def adapter_part(adapter: Adapter | None, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``adapter``'s rules as JSON-able dicts (a rule that JSON cannot hold: its label), and the
    call's options that change what is planned."""
    rules: list[Any] = []
    for rule in adapter.rules if adapter is not None else []:
        try:
            rules.append(rule.model_dump(mode="json"))
        except Exception:  # noqa: BLE001 - a rule of one's own holding a function: its label says what it is
            rules.append({"kind": getattr(rule, "kind", type(rule).__name__), "label": rule.label()})
    return {"rules": rules, "options": dict(options or {})}


def plan_part(recipes: Mapping[str, Node] | None) -> dict[str, Any] | None:
    """Each output key's global shape, dtype and recipe (``None``: ranks plan different keys,
    as the stages of a pipeline do; the adapter and versions are still compared)."""
    if recipes is None:
        return None
    return {k: [list(n.shape), dtype_name(n.dtype), n.describe()] for k, n in recipes.items()}


def intent(adapter: Adapter | None, recipes: Mapping[str, Node] | None, **options: Any) -> dict[str, Any]:
    """The parts of :data:`PARTS` for one collective operation on this rank."""
    return {"adapter": adapter_part(adapter, options), "plan": plan_part(recipes), "versions": agreement.installed_versions()}


def no_intent() -> dict[str, Any]:
    """The parts of a rank that failed before it knew what it would do."""
    return dict.fromkeys(PARTS)


__all__ = ["PARTS", "adapter_part", "intent", "no_intent", "plan_part"]
