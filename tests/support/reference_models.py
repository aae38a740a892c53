"""Small reference implementations of layouts that have no public model class.

- :class:`MetaLlama`: the Meta reference Llama layout (``tok_embeddings``, ``layers.{i}.attention.wq``,
  ``feed_forward.w1|w2|w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) with Meta's
  rotary (complex multiply on *interleaved* row pairs of each head), GQA, optional fused ``wqkv``
  and ``w13``, optional Meta-style MoE with stacked experts (``layers.{i}.moe.experts.w1|w2|w3``
  of shape ``[E, ...]`` and ``layers.{i}.moe.router.gate``) in place of the dense feed-forward;
- :class:`Qwen3`: Qwen3 / Qwen3-MoE in the same family of names (torchtitan's Qwen3), with
  ``attention.q_norm|k_norm`` (RMSNorm over each head), HF's "half" rotary order, optional
  q/k/v/o biases, and MoE layers (``moe.*`` as above) beside dense ``feed_forward`` layers;
- :class:`GptOss`: GPT-OSS in the same family of names: q/k/v/o with biases, per-head
  ``attention.sinks``, YaRN rotary in HF's "half" order, sliding-window and full attention
  alternating, a router with bias (top-k of the logits, softmax over the k) and stacked experts
  ``moe.experts.w1|w3`` ``[E, F, dim]``, ``w2`` ``[E, dim, F]`` with biases ``b1|b3|b2`` and the
  clamped SwiGLU (``alpha``, ``limit``); :func:`parallelize_gpt_oss` also shards the experts'
  F dim and the sinks over ``"tp"``;
- :class:`NanoGPT`: nanoGPT's GPT-2 (``transformer.h.{i}.attn.c_attn`` as ``nn.Linear``),
  optionally with ``c_attn`` split into ``q_proj``/``k_proj``/``v_proj``.

Written from the published model definitions (Meta's llama ``model.py``, nanoGPT ``model.py``,
the Qwen3 equations of HF's ``modeling_qwen3``/``modeling_qwen3_moe``, OpenAI's ``gpt_oss/torch/model.py``),
so they are independent of sdadapt and of transformers' code; the decoders share one frame,
:class:`DecoderLM`. Head counts are derived from the local width of each projection output, so
the same code runs unsharded and under tensor parallelism (``ColwiseParallel`` q/k/v,
``RowwiseParallel`` output), where each rank holds whole heads. ``parallelize_*`` apply TP over
mesh dim ``"tp"`` and FSDP2 over ``"fsdp"``, as present.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
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


class DecoderLM(nn.Module):
    """The decoders' frame: ``tok_embeddings``, ``layers`` (``block(cfg, i)`` each), ``norm``, ``output`` (always
    its own parameter: a tied checkpoint fills it from ``tok_embeddings``). ``forward`` calls each block as
    ``block(h, *self.rotary(seqlen))``: each family supplies its rotary tables."""

    def __init__(self, cfg: dict, block: Callable[[dict, int], nn.Module]):
        super().__init__()
        self.cfg = dict(cfg)
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList([block(cfg, i) for i in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        """The rotary tables every block takes after the hidden states."""
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tables = self.rotary(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, *tables)
        return self.output(self.norm(h)).float()


class MetaLlama(DecoderLM):
    """Meta's reference Llama layout. ``cfg``: dim, n_layers, n_heads, n_kv_heads, vocab_size,
    hidden_dim, norm_eps, rope_theta; optional fused_qkv, fused_w13, n_experts + top_k (MoE)."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, lambda block_cfg, _layer: MetaBlock(block_cfg))

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        return (precompute_freqs_cis(cfg["dim"] // cfg["n_heads"], seqlen, cfg["rope_theta"]),)


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
        self.attention = Qwen3Attention(dim, cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], eps, cfg.get("attention_bias", False))
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


class Qwen3(DecoderLM):
    """Qwen3 in torchtitan's names. ``cfg``: dim, n_layers, n_heads, n_kv_heads, head_dim,
    vocab_size, hidden_dim, norm_eps, rope_theta; optional attention_bias; MoE: n_experts, top_k,
    moe_hidden_dim, norm_topk, dense_layers (indices with a dense ``feed_forward``)."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, Qwen3Block)

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        return rope_half(self.cfg["head_dim"], seqlen, self.cfg["rope_theta"])


def vocab_parallel_plan() -> dict:
    """The decoders' TP plan for ``tok_embeddings`` and ``output``: vocab-sharded, outputs replicated."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def parallelize_meta_llama(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """TP (vocab-sharded embedding/output, colwise q/k/v and w1/w3, rowwise wo/w2) + FSDP2;
    MoE experts and norms are sharded by FSDP only. Serves :class:`MetaLlama`, :class:`Qwen3`
    and :class:`GptOss` (same module names)."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        plan = vocab_parallel_plan()
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
# GPT-OSS (torchtitan-style names)
# --------------------------------------------------------------------------------------------
def rope_yarn(head_dim: int, seqlen: int, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's YaRN rotary tables ``cos, sin`` ``[seqlen, head_dim]`` (OpenAI's
    ``RotaryEmbedding``): frequencies blended between interpolation (``/ factor``) and
    extrapolation by a linear ramp over ``beta_fast..beta_slow`` rotations of the original
    context, both tables scaled by the concentration ``0.1 * ln(factor) + 1``."""
    base, factor, ctx = rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"]
    freq = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    half = head_dim / 2
    low = max(half * math.log(ctx / (rope["beta_fast"] * 2 * math.pi)) / math.log(base), 0.0)
    high = min(half * math.log(ctx / (rope["beta_slow"] * 2 * math.pi)) / math.log(base), head_dim - 1.0)
    mask = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1.0 / (factor * freq)) * (1 - mask) + (1.0 / freq) * mask
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), inv_freq).repeat(1, 2)  # as rope_half's
    concentration = 0.1 * math.log(factor) + 1.0
    return angles.cos() * concentration, angles.sin() * concentration


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a TP-sharded parameter (FSDP2 leaves it a DTensor on the TP mesh)."""
    return t.to_local() if isinstance(t, DTensor) else t


class GptOssAttention(nn.Module):
    """q/k/v/o with biases, YaRN rotary on row halves, GQA, one sink logit per head that joins
    each softmax and is dropped after it, a causal mask narrowed to ``window`` keys when set.
    ``fused_qkv`` is always False (read by :func:`parallelize_meta_llama`)."""

    fused_qkv = False

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None):
        super().__init__()
        self.head_dim, self.window = head_dim, window
        self.wq = nn.Linear(dim, n_heads * head_dim)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim)
        self.wo = nn.Linear(n_heads * head_dim, dim)
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        xq, xk, xv = (w(x).reshape(b, s, -1, hd) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_half(xq, cos, sin), apply_rotary_half(xk, cos, sin)
        rep = xq.shape[2] // xk.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (xq, xk.repeat_interleave(rep, 2), xv.repeat_interleave(rep, 2)))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        pos = torch.arange(s)
        hidden = pos[None, :] > pos[:, None]
        if self.window is not None:
            hidden |= pos[None, :] <= pos[:, None] - self.window
        scores = scores.masked_fill(hidden, float("-inf"))
        sinks = local(self.sinks).reshape(1, -1, 1, 1).expand(b, -1, s, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


class GptOssExperts(nn.Module):
    """Stacked experts with biases; ``swiglu``: gate clamped above at ``limit``, up to
    ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``. Under TP each rank holds an
    F slice of w1/w3/b1/b3/w2: the partial down projections are summed over the TP group, then
    b2 (replicated) is added once."""

    def __init__(self, experts: int, dim: int, hidden: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.w1 = nn.Parameter(torch.zeros(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.zeros(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.zeros(experts, dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(experts, hidden))
        self.b3 = nn.Parameter(torch.zeros(experts, hidden))
        self.b2 = nn.Parameter(torch.zeros(experts, dim))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        w1, w3, w2, b1, b3, b2 = (local(p) for p in (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2))
        down, bias = torch.zeros_like(x), torch.zeros_like(x)
        for e in range(w1.shape[0]):
            tok, slot = torch.where(index == e)
            if tok.numel() == 0:
                continue
            xe, we = x[tok], weights[tok, slot, None]
            gate = (xe @ w1[e].T + b1[e]).clamp(max=self.limit)
            up = (xe @ w3[e].T + b3[e]).clamp(-self.limit, self.limit)
            h = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
            down.index_add_(0, tok, (h @ w2[e].T) * we)
            bias.index_add_(0, tok, b2[e] * we)
        if isinstance(self.w2, DTensor):
            torch.distributed.all_reduce(down, group=self.w2.device_mesh.get_group())
        return down + bias


class GptOssMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, alpha: float, limit: float):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, experts)
        self.experts = GptOssExperts(experts, dim, hidden, alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top, index = torch.topk(self.router.gate(flat), self.top_k, dim=-1)
        return self.experts(flat, torch.softmax(top, dim=-1), index).reshape(x.shape)


class GptOssBlock(nn.Module):
    def __init__(self, cfg: dict, layer: int):
        super().__init__()
        dim, eps = cfg["dim"], cfg["norm_eps"]
        window = cfg["sliding_window"] if layer % 2 == 0 else None  # sliding, full, sliding, ...
        self.attention = GptOssAttention(dim, cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], window)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.moe = GptOssMoE(dim, cfg["hidden_dim"], cfg["n_experts"], cfg["top_k"], cfg["swiglu_alpha"], cfg["swiglu_limit"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.moe(self.ffn_norm(h))


class GptOss(DecoderLM):
    """GPT-OSS in torchtitan's names. ``cfg``: dim, n_layers, n_heads, n_kv_heads, head_dim,
    vocab_size, hidden_dim (F), n_experts, top_k, norm_eps, sliding_window, swiglu_alpha,
    swiglu_limit, rope (rope_theta, factor, beta_fast, beta_slow, original_max_position_embeddings)."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, GptOssBlock)

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        return rope_yarn(self.cfg["head_dim"], seqlen, self.cfg["rope"])


def parallelize_gpt_oss(model: GptOss, mesh: DeviceMesh) -> nn.Module:
    """:func:`parallelize_meta_llama`'s TP + FSDP2, and over ``"tp"`` the sinks by head and the
    experts along F (w1/w3/b1/b3 dim 1, w2 dim 2; b2 replicated)."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        tp = mesh["tp"]
        for layer in model.layers:
            shards = [(layer.attention, "sinks", Shard(0))]
            shards += [(layer.moe.experts, n, Shard(1)) for n in ("w1", "w3", "b1", "b3")]
            shards += [(layer.moe.experts, "w2", Shard(2)), (layer.moe.experts, "b2", Replicate())]
            for module, name, placement in shards:
                param = getattr(module, name)
                module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, tp, [placement])))
    return parallelize_meta_llama(model, mesh)


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

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, eps: float = 1e-5, split_qkv: bool = False
    ):
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
