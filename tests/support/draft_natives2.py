"""A second native decoder for the draft tests: twelve more transformers families, chosen for
what sets them apart (post-norm, parallel blocks, partial rotary, a per-head fused qkv, q/k
norms over the whole projection, config multipliers, rotary that HF already interleaves, MoE
with a shared expert, LayerNorm with biases, non-gated MLPs, a fused gate|up).

:class:`Native2` is written from the families' published equations, in torchtitan's names
(``tok_embeddings``, ``layers.{i}.attention.wq|wk|wv|wo``, ``attention_norm``, ``ffn_norm``,
``feed_forward.w1|w2|w3``, ``moe.router.gate`` + stacked ``moe.experts.w1|w2|w3``,
``moe.shared_experts.w1|w2|w3``, ``moe.shared_gate``, ``norm``, ``output``); it always rotates
with Meta's interleaved pairs (on the first ``rot_dim`` rows of a head), so a family whose HF
code keeps rows in "half" order needs a rotary rule and one that already interleaves needs none.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from support import draft_natives


class Norm(nn.Module):
    """RMSNorm (``rms``), LayerNorm with bias (``ln``) or without (``ln_nobias``, Cohere)."""

    def __init__(self, kind: str, dim: int, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))
        if kind == "ln":
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return F.layer_norm(x, x.shape[-1:], self.weight, getattr(self, "bias", None), self.eps)


def rotate(x: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Meta's rotary on ``[b, s, heads, head_dim]``: rows (2j, 2j+1) of the first ``rot`` rows
    of each head form one complex number rotated by frequency j; the other rows pass."""
    s = x.shape[1]
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    fc = torch.polar(torch.ones(s, rot // 2), torch.outer(torch.arange(s).float(), inv))
    xr = torch.view_as_complex(x[..., :rot].float().reshape(*x.shape[:-1], -1, 2).contiguous())
    out = torch.view_as_real(xr * fc[None, :, None, :]).flatten(3)
    return torch.cat([out.type_as(x), x[..., rot:]], -1)


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        d, h, kv, hd = c["dim"], c["heads"], c["kv_heads"], c["head_dim"]
        self.c = c
        if c.get("fused_qkv"):  # one projection, rows [q; k; v]
            self.wqkv = nn.Linear(d, (h + 2 * kv) * hd, bias=c.get("qkv_bias", False))
        else:
            self.wq = nn.Linear(d, h * hd, bias=c.get("qkv_bias", False))
            self.wk = nn.Linear(d, kv * hd, bias=c.get("qkv_bias", False))
            self.wv = nn.Linear(d, kv * hd, bias=c.get("qkv_bias", False))
        self.wo = nn.Linear(h * hd, d, bias=c.get("o_bias", False))
        if c.get("qk_norm") == "full":  # over the whole projection (OLMo2)
            self.q_norm = Norm(c["norm"], h * hd, c["eps"])
            self.k_norm = Norm(c["norm"], kv * hd, c["eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        hd = c["head_dim"]
        if c.get("fused_qkv"):
            q, k, v = self.wqkv(x).split([c["heads"] * hd, c["kv_heads"] * hd, c["kv_heads"] * hd], -1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if c.get("qk_norm") == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(b, s, -1, hd) for t in (q, k, v))
        rot = c.get("rot_dim", hd)
        q, k = rotate(q, rot, c["theta"]), rotate(k, rot, c["theta"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) * c.get("scaling", hd**-0.5)
        scores = scores + torch.full((s, s), float("-inf")).triu(1)
        out = scores.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def act(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


class FeedForward(nn.Module):
    """Gated (``w2(act(w1 x) * w3 x)``) or not (``w2(act(w1 x))``), with or without biases."""

    def __init__(self, c: dict[str, Any], hidden: int):
        super().__init__()
        self.act, self.gated = c.get("act", "silu"), c.get("gated", True)
        b = c.get("mlp_bias", False)
        self.w1 = nn.Linear(c["dim"], hidden, bias=b)
        self.w2 = nn.Linear(hidden, c["dim"], bias=b)
        if self.gated:
            self.w3 = nn.Linear(c["dim"], hidden, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = act(self.act, self.w1(x))
        return self.w2(h * self.w3(x) if self.gated else h)


class MoE(draft_natives.MoE):
    """Softmax router, top-k (optionally renormalised), stacked SwiGLU experts; optionally a
    shared expert scaled by ``sigmoid(shared_gate(x))`` (Qwen2-MoE)."""

    def __init__(self, c: dict[str, Any]):
        super().__init__(c)
        if c.get("shared_hidden"):
            self.shared_experts = FeedForward({**c, "mlp_bias": False, "gated": True, "act": "silu"}, c["shared_hidden"])
            self.shared_gate = nn.Linear(c["dim"], 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if hasattr(self, "shared_experts"):
            flat = x.reshape(-1, x.shape[-1])
            out = out + (torch.sigmoid(self.shared_gate(flat)) * self.shared_experts(flat)).reshape(x.shape)
        return out


class Block(nn.Module):
    """Pre-norm (``attention_norm``, ``ffn_norm``), post-norm (OLMo2: ``post_attention_norm``,
    ``post_ffn_norm`` on the branch outputs only) or parallel (one norm feeding both branches,
    Cohere and Phi; or two, GPT-NeoX); residual branches scaled by ``res_mult`` (Granite)."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = c
        n, d, eps = c["norm"], c["dim"], c["eps"]
        self.attention = Attention(c)
        if c.get("post_norm"):
            self.post_attention_norm = Norm(n, d, eps)
            self.post_ffn_norm = Norm(n, d, eps)
        else:
            self.attention_norm = Norm(n, d, eps)
            if c.get("parallel") != "one":
                self.ffn_norm = Norm(n, d, eps)
        if c.get("experts"):
            self.moe = MoE(c)
        else:
            self.feed_forward = FeedForward(c, c["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        m = c.get("res_mult", 1.0)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        if c.get("post_norm"):
            h = x + self.post_attention_norm(self.attention(x))
            return h + self.post_ffn_norm(ffn(h))
        if c.get("parallel") == "one":
            n = self.attention_norm(x)
            return x + self.attention(n) + ffn(n)
        if c.get("parallel") == "two":
            return x + self.attention(self.attention_norm(x)) + ffn(self.ffn_norm(x))
        h = x + self.attention(self.attention_norm(x)) * m
        return h + ffn(self.ffn_norm(h)) * m


class Native2(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = dict(c)
        self.tok_embeddings = nn.Embedding(c["vocab"], c["dim"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["layers"])])
        self.norm = Norm(c["norm"], c["dim"], c["eps"])
        self.output = nn.Linear(c["dim"], c["vocab"], bias=c.get("output_bias", False))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) * self.c.get("emb_mult", 1.0)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h)).float()
        return logits * self.c.get("logit_mult", 1.0) / self.c.get("logit_div", 1.0)


def _theta(cfg: dict[str, Any]) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def native2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """:class:`Native2`'s options for an HF ``config.json`` dict of one of :data:`FAMILIES`."""
    t = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    c: dict[str, Any] = dict(
        dim=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads, vocab=cfg["vocab_size"], hidden=cfg["intermediate_size"],
        eps=cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or cfg.get("norm_epsilon") or 1e-5, theta=_theta(cfg),
        norm="rms",
    )  # fmt: skip
    c["head_dim"] = cfg.get("head_dim") or c["dim"] // heads
    frac = cfg.get("partial_rotary_factor") or cfg.get("rotary_pct") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor") or 1.0
    c["rot_dim"] = int(c["head_dim"] * frac)
    if t == "olmo2":
        c.update(post_norm=True, qk_norm="full")
    if t == "granite":
        c.update(emb_mult=cfg["embedding_multiplier"], res_mult=cfg["residual_multiplier"],
                 scaling=cfg["attention_multiplier"], logit_div=cfg["logits_scaling"])
    if t == "stablelm":
        c.update(norm="ln", qkv_bias=cfg.get("use_qkv_bias", False))
    if t == "cohere":
        c.update(norm="ln_nobias", parallel="one", logit_mult=cfg["logit_scale"])
    if t == "phi":
        c.update(norm="ln", parallel="one", qkv_bias=True, o_bias=True, gated=False, act="gelu_tanh", mlp_bias=True,
                 output_bias=True)
    if t == "gpt_neox":
        c.update(norm="ln", parallel="two", qkv_bias=True, o_bias=True, gated=False, act="gelu", mlp_bias=True)
    if t == "starcoder2":
        c.update(norm="ln", qkv_bias=True, o_bias=True, gated=False, act="gelu_tanh", mlp_bias=True)
    if t == "glm":
        c.update(qkv_bias=cfg.get("attention_bias", True))
    if t in ("mixtral", "qwen2_moe"):
        c.update(experts=cfg.get("num_local_experts") or cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                 moe_hidden=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                 norm_topk=t == "mixtral" or bool(cfg.get("norm_topk_prob")))
    if t == "qwen2_moe":
        c.update(qkv_bias=True, shared_hidden=cfg["shared_expert_intermediate_size"])
    return c


def more_configs() -> dict[str, Any]:
    """Tiny configs of the twelve families (transformers classes)."""
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gqa = dict(common, num_key_value_heads=2)
    return {
        "mistral": T.MistralConfig(**gqa, head_dim=8),
        "helium": T.HeliumConfig(**gqa, head_dim=8),
        "granite": T.GraniteConfig(**gqa, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                   logits_scaling=4.0),
        "olmo2": T.Olmo2Config(**gqa),
        "stablelm": T.StableLmConfig(**gqa, partial_rotary_factor=0.5, use_qkv_bias=True),
        "cohere": T.CohereConfig(**gqa, logit_scale=0.5),
        "phi": T.PhiConfig(**common, partial_rotary_factor=0.5, hidden_act="gelu_new"),
        "gpt_neox": T.GPTNeoXConfig(**common, rotary_pct=0.5, hidden_act="gelu", use_parallel_residual=True),
        "starcoder2": T.Starcoder2Config(**gqa, hidden_act="gelu_pytorch_tanh"),
        "glm": T.GlmConfig(**gqa, head_dim=8, partial_rotary_factor=0.5),
        "mixtral": T.MixtralConfig(**gqa, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": T.Qwen2MoeConfig(**gqa, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, norm_topk_prob=False),
    }  # fmt: skip


FAMILIES = ["mistral", "helium", "granite", "olmo2", "stablelm", "cohere", "phi", "gpt_neox", "starcoder2", "glm",
            "mixtral", "qwen2_moe"]
