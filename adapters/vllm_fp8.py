"""vLLM's block-quantized FP8 weights (DeepSeek-V3's serving format: ``quant_method: fp8`` with
``weight_block_size: [128, 128]``), appended to a vLLM layout adapter for refit.

vLLM's ``Fp8LinearMethod`` and ``Fp8MoEMethod`` with block quantization hold each linear layer's
weight as ``float8_e4m3fn`` and its scales as float32 ``<weight>_scale_inv``, one per block of
``block`` rows x columns (``[ceil(R / 128), ceil(C / 128)]``; FusedMoE's ``w13_weight_scale_inv``
``[E, ceil(2I / 128), ceil(dim / 128)]``), each rank the blocks of its shard. A block's scale is
its largest magnitude over 448 (1 for an all-zero block); its values are the weight over the
scale, clamped to +-448 and rounded to e4m3: DeepSeek-V3's and compressed-tensors' block
quantization, here computed from the trainer's float32 or bfloat16 values (the same arithmetic
as ``sdadapt.dequant_fp8(...).inverse()``).

The adapter (:func:`build`) quantizes the vLLM layout's whole tensors; :func:`layout` wraps a
vLLM layout (``vllm_llama.layout(tp, rank)``, ...) so that it cuts a weight's scales as it cuts
the weight and refuses a rank's share that is not whole blocks. That
equals quantizing each checkpoint tensor (what vLLM's loader would be given) when every fused
part (``q``/``k``/``v``, ``gate``/``up``) and every rank's share of a cut dim is a multiple of the
block, which vLLM requires of block-quantized layers anyway. In a refit the trainer rank that
holds a block quantizes it and sends its e4m3 bytes and scale; a block that straddles two
trainer shards is fetched whole by the engine rank (its rows from each shard) and quantized
there, never the whole tensor.

Not covered: per-tensor and per-channel FP8 scales (vLLM computes those itself when it
quantizes a bfloat16 checkpoint online), activation scales.
"""

from __future__ import annotations

import dataclasses
import re

from sdadapt.adapters._vllm import SCALE_SUFFIX, ShardLayout

import sdadapt
from sdadapt import Adapter

SUMMARY = "vLLM's block-quantized FP8 (weight e4m3 + weight_scale_inv per 128x128 block), after a vLLM layout; for refit"

BLOCK = (128, 128)
KEYS = "model.layers.**"
EXCLUDE = ("**.mlp.gate.weight",)
"""vLLM quantizes every linear layer of the decoder layers but the MoE router (``mlp.gate``);
the embeddings, the head and the norms (one-dim, never matched) stay unquantized."""


def build(*, block: tuple[int, int] = BLOCK, keys: str = KEYS, exclude: list[str] | None = None) -> Adapter:
    """The adapter quantizing a vLLM layout's weights (two or more dims, matching ``keys``, not
    ``exclude``) to e4m3 with float32 block scales ``<weight>_scale_inv``.

    Args:
        block: the scale block, ``(rows, cols)`` (``weight_block_size``).
        keys: the weights' key pattern (vLLM's keys).
        exclude: key patterns left unquantized (default: the MoE router, ``**.mlp.gate.weight``).

    Returns:
        The adapter; append it to a vLLM layout adapter.

    Example::

        from sdadapt.adapters import vllm_fp8, vllm_llama

        adapter = vllm_llama.build(n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336) + vllm_fp8.build()
    """
    rule = sdadapt.dequant_fp8(keys, (block[0], block[1]), exclude=list(EXCLUDE if exclude is None else exclude), scale_suffix=SCALE_SUFFIX)
    return Adapter([rule], name="vllm_fp8", description=f"vLLM FP8, block {list(block)}").inverse()


def layout(base: ShardLayout, block: tuple[int, int] = BLOCK) -> ShardLayout:
    """A vLLM layout (``vllm_llama.layout(tp, rank)``, ...) for the FP8 weights: the scales cut as
    their weights, and a weight whose share of a cut dim is not whole blocks refused.

    Args:
        base: the unquantized layout of this rank.
        block: the scale block.

    Returns:
        The layout, for ``sdadapt.refit_plan(..., engine_layout=...)``.

    Example::

        engine_layout = vllm_fp8.layout(vllm_llama.layout(tp=2, rank=rank))
    """
    return dataclasses.replace(base, block=(block[0], block[1]))


def parameter_shapes(
    shapes: dict[str, tuple[int, ...]], *, block: tuple[int, int] = BLOCK, keys: str = KEYS, exclude: list[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """One rank's vLLM parameter shapes (a layout module's ``parameter_shapes(...)``) with the
    block scales of the weights :func:`build` quantizes, each after its weight.

    Args:
        shapes: the unquantized layout's shapes on one rank.
        block: the scale block.
        keys, exclude: as for :func:`build`.

    Returns:
        Every key's shape; the quantized weights are those with a ``_scale_inv`` beside them.

    Example::

        shapes = vllm_fp8.parameter_shapes(vllm_llama.parameter_shapes(n_layers=2, vocab_size=100, dim=256,
                                                                       n_heads=4, hidden_dim=512))
    """
    take, skip = _glob(keys), [_glob(p) for p in (EXCLUDE if exclude is None else exclude)]
    out: dict[str, tuple[int, ...]] = {}
    for k, s in shapes.items():
        out[k] = s
        if len(s) >= 2 and take.fullmatch(k) and not any(x.fullmatch(k) for x in skip):
            out[k + SCALE_SUFFIX] = tuple(s[:-2]) + (-(-s[-2] // block[0]), -(-s[-1] // block[1]))
    return out


def _glob(pattern: str) -> re.Pattern[str]:
    """A key pattern of plain keys, ``*`` (within one dotted part) and ``**`` (any parts)."""
    parts = re.split(r"(\*\*|\*)", pattern)
    return re.compile("".join(".*" if p == "**" else "[^.]*" if p == "*" else re.escape(p) for p in parts))


def quantized(shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The keys of ``shapes`` (from :func:`parameter_shapes`) that hold e4m3 values."""
    return {k.removesuffix(SCALE_SUFFIX) for k in shapes if k.endswith(SCALE_SUFFIX)}
