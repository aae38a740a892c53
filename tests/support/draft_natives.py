"""Native (torchtitan-style) decoders for the draft family tests, and the tiny HF checkpoints they load.

:class:`Native` is one small decoder in torchtitan's names (``tok_embeddings``,
``layers.{i}.attention.wq|wk|wv|wo``, ``attention.q_norm|k_norm``, ``attention_norm``,
``ffn_norm``, ``feed_forward.w1|w2|w3`` or ``moe.router.gate`` + stacked ``moe.experts.w1|w2|w3``,
``norm``, ``output``), written from the families' published equations so that it is independent
of sdadapt and of transformers' code. Options cover what the tested families differ in: q/k/v
biases, per-head q/k norms, Meta's interleaved or HF's half rotary, Gemma's embedding scale, tanh
GELU and sandwich norms with soft-capping (Gemma2). Its norms are plain ``x_hat * w`` (a
checkpoint storing Gemma's ``1 + w`` offset needs a value rule).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from support.reference_models import RMSNorm, apply_rotary_emb, apply_rotary_half, precompute_freqs_cis, rope_half


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        d, h, kv, hd, b = c["dim"], c["heads"], c["kv_heads"], c["head_dim"], c.get("qkv_bias", False)
        self.c = c
        self.wq = nn.Linear(d, h * hd, bias=b)
        self.wk = nn.Linear(d, kv * hd, bias=b)
        self.wv = nn.Linear(d, kv * hd, bias=b)
        self.wo = nn.Linear(h * hd, d, bias=False)
        if c.get("qk_norm"):
            self.q_norm = RMSNorm(hd, c["eps"])
            self.k_norm = RMSNorm(hd, c["eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        hd = c["head_dim"]
        q = self.wq(x).reshape(b, s, -1, hd)
        k = self.wk(x).reshape(b, s, -1, hd)
        v = self.wv(x).reshape(b, s, -1, hd)
        if c.get("qk_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if c["rotary"] == "interleaved":
            fc = precompute_freqs_cis(hd, s, c["theta"])
            q, k = apply_rotary_emb(q, fc), apply_rotary_emb(k, fc)
        else:
            cos, sin = rope_half(hd, s, c["theta"])
            q, k = apply_rotary_half(q, cos, sin), apply_rotary_half(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) * c.get("scaling", hd**-0.5)
        if c.get("attn_softcap"):
            scores = torch.tanh(scores / c["attn_softcap"]) * c["attn_softcap"]
        scores = scores + torch.full((s, s), float("-inf")).triu(1)
        out = scores.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: dict[str, Any], hidden: int):
        super().__init__()
        self.act = c.get("act", "silu")
        self.w1 = nn.Linear(c["dim"], hidden, bias=False)
        self.w2 = nn.Linear(hidden, c["dim"], bias=False)
        self.w3 = nn.Linear(c["dim"], hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.w1(x)
        g = F.gelu(g, approximate="tanh") if self.act == "gelu_tanh" else F.silu(g)
        return self.w2(g * self.w3(x))


class Router(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.gate = nn.Linear(c["dim"], c["experts"], bias=False)


class Experts(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        e, d, f = c["experts"], c["dim"], c["moe_hidden"]
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, f, d))


class MoE(nn.Module):
    """Softmax router, top-k (optionally renormalised), SwiGLU experts stacked over a leading dim."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = c
        self.router = Router(c)
        self.experts = Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router.gate(flat).float().softmax(-1)
        w, idx = probs.topk(self.c["top_k"], dim=-1)
        if self.c.get("norm_topk"):
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        ex = self.experts
        for j in range(self.c["top_k"]):
            for e in range(self.c["experts"]):
                sel = idx[:, j] == e
                if sel.any():
                    t = flat[sel]
                    y = (F.silu(t @ ex.w1[e].T) * (t @ ex.w3[e].T)) @ ex.w2[e].T
                    out[sel] += w[sel, j, None].to(y.dtype) * y
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, c: dict[str, Any], layer: int):
        super().__init__()
        self.c = c
        self.attention = Attention(c)
        self.attention_norm = RMSNorm(c["dim"], c["eps"])
        self.ffn_norm = RMSNorm(c["dim"], c["eps"])
        if c.get("sandwich"):
            self.post_attention_norm = RMSNorm(c["dim"], c["eps"])
            self.post_ffn_norm = RMSNorm(c["dim"], c["eps"])
        if c.get("experts"):
            self.moe = MoE(c)
        else:
            self.feed_forward = FeedForward(c, c["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.attention_norm(x))
        if self.c.get("sandwich"):
            a = self.post_attention_norm(a)
        h = x + a
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        f = ffn(self.ffn_norm(h))
        if self.c.get("sandwich"):
            f = self.post_ffn_norm(f)
        return h + f


class Native(nn.Module):
    """The native decoder; ``c`` is built by :func:`native_config` from an HF ``config.json``."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = dict(c)
        self.tok_embeddings = nn.Embedding(c["vocab"], c["dim"])
        self.layers = nn.ModuleList([Block(c, i) for i in range(c["layers"])])
        self.norm = RMSNorm(c["dim"], c["eps"])
        self.output = nn.Linear(c["dim"], c["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.c.get("embed_scale"):
            h = h * torch.tensor(self.c["dim"] ** 0.5, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h)).float()
        if self.c.get("final_softcap"):
            logits = torch.tanh(logits / self.c["final_softcap"]) * self.c["final_softcap"]
        return logits


def native_config(cfg: dict[str, Any], rotary: str) -> dict[str, Any]:
    """The native decoder's options for an HF ``config.json`` dict (families tested here)."""
    t = cfg["model_type"]
    c: dict[str, Any] = dict(
        dim=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"], vocab=cfg["vocab_size"], hidden=cfg["intermediate_size"],
        eps=cfg["rms_norm_eps"], theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")),
        rotary=rotary,
    )  # fmt: skip
    c["head_dim"] = cfg.get("head_dim") or c["dim"] // c["heads"]
    c["qkv_bias"] = t == "qwen2"
    c["qk_norm"] = t in ("qwen3", "qwen3_moe")
    if t == "qwen3_moe":
        c.update(experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                 moe_hidden=cfg["moe_intermediate_size"], norm_topk=cfg["norm_topk_prob"])
    if t in ("gemma", "gemma2"):
        c.update(embed_scale=True, act="gelu_tanh")
    if t == "gemma2":
        c.update(sandwich=True, attn_softcap=cfg["attn_logit_softcapping"], final_softcap=cfg["final_logit_softcapping"],
                 scaling=cfg["query_pre_attn_scalar"] ** -0.5)
    return c


def hf_configs() -> dict[str, Any]:
    """Tiny configs of the eight families (transformers classes)."""
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)
    return {
        "qwen2": T.Qwen2Config(**common, head_dim=8),
        "qwen3": T.Qwen3Config(**common, head_dim=8),
        "qwen3_moe": T.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, norm_topk_prob=True, **moe),
        "phi3": T.Phi3Config(**common),
        "gemma": T.GemmaConfig(**common, head_dim=8, hidden_activation="gelu_pytorch_tanh"),
        "gemma2": T.Gemma2Config(**common, head_dim=8),
        "deepseek_v3": T.DeepseekV3Config(**common, n_routed_experts=4, first_k_dense_replace=1, q_lora_rank=16,
                                          kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                          n_group=1, topk_group=1, **moe),
        "gpt_oss": T.GptOssConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    }  # fmt: skip


def perturb(model: nn.Module, seed: int) -> None:
    """Random values everywhere, norms around 1 and biases around 0 but not equal to them (HF's
    initial ones and zeros hide layout mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.2))
            if p.dim() == 1 and "norm" in name:
                p.add_(1.0 if "gemma" not in type(model).__name__.lower() else 0.0)


def save_hf(family: str, root: Path, seed: int = 0) -> tuple[Path, nn.Module]:
    """``save_pretrained`` of a perturbed tiny model of ``family`` into ``root/family``."""
    import transformers as T

    cfg = hf_configs()[family]
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    perturb(model, seed)
    out = root / family
    model.save_pretrained(out)
    return out, model


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def logits_hf(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def tokens(vocab: int, n: int = 8) -> torch.Tensor:
    return torch.arange(n).mul(7).remainder(vocab)[None]


__all__ = ["Native", "hf_configs", "logits_hf", "native_config", "read_config", "save_hf", "tokens", "math"]
