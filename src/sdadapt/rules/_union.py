""":data:`Rule`: the union of the built-in rule classes of plain adapters, for a user's pydantic
field or annotation. Its own module: building it imports every kind's module, which a plain
load does not need (:data:`sdadapt._base.rule_kinds.ON_USE`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Annotated, TypeAlias, Union

from pydantic import Field

from .._base.rule_kinds import QUANTIZED, RULE_KINDS

_CLASSES = tuple(
    getattr(importlib.import_module(f"sdadapt.rules.{module}"), cls) for cls, module, _ in RULE_KINDS if module not in QUANTIZED
)

if TYPE_CHECKING:
    from ._key_moves import AddPrefix, Drop, Fuse, Split, StripPrefix, Tie
    from ._keys import Rename
    from ._stacking import Stack, Unstack
    from ._tensor_parallel import Deinterleave, Interleave
    from ._values import Affine, Cast, Pad, Rotary, Transpose, Trim

    # the same union spelled for type checkers, in the table's order (tests/rules/test_rule_union.py
    # compares the two)
    Rule: TypeAlias = Annotated[
        Rename | Fuse | Split | Cast | Drop | Tie | Transpose | Rotary | Affine | Stack | Unstack | Pad | Trim
        | Interleave | Deinterleave | StripPrefix | AddPrefix,
        Field(discriminator="kind"),
    ]  # fmt: skip
else:
    Rule = Annotated[Union[_CLASSES], Field(discriminator="kind")]  # noqa: UP007 - a union of the table's classes
    Rule.__doc__ = """The built-in rules: the union of their classes, told apart by the ``kind`` field.
    Adapters hold any registered rule (see :func:`sdadapt.rules.register_rule`)."""
