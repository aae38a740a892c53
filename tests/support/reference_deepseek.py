"""A DeepSeek-V3 reference model in torchtitan's names, written from DeepSeek's equations
(``inference/model.py``), independent of sdadapt and of transformers' code: MLA attention
(``attention.wq`` or ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``) with
interleaved rotary rows, dense first layers, and MoE layers with a sigmoid group-limited router,
``moe.expert_bias``, stacked experts and ``moe.shared_experts``. Shared pieces (norms, rotary,
attention, feed-forward, the model frame, FSDP) come from :mod:`reference_models`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from support.reference_models import (
    DecoderLM,
    FeedForward,
    GroupedExperts,
    RMSNorm,
    _fsdp,
    apply_rotary_emb,
    causal_attention,
    precompute_freqs_cis,
    vocab_parallel_plan,
)


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


class DeepSeekV3(DecoderLM):
    """DeepSeek-V3 in torchtitan's names (the equations of DeepSeek's ``inference/model.py``).
    ``cfg``: dim, n_layers, n_heads, vocab_size, hidden_dim, norm_eps, rope_theta, q_lora_rank
    (0: one ``wq``), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_dense_layers,
    n_experts, top_k, n_groups, topk_groups, norm_topk, route_scale, moe_hidden_dim,
    n_shared_experts. Default rotary only (no YaRN)."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, DeepSeekBlock)

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        return (precompute_freqs_cis(self.cfg["qk_rope_head_dim"], seqlen, self.cfg["rope_theta"]),)


def parallelize_deepseek(model: DeepSeekV3, mesh: DeviceMesh) -> DeepSeekV3:
    """TP as torchtitan's DeepSeek-V3: vocab-sharded embedding/output, colwise q (``wq``/``wq_b``)
    and ``wkv_b`` (whole heads), rowwise ``wo``; colwise/rowwise dense and shared-expert MLPs;
    the latent projections, norms, router and routed experts by FSDP only. Then FSDP2."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        plan = vocab_parallel_plan()
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
