"""Typed rules: the steps an :class:`~sdadapt.Adapter` applies to a checkpoint's keys.

A rule is plain data (a pydantic model, serialisable to JSON). Applied to a plan's working
set of ``key -> Node`` it matches whole keys with :mod:`sdadapt._patterns` and replaces the
matched entries with new nodes, so that shapes, dtypes and region mappings follow from the
nodes (see :mod:`sdadapt._nodes`). Each rule also states its inverse, so one adapter serves
both loading and exporting.

Two kinds of rules:

- *key-moving* rules (rename, fuse, split, drop, stack, ...) take keys away. A key may be taken
  by one such rule only: if a later key-moving rule would also match it, the plan reports the
  two rules as ambiguous instead of silently letting the first win;
- *value* rules (cast, transpose, rotary, pad, interleave, ...) keep the key and change its
  value; they apply in order.

Modules, one family each:

- :mod:`.base`: :class:`RuleBase` (the protocol every rule implements) and the helpers rules
  share (matching keys, moving them, reading the target's size under a key's final name);
- :mod:`.keys`: rename, fuse/split, drop, tie, strip_prefix/add_prefix;
- :mod:`.values`: cast, transpose, rotary (row order inside heads), pad/trim;
- :mod:`.stacking`: stack/unstack (per-expert keys <-> one tensor);
- :mod:`.tensor_parallel`: interleave/deinterleave (fused parts laid out per TP rank) and
  :func:`tp_degree`.

Adding a rule kind: write its class (a :class:`RuleBase` subclass with a ``kind`` literal) in
a module of this package and add the class to :data:`Rule` below; a public constructor for it
goes in :mod:`sdadapt`. Nothing else dispatches on rule types: planning calls ``apply``,
inversion calls ``inverse``, and :func:`final_key` asks each later rule's ``key_after``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .base import RuleBase, final_key, parse_dtype, target_info
from .keys import AddPrefix, Drop, Fuse, Rename, Split, StripPrefix, Tie
from .stacking import Stack, Unstack
from .tensor_parallel import DP_MESH_NAMES, TP_MESH_NAMES, Deinterleave, Interleave, tp_degree
from .values import Cast, Pad, Rotary, Transpose, Trim, rotary_perm

Rule = Annotated[
    Rename | Fuse | Split | Cast | Drop | Tie | Transpose | Rotary | Stack | Unstack | Pad | Trim | Interleave
    | Deinterleave | StripPrefix | AddPrefix,
    Field(discriminator="kind"),
]
Rule.__doc__ = """Any rule: the union of the rule classes, read from JSON by its ``kind`` field."""

__all__ = [
    "DP_MESH_NAMES",
    "TP_MESH_NAMES",
    "AddPrefix",
    "Cast",
    "Deinterleave",
    "Drop",
    "Fuse",
    "Interleave",
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
    "final_key",
    "parse_dtype",
    "rotary_perm",
    "target_info",
    "tp_degree",
]
