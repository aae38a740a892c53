"""Structural matching of two schemas: scopes first (layers with layers), then tensors inside.

Inside a pair of scopes every tensor of one side is an :class:`Item`; an index container of one
side with no counterpart on the other becomes *virtual* items (its tensors stacked along a new
leading dim: ``experts.{e}.w1.weight`` [F, D] x E -> [E, F, D]), so stacking is matched like
any rename. Candidates are:

- rename: same shape (or the last two dims swapped: a transpose), scored by name similarity;
- split / fuse: a fused name (``qkv``, ``w13``, ``gate_up_proj``) on one side, a group of
  siblings holding those roles on the other, and shapes that add up along one dim.

A greedy loop accepts the best candidate, then re-scores the rest: once ``time_in.in_layer``
matched ``timestep_embedder.linear_1``, ``time_in.*`` and ``timestep_embedder.*`` are
known to correspond (the *ancestor* evidence), which settles their same-shaped siblings.
Tensors left over at the end may still be one split/fused tensor whose parts add up exactly
(no name evidence: marked uncertain).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .names import FUSED_ROLES, PARAM_BIAS, ROLE_ORDER, Similarity, role_of
from .segments import Family, Scope, Tree

log = logging.getLogger(__name__)

PARAM_NAMES = frozenset({"weight", "bias", "scale", "gamma", "beta"})
MIN_SCORE = 0.3
EQUAL_FIT = 0.05  # name evidence closer than this does not tell two mappings apart
AMBIGUOUS_CONFIDENCE = 0.5
MAX_PAIRS_PER_BUCKET = 40_000  # same-shape buckets larger than this are matched by exact name only


@dataclass(eq=False)
class Item:
    side: str  # "src" or "tgt"
    rel: tuple[str, ...]  # name inside the scope
    shape: tuple[int, ...]
    dtype: torch.dtype
    family: Family
    stacked: Scope | None = None  # virtual: the family stacked over this container's index

    @property
    def is_bias(self) -> bool:
        return bool(self.rel) and self.rel[-1] in PARAM_BIAS

    @property
    def buffer(self) -> bool:
        return self.family.buffer is not None

    @property
    def count(self) -> int:
        return self.family.count

    def pattern(self) -> str:
        assert self.family.scope is not None
        return self.family.pattern(self.family.scope.names())

    def module_index(self) -> int:
        return len(self.rel) - 2 if len(self.rel) >= 2 and self.rel[-1] in PARAM_NAMES else len(self.rel) - 1

    def name(self) -> str:
        return ".".join(self.rel)


@dataclass(eq=False)
class Match:
    """An accepted correspondence: ``srcs`` make ``tgts``."""

    kind: str  # rename | split | fuse
    srcs: list[Item]
    tgts: list[Item]
    transpose: bool = False
    dim: int = 0  # split/fuse dim, in the source's orientation (before any transpose)
    score: float = 0.0
    confidence: float = 0.0
    evidence: list[str] = field(default_factory=list)
    scope: str = ""


def transposed(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if len(shape) < 2:
        return None
    return shape[:-2] + (shape[-1], shape[-2])


def concat_dim(whole: tuple[int, ...], parts: list[tuple[int, ...]]) -> int | None:
    """The dim along which ``parts`` concatenate to ``whole``, if any (lowest first)."""
    nd = len(whole)
    if any(len(p) != nd for p in parts):
        return None
    for d in range(nd):
        if all(p[:d] + p[d + 1:] == whole[:d] + whole[d + 1:] for p in parts) and sum(p[d] for p in parts) == whole[d]:
            return d
    return None


def transposed_concat(kind: str, whole: tuple[int, ...], parts: list[tuple[int, ...]]) -> int | None:
    """The concat dim, in the source's orientation, when the last two dims of the targets are
    swapped: a split whose parts are each transposed (``Conv1D`` c_attn -> Linear q/k/v), or a
    fuse whose result is transposed."""
    if kind == "split":
        tparts = [t for t in (transposed(p) for p in parts) if t is not None]
        return None if len(tparts) != len(parts) else concat_dim(whole, tparts)
    tw = transposed(whole)
    return None if tw is None else concat_dim(tw, parts)


def fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@dataclass(eq=False)
class _Cand:
    kind: str
    srcs: list[Item]
    tgts: list[Item]
    base: float
    sims: list[float]
    transpose: bool = False
    dim: int = 0
    why: str = ""
    alive: bool = True

    def items(self) -> list[Item]:
        return self.srcs + self.tgts


STRICT_ROLES = frozenset({"#q", "#k", "#v", "#gate", "#up", "#qkv", "#kv", "#gate_up"})


def item_role(i: Item) -> str | None:
    mi = i.module_index()
    return role_of(i.rel[mi])[0] if mi >= 0 else None


def _module_roles(items: list[Item], stacked: bool = False) -> Iterator[tuple[Item, int, str | None, str]]:
    """``(item, module index, role, template)`` for the items that have a module segment, not
    buffers, and stacked (virtual) ones only with ``stacked``: the candidates for fuse/split."""
    for i in items:
        if (i.stacked is not None and not stacked) or i.buffer:
            continue
        mi = i.module_index()
        if mi >= 0:
            yield (i, mi, *role_of(i.rel[mi]))


def role_clash(s: Item, t: Item) -> float:
    """Penalty for renaming across roles: ``proj`` (an output projection) must not become
    ``add_q_proj`` just because both sit in the same attention block."""
    a, b = item_role(s), item_role(t)
    if a == b:
        return 0.0
    if (a is not None and b is not None) or a in STRICT_ROLES or b in STRICT_ROLES:
        return 0.6
    return 0.0


def _param_tail(tail: tuple[str, ...]) -> tuple[str, ...]:
    """A module's ``weight`` and a bare parameter are the same thing to a fuse or split
    (per-expert ``gate_proj.weight`` stacked into ``experts.w13``)."""
    return () if tail in ((), ("weight",)) else tail


def _bucket(i: Item) -> tuple:
    """Tensors of one block that shapes and dtypes cannot tell apart."""
    return (i.shape, i.dtype, i.is_bias, i.buffer, i.stacked is None)


def ancestors(rel: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Enclosing modules, innermost first; a numeric segment stays with its container
    (``attn.to_out.0.weight`` -> ``attn.to_out.0``, ``attn``)."""
    return [rel[:k] for k in range(len(rel) - 1, 0, -1) if not rel[k].isdigit()]


class ScopeMatcher:
    """Matches the items of one pair of scopes."""

    def __init__(self, label: str, srcs: list[Item], tgts: list[Item]):
        self.label = label
        self.srcs = srcs
        self.tgts = tgts
        self.sim = Similarity([i.rel for i in srcs + tgts])
        self.used: set[int] = set()
        self.matches: list[Match] = []
        self.corr: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
        self.src_has: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
        self.tgt_has: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
        self.exact: set[int] = set()  # items matched by identical name and shape
        self.src_bucket: dict[tuple, list[Item]] = defaultdict(list)
        self.tgt_bucket: dict[tuple, list[Item]] = defaultdict(list)
        for i in srcs:
            self.src_bucket[_bucket(i)].append(i)
        for i in tgts:
            self.tgt_bucket[_bucket(i)].append(i)

    # --- evidence from accepted matches ---------------------------------------------------
    def _learn(self, s: Item, t: Item) -> None:
        # innermost first: pair enclosing modules level by level, as deep as the shallower key goes
        for a, b in zip(ancestors(s.rel), ancestors(t.rel), strict=False):
            self.corr.add((a, b))
            self.src_has[a].add(b)
            self.tgt_has[b].add(a)

    def _bonus(self, s: Item, t: Item) -> float:
        if not self.corr:
            return 0.0
        sa, ta = ancestors(s.rel), ancestors(t.rel)
        sset, tset = set(sa), set(ta)
        bonus = 0.0
        if sa and ta and (sa[0], ta[0]) in self.corr:
            bonus += 0.5
        elif any((a, b) in self.corr for a in sa for b in ta):
            bonus += 0.25
        # a module already known to correspond to another one speaks against this pair
        # (linear2.weight went to proj_out.weight: linear2.bias goes to proj_out.bias)
        if sa and self.src_has.get(sa[0]) and not (self.src_has[sa[0]] & tset):
            bonus -= 0.3
        if ta and self.tgt_has.get(ta[0]) and not (self.tgt_has[ta[0]] & sset):
            bonus -= 0.3
        return bonus

    # --- candidates -----------------------------------------------------------------------
    def _compatible(self, s: Item, t: Item) -> bool:
        return (
            s.is_bias == t.is_bias
            and s.buffer == t.buffer
            and not (s.stacked is not None and t.stacked is not None)
        )

    def candidates(self) -> list[_Cand]:
        cands: list[_Cand] = []
        by_shape: dict[tuple[int, ...], list[Item]] = defaultdict(list)
        for t in self.tgts:
            by_shape[t.shape].append(t)
        src_by_shape: dict[tuple[int, ...], list[Item]] = defaultdict(list)
        for s in self.srcs:
            src_by_shape[s.shape].append(s)
        # renames: same shape, or transposed
        for shape, ss in src_by_shape.items():
            for tshape, base, tr in ((shape, 0.3, False), (transposed(shape), 0.1, True)):
                if tshape is None or (tr and tshape == shape):
                    continue
                ts = by_shape.get(tshape, [])
                if not ts:
                    continue
                if len(ss) * len(ts) > MAX_PAIRS_PER_BUCKET:
                    log.info("draft: %d x %d tensors of shape %s; matching them by exact name only", len(ss), len(ts), shape)
                    names = {t.rel: t for t in ts}
                    for s in ss:
                        same = names.get(s.rel)
                        if same is not None and self._compatible(s, same):
                            cands.append(_Cand("rename", [s], [same], base + 0.5, [1.0], transpose=tr))
                    continue
                for s in ss:
                    for t in ts:
                        if self._compatible(s, t):
                            cands.append(_Cand("rename", [s], [t], base, [self.sim(s.rel, t.rel)], transpose=tr))
        cands += self._role_cands(self.srcs, self.tgts, "split")
        cands += self._role_cands(self.tgts, self.srcs, "fuse")
        return cands

    def _role_cands(self, wholes: list[Item], pieces: list[Item], kind: str) -> list[_Cand]:
        """Fused names on the ``wholes`` side against sibling groups on the ``pieces`` side."""
        groups: dict[tuple, dict[str, Item]] = defaultdict(dict)
        for p, mi, role, template in _module_roles(pieces, stacked=kind == "fuse"):
            if role in ROLE_ORDER:
                groups[(p.rel[:mi], template, _param_tail(p.rel[mi + 1:]))][role] = p
        out: list[_Cand] = []
        if not groups:
            return out
        for w, mi, role, _ in _module_roles(wholes):
            roles = FUSED_ROLES.get(role or "")
            if not roles:
                continue
            for (_, _, tail), members in groups.items():
                if tail != _param_tail(w.rel[mi + 1:]) or not all(r in members for r in roles):
                    continue
                parts = [members[r] for r in roles]
                if any(p.is_bias != w.is_bias for p in parts):
                    continue
                d = concat_dim(w.shape, [p.shape for p in parts])
                tr = False
                if d is None:
                    d = transposed_concat(kind, w.shape, [p.shape for p in parts])
                    tr = d is not None
                if d is None:
                    continue
                sims = [self.sim(w.rel, p.rel) for p in parts]
                why = f"'{w.rel[mi]}' holds {'/'.join(r[1:] for r in roles)}; " + ", ".join(
                    f"{p.name()} {fmt(p.shape)}" for p in parts
                ) + f" add up to {fmt(w.shape)}" + (" (transposed)" if tr else "")
                if kind == "split":
                    out.append(_Cand("split", [w], parts, 0.35, sims, transpose=tr, dim=d, why=why))
                else:
                    out.append(_Cand("fuse", parts, [w], 0.35, sims, transpose=tr, dim=d, why=why))
        return out

    # --- selection ------------------------------------------------------------------------
    def _score(self, c: _Cand, live_count: dict[int, int]) -> tuple[float, bool]:
        if c.kind == "rename":
            s, t = c.srcs[0], c.tgts[0]
            score = c.base + c.sims[0] + self._bonus(s, t) + (0.02 if s.dtype == t.dtype else 0.0) - role_clash(s, t)
            unique = live_count[id(s)] == 1 and live_count[id(t)] == 1
            if unique:
                score += 0.6
            return score, unique
        pairs = [(c.srcs[0], t) for t in c.tgts] if c.kind == "split" else [(s, c.tgts[0]) for s in c.srcs]
        bonus = sum(self._bonus(a, b) for a, b in pairs) / len(pairs)
        return c.base + sum(c.sims) / len(c.sims) + bonus, False

    def run(self) -> list[Match]:
        # identical names and shapes need no judgement
        tgt_by_rel = {(t.rel, t.shape, t.stacked is None): t for t in self.tgts}
        for s in self.srcs:
            t = tgt_by_rel.get((s.rel, s.shape, s.stacked is None))
            if t is not None and id(t) not in self.used and self._compatible(s, t):
                self.exact.update((id(s), id(t)))
                self._accept(_Cand("rename", [s], [t], 1.0, [1.0]), 2.0, 0.99, ["same name and shape"])
        cands = [c for c in self.candidates() if not any(id(i) in self.used for i in c.items())]
        while True:
            live = [c for c in cands if c.alive]
            if not live:
                break
            count: dict[int, int] = defaultdict(int)
            for c in live:
                if c.kind == "rename":
                    for i in c.items():
                        count[id(i)] += 1
            scored = [(self._score(c, count), c) for c in live]
            (best, unique), c = max(scored, key=lambda x: x[0][0])
            if best < MIN_SCORE:
                break
            rivals = [sc for (sc, _u), o in scored if o is not c and set(map(id, o.items())) & set(map(id, c.items()))]
            runner = max(rivals, default=None)
            conf, evidence = self._confidence(c, best, unique, runner)
            self._accept(c, best, conf, evidence)
            used = set(map(id, c.items()))
            for o in live:
                if set(map(id, o.items())) & used:
                    o.alive = False
        self._leftovers()
        self._swaps()
        self._coherence()
        return self.matches

    def _coherence(self) -> None:
        """Parameters of one module mapped to one module (weight and bias alike) back each other up."""
        groups: dict[tuple, list[Match]] = defaultdict(list)
        for m in self.matches:
            key = (m.kind, tuple(s.rel[:-1] for s in m.srcs), tuple(t.rel[:-1] for t in m.tgts))
            groups[key].append(m)
        for ms in groups.values():
            if len(ms) < 2:
                continue
            best = max(m.confidence for m in ms)
            for m in ms:
                if m.confidence < best:
                    m.confidence = best
                    names = ", ".join(s.rel[-1] for o in ms if o is not m for s in o.srcs[:1])
                    m.evidence.append(f"the module's other parameters ({names}) map the same way")

    def _confidence(self, c: _Cand, score: float, unique: bool, runner: float | None) -> tuple[float, list[str]]:
        ev: list[str] = []
        if c.kind == "rename":
            s, t = c.srcs[0], c.tgts[0]
            what = "shapes match transposed" if c.transpose else "same shape"
            ev.append(f"{what} {fmt(s.shape)}" + (f" -> {fmt(t.shape)}" if c.transpose else ""))
            if s.stacked is not None:
                ev.append(f"{s.stacked.count} tensors {fmt(s.family.shape)} stacked over {{{s.stacked.capname}}}")
            if t.stacked is not None:
                ev.append(f"one tensor per {{{t.stacked.capname}}} ({t.stacked.count}) unstacked from a leading dim")
            sim = c.sims[0]
        else:
            ev.append(c.why)
            sim = sum(c.sims) / len(c.sims)
        if sim >= 0.15:
            ev.append(f"names agree ({sim:.2f})")
        else:
            ev.append(f"names differ ({sim:.2f})")
        if unique:
            ns, nt = (len(self.src_bucket[_bucket(c.srcs[0])]), len(self.tgt_bucket[_bucket(c.tgts[0])]))
            if ns == 1 and nt == 1:
                ev.append("the only candidates of this shape on both sides")
            else:
                ev.append(f"the last pair of this shape left by earlier matches ({ns} checkpoint, {nt} model tensors "
                          "of this shape and dtype in this block)")
            conf = 0.95 if sim >= 0.15 else 0.75
        elif runner is None:
            conf = 0.9 if sim >= 0.15 else 0.6
        else:
            margin = score - runner
            ev.append(f"next best candidate scored {margin:.2f} lower")
            conf = 0.4 + 0.55 * min(1.0, margin / 0.3)
        if c.kind in ("split", "fuse") and runner is None:
            conf = max(conf, 0.85)
        return round(conf, 2), ev

    def _fit(self, s: Item, t: Item) -> float:
        """Name evidence for ``s -> t``: the names, and whether the modules enclosing their own
        modules are known to correspond (``vector_in`` ~ ``text_embedder`` from other matches)."""
        outer = any((a, b) in self.corr for a in ancestors(s.rel)[1:] for b in ancestors(t.rel)[1:])
        return self.sim(s.rel, t.rel) + (0.25 if outer else 0.0)

    def _swaps(self) -> None:
        """Two renames among same-shaped, same-dtype tensors of this block whose evidence fits as
        well swapped (``a -> x, b -> y`` vs ``a -> y, b -> x``, within :data:`EQUAL_FIT`): names,
        enclosing modules and the module's other parameters cannot tell them apart, so both are
        marked uncertain with the alternative."""
        plain = [m for m in self.matches if m.kind == "rename" and not m.transpose and m.srcs[0].stacked is None
                 and m.tgts[0].stacked is None and id(m.srcs[0]) not in self.exact]
        by_bucket: dict[tuple, list[Match]] = defaultdict(list)
        for m in plain:
            by_bucket[_bucket(m.srcs[0])].append(m)
        # a module's weight matched by shape elsewhere settles where its bias goes
        modules: dict[tuple, set[tuple]] = defaultdict(set)
        for m in self.matches:
            if len(m.srcs) == 1 and len(m.tgts) == 1:
                modules[(m.srcs[0].rel[:-1], m.tgts[0].rel[:-1])].add(_bucket(m.srcs[0]))

        def fit(s: Item, t: Item) -> float:
            sibling = modules.get((s.rel[:-1], t.rel[:-1]), set()) - {_bucket(s)}
            return self._fit(s, t) + (0.5 if sibling else 0.0)

        for ms in by_bucket.values():
            for a, b in itertools.combinations(ms, 2):
                (sa, ta), (sb, tb) = (a.srcs[0], a.tgts[0]), (b.srcs[0], b.tgts[0])
                kept = fit(sa, ta) + fit(sb, tb)
                swapped = fit(sa, tb) + fit(sb, ta)
                if swapped < kept - EQUAL_FIT:
                    continue
                for m, s, t in ((a, sa, tb), (b, sb, ta)):
                    m.confidence = min(m.confidence, AMBIGUOUS_CONFIDENCE)
                    m.evidence.append(f"{s.name()} -> {t.name()} fits as well (same shape, dtype and block; name "
                                      f"evidence {kept:.2f} as matched, {swapped:.2f} swapped)")

    def _accept(self, c: _Cand, score: float, conf: float, evidence: list[str]) -> None:
        for i in c.items():
            self.used.add(id(i))
        if c.kind == "rename":
            self._learn(c.srcs[0], c.tgts[0])
        elif c.kind == "split":
            for t in c.tgts:
                self._learn(c.srcs[0], t)
        else:
            for s in c.srcs:
                self._learn(s, c.tgts[0])
        self.matches.append(
            Match(kind=c.kind, srcs=c.srcs, tgts=c.tgts, transpose=c.transpose, dim=c.dim, score=round(score, 3),
                  confidence=conf, evidence=evidence, scope=self.label)
        )

    def _leftovers(self) -> None:
        """One unmatched tensor whose shape is exactly the concatenation of unmatched tensors of
        the other side (no name evidence): a split or fuse, marked uncertain."""
        for wholes, pieces, kind in ((self.srcs, self.tgts, "split"), (self.tgts, self.srcs, "fuse")):
            for w in wholes:
                if id(w) in self.used or w.buffer or w.stacked is not None:
                    continue
                rest = [p for p in pieces if id(p) not in self.used and not p.buffer and p.stacked is None
                        and p.is_bias == w.is_bias and len(p.shape) == len(w.shape)]
                found = self._subset(w, rest, kind)
                if found is None:
                    continue
                parts, d, tr = found
                parts.sort(key=lambda p: (self._role_rank(p), pieces.index(p)))
                why = (f"{fmt(w.shape)} is exactly {' + '.join(fmt(p.shape) for p in parts)} along dim {d}"
                       + (" (transposed)" if tr else "") + "; no name says so and the order of the parts is a guess")
                c = _Cand(kind, [w] if kind == "split" else parts, parts if kind == "split" else [w], 0.0, [0.0],
                          transpose=tr, dim=d, why=why)
                self._accept(c, 0.0, 0.5, [why])

    @staticmethod
    def _role_rank(p: Item) -> int:
        mi = p.module_index()
        role, _ = role_of(p.rel[mi]) if mi >= 0 else (None, "")
        return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)

    @staticmethod
    def _subset(w: Item, rest: list[Item], kind: str) -> tuple[list[Item], int, bool] | None:
        if len(rest) < 2 or len(rest) > 16:
            return None
        for tr in (False, True):
            found: list[tuple[list[Item], int]] = []
            for n in range(2, min(len(rest), 6) + 1):
                for combo in itertools.combinations(range(len(rest)), n):
                    shapes = [rest[i].shape for i in combo]
                    d = transposed_concat(kind, w.shape, shapes) if tr else concat_dim(w.shape, shapes)
                    if d is not None:
                        found.append(([rest[i] for i in combo], d))
                        if len(found) > 1:
                            return None
            if len(found) == 1:
                parts, d = found[0]
                return parts, d, tr
        return None


# --- scopes ---------------------------------------------------------------------------------


@dataclass
class ScopePair:
    src: Scope
    tgt: Scope
    evidence: str


@dataclass
class MatchResult:
    matches: list[Match]
    pairs: list[ScopePair]
    unpaired_src: list[Scope]
    unpaired_tgt: list[Scope]
    src_items: list[Item]
    tgt_items: list[Item]


def _pair_children(s: Scope, t: Scope) -> tuple[list[ScopePair], list[Scope], list[Scope]]:
    sim = Similarity([c.rel for c in list(s.children.values()) + list(t.children.values())])
    cands = []
    for a in s.children.values():
        for b in t.children.values():
            if a.count != b.count:
                continue
            na, nb = a.per_instance_numel, b.per_instance_numel
            if na == nb:
                size, why = 1.0, "same parameter count per block"
            elif max(na, nb) and abs(na - nb) / max(na, nb) <= 0.01:
                size, why = 0.7, "parameter counts per block within 1%"
            else:
                continue
            score = size + 0.5 * sim(a.rel, b.rel)
            cands.append((score, a, b, why))
    cands.sort(key=lambda x: -x[0])
    pairs: list[ScopePair] = []
    done: set[int] = set()
    for _score, a, b, why in cands:
        if id(a) in done or id(b) in done:
            continue
        done.update((id(a), id(b)))
        pairs.append(ScopePair(a, b, f"{a.count} instances each, {why} ({int(a.per_instance_numel)})"))
    return (
        pairs,
        [a for a in s.children.values() if id(a) not in done],
        [b for b in t.children.values() if id(b) not in done],
    )


def _rename_captures(scope: Scope, name: str) -> None:
    scope.capname = name


def _items(scope: Scope, side: str, unpaired: list[Scope]) -> list[Item]:
    items = [Item(side, f.rel(), f.shape, f.dtype, f) for f in scope.families]
    for c in unpaired:
        if c.children or c.values != set(range(c.count)):
            continue
        for f in c.families:
            if f.count != len(c.instances) or not f.regular:
                continue
            items.append(Item(side, c.rel + f.rel(), (c.count,) + f.shape, f.dtype, f, stacked=c))
    return items


def match_trees(src: Tree, tgt: Tree) -> MatchResult:
    result = MatchResult([], [], [], [], [], [])

    def visit(s: Scope, t: Scope) -> None:
        pairs, us, ut = _pair_children(s, t)
        for p in pairs:
            _rename_captures(p.tgt, p.src.capname)
        result.pairs += pairs
        result.unpaired_src += us
        result.unpaired_tgt += ut
        for p in pairs:
            visit(p.src, p.tgt)
        si, ti = _items(s, "src", us), _items(t, "tgt", ut)
        result.src_items += si
        result.tgt_items += ti
        label = f"{s.label()} -> {t.label()}"
        result.matches += ScopeMatcher(label, si, ti).run()

    visit(src.root, tgt.root)
    return result


__all__ = ["Item", "Match", "MatchResult", "ScopePair", "match_trees", "fmt", "transposed"]
