"""Value rules: they keep each matched key and replace its node (cast, transpose, rotary row
order, pad/trim). They apply in order; rules that read the target (pad, trim) look a key up
under the name it will have after the later key-moving rules (:func:`.base.final_key`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .. import _nodes as N
from .._nodes import Cast as CastNode
from .._nodes import Narrow
from ..errors import AdapterError
from .base import RuleBase, dim_of, dtype_str, matching, matching_dim, parse_dtype, target_size

if TYPE_CHECKING:
    from .._plan import PlanContext


class Cast(RuleBase):
    """Convert matched tensors to ``dtype`` (optionally only those stored as ``from_dtype``).
    Dtype changes are never silent: without a cast rule a dtype mismatch is a problem."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["cast"] = "cast"
    keys: str = "**"
    dtype: str
    from_dtype: str | None = None

    @field_validator("dtype", "from_dtype", mode="before")
    @classmethod
    def _norm(cls, v: object) -> str | None:
        return None if v is None else dtype_str(v)

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        to = parse_dtype(self.dtype)
        only = parse_dtype(self.from_dtype) if self.from_dtype else None
        for key, node in matching(ctx, self.keys):
            if only is not None and node.dtype != only:
                continue
            ctx.mark(index)
            if node.dtype != to:
                ctx.replace(key, CastNode(node, to))

    def inverse(self) -> list[RuleBase]:
        if self.from_dtype is None:
            raise AdapterError(
                f"{self.label()} cannot be inverted: it does not say which dtype it converts from; "
                "give from_dtype=..."
            )
        return [Cast(keys=self.keys, dtype=self.from_dtype, from_dtype=self.dtype)]


class Transpose(RuleBase):
    """Swap dims ``dim0`` and ``dim1`` of matched tensors, keeping their keys (GPT-2 ``Conv1D``
    ``[in, out]`` <-> ``nn.Linear`` ``[out, in]``). Its own inverse."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["transpose"] = "transpose"
    keys: str
    dim0: int = 0
    dim1: int = 1

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node in matching(ctx, self.keys):
            d0 = dim_of(ctx, index, key, node, self.dim0, "dim0")
            d1 = dim_of(ctx, index, key, node, self.dim1, "dim1")
            if d0 is None or d1 is None:
                continue
            ctx.mark(index)
            if d0 != d1:
                ctx.replace(key, N.Transpose(node, d0, d1))

    def inverse(self) -> list[RuleBase]:
        return [Transpose(keys=self.keys, dim0=self.dim0, dim1=self.dim1)]


def rotary_perm(head_dim: int, to: str) -> tuple[int, ...]:
    """Row order inside one head: output row ``j`` is input row ``perm[j]``.

    ``to="half"`` (Meta -> HF transformers): HF row ``t * head_dim/2 + j`` is Meta row ``2j + t``
    (HF's conversion script: ``w.view(heads, head_dim // 2, 2, dim).transpose(1, 2)``);
    ``to="interleaved"`` (HF -> Meta) is its inverse."""
    h = head_dim // 2
    if to == "half":
        return tuple(2 * (r % h) + r // h for r in range(head_dim))
    return tuple((m % 2) * h + m // 2 for m in range(head_dim))


class Rotary(RuleBase):
    """Reorder the rows inside each head of a q or k projection between rotary layouts.

    ``to="interleaved"``: from HF transformers' "half" layout (``rotate_half``: the first half of
    each head's rows are the real parts) to Meta's interleaved pairs; ``to="half"``: the other
    way. ``heads`` is the head count of the matched keys (GQA: give k its own rule with the kv
    head count). Rows along ``dim`` must divide into ``heads`` heads of even size. A region
    that cuts a head is read as whole heads, permuted, then narrowed."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["rotary"] = "rotary"
    keys: str
    heads: int = Field(gt=0)
    to: Literal["interleaved", "half"] = "interleaved"
    dim: int = 0

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            rows = node.shape[d]
            if rows % self.heads:
                ctx.issue(index, key, f"{rows} rows along dim {d} do not divide into heads={self.heads}")
                continue
            hd = rows // self.heads
            if hd % 2:
                ctx.issue(
                    index,
                    key,
                    f"head_dim {hd} (= {rows} rows / heads={self.heads}) is odd; rotary needs an even head_dim",
                )
                continue
            ctx.mark(index)
            label = f"rotary_{self.to}[heads={self.heads}, dim={d}]"
            ctx.replace(key, N.UnitPermute(node, d, hd, rotary_perm(hd, self.to), label))

    def inverse(self) -> list[RuleBase]:
        other: Literal["interleaved", "half"] = "half" if self.to == "interleaved" else "interleaved"
        return [Rotary(keys=self.keys, heads=self.heads, to=other, dim=self.dim)]


class Pad(RuleBase):
    """Extend matched tensors along ``dim`` with ``value`` up to ``size``, or to the next multiple
    of ``multiple_of``, or (neither given) to the target's size for that key (vocab padded for
    TP). The inverse is :class:`Trim` to the target's size: exporting needs a target (or a
    ``Trim`` with an explicit ``size``), since one rule may match tensors of several sizes."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["pad"] = "pad"
    keys: str
    dim: int = 0
    size: int | None = Field(default=None, ge=0)
    multiple_of: int | None = Field(default=None, gt=0)
    value: float = 0.0

    @model_validator(mode="after")
    def _check(self) -> Pad:
        if self.size is not None and self.multiple_of is not None:
            raise AdapterError(f"pad of {self.keys!r}: give size or multiple_of, not both")
        return self

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            want = self._size(ctx, key, index, n, d, len(node.shape))
            if want is None:
                ctx.issue(index, key, "the model has no such key to take the size from; give size= or multiple_of=")
                continue
            if want < n:
                ctx.issue(index, key, f"cannot pad dim {d} from {n} down to {want}; use trim")
                continue
            ctx.mark(index)
            if want > n:
                ctx.replace(key, N.Pad(node, d, want, self.value))

    def _size(self, ctx: PlanContext, key: str, index: int, n: int, d: int, nd: int) -> int | None:
        """The padded size along dim ``d`` (now ``n``): declared, rounded up, or the target's."""
        if self.size is not None:
            return self.size
        if self.multiple_of is not None:
            return -(-n // self.multiple_of) * self.multiple_of
        return target_size(ctx, key, index, d, nd)

    def inverse(self) -> list[RuleBase]:
        return [Trim(keys=self.keys, dim=self.dim)]


class Trim(RuleBase):
    """Keep the first ``size`` entries of matched tensors along ``dim`` (``size`` omitted: the
    target's size for that key; a plan without that key in its target reports it)."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["trim"] = "trim"
    keys: str
    dim: int = 0
    size: int | None = Field(default=None, ge=0)

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            want = self.size if self.size is not None else target_size(ctx, key, index, d, len(node.shape))
            if want is None:
                ctx.issue(index, key, "the model has no such key to take the size from; give size= to trim")
                continue
            if want > n:
                ctx.issue(index, key, f"cannot trim dim {d} from {n} up to {want}; use pad")
                continue
            ctx.mark(index)
            if want < n:
                ctx.replace(key, Narrow(node, d, 0, want))

    def inverse(self) -> list[RuleBase]:
        return [Pad(keys=self.keys, dim=self.dim)]
