""":data:`Rule`: the union of the built-in rule classes of plain adapters, for a user's pydantic
field or annotation. Its own module: building it imports every kind's module, which a plain
load does not need (:data:`sdadapt._base.rule_kinds.ON_USE`)."""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Union

from pydantic import Field

from .._base.rule_kinds import QUANTIZED, RULE_KINDS

_CLASSES = tuple(
    getattr(importlib.import_module(f"sdadapt.rules.{module}"), cls) for cls, module, _ in RULE_KINDS if module not in QUANTIZED
)

Rule: Any = Annotated[Union[_CLASSES], Field(discriminator="kind")]  # noqa: UP007 - a union of the table's classes
Rule.__doc__ = """The built-in rules: the union of their classes, told apart by the ``kind`` field.
Adapters hold any registered rule (see :func:`register_rule`)."""
