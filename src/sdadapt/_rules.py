"""Typed rules: the steps an :class:`~sdadapt.Adapter` applies to a checkpoint's keys.

A rule is plain data (a pydantic model, serialisable to JSON). Applied to a plan's working
set of ``key -> Node`` it matches whole keys with :mod:`sdadapt._patterns` and replaces the
matched entries with new nodes, so that shapes, dtypes and region mappings follow from the
nodes (see :mod:`sdadapt._nodes`). Each rule also states its inverse, so one adapter serves
both loading and exporting.

Two kinds of rules:

- *key-moving* rules (rename, fuse, split, drop, ...) take keys away. A key may be taken by
  one such rule only: if a later key-moving rule would also match it, the plan reports the
  two rules as ambiguous instead of silently letting the first win;
- *value* rules (cast, ...) keep the key and change its value; they apply in order.

Layout rules (issue 3), with their constructors in :mod:`sdadapt`:

- ``transpose(keys, dim0=0, dim1=1)`` -> :class:`Transpose` (value; its own inverse);
- ``rotary(keys, heads, to="interleaved", dim=0)`` -> :class:`Rotary` (value): the row order
  inside each head, HF "half" <-> Meta "interleaved"; inverse: the other ``to``. A region
  cutting a head is read as whole heads, permuted, then narrowed;
- ``stack(src, dst, over="e", dim=0, count=None)`` -> :class:`Stack` (key-moving) and
  ``unstack(...)`` -> :class:`Unstack`, each the other's inverse; ``count`` (optional) is the
  expected number of entries, checked at plan time;
- ``pad(keys, dim=0, size=None, multiple_of=None, value=0.0)`` -> :class:`Pad` (value) and
  ``trim(keys, dim=0, size=None)`` -> :class:`Trim`. Deviation from the brief: ``Trim.size``
  is optional (omitted: the target's size), and ``Pad.inverse()`` is ``Trim`` without a size,
  because one pad rule may match tensors of several original sizes; a plan whose target lacks
  the key reports "give size=" instead of guessing;
- ``interleave(keys, sizes, tp=None, dim=0)`` -> :class:`Interleave` (value); its inverse is a
  separate rule ``deinterleave(...)`` -> :class:`Deinterleave` (not ``inverse=True``).
  ``tp=None``: interleave reads the TP degree from the target's placements
  (:attr:`TensorInfo.mesh <sdadapt.sources._base.TensorInfo.mesh>`, see :func:`tp_degree`),
  deinterleave from the source's (exporting a parallelised model's state dict);
- ``strip_prefix(prefix, optional=False)`` -> :class:`StripPrefix` and
  ``add_prefix(prefix, keys="**")`` -> :class:`AddPrefix` (key-moving, each the other's
  inverse). They act on the keys present when they run and take no part in the
  one-rule-per-key check. Wrapper segments ``_orig_mod.``, ``_checkpoint_wrapped_module.`` and
  ``_fsdp_wrapped_module.`` need no rule: :func:`~sdadapt._plan.build_plan` removes them from
  every source key before the rules run (a collision is reported with both keys).

Value rules that read the target (pad, trim, interleave) look a key up under the name it will
have after the later renames and prefix rules (:func:`final_key`), so they may sit before
those rules, as they do in an inverted adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import _nodes as N
from ._nodes import Cast as CastNode
from ._nodes import Concat, Narrow, Node
from ._patterns import check_output_pattern, compile_pattern, typed_like
from .errors import AdapterError

if TYPE_CHECKING:
    from ._plan import PlanContext
    from .sources._base import TensorInfo


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise AdapterError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16' or 'float32'")
    return dt


def _dtype_str(v: object) -> str:
    return str(parse_dtype(v)).removeprefix("torch.")  # type: ignore[arg-type]


class RuleBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    moves_keys: ClassVar[bool] = True

    def __init__(self, **data: object):
        try:
            super().__init__(**data)
        except ValidationError as e:  # a bad argument is an AdapterError naming the rule
            kind = type(self).model_fields["kind"].default
            raise AdapterError(f"invalid adapter rule {kind!r}: {e}") from None

    def input_patterns(self) -> list[str]:
        raise NotImplementedError

    def apply(self, ctx: PlanContext, index: int) -> None:
        raise NotImplementedError

    def inverse(self) -> list[Rule]:
        raise NotImplementedError

    def label(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.model_dump(exclude={"kind"}).items() if v is not None)
        return f"{self.kind}({fields})"  # type: ignore[attr-defined]


def _matching(ctx: PlanContext, keys: str) -> Iterator[tuple[str, Node]]:
    """``(key, node)`` for each key present when the rule starts that matches the pattern ``keys``."""
    pat = compile_pattern(keys)
    for key in ctx.keys():
        if pat.match(key) is not None:
            yield key, ctx.get(key)


def _move(ctx: PlanContext, index: int, moved: list[tuple[str, str]]) -> None:
    """Rule ``index`` renames each ``(old, new)``: all are taken first, then put, so that a new
    name may be an old name of another pair."""
    for old, _ in moved:
        ctx.take(old, index)
    for old, new in moved:
        ctx.put(new, ctx.taken[old], index, origin=old)


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
        pat, out = compile_pattern(self.src), compile_pattern(self.dst)
        moved: list[tuple[str, str]] = []
        for key in ctx.keys():
            caps = pat.match(key)
            if caps is not None:
                moved.append((key, out.format(caps)))
        _move(ctx, index, moved)

    def inverse(self) -> list[Rule]:
        return [Rename(src=typed_like(self.dst, self.src), dst=self.src)]


class Fuse(RuleBase):
    """Concatenate ``srcs`` along ``dim`` into ``dst`` (e.g. q, k, v -> qkv). Parts may differ
    in size along ``dim`` (GQA). ``sizes`` is optional; it lets the inverse split run without
    a target schema."""

    kind: Literal["fuse"] = "fuse"
    srcs: list[str]
    dst: str
    dim: int = 0
    sizes: list[int] | None = None

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

    def input_patterns(self) -> list[str]:
        return list(self.srcs)

    def apply(self, ctx: PlanContext, index: int) -> None:
        first, out = compile_pattern(self.srcs[0]), compile_pattern(self.dst)
        others = [compile_pattern(s) for s in self.srcs[1:]]
        for key in ctx.keys():
            caps = first.match(key)
            if caps is None:
                continue
            names = [key] + [p.format(caps) for p in others]
            absent = [n for n in names if not ctx.has(n)]
            dst = out.format(caps)
            if absent:
                ctx.issue(index, dst, f"found {key!r} but not {', '.join(map(repr, absent))}")
                continue
            parts = [ctx.get(n) for n in names]
            problem = _concat_problem(parts, names, self.dim, self.sizes)
            if problem:
                ctx.issue(index, dst, problem)
                continue
            dim = self.dim % len(parts[0].shape)
            for n in names:
                ctx.take(n, index)
            ctx.put(dst, Concat(tuple(parts), dim), index, origin=names)

    def inverse(self) -> list[Rule]:
        return [Split(src=typed_like(self.dst, self.srcs), dsts=list(self.srcs), dim=self.dim, sizes=self.sizes)]


def _concat_problem(parts: list[Node], names: list[str], dim: int, sizes: list[int] | None) -> str | None:
    nd = len(parts[0].shape)
    if not -nd <= dim < nd:
        return f"dim {dim} is out of range for {names[0]!r} of shape {list(parts[0].shape)}"
    d = dim % nd
    for n, p in zip(names, parts):
        if len(p.shape) != nd or p.shape[:d] + p.shape[d + 1 :] != parts[0].shape[:d] + parts[0].shape[d + 1 :]:
            shapes = ", ".join(f"{m}{list(q.shape)}" for m, q in zip(names, parts))
            return f"shapes do not fit together along dim {dim}: {shapes}"
        if p.dtype != parts[0].dtype:
            return f"dtypes differ: {names[0]!r} is {parts[0].dtype}, {n!r} is {p.dtype}; cast first"
    if sizes is not None and [p.shape[d] for p in parts] != list(sizes):
        return f"declared sizes {sizes} but the parts have {[p.shape[d] for p in parts]} along dim {dim}"
    return None


class Split(RuleBase):
    """Cut ``src`` along ``dim`` into ``dsts`` (e.g. qkv -> q, k, v). ``sizes`` may be omitted:
    then they come from the target schema when it has every ``dst``, else equal parts."""

    kind: Literal["split"] = "split"
    src: str
    dsts: list[str]
    dim: int = 0
    sizes: list[int] | None = None

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
        pat = compile_pattern(self.src)
        outs = [compile_pattern(d) for d in self.dsts]
        for key in ctx.keys():
            caps = pat.match(key)
            if caps is None:
                continue
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
            ctx.take(key, index)
            start = 0
            for dst, size in zip(dsts, sizes):
                ctx.put(dst, Narrow(node, d, start, size), index, origin=key)
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

    def inverse(self) -> list[Rule]:
        return [Fuse(srcs=[typed_like(d, self.src) for d in self.dsts], dst=self.src, dim=self.dim, sizes=self.sizes)]


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
        return None if v is None else _dtype_str(v)

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        to = parse_dtype(self.dtype)
        only = parse_dtype(self.from_dtype) if self.from_dtype else None
        for key, node in _matching(ctx, self.keys):
            if only is not None and node.dtype != only:
                continue
            ctx.mark(index)
            if node.dtype != to:
                ctx.replace(key, CastNode(node, to))

    def inverse(self) -> list[Rule]:
        if self.from_dtype is None:
            raise AdapterError(
                f"{self.label()} cannot be inverted: it does not say which dtype it converts from; "
                "give from_dtype=..."
            )
        return [Cast(keys=self.keys, dtype=self.from_dtype, from_dtype=self.dtype)]


class Drop(RuleBase):
    """Source keys deliberately ignored (rotary caches, optimizer entries...)."""

    kind: Literal["drop"] = "drop"
    keys: str

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        for key in ctx.keys(include_non_tensor=True):
            if pat.match(key) is not None:
                ctx.drop(key, index)

    def inverse(self) -> list[Rule]:
        return []  # dropped data cannot come back; the export simply lacks it


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
        pat, out = compile_pattern(self.src), compile_pattern(self.dst)
        for key in ctx.keys():
            caps = pat.match(key)
            if caps is None:
                continue
            ctx.mark(index)
            dst = out.format(caps)
            if ctx.has(dst) or (ctx.target is not None and dst not in ctx.target):
                continue  # the checkpoint holds it already, or the model does not want it
            ctx.put(dst, ctx.get(key), index, origin=key)

    def inverse(self) -> list[Rule]:
        return []  # exporting keeps dst: a checkpoint holding it loads with or without the tie



# --- layout rules: transpose, rotary, stack/unstack, pad/trim, interleave, prefixes ---------------


def _dim_of(ctx: PlanContext, index: int, key: str, node: Node, dim: int, what: str = "dim") -> int | None:
    nd = len(node.shape)
    if not -nd <= dim < nd:
        ctx.issue(index, key, f"{what} {dim} is out of range for {key!r} of shape {list(node.shape)}")
        return None
    return dim % nd


def _matching_dim(ctx: PlanContext, index: int, keys: str, dim: int) -> Iterator[tuple[str, Node, int]]:
    """:func:`_matching` with ``dim`` made non-negative for each key; a key for which ``dim`` is
    out of range is reported as an issue of rule ``index`` and skipped."""
    for key, node in _matching(ctx, keys):
        d = _dim_of(ctx, index, key, node, dim)
        if d is not None:
            yield key, node, d


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
        for key, node in _matching(ctx, self.keys):
            d0 = _dim_of(ctx, index, key, node, self.dim0, "dim0")
            d1 = _dim_of(ctx, index, key, node, self.dim1, "dim1")
            if d0 is None or d1 is None:
                continue
            ctx.mark(index)
            if d0 != d1:
                ctx.replace(key, N.Transpose(node, d0, d1))

    def inverse(self) -> list[Rule]:
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
        for key, node, d in _matching_dim(ctx, index, self.keys, self.dim):
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

    def inverse(self) -> list[Rule]:
        other = "half" if self.to == "interleaved" else "interleaved"
        return [Rotary(keys=self.keys, heads=self.heads, to=other, dim=self.dim)]


def _check_over(src: str, dst: str, over: str, what: str) -> None:
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


class Stack(RuleBase):
    """All keys matching ``src`` that differ only in the capture ``over`` become one tensor
    ``dst`` with a new dim ``dim`` of size E (MoE experts:
    ``Stack(src="layers.{i}.block_sparse_moe.experts.{e}.w1.weight", dst="layers.{i}.moe.experts.w1")``).
    The ``over`` values must be the integers 0..E-1 (``count`` E, if given) with equal shapes
    and dtypes."""

    kind: Literal["stack"] = "stack"
    src: str
    dst: str
    over: str = "e"
    dim: int = 0
    count: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Stack:
        _check_over(self.src, self.dst, self.over, f"stack into {self.dst!r}")
        return self

    def input_patterns(self) -> list[str]:
        return [self.src]

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat, out = compile_pattern(self.src), compile_pattern(self.dst)
        groups: dict[str, list[tuple[str, str]]] = {}
        for key in ctx.keys():
            caps = pat.match(key)
            if caps is not None:
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
            odd = [(k, p) for (_, k), p in zip(members, parts) if p.shape != parts[0].shape or p.dtype != parts[0].dtype]
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
            ctx.put(dst, N.Stack(tuple(parts), self.dim % (nd + 1)), index, origin=[k for _, k in members])

    def inverse(self) -> list[Rule]:
        return [Unstack(src=typed_like(self.dst, self.src), dst=self.src, over=self.over, dim=self.dim, count=self.count)]


class Unstack(RuleBase):
    """One tensor ``src`` becomes E keys ``dst`` (which captures ``over``), one per entry along
    ``dim``: ``Unstack(src="layers.{i}.moe.experts.w1", dst="layers.{i}.experts.{e}.w1.weight")``."""

    kind: Literal["unstack"] = "unstack"
    src: str
    dst: str
    over: str = "e"
    dim: int = 0
    count: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Unstack:
        _check_over(self.dst, self.src, self.over, f"unstack of {self.src!r}")
        return self

    def input_patterns(self) -> list[str]:
        return [self.src]

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat, out = compile_pattern(self.src), compile_pattern(self.dst)
        for key in ctx.keys():
            caps = pat.match(key)
            if caps is None:
                continue
            node = ctx.get(key)
            d = _dim_of(ctx, index, key, node, self.dim)
            if d is None:
                continue
            n = node.shape[d]
            if self.count is not None and n != self.count:
                ctx.issue(index, key, f"has {n} entries along dim {d} but count={self.count}")
                continue
            ctx.take(key, index)
            for e in range(n):
                ctx.put(out.format({**caps, self.over: str(e)}), N.Select(node, d, e), index, origin=key)

    def inverse(self) -> list[Rule]:
        return [Stack(src=typed_like(self.dst, self.src), dst=self.src, over=self.over, dim=self.dim, count=self.count)]


def final_key(ctx: PlanContext, key: str, index: int) -> str | None:
    """The name ``key`` will have once the key-moving rules after rule ``index`` have run:
    renames and prefix rules are followed; ``None`` if another key-moving rule (fuse, split,
    stack...) takes it. Value rules that read the target (pad, trim, interleave) look the key
    up under this name, so they work before renames too (as in an inverted adapter)."""
    k = key
    for rule in ctx.adapter.rules[index + 1 :]:
        if not rule.moves_keys:
            continue
        if isinstance(rule, Rename):
            caps = compile_pattern(rule.src).match(k)
            if caps is not None:
                k = compile_pattern(rule.dst).format(caps)
        elif isinstance(rule, StripPrefix):
            if k.startswith(rule.prefix) and len(k) > len(rule.prefix):
                k = k[len(rule.prefix) :]
        elif isinstance(rule, AddPrefix):
            if compile_pattern(rule.keys).match(k) is not None:
                k = rule.prefix + k
        elif isinstance(rule, Drop) and compile_pattern(rule.keys).match(k) is not None:
            return None
        elif any(compile_pattern(p).match(k) is not None for p in rule.input_patterns()):
            return None
    return k


def target_info(ctx: PlanContext, key: str, index: int) -> TensorInfo | None:
    """The target's TensorInfo for what ``key`` becomes (see :func:`final_key`), if any."""
    if ctx.target is None:
        return None
    final = final_key(ctx, key, index)
    return None if final is None else ctx.target.get(final)


def _target_size(ctx: PlanContext, key: str, index: int, d: int, nd: int) -> int | None:
    info = target_info(ctx, key, index)
    if info is None or len(info.shape) != nd:
        return None
    return info.shape[d]


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
        for key, node, d in _matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            if self.size is not None:
                want: int | None = self.size
            elif self.multiple_of is not None:
                want = -(-n // self.multiple_of) * self.multiple_of
            else:
                want = _target_size(ctx, key, index, d, len(node.shape))
                if want is None:
                    ctx.issue(index, key, "the model has no such key to take the size from; give size= or multiple_of=")
                    continue
            if want < n:
                ctx.issue(index, key, f"cannot pad dim {d} from {n} down to {want}; use trim")
                continue
            ctx.mark(index)
            if want > n:
                ctx.replace(key, N.Pad(node, d, want, self.value))

    def inverse(self) -> list[Rule]:
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
        for key, node, d in _matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            want = self.size if self.size is not None else _target_size(ctx, key, index, d, len(node.shape))
            if want is None:
                ctx.issue(index, key, "the model has no such key to take the size from; give size= to trim")
                continue
            if want > n:
                ctx.issue(index, key, f"cannot trim dim {d} from {n} up to {want}; use pad")
                continue
            ctx.mark(index)
            if want < n:
                ctx.replace(key, Narrow(node, d, 0, want))

    def inverse(self) -> list[Rule]:
        return [Pad(keys=self.keys, dim=self.dim)]


TP_MESH_NAMES = frozenset({"tp", "tensor", "tensor_parallel", "model_parallel", "mp"})
DP_MESH_NAMES = frozenset(
    {"dp", "ddp", "fsdp", "hsdp", "replicate", "shard", "data", "data_parallel", "dp_shard", "dp_replicate",
     "dp_shard_cp", "dp_cp", "cp", "ep", "pp"}
)  # fmt: skip


def tp_degree(info: TensorInfo, dim: int) -> int | str:
    """How many tensor-parallel ranks split ``dim`` of a target tensor: the product of the sizes
    of the mesh dims that shard ``dim`` and are named like TP (:data:`TP_MESH_NAMES`). Mesh dims
    named like data parallel (:data:`DP_MESH_NAMES`, ``dp*``, ``*fsdp*``) or ``_StridedShard``
    (FSDP2 over TP) do not count. Returns a message when a sharding mesh dim is unnamed or
    unknown: the caller should ask for ``tp=``."""
    if info.mesh is None:
        if info.placements is None:
            return 1  # a plain tensor: no TP
        return f"the model's placements {info.placements} are not described in detail; pass tp="
    nd = len(info.shape)
    tp = 1
    for i, md in enumerate(info.mesh):
        if md.shard_dim is None or md.shard_dim % nd != dim or md.size == 1:
            continue
        name = (md.name or "").lower()
        if name in TP_MESH_NAMES:
            tp *= md.size
        elif md.strided or name in DP_MESH_NAMES or name.startswith("dp") or "fsdp" in name:
            continue
        else:
            label = f"mesh dim {i} ({md.name!r}, size {md.size}, {md.placement})" if md.name else (
                f"unnamed mesh dim {i} (size {md.size}, {md.placement})"
            )
            return (
                f"cannot tell whether {label} is tensor or data parallel; name the mesh dims "
                f"(mesh_dim_names=('dp', 'tp')) or pass tp="
            )
    return tp


class Interleave(RuleBase):
    """Lay a fused tensor ``[part0; part1; ...]`` (``sizes`` along ``dim``, e.g. q, k, v rows)
    out per TP rank: ``[p0_r0; p1_r0; ...; p0_r1; ...]``, so that a ``ColwiseParallel`` shard on
    TP rank ``r`` holds ``[q_r; k_r; v_r]`` as the layer's code expects.

    ``tp`` omitted: the TP degree of the target's placements for that key (see
    :func:`tp_degree`; a plain target tensor means 1, nothing moves). Every size must divide by
    the degree. The inverse is :class:`Deinterleave`."""

    moves_keys: ClassVar[bool] = False
    kind: Literal["interleave"] = "interleave"
    keys: str
    sizes: list[int]
    tp: int | None = Field(default=None, gt=0)
    dim: int = 0

    backward: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check(self) -> Interleave:
        if not self.sizes or any(s < 0 for s in self.sizes):
            raise AdapterError(f"{self.kind} of {self.keys!r}: sizes must be a non-empty list of sizes >= 0, got {self.sizes}")
        if self.tp is not None and any(s % self.tp for s in self.sizes):
            raise AdapterError(f"{self.kind} of {self.keys!r}: sizes {self.sizes} do not all divide by tp={self.tp}")
        return self

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def _degree(self, ctx: PlanContext, key: str, node: Node, d: int, index: int) -> int | str:
        if self.tp is not None:
            return self.tp
        if ctx.target is None:
            return "there is no model to read the TP degree from; pass tp="
        info = target_info(ctx, key, index)
        if info is None:
            return "the model has no such key to read the TP degree from; pass tp="
        return tp_degree(info, d)

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in _matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            if sum(self.sizes) != n:
                ctx.issue(index, key, f"sizes {self.sizes} add up to {sum(self.sizes)}, but dim {d} has {n}")
                continue
            tp = self._degree(ctx, key, node, d, index)
            if isinstance(tp, str):
                ctx.issue(index, key, tp)
                continue
            if any(s % tp for s in self.sizes):
                ctx.issue(index, key, f"sizes {self.sizes} do not all divide by the TP degree {tp}")
                continue
            ctx.mark(index)
            if tp > 1 and len(self.sizes) > 1:
                ctx.replace(key, N.Interleave(node, d, tuple(self.sizes), tp, self.backward))

    def inverse(self) -> list[Rule]:
        return [Deinterleave(keys=self.keys, sizes=list(self.sizes), tp=self.tp, dim=self.dim)]


class Deinterleave(Interleave):
    """The inverse of :class:`Interleave`: a per-TP-rank layout ``[p0_r0; p1_r0; ...; p0_r1; ...]``
    back to contiguous parts ``[part0; part1; ...]``. ``tp`` omitted: the TP degree of the
    *source's* placements (a parallelised model's state dict being exported), else a plan
    issue asking for ``tp=`` (the degree the checkpoint was saved with)."""

    kind: Literal["deinterleave"] = "deinterleave"  # type: ignore[assignment]
    backward: ClassVar[bool] = True

    def _degree(self, ctx: PlanContext, key: str, node: Node, d: int, index: int) -> int | str:
        if self.tp is not None:
            return self.tp
        if isinstance(node, N.Leaf) and node.key in ctx.source:
            return tp_degree(ctx.source[node.key], d)
        return "the checkpoint's TP degree is not known here; pass tp= (the TP degree it was saved with)"

    def inverse(self) -> list[Rule]:
        return [Interleave(keys=self.keys, sizes=list(self.sizes), tp=self.tp, dim=self.dim)]


def _check_prefix(prefix: str) -> str:
    if not prefix or any(c in prefix for c in "{}*"):
        raise AdapterError(f"prefix {prefix!r} must be non-empty literal text (no braces or '*'), e.g. 'model.'")
    return prefix


class StripPrefix(RuleBase):
    """Remove ``prefix`` from the keys that start with it: ``StripPrefix(prefix="model.")``.

    It acts on the keys present when it runs (put it first to strip checkpoint keys) and takes
    no part in the one-rule-per-key check. With ``optional=True`` finding no such key is fine
    (checkpoints that may or may not carry ``model.diffusion_model.``).

    Wrapper segments (``_orig_mod.`` of torch.compile, ``_checkpoint_wrapped_module.`` of
    activation checkpointing, ``_fsdp_wrapped_module.`` of FSDP1) need no rule: planning removes
    them from every key, wherever they appear, before any rule runs; two keys that become one
    are reported with both names."""

    kind: Literal["strip_prefix"] = "strip_prefix"
    prefix: str
    optional: bool = False

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _check_prefix(v)

    def input_patterns(self) -> list[str]:
        return []  # a catch-all on what is left; exempt from the ambiguity check

    def apply(self, ctx: PlanContext, index: int) -> None:
        moved = [(k, k[len(self.prefix) :]) for k in ctx.keys() if k.startswith(self.prefix) and len(k) > len(self.prefix)]
        _move(ctx, index, moved)
        if self.optional:
            ctx.mark(index)

    def inverse(self) -> list[Rule]:
        return [AddPrefix(prefix=self.prefix)]


class AddPrefix(RuleBase):
    """Put ``prefix`` in front of the keys matching ``keys`` (default: every key present when
    it runs). The inverse of :class:`StripPrefix`."""

    kind: Literal["add_prefix"] = "add_prefix"
    prefix: str
    keys: str = "**"

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _check_prefix(v)

    def input_patterns(self) -> list[str]:
        return []  # a catch-all on what is left; exempt from the ambiguity check

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        moved = [(k, self.prefix + k) for k in ctx.keys() if pat.match(k) is not None]
        _move(ctx, index, moved)

    def inverse(self) -> list[Rule]:
        return [StripPrefix(prefix=self.prefix)]


Rule = Annotated[
    Rename | Fuse | Split | Cast | Drop | Tie | Transpose | Rotary | Stack | Unstack | Pad | Trim | Interleave
    | Deinterleave | StripPrefix | AddPrefix,
    Field(discriminator="kind"),
]
