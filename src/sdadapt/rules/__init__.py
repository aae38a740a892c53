"""Typed rules: the steps an :class:`~sdadapt.Adapter` applies to a checkpoint's keys.

A rule is plain data (a pydantic model, serialisable to JSON). Applied to a plan's working
set of ``key -> Node`` it matches whole keys with :mod:`sdadapt.rules._patterns` and replaces the
matched entries with new nodes, so that shapes, dtypes and region mappings follow from the
nodes (see :mod:`sdadapt._recipes.nodes`). Each rule also states its inverse, so one adapter serves
both loading and exporting.

Two kinds of rules:

- *key-moving* rules (rename, fuse, split, drop, stack, ...) take keys away. A key may be taken
  by one such rule only: if a later key-moving rule would also match it, the plan reports the
  two rules as ambiguous instead of silently letting the first win;
- *value* rules (cast, transpose, rotary, affine, pad, interleave, ...) keep the key and change
  its value; they apply in order.

Modules, one family each:

- :mod:`.base`: :class:`RuleBase` (the protocol every rule implements) and the helpers rules
  share (matching keys, moving them, reading the target's size under a key's final name);
- :mod:`.keys`: rename, fuse/split, drop, tie, strip_prefix/add_prefix;
- :mod:`.values`: cast, transpose, rotary (row order inside heads), affine, pad/trim;
- :mod:`.stacking`: stack/unstack (per-expert keys <-> one tensor);
- :mod:`.tensor_parallel`: interleave/deinterleave (fused parts laid out per TP rank) and
  :func:`tp_degree`;
- :mod:`.custom`: :func:`register_rule` (the registry of rule kinds an adapter's JSON is read
  with) and :class:`ValueRule`, the short way to write a value rule of one's own.

Adding a rule kind, built in or a user's: a :class:`RuleBase` subclass with a ``kind`` literal,
registered with :func:`register_rule` (built-in kinds are registered below and listed in
:data:`Rule` for typing); a public constructor for a built-in one goes in :mod:`sdadapt`.
Nothing else dispatches on rule types: planning calls ``apply``, inversion calls ``inverse``,
resuming optimizer state calls ``for_optimizer_state``, and :func:`final_key` asks each later
rule's ``key_after``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ._base import Keys, RuleBase, final_key, parse_dtype, target_info
from ._custom import ValueRule, register_rule, registered_rules, rule_from_data
from ._keys import AddPrefix, Drop, Fuse, Rename, Split, StripPrefix, Tie
from ._stacking import Stack, Unstack
from ._tensor_parallel import DP_MESH_NAMES, TP_MESH_NAMES, Deinterleave, Interleave, tp_degree
from ._values import Affine, Cast, Pad, Rotary, Transpose, Trim, rotary_perm

BUILTIN_RULES: tuple[type[RuleBase], ...] = (
    Rename, Fuse, Split, Cast, Drop, Tie, Transpose, Rotary, Affine, Stack, Unstack, Pad, Trim, Interleave,
    Deinterleave, StripPrefix, AddPrefix,
)  # fmt: skip
for _cls in BUILTIN_RULES:
    register_rule(_cls)

Rule = Annotated[
    Rename | Fuse | Split | Cast | Drop | Tie | Transpose | Rotary | Affine | Stack | Unstack | Pad | Trim
    | Interleave | Deinterleave | StripPrefix | AddPrefix,
    Field(discriminator="kind"),
]
Rule.__doc__ = """The built-in rules: the union of their classes, told apart by the ``kind`` field.
Adapters hold any registered rule (see :func:`register_rule`)."""

__all__ = [
    "BUILTIN_RULES",
    "DP_MESH_NAMES",
    "TP_MESH_NAMES",
    "AddPrefix",
    "Affine",
    "Cast",
    "Deinterleave",
    "Drop",
    "Fuse",
    "Interleave",
    "Keys",
    "Pad",
    "Rename",
    "Rotary",
    "Rule",
    "RuleBase",
    "Split",
    "Stack",
    "StripPrefix",
    "Tie",
    "Transpose",
    "Trim",
    "Unstack",
    "ValueRule",
    "final_key",
    "parse_dtype",
    "register_rule",
    "registered_rules",
    "rotary_perm",
    "rule_from_data",
    "target_info",
    "tp_degree",
]
