"""What refit tests compare engine shards against: the adapter's recipes applied eagerly to the
trainer's full tensors, and a tensor's bytes for equality (float8 has no equality on every build);
the small HF-layout Llama weights they refit, and the quantized engines' adapters (shared with
bench/refit_bench.py)."""

from __future__ import annotations

import torch

import sdadapt
from sdadapt._base.schema import TensorInfo, slices
from sdadapt._export import plan_outputs


class _IO:
    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd

    def read(self, key, box):
        return self.sd[key][slices(box)]


def eager(full: dict[str, torch.Tensor], adapter: sdadapt.Adapter) -> dict[str, torch.Tensor]:
    """The engine's whole tensors: the adapter's recipes applied eagerly to the full weights."""
    schema = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in full.items()}
    outputs, _ = plan_outputs(schema, adapter, what="test")
    return {k: node.full(_IO(full)) for k, node in outputs.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 has no equality on every build)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def llama_weights(layers: int, dims: tuple[int, int, int, int, int], vocab: int, seed: int,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:  # fmt: skip
    """A Llama's weights in HF's layout, ``dims`` = (hidden, heads, kv heads, head dim, MLP
    hidden), random from ``seed``; the decoder layers' in ``dtype``, the rest float32."""
    d, h, kv, hd, f = dims
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g), "model.norm.weight": torch.randn(d, generator=g),
          "lm_head.weight": torch.randn(vocab, d, generator=g)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h * hd, d)), ("self_attn.k_proj", (kv * hd, d)), ("self_attn.v_proj", (kv * hd, d)),
                            ("self_attn.o_proj", (d, h * hd)), ("mlp.gate_proj", (f, d)), ("mlp.up_proj", (f, d)),
                            ("mlp.down_proj", (d, f)), ("input_layernorm", (d,)), ("post_attention_layernorm", (d,))):  # fmt: skip
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g).to(dtype)
    return sd


def local_shape(layout, t: torch.Tensor, key: str) -> list[int]:  # noqa: ANN001 - a vLLM ShardLayout
    """The shape of one engine rank's shard of whole tensor ``t`` (``key``) as ``layout`` cuts it."""
    d = layout.dim_of(key)
    shape = list(t.shape)
    if d is not None:
        shape[d] //= layout.size
    return shape


QUANT_FORMATS: dict[str, dict[str, object]] = {
    "fp8_block": {},  # vllm_fp8: e4m3, float32 scales per 128 x 128 block
    "fp8_channel": dict(codec="e4m3", strategy="channel"),
    "fp8_tensor": dict(codec="e4m3", strategy="tensor"),
    "mxfp8": dict(codec="e4m3", strategy="group", group_size=32, scale_dtype="uint8"),
    "nvfp4": dict(codec="e2m1", strategy="group", group_size=16, global_suffix="_global_scale"),
}
"""The quantized engines a refit is tested and benched into: vLLM's FP8 block format, and
compressed-tensors' FP8 per channel and per tensor, MXFP8 (e8m0 per 32) and NVFP4 (e2m1, e4m3
per 16, a dividing global scale)."""


def quant_adapter(fmt: str, block: tuple[int, int] = (128, 128)) -> sdadapt.Adapter:
    """Appended to a vLLM layout's adapter: its linear weights (``*_proj.weight``) quantized in
    ``fmt`` (:data:`QUANT_FORMATS`), each scale at ``<weight>_scale_inv`` (so that a vLLM FP8
    layout cuts it as its weight)."""
    from sdadapt.adapters import vllm_fp8

    if fmt == "fp8_block":
        return vllm_fp8.build(block=block)
    rule = sdadapt.dequant_scaled("model.layers.**.*_proj.weight", scale_suffix=vllm_fp8.SCALE_SUFFIX, **QUANT_FORMATS[fmt])  # type: ignore[arg-type]
    return sdadapt.Adapter([rule]).inverse()


def quant_engine(shapes: dict[str, tuple[int, ...]], adapter: sdadapt.Adapter, dtype: torch.dtype,
                 device: str = "cpu") -> dict[str, torch.Tensor]:  # fmt: skip
    """Zeroed engine tensors for ``adapter``'s outputs from float32 trainer tensors of ``shapes``:
    the quantized weights and their scales as the adapter makes them, the rest in ``dtype``."""
    schema = {k: TensorInfo(tuple(s), torch.float32) for k, s in shapes.items()}
    outputs, _ = plan_outputs(schema, adapter, what="engine")
    return {k: torch.zeros(n.shape, dtype=n.dtype if "_proj.weight" in k else dtype, device=device) for k, n in outputs.items()}
