"""What the dequant rules of every format share (:mod:`._dequant`: FP8 block scales and MXFP4;
:mod:`._dequant_scaled`: per-tensor, per-channel and group scales): the keys a rule acts on and
the dtype of its values. A module of its own so that each family's module imports only this."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, field_validator

from ._base import InPlaceRule, dtype_str, parse_dtype

VALUES_DTYPE = torch.bfloat16
"""The dtype of dequantised values where nothing says another: no ``dtype=`` on the rule, and no
model tensor to take the dtype from (``convert`` to a plain release)."""


def _two_positive(v: object) -> tuple[int, int]:
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v):
        raise ValueError(f"block must be two positive integers [rows, cols], got {v!r}")
    return (int(v[0]), int(v[1]))


Block = Annotated[tuple[int, int], BeforeValidator(_two_positive)]
"""A rule's ``block``: the values one scale covers, two positive integers ``[rows, cols]``."""


class QuantRule(InPlaceRule):
    """What every rule of the family has: the keys it acts on and the dtype of the values.

    ``dtype=None`` (the default): the values take the dtype the model holds for each key
    (float32 master weights get ``float(w) * scale`` in float32, computed so, not widened from
    bfloat16), or :data:`VALUES_DTYPE` where there is no model; a dtype pins it."""

    keys: str
    dtype: str | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _check_dtype(cls, v: object) -> str | None:
        return None if v is None else dtype_str(v)

    def _values_dtype(self) -> tuple[torch.dtype, bool]:
        """The dtype the dequantised nodes start with, and whether the target's replaces it."""
        return (VALUES_DTYPE, True) if self.dtype is None else (parse_dtype(self.dtype), False)

    def _fields(self) -> dict[str, Any]:
        return self.model_dump(exclude={"kind"})
