"""FP8 and MXFP4 releases written by hand (block and UE8M0 scales), their eager reference
dequantisation and the tiny model they load into; raw byte writers and readers for the export checks.
"""

from __future__ import annotations

import json
import os
import struct

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdadapt
from sdadapt._recipes import quant as Q
from support.checkpoints import write_safetensors

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def ref_dequant_fp8(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Element by element: float(w[i, j]) * scale[i // b0, j // b1], rounded once to float32;
    the scale is the stored float32, or ``2 ** (byte - 127)`` of an exponent byte (``fmt="ue8m0"``)."""
    b0, b1 = block
    lead = w.shape[:-2]
    wf = w.float().reshape(-1, *w.shape[-2:])
    sf = s.reshape(-1, *s.shape[-2:])
    if fmt == "ue8m0":
        sf = sf.view(torch.uint8)  # float8_e8m0fnu scales: their exponent bytes
    out = torch.empty(wf.shape, dtype=torch.float32)
    for n in range(wf.shape[0]):
        for i in range(wf.shape[1]):
            for j in range(wf.shape[2]):
                raw = sf[n, i // b0, j // b1]
                scale = 2.0 ** (int(raw) - 127) if fmt == "ue8m0" else float(raw)
                out[n, i, j] = float(wf[n, i, j]) * scale  # exact in float64, one rounding to float32
    return out.reshape(*lead, *w.shape[-2:]).to(dtype)


def ref_dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Element by element: value 2k of a block is the low nibble of byte k, 2k+1 the high nibble."""
    b = blocks.reshape(-1, *blocks.shape[-2:])
    s = scales.reshape(-1, scales.shape[-1])
    out = torch.empty(b.shape[0], b.shape[1] * 32, dtype=torch.float32)
    for n in range(b.shape[0]):
        for g in range(b.shape[1]):
            scale = 2.0 ** (int(s[n, g]) - 127)
            for k in range(16):
                byte = int(b[n, g, k])
                out[n, g * 32 + 2 * k] = FP4[byte & 15] * scale
                out[n, g * 32 + 2 * k + 1] = FP4[byte >> 4] * scale
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32).to(dtype)


def fp8_release(shape: tuple[int, ...], block: tuple[int, int], fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight quantized from random values (a stand-in for a released FP8 tensor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
    return Q.quantize_fp8(x, block, fmt)  # type: ignore[arg-type]


def mxfp4_release(lead: tuple[int, ...], cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return Q.quantize_mxfp4(torch.randn(*lead, cols, generator=g))


BLOCK = (16, 32)


V, D, F, E = 10, 64, 40, 3


class Layer(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, F, bias=False, dtype=dtype)  # [40, 64]: 40 rows cut 16-row tiles
        self.w2 = nn.Linear(F, D, bias=False, dtype=dtype)  # [64, 40]: 40 cols cut 32-col tiles
        self.norm = nn.Parameter(torch.ones(D, dtype=dtype))
        self.mlp = nn.Module()
        self.mlp.experts = nn.Parameter(torch.empty(E, F, D, dtype=dtype))  # MXFP4: 64 = 2 blocks of 32


class Tiny(nn.Module):
    """A model whose checkpoint is an FP8 release (w1, w2) with MXFP4 experts (keys without ``model.``)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D, dtype=dtype)
        self.layers = nn.ModuleList([Layer(dtype)])


def fp8_adapter(fmt: str) -> sdadapt.Adapter:
    """``"ue8m0_float32"``: a ``scale_fmt: ue8m0`` config whose release stores float32 scales
    (the release's schema tells ``dequant_rules``)."""
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3",
                                      "activation_scheme": "dynamic", **({"scale_fmt": "ue8m0"} if "ue8m0" in fmt else {})}}  # fmt: skip
    schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in release_tensors(fmt).items()}
    return sdadapt.Adapter(
        [
            *sdadapt.dequant_rules(config, schema=schema if fmt == "ue8m0_float32" else None),
            sdadapt.dequant_mxfp4("model.layers.{i}.mlp.experts"),
            sdadapt.rename("model.{rest:*}", "{rest}"),  # also matches the scales' names: no ambiguity
        ],
        name="tiny-quant",
    )


def release_tensors(fmt: str, seed: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1, s1 = fp8_release((F, D), BLOCK, fmt, seed)
    w2, s2 = fp8_release((D, F), BLOCK, fmt, seed + 1)
    xb, xs = mxfp4_release((E, F), D, seed + 2)
    return {
        "model.embed_tokens.weight": torch.randn(V, D, generator=g).to(torch.bfloat16),
        "model.layers.0.w1.weight": w1,
        "model.layers.0.w1.weight_scale_inv": s1,
        "model.layers.0.w2.weight": w2,
        "model.layers.0.w2.weight_scale_inv": s2,
        "model.layers.0.norm": torch.randn(D, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts_blocks": xb,
        "model.layers.0.mlp.experts_scales": xs,
    }


def expected_model(fmt: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What the model must hold: the release dequantised by the loop references."""
    t = release_tensors(fmt)
    return {
        "embed_tokens.weight": t["model.embed_tokens.weight"].to(dtype),
        "layers.0.w1.weight": ref_dequant_fp8(t["model.layers.0.w1.weight"], t["model.layers.0.w1.weight_scale_inv"], BLOCK, fmt, dtype),
        "layers.0.w2.weight": ref_dequant_fp8(t["model.layers.0.w2.weight"], t["model.layers.0.w2.weight_scale_inv"], BLOCK, fmt, dtype),
        "layers.0.norm": t["model.layers.0.norm"].to(dtype),
        "layers.0.mlp.experts": ref_dequant_mxfp4(t["model.layers.0.mlp.experts_blocks"], t["model.layers.0.mlp.experts_scales"], dtype),
    }


def write_release(folder: str, fmt: str) -> str:
    path = os.path.join(folder, "model.safetensors")
    write_safetensors(path, release_tensors(fmt))
    return path


def parallelize_tiny(model: nn.Module, kind: str, *, shard_experts: bool = False) -> nn.Module:
    """``model`` (a tiny test model on meta whose ``layers[0]`` has ``w1`` / ``w2``) sharded by
    ``kind``: ``fsdp``, ``tp`` (w1 column-, w2 row-parallel; with ``shard_experts`` the stacked
    ``mlp.experts`` along dim 2 too) or ``fsdp_tp_2x2``."""
    layer = model.layers[0]
    if kind == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",)))
        return model
    if kind == "fsdp_tp_2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        tp = mesh["tp"]
    else:
        tp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(layer, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if shard_experts:
        layer.mlp.experts = nn.Parameter(distribute_tensor(layer.mlp.experts.data, tp, [Shard(2)]))
    if kind == "fsdp_tp_2x2":
        fully_shard(model, mesh=mesh["fsdp"])
    return model


Raw = tuple[str, list[int], bytes]  # safetensors dtype name, shape, data


NAMES = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.uint8: "U8", torch.bfloat16: "BF16",
         torch.float8_e8m0fnu: "F8_E8M0"}  # fmt: skip


def raw(t: torch.Tensor) -> Raw:
    return NAMES[t.dtype], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def write_by_hand(path: str, tensors: dict[str, Raw]) -> str:
    """A safetensors file: 8-byte little-endian header length, JSON header, then the data."""
    header, offset = {}, 0
    for key, (dtype, shape, data) in tensors.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(data for _, _, data in tensors.values()))
    return path


def read_by_hand(path: str) -> dict[str, Raw]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (e["dtype"], e["shape"], data[e["data_offsets"][0] : e["data_offsets"][1]]) for k, e in header.items()}
