"""Matches -> typed rules with evidence: renames, splits/fuses, stacks, transposes, drops, ties,
casts; plus the questions shapes cannot answer (rotary row order, fused TP layout...)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .._rules import Cast, Drop, Fuse, Rename, Split, Stack, Tie, Transpose, Unstack
from ..sources._base import dtype_name
from .match import Item, Match, MatchResult, fmt, item_role
from .names import canon_tokens
from .segments import Family, Tree


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


@dataclass
class Question:
    """A value-level choice the draft cannot see in shapes."""

    about: list[str]
    question: str
    suggestion: list[str]  # commented-out code lines
    before: bool = False  # the suggestion goes before the proposal's rules (else after)


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
        rules = [Split(src=s0.pattern(), dsts=dsts, dim=m.dim)]
        if m.transpose:
            rules += _transpose_rules(dsts, t0.shape)
        return "split", rules
    dst = t0.pattern()
    rules = [Fuse(srcs=[s.pattern() for s in m.srcs], dst=dst, dim=m.dim)]
    if m.transpose:
        rules += _transpose_rules([dst], t0.shape)
    return "fuse", rules


def _short(item: Item) -> str:
    mi = item.module_index()
    return item.rel[mi] if mi >= 0 else item.name()


# --- value-level questions ----------------------------------------------------------------------

def _style(seg: str) -> str | None:
    low = seg.lower()
    if low in ("wq", "wk", "wqkv"):
        return "meta"
    if low in ("q_proj", "k_proj", "qkv_proj"):
        return "hf"
    return None


_STYLE_NAMES = {"hf": "HF-style (q_proj, k_proj)", "meta": "Meta-style (wq, wk)"}


def _rotary_question(m: Match) -> Question | None:
    seen = {(_style(s.rel[s.module_index()]), _style(t.rel[t.module_index()])) for s in m.srcs for t in m.tgts}
    styles = {(a, b) for a, b in seen if a and b and a != b}
    if not styles:
        return None
    qk = ("#q", "#k")
    if m.kind == "fuse":  # permute the parts before they are fused
        hit = [s for s in m.srcs if item_role(s) in qk]
    else:
        hit = [t for t in m.tgts if item_role(t) in qk]
    a, b = sorted(styles)[0]
    to = "interleaved" if b == "meta" else "half"
    lines = []
    for it in hit:
        heads = "N_KV_HEADS" if item_role(it) == "#k" else "N_HEADS"
        lines.append(f'sdadapt.rotary("{it.pattern()}", heads={heads}, to="{to}"),')
    return Question(
        about=[it.pattern() for it in hit] or [t.pattern() for t in m.tgts],
        question=(
            f"rotary row order: {_STYLE_NAMES[a]} q/k projections become {_STYLE_NAMES[b]} ones. HF transformers "
            "keeps each head's rows in 'half' order, Meta's code rotates interleaved pairs; shapes cannot show "
            "which one your model's code expects"
        ),
        suggestion=lines,
        before=m.kind == "fuse",
    )


_VALUE_HINTS = [
    (re.compile(r"adaLN_modulation"), re.compile(r"norm_out"),
     "chunk order: BFL's final adaLN_modulation yields (shift, scale), diffusers' norm_out expects "
     "(scale, shift); if so, split the tensor in halves and fuse them swapped"),
]


def _hint_questions(m: Match) -> list[Question]:
    out = []
    for s in m.srcs:
        for t in m.tgts:
            for rs, rt, text in _VALUE_HINTS:
                if rs.search(s.pattern()) and rt.search(t.pattern()):
                    out.append(Question(about=[t.pattern()], question=text, suggestion=[]))
    return out


def _tp_question(m: Match) -> Question | None:
    if m.kind != "fuse":
        return None
    t = m.tgts[0]
    if not canon_tokens(t.rel) & {"#qkv", "#gate_up", "#kv"}:
        return None
    return Question(
        about=[t.pattern()],
        question=(
            "tensor-parallel layout of a fused tensor: under ColwiseParallel each rank gets a contiguous "
            "slice, which mixes the parts unless the rows are interleaved per rank ([q_r; k_r; v_r]); "
            "decide from your model's parallel plan"
        ),
        suggestion=[f'sdadapt.interleave("{t.pattern()}", sizes={[s.shape[m.dim] for s in m.srcs]}),'],
    )


# --- all proposals ------------------------------------------------------------------------------

@dataclass
class Proposals:
    items: list[Proposed]
    questions: list[Question]
    strip: str | None
    matched_target_keys: int
    target_keys: int
    unchanged: int  # target keys that already line up (same name, shape, no transpose)


def build_proposals(result: MatchResult, src: Tree, tgt: Tree, strip: str | None) -> Proposals:
    props: list[Proposed] = []
    questions: list[Question] = []
    unchanged = 0
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
        if kind == "same":
            unchanged += tkeys
        else:
            ev = list(m.evidence)
            props.append(Proposed(kind=kind, rules=rules, sources=[s.pattern() for s in m.srcs],
                                  targets=[t.pattern() for t in m.tgts], confidence=m.confidence, evidence=ev,
                                  section=m.scope, keys=tkeys, match=m))
        qs = [q for q in (_rotary_question(m), *_hint_questions(m), _tp_question(m)) if q is not None]
        questions += qs
        if qs and kind != "same":
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
    return Proposals(items=props, questions=_dedupe(questions), strip=strip, matched_target_keys=matched,
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
        if m is not None and p.kind in _MERGEABLE and not m.transpose:
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
        for p in ps:
            merged.questions += [q for q in p.questions if q.question not in {x.question for x in merged.questions}]
        out.append(merged)
    return out


def _dedupe(qs: list[Question]) -> list[Question]:
    seen: dict[str, Question] = {}
    for q in qs:
        prev = seen.get(q.question)
        if prev is None:
            seen[q.question] = Question(about=list(q.about), question=q.question, suggestion=list(q.suggestion))
        else:
            prev.about += [a for a in q.about if a not in prev.about]
            prev.suggestion += [s for s in q.suggestion if s not in prev.suggestion]
    return list(seen.values())


def family_label(f: Family) -> str:
    return f.star_pattern()
