"""The registry of rule kinds, and :class:`ValueRule`: the open door for rules of one's own.

An adapter's JSON names each rule by its ``kind``; :func:`rule_from_data` finds the class
registered for that kind. Built-in rules are registered by :mod:`sdadapt.rules`, except those
whose module is imported when a kind of theirs is first asked for (:data:`_IMPORTED_ON_USE`: the
value, stacking and TP kinds, the quantized formats, which import their kernels, and the LoRA merge); a user's rule
class is registered with the :func:`register_rule` decorator and is then planned, loaded
(through its nodes' region mapping, on any mesh), inverted and serialised like a built-in one:

    @sdadapt.rules.register_rule
    class Negate(sdadapt.rules.ValueRule):
        kind: Literal["negate"] = "negate"

        def transform(self, key, node):
            return NegateNode(node)   # a Node: shape, dtype, produce, full, describe

        def inverse(self):
            return [Negate(keys=self.keys)]

A rule that moves keys subclasses :class:`RuleBase` directly and implements ``apply`` with the
plan context (``ctx.keys()``, ``ctx.get``, ``ctx.take``, ``ctx.put``, ``ctx.replace``,
``ctx.mark``, ``ctx.issue``), as the built-in rules of :mod:`._keys` do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, TypeVar

from .._base.rule_kinds import BUILT_IN, ON_USE
from ..errors import AdapterError
from ._base import InPlaceRule, Keys, RuleBase, matching

if TYPE_CHECKING:
    from .._recipes.nodes import Node
    from ._base import PlanContext

R = TypeVar("R", bound=type[RuleBase])

_KINDS: dict[str, type[RuleBase]] = {}
_IMPORTED_ON_USE: dict[str, str] = {
    kind: f"sdadapt.rules.{module}" for _, module, kind, public in BUILT_IN if module in ON_USE or not public
}
"""Built-in kinds -> the module that registers them when imported; imported the first time one of
its kinds is asked for, so that an adapter of plain rules does not import it."""


def _import_kind(kind: str) -> None:
    """Import the module of built-in kind ``kind`` (it registers its rules), if it has one."""
    module = _IMPORTED_ON_USE.get(kind)
    if module is not None:
        importlib.import_module(module)


def _kind_of(cls: type[RuleBase]) -> str:
    field = cls.model_fields.get("kind")
    kind = None if field is None else field.default
    if not isinstance(kind, str) or not kind:
        raise AdapterError(
            f"rule class {cls.__qualname__} needs a kind field with a default, e.g. "
            'kind: Literal["my_rule"] = "my_rule"'
        )
    return kind


def register_rule(cls: R) -> R:
    """Register a rule class (a :class:`RuleBase` subclass with a ``kind`` literal field) so that
    adapters holding it read back from JSON; use it as a class decorator. Registering a kind
    that another class holds is an error (the same class again, e.g. its module re-imported,
    replaces the entry).

    Args:
        cls: the rule class.

    Returns:
        ``cls`` itself (so it works as a decorator).

    Raises:
        AdapterError: ``cls`` is no :class:`RuleBase` subclass with a ``kind``, or another class
            holds its kind.

    Example::

        @sdadapt.rules.register_rule
        class Negate(sdadapt.rules.ValueRule):
            kind: Literal["negate"] = "negate"
    """
    if not (isinstance(cls, type) and issubclass(cls, RuleBase)):
        raise AdapterError(f"register_rule takes a subclass of sdadapt.rules.RuleBase, got {cls!r}")
    kind = _kind_of(cls)
    if _IMPORTED_ON_USE.get(kind, cls.__module__) != cls.__module__:
        _import_kind(kind)  # the built-in class holds the kind: the check below names it
    have = _KINDS.get(kind)
    if have is not None and (have.__module__, have.__qualname__) != (cls.__module__, cls.__qualname__):
        raise AdapterError(
            f"rule kind {kind!r} is taken by {have.__module__}.{have.__qualname__}; give "
            f"{cls.__qualname__} another kind"
        )
    _KINDS[kind] = cls
    return cls


def registered_rules() -> dict[str, type[RuleBase]]:
    """``kind -> class`` of every registered rule (built-in ones first).

    Returns:
        A new dict ``{kind: class}``.

    Example::

        assert sdadapt.rules.registered_rules()["rename"] is sdadapt.rules.Rename
    """
    for kind in _IMPORTED_ON_USE:
        _import_kind(kind)
    built_in = {k: c for k, c in _KINDS.items() if c.__module__.startswith("sdadapt.")}
    return {**built_in, **{k: c for k, c in _KINDS.items() if k not in built_in}}


def rule_from_data(data: Any) -> RuleBase:
    """A rule from its JSON form (a dict with a ``kind``), or the rule itself if already one.

    Args:
        data: a dict such as ``{"kind": "rename", "src": "a", "dst": "b"}``, or a rule.

    Returns:
        The rule, an instance of the class registered for its ``kind``.

    Raises:
        AdapterError: an unknown ``kind`` (its class must be registered first) or a bad field.

    Example::

        rule = sdadapt.rules.rule_from_data({"kind": "rename", "src": "a", "dst": "b"})
        assert rule == sdadapt.rename("a", "b")
    """
    if isinstance(data, RuleBase):
        return data
    if not isinstance(data, dict):
        raise AdapterError(f"an adapter rule must be a rule object or a dict with a 'kind', got {type(data).__name__}")
    kind = data.get("kind")
    if isinstance(kind, str) and kind not in _KINDS:
        _import_kind(kind)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise AdapterError(
            f"unknown rule kind {kind!r}; known kinds: {', '.join(sorted({*_KINDS, *_IMPORTED_ON_USE}))}. A rule of your own "
            "must be registered (@sdadapt.rules.register_rule) before its adapter is read"
        )
    return cls(**data)


class ValueRule(InPlaceRule):
    """A value rule of one's own: for each key ``keys`` matches (one pattern or a list),
    :meth:`transform` returns the node that replaces the key's node. The node carries the
    shape, dtype and region mapping (see :class:`sdadapt.rules.Node`); the subclass adds its
    ``kind`` literal, its own fields, :meth:`transform` and :meth:`inverse`, and is registered
    with :func:`register_rule`.

    Args:
        keys: one key pattern or a list; the subclass adds its own fields.

    Example::

        @sdadapt.rules.register_rule
        class Negate(sdadapt.rules.ValueRule):
            kind: Literal["negate"] = "negate"

            def transform(self, key, node):
                return NegNode(node.shape, node.dtype, node)  # a sdadapt.rules.Node subclass

            def inverse(self):
                return [Negate(keys=self.keys)]
    """

    keys: Keys

    def transform(self, key: str, node: Node) -> Node | str:
        """The node that replaces ``node`` under ``key``, or a message saying why this key
        cannot be transformed (reported as a plan problem of this rule, nothing read)."""
        raise NotImplementedError

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node in matching(ctx, self.keys):
            made = self.transform(key, node)
            if isinstance(made, str):
                ctx.issue(index, key, made)
                continue
            ctx.mark(index)
            ctx.replace(key, made)
