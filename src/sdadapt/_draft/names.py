"""Name evidence: a small synonym table, roles (q/k/v, gate/up/down) and a weighted token similarity.

Whole segments with a well-known meaning map to one canonical token (``q_proj``, ``wq``,
``to_q`` -> ``#q``); other segments are cut into tokens (``txt_attn`` -> ``txt``, ``attn``) and
tokens with the same meaning share a canonical form (``txt`` ~ ``context`` ~ ``add``). The
similarity of two names is the IDF-weighted overlap of their tokens, so a token every candidate
shares (``weight``, ``layers``) says little and a rare one (``guidance``) says much.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from .segments import tokens

# whole segment -> canonical token
_SEGMENTS: dict[str, tuple[str, ...]] = {
    "#q": ("q_proj", "wq", "to_q", "q", "query", "q_lin", "query_proj"),
    "#k": ("k_proj", "wk", "to_k", "k", "key", "k_lin", "key_proj"),
    "#v": ("v_proj", "wv", "to_v", "v", "value", "v_lin", "value_proj"),
    "#o": ("o_proj", "wo", "out_proj", "to_out", "dense", "o", "out_lin"),
    "#qkv": ("qkv", "wqkv", "qkv_proj", "c_attn", "query_key_value", "in_proj", "Wqkv"),
    "#kv": ("kv", "wkv", "kv_proj"),
    "#gate": ("gate_proj", "w1", "wi_0"),
    "#up": ("up_proj", "w3", "wi_1", "c_fc", "fc1"),
    "#down": ("down_proj", "w2", "wo_ffn", "fc2"),
    "#gate_up": ("gate_up_proj", "w13", "gate_up", "w1w3"),
    "#emb": ("embed_tokens", "tok_embeddings", "wte", "word_embeddings", "embedding", "embeddings", "tok_embed",
             "embed", "token_embedding"),
    "#pos": ("wpe", "position_embeddings", "pos_embed", "pos_embedding"),
    "#head": ("lm_head", "output", "head", "embed_out", "classifier"),
    "#norm1": ("input_layernorm", "attention_norm", "ln_1", "attn_norm", "ln1", "pre_attention_norm"),
    "#norm2": ("post_attention_layernorm", "ffn_norm", "ln_2", "mlp_norm", "ln2", "pre_feedforward_layernorm"),
    "#normf": ("ln_f", "final_layernorm", "norm_f", "final_norm"),
    "#attn": ("self_attn", "attention", "attn", "self_attention"),
    "#mlp": ("mlp", "feed_forward", "ffn", "ff", "block_sparse_moe", "moe", "feedforward"),
    "#layers": ("layers", "h", "blocks", "layer", "transformer_blocks"),
    "#experts": ("experts", "local_experts"),
}
SEGMENT_SYNONYMS: dict[str, str] = {s.lower(): c for c, segs in _SEGMENTS.items() for s in segs}

# token -> canonical token
_TOKENS: dict[str, tuple[str, ...]] = {
    "txt": ("txt", "context", "add", "added", "text", "encoder", "ctx"),
    "q": ("q", "query"),
    "k": ("k", "key"),
    "v": ("v", "value"),
    "linear": ("linear", "lin", "fc", "dense"),
    "mod": ("mod", "modulation", "adaln"),
    "time": ("time", "timestep"),
    "emb": ("emb", "embed", "embedding", "embedder", "embeddings"),
    "proj": ("proj", "projection"),
    "norm": ("norm", "layernorm", "ln", "rmsnorm"),
    "attn": ("attn", "attention"),
    "mlp": ("mlp", "ff", "ffn", "feed", "forward"),
    "#w": ("weight", "scale", "gamma"),
    "#b": ("bias", "beta"),
}
TOKEN_SYNONYMS: dict[str, str] = {t: c for c, toks in _TOKENS.items() for t in toks}

# fused name -> the roles it holds, in order
FUSED_ROLES: dict[str, tuple[str, ...]] = {
    "#qkv": ("#q", "#k", "#v"),
    "#kv": ("#k", "#v"),
    "#gate_up": ("#gate", "#up"),
}
_ROLE_TOKENS = {"q": "#q", "k": "#k", "v": "#v", "query": "#q", "key": "#k", "value": "#v", "gate": "#gate",
                "up": "#up", "down": "#down"}
ROLE_ORDER = ("#q", "#k", "#v", "#gate", "#up", "#down", "#o")
PARAM_BIAS = frozenset({"bias", "beta"})


def canon_tokens(rel: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for seg in rel:
        c = SEGMENT_SYNONYMS.get(seg.lower())
        if c is not None:
            out.add(c)
            continue
        for t in tokens(seg):
            out.add(TOKEN_SYNONYMS.get(t, t))
    return out


_ROLEISH = frozenset({"q", "k", "v", "o", "qkv", "kv", "gate", "up", "down", "query", "key", "value"})


def role_of(segment: str) -> tuple[str | None, str]:
    """The role of a module segment and its template with the role cut out:
    ``add_q_proj`` -> ``("#q", "add_#_proj")``; ``wq`` -> ``("#q", "w#")``; ``w13`` -> ``("#gate_up", "w#")``."""
    low = segment.lower()
    toks = tokens(segment)
    c = SEGMENT_SYNONYMS.get(low)
    if c is not None and (c in FUSED_ROLES or c in ROLE_ORDER):
        if low.startswith("w") and low[1:] in {"q", "k", "v", "o", "qkv", "kv", "1", "2", "3", "13"}:
            return c, "w#"
        return c, _template(toks)
    hits = [t for t in toks if t in _ROLE_TOKENS]
    if len(hits) == 1:
        return _ROLE_TOKENS[hits[0]], _template(toks)
    if "qkv" in toks:
        return "#qkv", _template(toks)
    return None, low


def _template(toks: list[str]) -> str:
    out: list[str] = []
    for t in toks:
        t = "#" if t in _ROLEISH else t
        if not (t == "#" and out and out[-1] == "#"):
            out.append(t)
    return "_".join(out)


def _fuzzy(a: str, b: str) -> bool:
    return len(a) >= 3 and len(b) >= 3 and (a.startswith(b) or b.startswith(a))


class Similarity:
    """IDF-weighted token overlap among a set of names (one scope's candidates)."""

    def __init__(self, names: Iterable[tuple[str, ...]]):
        self.cache: dict[tuple[str, ...], set[str]] = {}
        df: Counter = Counter()
        n = 0
        for rel in names:
            n += 1
            df.update(self.toks(rel))
        self.idf = {t: math.log(1.0 + n / c) for t, c in df.items()}
        self.default = math.log(1.0 + max(n, 1))

    def toks(self, rel: tuple[str, ...]) -> set[str]:
        t = self.cache.get(rel)
        if t is None:
            t = self.cache[rel] = canon_tokens(rel)
        return t

    def __call__(self, a: tuple[str, ...], b: tuple[str, ...]) -> float:
        ta, tb = self.toks(a), self.toks(b)
        if not ta or not tb:
            return 0.0
        w = self.idf
        common = ta & tb
        score = sum(w.get(t, self.default) for t in common)
        for x in ta - common:  # near-equal tokens (time ~ timestep) count half
            if any(_fuzzy(x, y) for y in tb - common):
                score += 0.5 * w.get(x, self.default)
        union = sum(w.get(t, self.default) for t in ta | tb)
        return score / union if union else 0.0
