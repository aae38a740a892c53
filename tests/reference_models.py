"""Small reference implementations of layouts that have no public model class.

- :class:`MetaLlama`: the Meta reference Llama layout (``tok_embeddings``, ``layers.{i}.attention.wq``,
  ``feed_forward.w1|w2|w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) with Meta's
  rotary (complex multiply on *interleaved* row pairs of each head), GQA, optional fused ``wqkv``
  and ``w13``, optional Meta-style MoE with stacked experts (``layers.{i}.moe.experts.w1|w2|w3``
  of shape ``[E, ...]`` and ``layers.{i}.moe.router.gate``) in place of the dense feed-forward;
- :class:`Qwen3`: Qwen3 / Qwen3-MoE in the same family of names (torchtitan's Qwen3), with
  ``attention.q_norm|k_norm`` (RMSNorm over each head), HF's "half" rotary order, optional
  q/k/v/o biases, and MoE layers (``moe.*`` as above) beside dense ``feed_forward`` layers;
- :class:`DeepSeekV3`: DeepSeek-V3 in torchtitan's names: MLA attention (``attention.wq`` or
  ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``) with interleaved rotary
  rows, dense first layers, and MoE layers with a sigmoid group-limited router, ``moe.expert_bias``,
  stacked experts and ``moe.shared_experts``;
- :class:`NanoGPT`: nanoGPT's GPT-2 (``transformer.h.{i}.attn.c_attn`` as ``nn.Linear``),
  optionally with ``c_attn`` split into ``q_proj``/``k_proj``/``v_proj``.

Written from the published model definitions (Meta's llama ``model.py``, nanoGPT ``model.py``,
the Qwen3 equations of HF's ``modeling_qwen3``/``modeling_qwen3_moe``, DeepSeek's
``inference/model.py``), so they are independent
of sdadapt and of transformers' code. Head counts are derived from the local width of each
projection output, so the same code runs unsharded and under tensor parallelism
(``ColwiseParallel`` q/k/v, ``RowwiseParallel`` output), where each rank holds whole heads.
``parallelize_*`` apply TP over mesh dim ``"tp"`` and FSDP2 over ``"fsdp"``, as present.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


# --------------------------------------------------------------------------------------------
# Meta Llama
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def precompute_freqs_cis(head_dim: int, seqlen: int, theta: float) -> torch.Tensor:
    """Meta's ``precompute_freqs_cis``: ``[seqlen, head_dim // 2]`` complex rotations."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(seqlen, dtype=torch.int64).float()
    return torch.polar(torch.ones(seqlen, head_dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's rotary: rows (2j, 2j+1) of each head form one complex number rotated by freq j."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


class MetaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, fused_qkv: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.fused_qkv = fused_qkv
        q, kv = n_heads * self.head_dim, n_kv_heads * self.head_dim
        if fused_qkv:
            self.wqkv = nn.Linear(dim, q + 2 * kv, bias=False)
        else:
            self.wq = nn.Linear(dim, q, bias=False)
            self.wk = nn.Linear(dim, kv, bias=False)
            self.wv = nn.Linear(dim, kv, bias=False)
        self.wo = nn.Linear(q, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        if self.fused_qkv:
            y = self.wqkv(x)  # under TP: this rank's [q_r; k_r; v_r] (interleaved per rank)
            unit = y.shape[-1] // (self.n_heads + 2 * self.n_kv_heads)
            xq, xk, xv = y.split([self.n_heads * unit, self.n_kv_heads * unit, self.n_kv_heads * unit], dim=-1)
        else:
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq, xk, xv = (t.reshape(b, s, -1, hd) for t in (xq, xk, xv))
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        return self.wo(causal_attention(xq, xk, xv))


def causal_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with GQA on ``[b, s, heads, head_dim]`` inputs (k/v heads are
    repeated to q's count); returns ``[b, s, heads * head_dim]``."""
    b, s, _, hd = xq.shape
    rep = xq.shape[2] // xk.shape[2]
    xk, xv = (t.repeat_interleave(rep, dim=2) for t in (xk, xv))
    q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    mask = torch.full((s, s), float("-inf")).triu(1)
    out = torch.softmax((scores + mask).float(), dim=-1).type_as(q) @ v
    return out.transpose(1, 2).reshape(b, s, -1)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, fused_w13: bool):
        super().__init__()
        self.fused_w13 = fused_w13
        if fused_w13:
            self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_w13:
            h1, h3 = self.w13(x).chunk(2, dim=-1)  # under TP: this rank's [w1_r; w3_r]
        else:
            h1, h3 = self.w1(x), self.w3(x)
        return self.w2(F.silu(h1) * h3)


class Router(nn.Module):
    """Softmax over the experts, top-k; ``norm_topk``: the k weights are renormalised to sum to 1
    (Mixtral always, Qwen3-MoE with ``norm_topk_prob``)."""

    def __init__(self, dim: int, experts: int, top_k: int, norm_topk: bool = True):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index


class GroupedExperts(nn.Module):
    """Stacked expert weights ``w1, w3: [E, hidden, dim]``, ``w2: [E, dim, hidden]``."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = torch.where(index == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, slot, None].to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, norm_topk: bool = True):
        super().__init__()
        self.router = Router(dim, experts, top_k, norm_topk)
        self.experts = GroupedExperts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = self.router(flat)
        return self.experts(flat, weights, index).reshape(shape)


class MetaBlock(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        dim = cfg["dim"]
        self.attention = MetaAttention(dim, cfg["n_heads"], cfg["n_kv_heads"], cfg.get("fused_qkv", False))
        self.attention_norm = RMSNorm(dim, cfg["norm_eps"])
        self.ffn_norm = RMSNorm(dim, cfg["norm_eps"])
        if cfg.get("n_experts"):
            self.moe = MoE(dim, cfg["hidden_dim"], cfg["n_experts"], cfg["top_k"])
        else:
            self.feed_forward = FeedForward(dim, cfg["hidden_dim"], cfg.get("fused_w13", False))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """Meta's reference Llama layout. ``cfg``: dim, n_layers, n_heads, n_kv_heads, vocab_size,
    hidden_dim, norm_eps, rope_theta; optional fused_qkv, fused_w13, n_experts + top_k (MoE).
    ``output`` is always its own parameter (a tied checkpoint fills it from ``tok_embeddings``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList([MetaBlock(cfg) for _ in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        freqs_cis = precompute_freqs_cis(cfg["dim"] // cfg["n_heads"], tokens.shape[1], cfg["rope_theta"])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


# --------------------------------------------------------------------------------------------
# Qwen3 / Qwen3-MoE (torchtitan-style names)
# --------------------------------------------------------------------------------------------
def rope_half(head_dim: int, seqlen: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's default rotary tables ``cos, sin``: ``[seqlen, head_dim]``, each frequency twice
    (first half of the head, then second half)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary on ``[b, s, heads, head_dim]``: row j pairs with row j + head_dim/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[None, :, None, :] + torch.cat((-x2, x1), dim=-1) * sin[None, :, None, :]


class Qwen3Attention(nn.Module):
    """q/k/v/o (optional biases), per-head RMSNorm of q and k before HF "half" rotary, GQA.
    ``fused_qkv`` is always False (read by :func:`parallelize_meta_llama`)."""

    fused_qkv = False

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, bias: bool):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        xq = self.q_norm(self.wq(x).reshape(b, s, -1, hd))
        xk = self.k_norm(self.wk(x).reshape(b, s, -1, hd))
        xv = self.wv(x).reshape(b, s, -1, hd)
        xq, xk = apply_rotary_half(xq, cos, sin), apply_rotary_half(xk, cos, sin)
        return self.wo(causal_attention(xq, xk, xv))


class Qwen3Block(nn.Module):
    def __init__(self, cfg: dict, layer: int):
        super().__init__()
        dim, eps = cfg["dim"], cfg["norm_eps"]
        self.attention = Qwen3Attention(
            dim, cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], eps, cfg.get("attention_bias", False)
        )
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        if cfg.get("n_experts") and layer not in cfg.get("dense_layers", ()):
            self.moe = MoE(dim, cfg["moe_hidden_dim"], cfg["n_experts"], cfg["top_k"], cfg.get("norm_topk", False))
        else:
            self.feed_forward = FeedForward(dim, cfg["hidden_dim"], fused_w13=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3(nn.Module):
    """Qwen3 in torchtitan's names. ``cfg``: dim, n_layers, n_heads, n_kv_heads, head_dim,
    vocab_size, hidden_dim, norm_eps, rope_theta; optional attention_bias; MoE: n_experts, top_k,
    moe_hidden_dim, norm_topk, dense_layers (indices with a dense ``feed_forward``).
    ``output`` is always its own parameter (a tied checkpoint fills it from ``tok_embeddings``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList([Qwen3Block(cfg, i) for i in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_half(self.cfg["head_dim"], tokens.shape[1], self.cfg["rope_theta"])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()


def parallelize_meta_llama(model: MetaLlama | Qwen3, mesh: DeviceMesh) -> MetaLlama | Qwen3:
    """TP (vocab-sharded embedding/output, colwise q/k/v and w1/w3, rowwise wo/w2) + FSDP2;
    MoE experts and norms are sharded by FSDP only. Serves both :class:`MetaLlama` and
    :class:`Qwen3` (same module names)."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        plan: dict = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            attn = layer.attention
            for name in ("wqkv",) if attn.fused_qkv else ("wq", "wk", "wv"):
                plan[p + "attention." + name] = ColwiseParallel()
            plan[p + "attention.wo"] = RowwiseParallel()
            if hasattr(layer, "feed_forward"):
                for name in ("w13",) if layer.feed_forward.fused_w13 else ("w1", "w3"):
                    plan[p + "feed_forward." + name] = ColwiseParallel()
                plan[p + "feed_forward.w2"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    _fsdp(model, model.layers, mesh)
    return model


def _fsdp(model: nn.Module, blocks: nn.ModuleList | list[nn.Module], mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names or ()
    dp = tuple(n for n in ("replicate", "fsdp") if n in names)
    if not dp:
        return
    dp_mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


# --------------------------------------------------------------------------------------------
# DeepSeek-V3 (torchtitan-style names)
# --------------------------------------------------------------------------------------------
class MLA(nn.Module):
    """Multi-head latent attention: q from ``wq`` (or low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b``),
    a shared latent ``wkv_a`` -> (``kv_norm`` -> ``wkv_b``: per-head k_nope and v) plus one
    rotary key shared by all heads. Rotary rows are interleaved pairs (Meta's complex rotation)."""

    def __init__(self, cfg: dict):
        super().__init__()
        dim, eps, heads = cfg["dim"], cfg["norm_eps"], cfg["n_heads"]
        self.nope, self.rope, self.v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kv_rank = cfg["kv_lora_rank"]
        qk = self.nope + self.rope
        if cfg.get("q_lora_rank"):
            self.wq_a = nn.Linear(dim, cfg["q_lora_rank"], bias=False)
            self.q_norm = RMSNorm(cfg["q_lora_rank"], eps)
            self.wq_b = nn.Linear(cfg["q_lora_rank"], heads * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.reshape(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).reshape(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        k_pe = apply_rotary_emb(k_pe[:, :, None, :], freqs_cis).expand(-1, -1, k_nope.shape[2], -1)
        q, k = torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, k_pe], dim=-1)
        return self.wo(causal_attention(q, k, v))


class DeepSeekMoE(nn.Module):
    """Sigmoid router with a per-expert selection bias (``expert_bias``, a persistent buffer as in
    torchtitan), group-limited top-k, optional renormalisation, ``route_scale``; stacked routed
    experts plus always-on ``shared_experts``."""

    def __init__(self, cfg: dict):
        super().__init__()
        dim, hidden, experts = cfg["dim"], cfg["moe_hidden_dim"], cfg["n_experts"]
        self.top_k, self.groups, self.top_groups = cfg["top_k"], cfg["n_groups"], cfg["topk_groups"]
        self.norm_topk, self.route_scale = cfg["norm_topk"], cfg["route_scale"]
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts), persistent=True)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.shared_experts = FeedForward(dim, hidden * cfg["n_shared_experts"], fused_w13=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores = torch.sigmoid(F.linear(flat.float(), self.router.gate.weight.float()))
        choice = scores + self.expert_bias
        grouped = choice.reshape(flat.shape[0], self.groups, -1)
        group_idx = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(self.top_groups, dim=-1)[1]
        keep = torch.zeros(flat.shape[0], self.groups, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape_as(choice), float("-inf"))
        index = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, index)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        routed = self.experts(flat, weights * self.route_scale, index)
        return routed.reshape(shape) + self.shared_experts(x)


class DeepSeekBlock(nn.Module):
    def __init__(self, cfg: dict, layer: int):
        super().__init__()
        self.attention = MLA(cfg)
        self.attention_norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.ffn_norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        if layer < cfg["n_dense_layers"]:
            self.feed_forward = FeedForward(cfg["dim"], cfg["hidden_dim"], fused_w13=False)
        else:
            self.moe = DeepSeekMoE(cfg)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3(nn.Module):
    """DeepSeek-V3 in torchtitan's names (the equations of DeepSeek's ``inference/model.py``).
    ``cfg``: dim, n_layers, n_heads, vocab_size, hidden_dim, norm_eps, rope_theta, q_lora_rank
    (0: one ``wq``), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_dense_layers,
    n_experts, top_k, n_groups, topk_groups, norm_topk, route_scale, moe_hidden_dim,
    n_shared_experts. Default rotary only (no YaRN)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList([DeepSeekBlock(cfg, i) for i in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        freqs_cis = precompute_freqs_cis(self.cfg["qk_rope_head_dim"], tokens.shape[1], self.cfg["rope_theta"])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def parallelize_deepseek(model: DeepSeekV3, mesh: DeviceMesh) -> DeepSeekV3:
    """TP as torchtitan's DeepSeek-V3: vocab-sharded embedding/output, colwise q (``wq``/``wq_b``)
    and ``wkv_b`` (whole heads), rowwise ``wo``; colwise/rowwise dense and shared-expert MLPs;
    the latent projections, norms, router and routed experts by FSDP only. Then FSDP2."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        plan: dict = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            q = "wq" if hasattr(layer.attention, "wq") else "wq_b"
            plan.update({p + "attention." + q: ColwiseParallel(), p + "attention.wkv_b": ColwiseParallel(),
                         p + "attention.wo": RowwiseParallel()})  # fmt: skip
            mlp = p + ("feed_forward." if hasattr(layer, "feed_forward") else "moe.shared_experts.")
            plan.update({mlp + "w1": ColwiseParallel(), mlp + "w3": ColwiseParallel(), mlp + "w2": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], plan)
    _fsdp(model, model.layers, mesh)
    return model


# --------------------------------------------------------------------------------------------
# nanoGPT GPT-2
# --------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, split_qkv: bool):
        super().__init__()
        self.n_embd, self.n_head, self.split_qkv = n_embd, n_head, split_qkv
        if split_qkv:
            self.q_proj = nn.Linear(n_embd, n_embd)
            self.k_proj = nn.Linear(n_embd, n_embd)
            self.v_proj = nn.Linear(n_embd, n_embd)
        else:
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.n_embd // self.n_head
        if self.split_qkv:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.reshape(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" (tanh approximation), as in the released weights' training
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, eps: float, split_qkv: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = CausalSelfAttention(n_embd, n_head, split_qkv)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: ``transformer.{wte,wpe,h.{i},ln_f}`` and ``lm_head`` (its own parameter
    here; a tied checkpoint fills it from ``transformer.wte``)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 eps: float = 1e-5, split_qkv: bool = False):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([GPTBlock(n_embd, n_head, eps, split_qkv) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd, eps=eps),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def parallelize_nanogpt(model: NanoGPT, mesh: DeviceMesh) -> NanoGPT:
    """TP on the MLP (and on attention when q/k/v are split), vocab-sharded lm_head; + FSDP2."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        plan: dict = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i, block in enumerate(model.transformer.h):
            p = f"transformer.h.{i}."
            plan[p + "mlp.c_fc"] = ColwiseParallel()
            plan[p + "mlp.c_proj"] = RowwiseParallel()
            if block.attn.split_qkv:
                for n in ("q_proj", "k_proj", "v_proj"):
                    plan[p + "attn." + n] = ColwiseParallel()
                plan[p + "attn.c_proj"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    _fsdp(model, model.transformer.h, mesh)
    return model
