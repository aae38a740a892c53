"""Matches -> typed rules with evidence: renames, splits/fuses, stacks, transposes, drops, ties,
casts; plus the questions shapes cannot answer (:mod:`.questions`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .._base.schema import dtype_name
from ..rules import Cast, Deinterleave, Drop, Fuse, Rename, Split, Stack, Tie, Transpose, Unstack
from .config import FP8_SCALE_SUFFIX, NO_CONFIG, Facts
from .match import Item, Match, MatchResult, fmt
from .names import canon_tokens
from .questions import (
    Question,
    deinterleave_rule,
    dequant_question,
    head_norm_question,
    hint_questions,
    merge_questions,
    model_dim,
    offset_question,
    rotary_direction,
    rotary_question,
    tp_question,
)
from .segments import Tree


@dataclass
class Proposed:
    """One proposal: the rules it adds (in order) and why."""

    kind: str
    rules: list[Any]
    sources: list[str]
    targets: list[str]
    confidence: float
    evidence: list[str]
    section: str
    keys: int = 0
    questions: list[Question] = field(default_factory=list)
    match: Match | None = None


def _tdims(shape: tuple[int, ...]) -> tuple[int, int]:
    return len(shape) - 2, len(shape) - 1


def _transpose_rules(patterns: list[str], shape: tuple[int, ...]) -> list[Transpose]:
    d0, d1 = _tdims(shape)
    return [Transpose(keys=p, dim0=d0, dim1=d1) for p in patterns]


def match_rules(m: Match) -> tuple[str, list[Any]]:
    """The rules that realise one match (key-moving rule first, then its transposes)."""
    s0, t0 = m.srcs[0], m.tgts[0]
    if m.kind == "rename":
        sp, tp = s0.pattern(), t0.pattern()
        if s0.stacked is not None:
            rules: list[Any] = [Stack(src=sp, dst=tp, over=s0.stacked.capname, dim=0)]
            kind = "stack"
        elif t0.stacked is not None:
            rules = [Unstack(src=sp, dst=tp, over=t0.stacked.capname, dim=0)]
            kind = "unstack"
        else:
            rules = [] if sp == tp else [Rename(src=sp, dst=tp)]
            kind = "rename" if rules else ("transpose" if m.transpose else "same")
        if m.transpose:
            rules += _transpose_rules([tp], t0.shape)
        return kind, rules
    if m.kind == "split":
        dsts = [t.pattern() for t in m.tgts]
        # parts transposed afterwards: their sizes along the split dim are the model's sizes along
        # the swapped dim, so they are given here rather than read from the model
        sizes = [t.shape[model_dim(m.dim, len(s0.shape))] for t in m.tgts] if m.transpose else None
        rules = [Split(src=s0.pattern(), dsts=dsts, dim=m.dim, sizes=sizes)]
        if m.transpose:
            rules += _transpose_rules(dsts, t0.shape)
        return "split", rules
    dst = t0.pattern()
    srcs = [s.pattern() for s in m.srcs]
    rules = []
    for s in m.srcs:  # per-expert parts are stacked first, then fused
        if s.stacked is not None:
            stacked = s.pattern().replace(".{" + s.stacked.capname + "}", "")
            rules.append(Stack(src=s.pattern(), dst=stacked, over=s.stacked.capname, dim=0))
            srcs[m.srcs.index(s)] = stacked
    kind = "stack_fuse" if rules else "fuse"
    # parts of different sizes (GQA q/k/v) are given their sizes: the inverse split needs them
    sizes = None
    if all(s.stacked is None and len(s.shape) == len(m.srcs[0].shape) > 0 for s in m.srcs):
        got = [s.shape[m.dim % len(s.shape)] for s in m.srcs]
        sizes = got if len(set(got)) > 1 else None
    rules.append(Fuse(srcs=srcs, dst=dst, dim=m.dim, sizes=sizes))
    if m.transpose:
        rules += _transpose_rules([dst], t0.shape)
    return kind, rules


def _short(item: Item) -> str:
    mi = item.module_index()
    return item.rel[mi] if mi >= 0 else item.name()


# --- all proposals ------------------------------------------------------------------------------

@dataclass
class Proposals:
    items: list[Proposed]
    questions: list[Question]
    strip: str | None
    matched_target_keys: int
    target_keys: int
    unchanged: int  # target keys that already line up (same name, shape, no transpose)


def build_proposals(result: MatchResult, src: Tree, tgt: Tree, strip: str | None,
                    facts: Facts = NO_CONFIG) -> Proposals:
    props: list[Proposed] = []
    questions: list[Question] = []
    unchanged = 0
    # per-head q/k norms follow the rotary row order of their block's projections
    rotary_in: dict[str, tuple[str, str]] = {}
    for m in result.matches:
        direction = rotary_direction(m)
        if direction is not None:
            rotary_in.setdefault(m.scope, direction)
    section_of = {}
    for p in result.pairs:
        section_of[f"{p.src.label()} -> {p.tgt.label()}"] = p.evidence
    # key-moving rules, grouped by scope pair (the match order inside a scope is the accept order)
    transposed_by_scope: dict[str, list[Match]] = defaultdict(list)
    square_by_scope: dict[str, list[Match]] = defaultdict(list)
    plain_by_scope: dict[str, list[Match]] = defaultdict(list)
    for m in sorted(result.matches, key=lambda m: (m.scope, m.tgts[0].pattern())):
        kind, rules = match_rules(m)
        tkeys = sum(t.count for t in m.tgts)
        ev = list(m.evidence)
        first = deinterleave_rule(m, facts)
        if first is not None:
            rules = first[0] + rules
            ev.append(first[1])
        if kind == "same" and not rules:
            unchanged += tkeys
        else:
            props.append(Proposed(kind=kind, rules=rules, sources=[s.pattern() for s in m.srcs],
                                  targets=[t.pattern() for t in m.tgts], confidence=m.confidence, evidence=ev,
                                  section=m.scope, keys=tkeys, match=m))
        direction = rotary_in.get(m.scope)
        qs = [q for q in (rotary_question(m, facts), head_norm_question(m, direction, facts) if direction else None,
                          offset_question(m, facts), *hint_questions(m), tp_question(m)) if q is not None]
        questions += qs
        if qs and (kind != "same" or rules):
            props[-1].questions += qs
        t = m.tgts[0]
        if len(t.shape) >= 2 and not t.buffer and not t.is_bias and "#emb" not in canon_tokens(t.rel):
            if m.transpose:
                transposed_by_scope[m.scope].append(m)
            elif m.kind in ("rename", "split") and all(x.shape[-1] == x.shape[-2] for x in m.tgts):
                square_by_scope[m.scope].append(m)
            else:
                plain_by_scope[m.scope].append(m)
    props = _merge_params(props, src)
    # Conv1D-style storage: every non-square matrix of a block transposed -> the square ones too
    for scope, tr in transposed_by_scope.items():
        if plain_by_scope.get(scope) or not square_by_scope.get(scope):
            continue
        for m in square_by_scope[scope]:
            t = m.tgts[0]
            what = "square" if m.kind == "rename" else "cut into square parts"
            ev = [f"{what} {fmt(t.shape)}, so shapes cannot show the orientation",
                  f"the other {len(tr)} matrices of this block all needed a transpose (Conv1D-style [in, out] storage?)"]
            targets = [x.pattern() for x in m.tgts]
            props.append(Proposed(kind="transpose", rules=_transpose_rules(targets, t.shape),
                                  sources=[s.pattern() for s in m.srcs], targets=targets, confidence=0.5,
                                  evidence=ev, section=scope, keys=sum(x.count for x in m.tgts)))
    used_src = {id(i.family) for m in result.matches for i in m.srcs}
    used_tgt = {id(i.family) for m in result.matches for i in m.tgts}
    # drops: buffer-like source keys the model does not take
    for f in src.families:
        if id(f) in used_src or not f.buffer:
            continue
        props.append(Proposed(kind="drop", rules=[Drop(keys=f.star_pattern())], sources=[f.star_pattern()], targets=[],
                              confidence=0.9, evidence=[f.buffer, "the model has no counterpart"], section="drops",
                              keys=f.count))
    # ties: an output matrix the checkpoint lacks, next to an embedding of the same shape
    tgt_items = {id(i): i for i in result.tgt_items}
    matched_items = [i for m in result.matches for i in m.tgts]
    embeddings = [i for i in matched_items if "#emb" in canon_tokens(i.rel) and i.stacked is None]
    for t in tgt_items.values():
        if id(t.family) in used_tgt or t.is_bias or t.buffer or len(t.shape) != 2 or t.stacked is not None:
            continue
        for e in embeddings:
            if e.shape != t.shape or e.family.scope is None or t.family.scope is None:
                continue
            if e.family.scope.names() != t.family.scope.names():
                continue
            head = "#head" in canon_tokens(t.rel)
            ev = [f"the model has {t.pattern()} {fmt(t.shape)}, the checkpoint has no counterpart",
                  f"the embedding {e.pattern()} has the same shape" + (" and the name says output head" if head else "")]
            props.append(Proposed(kind="tie", rules=[Tie(dst=t.pattern(), src=e.pattern())], sources=[e.pattern()],
                                  targets=[t.pattern()], confidence=0.9 if head else 0.55, evidence=ev,
                                  section="ties", keys=t.count))
            used_tgt.add(id(t.family))
            break
    # casts: dtype changes are never silent
    by_pair: dict[tuple[str, str], list[Match]] = defaultdict(list)
    for m in result.matches:
        for t in m.tgts:
            s = m.srcs[0]
            if s.dtype != t.dtype:
                by_pair[(dtype_name(s.dtype), dtype_name(t.dtype))].append(m)
    wants: dict[str, set[str]] = defaultdict(set)
    for m in result.matches:
        for t in m.tgts:
            wants[dtype_name(m.srcs[0].dtype)].add(dtype_name(t.dtype))
    for (a, b), ms in sorted(by_pair.items()):
        n = sum(t.count for m in ms for t in m.tgts)
        if a.startswith("float8") and facts.quantization == "fp8":
            q = dequant_question(facts, sorted({s.pattern() for m in ms for s in m.srcs}), b)
            questions.append(q)
            props.append(Proposed(kind="dequant", rules=[], sources=q.about, targets=[], confidence=0.9,
                                  evidence=[f"{n} model tensors are {b}, the checkpoint stores them as {a} with "
                                            f"'{FP8_SCALE_SUFFIX}' block scales beside them"],
                                  section="dequant", keys=n, questions=[q]))
            continue
        ev = [f"{n} model tensors are {b}, the checkpoint stores them as {a}"]
        if wants[a] == {b}:
            casts = [Cast(keys="**", dtype=b, from_dtype=a)]
            targets = ["**"]
        else:
            targets = sorted({t.pattern() for m in ms for t in m.tgts if t.dtype != m.srcs[0].dtype})
            casts = [Cast(keys=k, dtype=b, from_dtype=a) for k in targets]
        props.append(Proposed(kind="cast", rules=list(casts), sources=[], targets=targets, confidence=0.8, evidence=ev,
                              section="casts", keys=n))
    matched = sum(t.count for m in result.matches for t in m.tgts) + sum(
        p.keys for p in props if p.kind == "tie"
    )
    total = sum(f.count for f in tgt.families if not f.buffer)
    return Proposals(items=props, questions=merge_questions(questions), strip=strip, matched_target_keys=matched,
                     target_keys=total, unchanged=unchanged)


_MERGEABLE = ("rename", "split", "fuse", "stack", "unstack")


def _merge_params(props: list[Proposed], src: Tree) -> list[Proposed]:
    """``lin.weight -> linear.weight`` and ``lin.bias -> linear.bias`` become one rule on
    ``lin.{p} -> linear.{p}`` when they agree in everything but the parameter name and the
    module holds no other keys (so ``{p}`` takes exactly them)."""
    families_of: dict[tuple[str, ...], set[int]] = defaultdict(set)
    for f in src.families:
        families_of[f.segs[:-1]].add(id(f))
    groups: dict[tuple, list[Proposed]] = defaultdict(list)
    order: list[tuple | Proposed] = []
    for p in props:
        m = p.match
        key: tuple | None = None
        if m is not None and p.kind in _MERGEABLE and not m.transpose and not any(
            isinstance(r, Deinterleave) for r in p.rules
        ):
            items = m.srcs + m.tgts
            last = {i.family.segs[-1] for i in items}
            if len(last) == 1 and all(len(i.family.segs) >= 2 for i in items):
                key = (p.kind, p.section, m.dim, tuple(x.rsplit(".", 1)[0] for x in p.sources),
                       tuple(x.rsplit(".", 1)[0] for x in p.targets))
        if key is None:
            order.append(p)
            continue
        if key not in groups:
            order.append(key)
        groups[key].append(p)
    out: list[Proposed] = []
    for entry in order:
        if isinstance(entry, Proposed):
            out.append(entry)
            continue
        ps = sorted(groups[entry], key=lambda p: p.match is not None and p.match.srcs[0].is_bias)
        fams = {id(s.family) for p in ps for s in p.match.srcs}  # type: ignore[union-attr]
        modules = {s.family.segs[:-1] for p in ps for s in p.match.srcs}  # type: ignore[union-attr]
        if len(ps) < 2 or any(families_of[mod] - fams for mod in modules):
            out += ps
            continue
        kind, _section, dim, srcs, dsts = entry
        srcs = [x + ".{p}" for x in srcs]
        dsts = [x + ".{p}" for x in dsts]
        first = ps[0]
        assert first.match is not None
        if kind == "rename":
            rules: list[Any] = [Rename(src=srcs[0], dst=dsts[0])]
        elif kind == "stack":
            rules = [Stack(src=srcs[0], dst=dsts[0], over=first.match.srcs[0].stacked.capname, dim=0)]  # type: ignore[union-attr]
        elif kind == "unstack":
            rules = [Unstack(src=srcs[0], dst=dsts[0], over=first.match.tgts[0].stacked.capname, dim=0)]  # type: ignore[union-attr]
        elif kind == "split":
            rules = [Split(src=srcs[0], dsts=dsts, dim=dim)]
        else:
            rules = [Fuse(srcs=srcs, dst=dsts[0], dim=dim)]
        names = [p.match.srcs[0].family.segs[-1] for p in ps]  # type: ignore[union-attr]
        evidence = list(first.evidence) + [f"the same for {', '.join(names[1:])} of this module"]
        merged = Proposed(kind=kind, rules=rules, sources=srcs, targets=dsts,
                          confidence=min(p.confidence for p in ps), evidence=evidence, section=first.section,
                          keys=sum(p.keys for p in ps), match=first.match)
        merged.questions = merge_questions([q for p in ps for q in p.questions])
        out.append(merged)
    return out

