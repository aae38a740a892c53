"""The rename rule: what a plain adapter (renames only) imports of the rules.

A key-moving rule takes the keys it matches away (a key may be taken by one such rule only;
the plan reports two rules that both match it as ambiguous). The other key-moving rules (fuse,
split, drop, tie, the prefix rules) are in :mod:`._key_moves`, imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import model_validator

from ._base import RuleBase, built_by, captured, move
from ._patterns import check_output_pattern, compile_pattern, typed_like

if TYPE_CHECKING:
    from ._base import PlanContext


@built_by('"model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"')
class Rename(RuleBase):
    """``src`` keys become ``dst`` keys: ``Rename(src="model.layers.{i}.mlp.up_proj.weight",
    dst="layers.{i}.feed_forward.w3.weight")``."""

    kind: Literal["rename"] = "rename"
    src: str
    dst: str

    @model_validator(mode="after")
    def _check(self) -> Rename:
        check_output_pattern(self.src, self.dst)
        check_output_pattern(self.dst, self.src)  # invertible: same captures both ways
        return self

    def input_patterns(self) -> list[str]:
        return [self.src]

    def apply(self, ctx: PlanContext, index: int) -> None:
        out = compile_pattern(self.dst)
        moved = [(key, out.format(caps)) for key, caps in captured(ctx, self.src)]
        move(ctx, index, moved)

    def inverse(self) -> list[RuleBase]:
        return [Rename(src=typed_like(self.dst, self.src), dst=self.src)]

    def key_after(self, key: str) -> str | None:
        caps = compile_pattern(self.src).match(key)
        return key if caps is None else compile_pattern(self.dst).format(caps)
