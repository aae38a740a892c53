"""Stacking rules: per-index keys (MoE experts ``experts.{e}.w1``) <-> one tensor with a new dim."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from .._recipes import moves as MV
from ..errors import AdapterError
from ._base import RuleBase, built_by, captured, dim_of
from ._custom import register_rule
from ._patterns import compile_pattern, typed_like

if TYPE_CHECKING:
    from ._base import PlanContext


def check_over(src: str, dst: str, over: str, what: str) -> None:
    """``src`` captures ``over`` and ``dst`` uses every other capture of ``src`` and not ``over``."""
    s, d = set(compile_pattern(src).names), set(compile_pattern(dst).names)
    if over not in s:
        raise AdapterError(f"{what}: pattern {src!r} must capture {{{over}}} (the index to stack over)")
    if over in d:
        raise AdapterError(f"{what}: pattern {dst!r} must not use {{{over}}}: that index becomes a dim")
    if d != s - {over}:
        raise AdapterError(
            f"{what}: patterns {src!r} and {dst!r} must share every capture except {{{over}}}; "
            f"got {sorted(s)} and {sorted(d)}"
        )
    for m in ("*", "**"):
        if m in dst.replace("{", " ").replace("}", " ").split("."):
            raise AdapterError(f"{what}: pattern {dst!r} may not contain '*' or '**'; name the capture instead")


class _Stacking(RuleBase):
    """The fields of :class:`Stack` and :class:`Unstack`: the pattern ``src`` they read, the
    pattern ``dst`` they write, the capture ``over`` that indexes the entries of dim ``dim``, and
    the number of entries ``count`` if it is fixed."""

    src: str
    dst: str
    over: str = "e"
    dim: int = 0
    count: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> _Stacking:
        check_over(*self.sides(), self.over, self.label())
        return self

    def sides(self) -> tuple[str, str]:
        """The per-entry pattern (it captures ``over``) and the stacked tensor's pattern."""
        raise NotImplementedError

    def input_patterns(self) -> list[str]:
        return [self.src]


@built_by('"layers.{i}.experts.{e}.w1.weight", "layers.{i}.moe.experts.w1"')
class Stack(_Stacking):
    """All keys matching ``src`` that differ only in the capture ``over`` become one tensor
    ``dst`` with a new dim ``dim`` of size E (MoE experts:
    ``Stack(src="layers.{i}.block_sparse_moe.experts.{e}.w1.weight", dst="layers.{i}.moe.experts.w1")``).
    The ``over`` values must be the integers 0..E-1 (``count`` E, if given) with equal shapes
    and dtypes."""

    kind: Literal["stack"] = "stack"

    def sides(self) -> tuple[str, str]:
        return self.src, self.dst

    def apply(self, ctx: PlanContext, index: int) -> None:
        out = compile_pattern(self.dst)
        groups: dict[str, list[tuple[str, str]]] = {}
        for key, caps in captured(ctx, self.src):
            groups.setdefault(out.format(caps), []).append((caps[self.over], key))
        for dst, members in groups.items():
            bad = [k for e, k in members if not e.isdigit()]
            if bad:
                ctx.issue(index, dst, f"{{{self.over}}} must be an integer, got {', '.join(map(repr, bad))}")
                continue
            members.sort(key=lambda m: int(m[0]))
            idx = [int(e) for e, _ in members]
            if idx != list(range(len(idx))):
                missing = sorted(set(range(max(idx) + 1)) - set(idx))
                dup = sorted({i for i in idx if idx.count(i) > 1})
                ctx.issue(
                    index,
                    dst,
                    f"{{{self.over}}} must run 0..E-1; found {len(idx)} keys"
                    + (f", missing {self.over}={missing}" if missing else "")
                    + (f", repeated {self.over}={dup}" if dup else ""),
                )
                continue
            if self.count is not None and len(idx) != self.count:
                ctx.issue(index, dst, f"found {len(idx)} entries ({self.over}=0..{len(idx) - 1}) but count={self.count}")
                continue
            parts = [ctx.get(k) for _, k in members]
            odd = [(k, p) for (_, k), p in zip(members, parts, strict=True) if p.shape != parts[0].shape or p.dtype != parts[0].dtype]
            if odd:
                k, p = odd[0]
                ctx.issue(
                    index,
                    dst,
                    f"entries differ: {members[0][1]!r} is {list(parts[0].shape)} {parts[0].dtype}, "
                    f"{k!r} is {list(p.shape)} {p.dtype}",
                )
                continue
            nd = len(parts[0].shape)
            if not -(nd + 1) <= self.dim <= nd:
                ctx.issue(index, dst, f"dim {self.dim} is out of range for stacking tensors of shape {list(parts[0].shape)}")
                continue
            for _, k in members:
                ctx.take(k, index)
            ctx.put(dst, MV.Stacked(tuple(parts), self.dim % (nd + 1)), index, origin=[k for _, k in members])

    def inverse(self) -> list[RuleBase]:
        return [Unstack(src=typed_like(self.dst, self.src), dst=self.src, over=self.over, dim=self.dim, count=self.count)]


@built_by('"layers.{i}.moe.experts.w1", "layers.{i}.experts.{e}.w1.weight"')
class Unstack(_Stacking):
    """One tensor ``src`` becomes E keys ``dst`` (which captures ``over``), one per entry along
    ``dim``: ``Unstack(src="layers.{i}.moe.experts.w1", dst="layers.{i}.experts.{e}.w1.weight")``."""

    kind: Literal["unstack"] = "unstack"

    def sides(self) -> tuple[str, str]:
        return self.dst, self.src

    def apply(self, ctx: PlanContext, index: int) -> None:
        out = compile_pattern(self.dst)
        for key, caps in captured(ctx, self.src):
            node = ctx.get(key)
            d = dim_of(ctx, index, key, node, self.dim)
            if d is None:
                continue
            n = node.shape[d]
            if self.count is not None and n != self.count:
                ctx.issue(index, key, f"has {n} entries along dim {d} but count={self.count}")
                continue
            ctx.take(key, index)
            for e in range(n):
                ctx.put(out.format({**caps, self.over: str(e)}), MV.Selected(node, d, e), index, origin=key)

    def inverse(self) -> list[RuleBase]:
        return [Stack(src=typed_like(self.dst, self.src), dst=self.src, over=self.over, dim=self.dim, count=self.count)]


# imported on first use (sdadapt._base.rule_kinds.ON_USE): its kinds are registered here
for _cls in (Stack, Unstack):
    register_rule(_cls)
