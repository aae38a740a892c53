"""Value-level facts a draft cannot read from shapes: each becomes a :class:`Question` (a
``DECIDE`` in the drafted module, with the rules to enable) or, where ``config.json`` settles it,
a rule with that evidence.

- rotary row order between HF-style and Meta-style q/k projections: the rule goes on every tensor
  whose rows follow the heads (weights, biases) and on per-head q/k norm weights, with head counts
  from ``config.json``;
- Gemma's norms store ``w`` for ``x_hat * (1 + w)``;
- FP8 weights with block scales need dequantisation (never a plain cast from float8);
- fused gate/up tensors whose parts alternate element by element (GPT-OSS) are de-interleaved
  before they are split;
- the per-TP-rank layout of fused tensors, and known chunk-order differences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from ..rules import Affine, Deinterleave, Rotary
from .config import FP8_SCALE_SUFFIX, NO_CONFIG, Facts
from .match import Item, Match, item_role
from .names import canon_tokens


@dataclass
class Question:
    """A value-level choice the draft cannot see in shapes."""

    about: list[str]
    question: str
    suggestion: list[str]  # commented-out code lines
    before: bool = False  # the suggestion goes before the proposal's rules (else after)
    rules: list[Any] | None = None  # the suggestion as rule objects (a numerical check may enable them)
    topic: str = ""  # rotary | offset | ...: questions of one topic are answered together


def merge_questions(qs: list[Question]) -> list[Question]:
    """One question per text, with the keys and suggested rules of all its occurrences."""
    seen: dict[str, Question] = {}
    for q in qs:
        prev = seen.get(q.question)
        if prev is None:
            seen[q.question] = Question(about=list(q.about), question=q.question, suggestion=list(q.suggestion),
                                        before=q.before, rules=list(q.rules or []), topic=q.topic)
        else:
            prev.about += [a for a in q.about if a not in prev.about]
            prev.suggestion += [s for s in q.suggestion if s not in prev.suggestion]
            prev.rules = (prev.rules or []) + [r for r in q.rules or [] if r not in (prev.rules or [])]
    return list(seen.values())


# --- rotary row order ---------------------------------------------------------------------------

def _style(seg: str) -> str | None:
    low = seg.lower()
    if low in ("wq", "wk", "wqkv"):
        return "meta"
    if low in ("q_proj", "k_proj", "qkv_proj", "query_key_value", "wqkv_proj"):
        return "hf"
    return None


_STYLE_NAMES = {"hf": "HF-style (q_proj, k_proj)", "meta": "Meta-style (wq, wk)"}
ROTARY_QUESTION = (
    "rotary row order: {a} q/k projections become {b} ones. HF transformers keeps each head's rows in "
    "'half' order in most families, Meta's code rotates interleaved pairs; shapes cannot show which one your model's code "
    "expects. The rule applies to every tensor whose rows follow the heads: weights, biases and per-head "
    "q/k norm weights"
)


def _heads(facts: Facts, role: str | None) -> str:
    n = facts.heads_of(role or "")
    if n:
        return str(n)
    return "N_KV_HEADS" if role == "#k" else "N_HEADS"


def rotary_direction(m: Match) -> tuple[str, str] | None:
    """``(from_style, to_style)`` when ``m`` maps q/k projections between HF and Meta names."""
    seen = {(_style(s.rel[s.module_index()]), _style(t.rel[t.module_index()])) for s in m.srcs for t in m.tgts}
    styles = sorted((a, b) for a, b in seen if a and b and a != b)
    return styles[0] if styles else None


def _rotary_text(direction: tuple[str, str], facts: Facts = NO_CONFIG) -> str:
    a, b = direction
    text = ROTARY_QUESTION.format(a=_STYLE_NAMES[a], b=_STYLE_NAMES[b])
    if facts.rotary_fraction:
        text += f"; config.json says only {facts.rotary_fraction:g} of each head rotates (rotary_dim)"
    if facts.interleaved_rotary:
        text += (f"; but model_type {facts.model_type!r} is one of the families whose transformers code already "
                 "rotates interleaved pairs: a Meta-style model then needs no rotary rule")
    return text


def _to(direction: tuple[str, str]) -> Literal["interleaved", "half"]:
    return "interleaved" if direction[1] == "meta" else "half"


def _rotary_code(rule: Rotary) -> str:
    args = [f'"{rule.keys}"']
    args.append(f"head_dim={rule.head_dim}" if rule.head_dim else f"heads={rule.heads}")
    args.append(f'to="{rule.to}"')
    if rule.rotary_dim is not None:
        args.append(f"rotary_dim={rule.rotary_dim!r}")
    return f"sdadapt.rotary({', '.join(args)}),"


def rotary_question(m: Match, facts: Facts) -> Question | None:
    direction = rotary_direction(m)
    if direction is None:
        return None
    qk = ("#q", "#k")
    hit = [s for s in m.srcs if item_role(s) in qk] if m.kind == "fuse" else [t for t in m.tgts if item_role(t) in qk]
    rules, lines = [], []
    for it in hit:
        n = facts.heads_of(item_role(it) or "")
        if n:
            rule = Rotary(keys=it.pattern(), heads=n, to=_to(direction), rotary_dim=facts.rotary_fraction)
            rules.append(rule)
            lines.append(_rotary_code(rule))
        else:
            lines.append(f'sdadapt.rotary("{it.pattern()}", heads={_heads(facts, item_role(it))}, to="{_to(direction)}"),')
    text = _rotary_text(direction, facts)
    return Question(about=[it.pattern() for it in hit] or [t.pattern() for t in m.tgts], question=text,
                    suggestion=lines, before=m.kind == "fuse", rules=rules if len(rules) == len(lines) else None,
                    topic="rotary")


def is_norm(i: Item) -> bool:
    """A norm's weight: 1-D, not a bias, "norm" in its module's name (``input_layernorm``, ``q_norm``)."""
    return len(i.shape) == 1 and not i.is_bias and any("norm" in seg.lower() for seg in i.rel[:-1] or i.rel)


def is_head_norm(t: Item) -> bool:
    """A q or k norm weight: per head (``q_norm.weight`` [head_dim]) or over the whole projection
    ([heads * head_dim], OLMo2)."""
    return is_norm(t) and item_role(t) in ("#q", "#k")


def head_norm_question(m: Match, direction: tuple[str, str], facts: Facts = NO_CONFIG) -> Question | None:
    """q/k norms scale each row of a head: they follow the rows' rotary order. Cut by
    ``head_dim`` (one rule for a per-head norm and one over the whole projection alike)."""
    hit = [t for t in m.tgts if is_head_norm(t)]
    if not hit or m.kind != "rename":
        return None
    rules, lines = [], []
    for t in hit:
        hd = facts.head_rows or t.shape[0]
        if t.shape[0] % hd:
            hd = t.shape[0]
        rule = Rotary(keys=t.pattern(), head_dim=hd, to=_to(direction), rotary_dim=facts.rotary_fraction)
        rules.append(rule)
        lines.append(_rotary_code(rule))
    return Question(about=[t.pattern() for t in hit], question=_rotary_text(direction, facts), suggestion=lines,
                    rules=rules, topic="rotary")


# --- norms that store an offset -----------------------------------------------------------------

def offset_question(m: Match, facts: Facts) -> Question | None:
    """Gemma's RMSNorm computes ``x_hat * (1 + w)`` and stores ``w``."""
    if not facts.norm_offset or m.kind != "rename":
        return None
    hit = [t for t, s in zip(m.tgts, m.srcs, strict=False) if is_norm(s) and len(t.shape) == 1]
    if not hit:
        return None
    return Question(
        about=[t.pattern() for t in hit],
        question=(f"norm offset: config.json says model_type {facts.model_type!r}, whose RMSNorm multiplies by "
                  "(1 + w) and stores w; if your model's norm multiplies by its weight, add 1 to every norm weight"),
        suggestion=[f'sdadapt.affine("{t.pattern()}", shift=1.0),' for t in hit],
        rules=[Affine(keys=t.pattern(), shift=1.0) for t in hit], topic="offset",
    )


# --- quantized weights --------------------------------------------------------------------------

def dequant_question(facts: Facts, weights: list[str], dtype: str) -> Question:
    """FP8 weights with ``*_scale_inv`` block scales: dequantise them, never cast them."""
    block = facts.block or (128, 128)
    return Question(
        about=weights,
        question=(f"quantized weights: {len(weights)} float8 weight patterns come with '{FP8_SCALE_SUFFIX}' block "
                  f"scales ({facts.describe()}); they must be dequantised (value = float(w) * scale[i // {block[0]}, "
                  f"j // {block[1]}]); a cast from float8 would load values without their scales"),
        suggestion=[f'sdadapt.dequant_fp8("**.weight", block=({block[0]}, {block[1]}), dtype="{dtype}"),'],
        before=True,
    )


# --- fused parts that alternate -------------------------------------------------------------------

def model_dim(dim: int, ndim: int) -> int:
    """The model-side dim of source dim ``dim`` when the last two dims are swapped."""
    return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(dim, dim)


def deinterleave_rule(m: Match, facts: Facts) -> tuple[list[Any], str] | None:
    """For a split of a fused gate/up tensor whose parts alternate element by element along the
    split dim (``config.json`` names such a family): the rule that makes the parts contiguous
    first (one row per part and "rank": ``tp`` = the part size), and its evidence."""
    if m.kind != "split" or not facts.interleaved_gate_up or len(m.tgts) != 2:
        return None
    w = m.srcs[0]
    toks = canon_tokens(w.rel) | set(w.rel[-1].lower().split("_"))
    if not ({"#gate_up"} & toks or {"gate", "up"} <= toks):
        return None
    sizes = [t.shape[model_dim(m.dim, len(w.shape)) if m.transpose else m.dim] for t in m.tgts]
    if sizes[0] != sizes[1]:
        return None
    rule = Deinterleave(keys=w.pattern(), sizes=sizes, tp=sizes[0], dim=m.dim)
    return [rule], (f"config.json says model_type {facts.model_type!r}: gate and up alternate along dim {m.dim} "
                    f"({sizes[0]} each), so they are de-interleaved before the split")


# --- other value-level hints --------------------------------------------------------------------

_VALUE_HINTS = [
    (re.compile(r"adaLN_modulation"), re.compile(r"norm_out"),
     "chunk order: BFL's final adaLN_modulation yields (shift, scale), diffusers' norm_out expects "
     "(scale, shift); if so, split the tensor in halves and fuse them swapped"),
]


def hint_questions(m: Match) -> list[Question]:
    out = []
    for s in m.srcs:
        for t in m.tgts:
            for rs, rt, text in _VALUE_HINTS:
                if rs.search(s.pattern()) and rt.search(t.pattern()):
                    out.append(Question(about=[t.pattern()], question=text, suggestion=[]))
    return out


def tp_question(m: Match) -> Question | None:
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
