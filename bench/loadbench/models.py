"""The model the checkpoint is loaded into: a Llama skeleton (no forward pass: this is a load
benchmark) built on the meta device, parallelised, and for the materialised flow given values."""

from __future__ import annotations

from typing import Any

from .common import BenchError
from .shapes import Shape


def build_model(shape: Shape, naming: str) -> tuple[Any, list[Any]]:
    """A Llama skeleton on the meta device with HF names (``hf``), torchtitan names (``titan``)
    or torchtitan names with fused ``wqkv``/``w13`` (``fused``). Returns (model, blocks)."""
    import torch
    from torch import nn

    dtype = getattr(torch, shape.dtype)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim

    def lin(o: int, n: int) -> nn.Linear:
        return nn.Linear(n, o, bias=False)

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(h))

    with torch.device("meta"):
        model = nn.Module()
        blocks = nn.ModuleList()
        if naming == "hf":
            model.model = nn.Module()
            model.model.embed_tokens = nn.Embedding(shape.vocab, h)
            for _ in range(shape.layers):
                b = nn.Module()
                b.self_attn = nn.Module()
                b.self_attn.q_proj, b.self_attn.k_proj = lin(h, h), lin(kv, h)
                b.self_attn.v_proj, b.self_attn.o_proj = lin(kv, h), lin(h, h)
                b.mlp = nn.Module()
                b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj = lin(i, h), lin(i, h), lin(h, i)
                b.input_layernorm, b.post_attention_layernorm = Norm(), Norm()
                blocks.append(b)
            model.model.layers = blocks
            model.model.norm = Norm()
            model.lm_head = lin(shape.vocab, h)
        else:
            model.tok_embeddings = nn.Embedding(shape.vocab, h)
            for _ in range(shape.layers):
                b = nn.Module()
                b.attention = nn.Module()
                if naming == "fused":
                    b.attention.wqkv = lin(h + 2 * kv, h)
                else:
                    b.attention.wq, b.attention.wk, b.attention.wv = lin(h, h), lin(kv, h), lin(kv, h)
                b.attention.wo = lin(h, h)
                b.feed_forward = nn.Module()
                if naming == "fused":
                    b.feed_forward.w13 = lin(2 * i, h)
                else:
                    b.feed_forward.w1, b.feed_forward.w3 = lin(i, h), lin(i, h)
                b.feed_forward.w2 = lin(h, i)
                b.attention_norm, b.ffn_norm = Norm(), Norm()
                blocks.append(b)
            model.layers = blocks
            model.norm = Norm()
            model.output = lin(shape.vocab, h)
    model.to(dtype)
    return model, list(blocks)


def tp_plan(naming: str) -> dict[str, Any]:
    """``parallelize_module`` plan (Megatron-style colwise/rowwise pairs) for the HF or titan names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if naming == "hf":
        return {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    if naming != "titan":
        raise BenchError("TP layout is benchmarked for the rename-only and HF-named models")
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def parallelize(model: Any, blocks: list[Any], naming: str, layout: str, device_type: str) -> Any:
    """FSDP2 over all ranks (``fsdp``), TP over all ranks (``tp``) or every rank a replica (``hsdp``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan(naming))
    elif layout == "hsdp":  # every rank a replica (FSDP over 1 rank): each needs the whole model
        mesh = init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "fsdp"))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise BenchError(f"unknown layout {layout!r}")
    return model


def materialize_with_values(model: Any, device: Any, seed: int) -> None:
    """What a training job does before its checkpoint load (torchtitan: ``to_empty`` then
    ``init_weights``): allocate every parameter on ``device`` and write values into it, normal(0,
    0.02) for matrices and ones for norm weights. Each rank fills its own shards, so every page of
    the model is touched before the load, as in a real job."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    torch.manual_seed(seed + (dist.get_rank() if dist.is_initialized() else 0))
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
