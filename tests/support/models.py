"""Small models shared by tests, examples and benchmarks' test counterparts."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Attention(nn.Module):
    """The discussion's attention: one fused ``qkv`` projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, -1, self.o_proj.in_features // self.heads).transpose(1, 2) for t in (q, k, v))
        y = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyTransformer(nn.Module):
    """The model of shared/seed/discussion.txt, at a configurable (odd-friendly) size."""

    def __init__(self, layers: int = 2, dim: int = 16, heads: int = 4, ffn: int = 40, vocab: int = 37):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Layer(dim, heads, ffn) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "embedding": ColwiseParallel(),
    "head": RowwiseParallel(output_layouts=Replicate()),
    "layers.*.attn.qkv": ColwiseParallel(),
    "layers.*.attn.o_proj": RowwiseParallel(),
    "layers.*.ffn.0": ColwiseParallel(),
    "layers.*.ffn.2": RowwiseParallel(),
}


# A TP plan whose forward pass is correct (TP_PLAN shards the fused qkv contiguously, which
# loads fine but gives each rank a wrong mix of q/k/v rows; its embedding output is also
# sharded on the feature dim). Attention stays replicated over TP; the vocab-sharded embedding
# and head and the FFN are tensor parallel, with replicated activations between blocks.
TP_PLAN_FORWARD = {
    "embedding": RowwiseParallel(input_layouts=Replicate()),
    "head": ColwiseParallel(output_layouts=Replicate()),
    "layers.*.ffn.0": ColwiseParallel(),
    "layers.*.ffn.2": RowwiseParallel(),
}


def parallelize(model: TinyTransformer, mesh: DeviceMesh, tp_plan: dict | None = None) -> TinyTransformer:
    """TP over mesh dim "tp" and FSDP2 over "fsdp" (or HSDP over ("replicate", "fsdp")), as present.

    ``tp_plan`` defaults to :data:`TP_PLAN` (the discussion's); :data:`TP_PLAN_FORWARD` gives a
    model whose forward pass matches the unsharded one."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], TP_PLAN if tp_plan is None else tp_plan)
    dp = tuple(n for n in ("replicate", "fsdp") if n in names)
    if dp:
        dp_mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def split_qkv(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The discussion model's state dict with ``qkv`` cut into ``q_proj``/``k_proj``/``v_proj``."""
    out = {}
    for k, v in state_dict.items():
        if ".qkv." in k:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[k.replace(".qkv.", f".{name}.")] = part.clone()
        else:
            out[k] = v.clone()
    return out


def module_of(sd: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree whose parameters are ``sd`` (its dotted keys), frozen."""
    root = nn.Module()
    for key, t in sd.items():
        *path, leaf = key.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root
