"""Key-moving rules besides rename: fuse/split, drop, tie, and the prefix rules. Imported on
first use (:data:`sdadapt._base.rule_kinds.ON_USE`): an adapter of renames never imports them.

A key-moving rule takes the keys it matches away (a key may be taken by one such rule only;
the plan reports two rules that both match it as ambiguous). :class:`Tie` and the prefix rules
are the exceptions: a tie keeps its source key, and the prefix rules act on whatever keys are
present when they run, outside the one-rule-per-key check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .._recipes.interleave import Interleaved
from .._recipes.moves import Concatenated, Narrowed
from .._recipes.nodes import Node
from ..errors import AdapterError
from ._base import RuleBase, built_by, captured, move
from ._custom import register_rule
from ._patterns import check_output_pattern, compile_pattern, typed_like

if TYPE_CHECKING:
    from ._base import PlanContext


@built_by('[f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]', '"layers.{i}.attention.wqkv.weight"')
class Fuse(RuleBase):
    """Concatenate ``srcs`` along ``dim`` into ``dst`` (e.g. q, k, v -> qkv). Parts may differ
    in size along ``dim`` (GQA); such parts need ``sizes`` (a plan without it says which), so
    that the inverse split (an export, which has no target schema) cuts them back where they
    were. Parts of equal sizes may omit it.

    ``heads=H``: the fused tensor is laid out per head, ``[H, parts, rows]`` (GPT-NeoX's,
    Bloom's and Persimmon's ``query_key_value``: ``view(heads, 3, head_dim, dim)``): each part is
    cut in ``H`` equal blocks and block ``h`` of every part follows block ``h`` of the previous
    one. For grouped attention fused per kv group (Falcon: each group's q heads, then its k and
    v) give the kv head count."""

    kind: Literal["fuse"] = "fuse"
    srcs: list[str]
    dst: str
    dim: int = 0
    sizes: list[int] | None = None
    heads: int | None = Field(default=None, gt=0)
    # the inverse of a split: its parts need no declared sizes (the split it undoes is its inverse)
    _undoes_split: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _check(self) -> Fuse:
        if len(self.srcs) < 2:
            raise AdapterError(f"fuse into {self.dst!r} needs at least two source patterns, got {self.srcs}")
        names = [set(compile_pattern(s).names) for s in self.srcs]
        if any(n != names[0] for n in names):
            raise AdapterError(f"fuse into {self.dst!r}: all source patterns must capture the same names, got {self.srcs}")
        check_output_pattern(self.srcs[0], self.dst)
        check_output_pattern(self.dst, self.srcs[0])  # invertible: the split back needs every capture
        if self.sizes is not None and len(self.sizes) != len(self.srcs):
            raise AdapterError(f"fuse into {self.dst!r}: {len(self.sizes)} sizes for {len(self.srcs)} sources")
        return self

    def __eq__(self, other: object) -> bool:  # the private mark is no part of what the rule is
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    __hash__ = RuleBase.__hash__

    def input_patterns(self) -> list[str]:
        return list(self.srcs)

    def apply(self, ctx: PlanContext, index: int) -> None:
        out, others = compile_pattern(self.dst), [compile_pattern(s) for s in self.srcs[1:]]
        for key, caps in captured(ctx, self.srcs[0]):
            names = [key] + [p.format(caps) for p in others]
            absent = [n for n in names if not ctx.has(n)]
            dst = out.format(caps)
            if absent:
                ctx.issue(index, dst, f"found {key!r} but not {', '.join(map(repr, absent))}")
                continue
            parts = [ctx.get(n) for n in names]
            problem = concat_problem(parts, names, self.dim, self.sizes)
            if problem:
                ctx.issue(index, dst, problem)
                continue
            dim = self.dim % len(parts[0].shape)
            sizes = tuple(p.shape[dim] for p in parts)
            if self.heads is not None and any(n % self.heads for n in sizes):
                ctx.issue(index, dst, f"parts of {list(sizes)} along dim {dim} do not all divide into heads={self.heads}")
                continue
            if self.sizes is None and len(set(sizes)) > 1 and not self._undoes_split:  # the inverse split would cut equal parts
                ctx.issue(index, dst, f"parts of {list(sizes)} along dim {dim} differ in size; pass sizes={list(sizes)} "
                          "so that the adapter's inverse (export, refit through adapter.inverse()) cuts them back")  # fmt: skip
                continue
            for n in names:
                ctx.take(n, index)
            node: Node = Concatenated(tuple(parts), dim)
            if self.heads is not None and self.heads > 1:
                node = Interleaved(node, dim, sizes, self.heads)
            ctx.put(dst, node, index, origin=names)

    def inverse(self) -> list[RuleBase]:
        return [Split(src=typed_like(self.dst, self.srcs), dsts=list(self.srcs), dim=self.dim, sizes=self.sizes,
                      heads=self.heads)]


def concat_problem(parts: list[Node], names: list[str], dim: int, sizes: list[int] | None) -> str | None:
    nd = len(parts[0].shape)
    if not -nd <= dim < nd:
        return f"dim {dim} is out of range for {names[0]!r} of shape {list(parts[0].shape)}"
    d = dim % nd
    for n, p in zip(names, parts, strict=True):
        if len(p.shape) != nd or p.shape[:d] + p.shape[d + 1 :] != parts[0].shape[:d] + parts[0].shape[d + 1 :]:
            shapes = ", ".join(f"{m}{list(q.shape)}" for m, q in zip(names, parts, strict=True))
            return f"shapes do not fit together along dim {dim}: {shapes}"
        if p.dtype != parts[0].dtype:
            return f"dtypes differ: {names[0]!r} is {parts[0].dtype}, {n!r} is {p.dtype}; cast first"
    if sizes is not None and [p.shape[d] for p in parts] != list(sizes):
        return f"declared sizes {sizes} but the parts have {[p.shape[d] for p in parts]} along dim {dim}"
    return None


@built_by('"h.{i}.attn.query_key_value.weight"', '["h.{i}.q.weight", "h.{i}.k.weight", "h.{i}.v.weight"]', "heads=8")
class Split(RuleBase):
    """Cut ``src`` along ``dim`` into ``dsts`` (e.g. qkv -> q, k, v). ``sizes`` may be omitted:
    then they come from the target schema when it has every ``dst``, else equal parts.

    ``heads=H``: ``src`` is laid out per head, ``[H, parts, rows]`` (GPT-NeoX's
    ``query_key_value``): part ``p`` is block ``p`` of each of the ``H`` groups, in order;
    ``sizes`` are then the parts' whole sizes (each divides by ``H``). See :class:`Fuse`."""

    kind: Literal["split"] = "split"
    src: str
    dsts: list[str]
    dim: int = 0
    sizes: list[int] | None = None
    heads: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Split:
        if len(self.dsts) < 2:
            raise AdapterError(f"split of {self.src!r} needs at least two destination patterns, got {self.dsts}")
        for d in self.dsts:
            check_output_pattern(self.src, d)
            check_output_pattern(d, self.src)  # invertible: the fuse back needs every capture
        if self.sizes is not None:
            if len(self.sizes) != len(self.dsts):
                raise AdapterError(f"split of {self.src!r}: {len(self.sizes)} sizes for {len(self.dsts)} destinations")
            if any(s < 0 for s in self.sizes):
                raise AdapterError(f"split of {self.src!r}: sizes must be >= 0, got {self.sizes}")
        return self

    def input_patterns(self) -> list[str]:
        return [self.src]

    def apply(self, ctx: PlanContext, index: int) -> None:
        outs = [compile_pattern(d) for d in self.dsts]
        for key, caps in captured(ctx, self.src):
            node = ctx.get(key)
            dsts = [o.format(caps) for o in outs]
            nd = len(node.shape)
            if not -nd <= self.dim < nd:
                ctx.issue(index, key, f"dim {self.dim} is out of range for shape {list(node.shape)}")
                continue
            d = self.dim % nd
            total = node.shape[d]
            sizes = self._sizes(ctx, dsts, d, total)
            if isinstance(sizes, str):
                ctx.issue(index, key, sizes)
                continue
            if self.heads is not None and any(n % self.heads for n in sizes):
                ctx.issue(index, key, f"parts of {sizes} along dim {d} do not all divide into heads={self.heads}")
                continue
            ctx.take(key, index)
            if self.heads is not None and self.heads > 1:  # per head -> contiguous parts, then cut
                node = Interleaved(node, d, tuple(sizes), self.heads, inverse=True)
            start = 0
            for dst, size in zip(dsts, sizes, strict=True):
                ctx.put(dst, Narrowed(node, d, start, size), index, origin=key)
                start += size

    def _sizes(self, ctx: PlanContext, dsts: list[str], d: int, total: int) -> list[int] | str:
        if self.sizes is not None:
            sizes = list(self.sizes)
            how = "declared"
        elif ctx.target is not None and all(k in ctx.target and len(ctx.target[k].shape) > d for k in dsts):
            sizes = [ctx.target[k].shape[d] for k in dsts]
            how = "taken from the target"
        elif total % len(dsts) == 0:
            return [total // len(dsts)] * len(dsts)
        else:
            return (
                f"cannot split {total} along dim {d} into {len(dsts)} equal parts and the target does "
                f"not give the sizes; pass sizes=[...] to the split rule"
            )
        if sum(sizes) != total:
            return f"sizes {sizes} ({how}) add up to {sum(sizes)}, but dim {d} has {total}"
        return sizes

    def inverse(self) -> list[RuleBase]:
        fuse = Fuse(srcs=[typed_like(d, self.src) for d in self.dsts], dst=self.src, dim=self.dim, sizes=self.sizes, heads=self.heads)
        fuse._undoes_split = True
        return [fuse]


@built_by('"**.rotary_emb.inv_freq"')
class Drop(RuleBase):
    """Source keys deliberately ignored (rotary caches, optimizer entries...). ``shadows=True``:
    the drop is meant to take its keys before later rules that match them too (a whole layer
    dropped first, whatever it holds); those later rules are then not ambiguous."""

    kind: Literal["drop"] = "drop"
    keys: str
    shadows: bool | None = None  # None: False (and the label stays drop(keys=...))

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        for key in ctx.keys(include_non_tensor=True):
            if pat.match(key) is not None:
                ctx.drop(key, index)

    def inverse(self) -> list[RuleBase]:
        return []  # dropped data cannot come back; the export simply lacks it


@built_by('"output.weight", "tok_embeddings.weight"')
class Tie(RuleBase):
    """Fill ``dst`` from ``src`` when the checkpoint lacks ``dst`` (tied embeddings:
    ``Tie(dst="output.weight", src="tok_embeddings.weight")``). ``src`` stays too."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["tie"] = "tie"
    dst: str
    src: str

    @model_validator(mode="after")
    def _check(self) -> Tie:
        check_output_pattern(self.src, self.dst)
        return self

    def input_patterns(self) -> list[str]:
        return [self.src]

    def apply(self, ctx: PlanContext, index: int) -> None:
        out = compile_pattern(self.dst)
        for key, caps in captured(ctx, self.src):
            ctx.mark(index)
            dst = out.format(caps)
            if ctx.has(dst) or (ctx.target is not None and dst not in ctx.target):
                continue  # the checkpoint holds it already, or the model does not want it
            ctx.put(dst, ctx.get(key), index, origin=key)

    def inverse(self) -> list[RuleBase]:
        return []  # exporting keeps dst: a checkpoint holding it loads with or without the tie


class _Prefixing(RuleBase):
    """A rule that moves keys by a literal ``prefix``; it acts on the keys present when it runs,
    outside the one-rule-per-key check."""

    prefix: str

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or any(c in v for c in "{}*"):
            raise AdapterError(f"prefix {v!r} must be non-empty literal text (no braces or '*'), e.g. 'model.'")
        return v

    def input_patterns(self) -> list[str]:
        return []  # a catch-all on what is left; exempt from the ambiguity check


@built_by('"model."')
class StripPrefix(_Prefixing):
    """Remove ``prefix`` from the keys that start with it: ``StripPrefix(prefix="model.")``.

    It acts on the keys present when it runs (put it first to strip checkpoint keys) and takes
    no part in the one-rule-per-key check. With ``optional=True`` finding no such key is fine
    (checkpoints that may or may not carry ``model.diffusion_model.``).

    Wrapper segments (``_orig_mod.`` of torch.compile, ``_checkpoint_wrapped_module.`` of
    activation checkpointing, ``_fsdp_wrapped_module.`` of FSDP1) need no rule: planning removes
    them from every key, wherever they appear, before any rule runs; two keys that become one
    are reported with both names."""

    kind: Literal["strip_prefix"] = "strip_prefix"
    optional: bool = False

    def apply(self, ctx: PlanContext, index: int) -> None:
        moved = [(k, k[len(self.prefix) :]) for k in ctx.keys() if k.startswith(self.prefix) and len(k) > len(self.prefix)]
        move(ctx, index, moved)
        if self.optional:
            ctx.mark(index)

    def inverse(self) -> list[RuleBase]:
        return [AddPrefix(prefix=self.prefix)]

    def key_after(self, key: str) -> str | None:
        return key[len(self.prefix) :] if key.startswith(self.prefix) and len(key) > len(self.prefix) else key


@built_by('"model."')
class AddPrefix(_Prefixing):
    """Put ``prefix`` in front of the keys matching ``keys`` (default: every key present when
    it runs). The inverse of :class:`StripPrefix`."""

    kind: Literal["add_prefix"] = "add_prefix"
    keys: str = "**"

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        moved = [(k, self.prefix + k) for k in ctx.keys() if pat.match(k) is not None]
        move(ctx, index, moved)

    def inverse(self) -> list[RuleBase]:
        return [StripPrefix(prefix=self.prefix)]

    def key_after(self, key: str) -> str | None:
        return self.prefix + key if compile_pattern(self.keys).match(key) is not None else key


# imported on first use (sdadapt._base.rule_kinds.ON_USE): its kinds are registered here
for _cls in (Fuse, Split, Drop, Tie, StripPrefix, AddPrefix):
    register_rule(_cls)
