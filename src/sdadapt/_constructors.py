"""The public rule constructors (``sdadapt.rename(...)``, ``sdadapt.fuse(...)``...): typed
functions that build the rule models of :mod:`sdadapt._rules`."""

from __future__ import annotations

from typing import Literal, overload

import torch

from ._adapter import Adapter
from ._quant import FP8_SCALE_SUFFIX, MX_BLOCKS_SUFFIX, MX_SCALES_SUFFIX, ScaleFormat
from ._quant_rules import DequantFP8, DequantMXFP4
from ._quant_scaled import Codec, GlobalMode, Strategy
from ._quant_scaled_rules import DequantScaled
from ._rules import (
    AddPrefix,
    Affine,
    Cast,
    Deinterleave,
    Drop,
    Fuse,
    Interleave,
    Pad,
    Rename,
    Rotary,
    Split,
    Stack,
    StripPrefix,
    Tie,
    Transpose,
    Trim,
    Unstack,
)
from ._rules.base import dtype_str


def rename(src: str, dst: str) -> Rename:
    """``src`` keys become ``dst`` keys; ``{name}`` captures carry over (``layers.{i}.wq``)."""
    return Rename(src=src, dst=dst)


def fuse(srcs: list[str], dst: str, dim: int = 0, sizes: list[int] | None = None, *, heads: int | None = None) -> Fuse:
    """Concatenate ``srcs`` along ``dim`` into ``dst`` (q, k, v -> qkv). ``heads=H``: the fused
    tensor is laid out per head, ``[H, parts, rows]`` (GPT-NeoX's ``query_key_value``)."""
    return Fuse(srcs=srcs, dst=dst, dim=dim, sizes=sizes, heads=heads)


def split(src: str, dsts: list[str], dim: int = 0, sizes: list[int] | None = None, *, heads: int | None = None) -> Split:
    """Cut ``src`` along ``dim`` into ``dsts``; sizes default to the target's, else equal.
    ``heads=H``: ``src`` is laid out per head, ``[H, parts, rows]``: each part is taken from
    every head's block (GPT-NeoX's ``query_key_value`` -> q, k, v).

    Example:
        >>> qkv = ["h.{i}.q.weight", "h.{i}.k.weight", "h.{i}.v.weight"]  # doctest: +SKIP
        >>> sdadapt.split("h.{i}.attn.query_key_value.weight", qkv, heads=8)  # doctest: +SKIP
    """
    return Split(src=src, dsts=dsts, dim=dim, sizes=sizes, heads=heads)


def cast(keys: str, dtype: str | torch.dtype, from_dtype: str | torch.dtype | None = None) -> Cast:
    """Convert tensors matching ``keys`` to ``dtype`` (only those stored as ``from_dtype``, if given);
    ``dtype="model"``: to the dtype the model holds for each tensor."""
    return Cast(keys=keys, dtype=dtype, from_dtype=from_dtype)  # type: ignore[arg-type]


@overload
def with_dtype(adapter: Adapter, dtype: str | torch.dtype | None) -> Adapter: ...


@overload
def with_dtype(adapter: None, dtype: str | torch.dtype | None) -> Adapter | None: ...


def with_dtype(adapter: Adapter | None, dtype: str | torch.dtype | None) -> Adapter | None:
    """``adapter`` followed by ``cast("**", dtype)`` (``dtype=None``: ``adapter`` as it is):
    what ``load``, ``plan_load`` and ``diff`` run for their ``dtype`` argument."""
    if dtype is None:
        return adapter
    to_dtype = Adapter([cast("**", dtype)], name=f"dtype={dtype}")
    return to_dtype if adapter is None else adapter + to_dtype


def drop(keys: str, *, shadows: bool = False) -> Drop:
    """Ignore source keys matching ``keys`` on purpose. ``shadows=True``: the drop takes its
    keys before later rules that match them too, on purpose (a whole layer dropped first,
    whatever it holds: ``drop("model.layers.61.**", shadows=True)``), so those rules are not
    reported as ambiguous."""
    return Drop(keys=keys, shadows=shadows or None)


def tie(dst: str, src: str) -> Tie:
    """Fill ``dst`` from ``src`` when the checkpoint lacks ``dst`` (tied embeddings)."""
    return Tie(dst=dst, src=src)


def transpose(keys: str, dim0: int = 0, dim1: int = 1) -> Transpose:
    """Swap dims ``dim0`` and ``dim1`` of tensors matching ``keys`` (GPT-2 ``Conv1D`` <-> ``nn.Linear``)."""
    return Transpose(keys=keys, dim0=dim0, dim1=dim1)


def rotary(
    keys: str | list[str],
    heads: int | None = None,
    to: Literal["interleaved", "half"] = "interleaved",
    dim: int = 0,
    *,
    head_dim: int | None = None,
    rotary_dim: int | float | None = None,
) -> Rotary:
    """Reorder the rows inside each head between rotary layouts: ``to="interleaved"`` from HF
    transformers' half split to Meta's pairs, ``to="half"`` the other way. ``keys``: one pattern
    or several (weight, bias, per-head norm weight). A head is ``head_dim`` rows, or the rows
    divided by ``heads`` (GQA: one rule for k with the kv head count); per-head norm weights
    ``[head_dim]`` need ``head_dim=``. Partial rotary: ``rotary_dim`` rows of each head rotate
    (an int, or a fraction of the head such as config.json's ``partial_rotary_factor``); only
    they are reordered.

    Example:
        >>> sdadapt.rotary("layers.{i}.attention.wq.weight", heads=32, rotary_dim=0.25)  # doctest: +SKIP
    """
    return Rotary(keys=keys, heads=heads, to=to, dim=dim, head_dim=head_dim, rotary_dim=rotary_dim)


def affine(keys: str | list[str], scale: float = 1.0, shift: float = 0.0) -> Affine:
    """``w * scale + shift`` for tensors matching ``keys`` (Gemma's ``1 + w`` norms:
    ``affine("**norm.weight", shift=1.0)``); the inverse computes ``(w - shift) / scale``."""
    return Affine(keys=keys, scale=scale, shift=shift)


def stack(src: str, dst: str, over: str = "e", dim: int = 0, count: int | None = None) -> Stack:
    """Keys matching ``src`` that differ in capture ``over`` (0..E-1) become one ``[E, ...]`` tensor ``dst``."""
    return Stack(src=src, dst=dst, over=over, dim=dim, count=count)


def unstack(src: str, dst: str, over: str = "e", dim: int = 0, count: int | None = None) -> Unstack:
    """One tensor ``src`` becomes one key ``dst`` per entry along ``dim`` (``dst`` captures ``over``)."""
    return Unstack(src=src, dst=dst, over=over, dim=dim, count=count)


def pad(
    keys: str, dim: int = 0, size: int | None = None, multiple_of: int | None = None, value: float = 0.0
) -> Pad:
    """Extend along ``dim`` with ``value`` to ``size``, the next multiple of ``multiple_of``, or the model's size."""
    return Pad(keys=keys, dim=dim, size=size, multiple_of=multiple_of, value=value)


def trim(keys: str, dim: int = 0, size: int | None = None) -> Trim:
    """Keep the first ``size`` entries along ``dim`` (``size`` omitted: the model's size for that key)."""
    return Trim(keys=keys, dim=dim, size=size)


def interleave(keys: str | list[str], sizes: list[int], tp: int | None = None, dim: int = 0) -> Interleave:
    """Lay fused ``[p0; p1; ...]`` (``sizes``) out per TP rank so each ``ColwiseParallel`` shard holds
    ``[p0_r; p1_r; ...]``; ``tp`` omitted: the model's TP degree for that key."""
    return Interleave(keys=keys, sizes=sizes, tp=tp, dim=dim)


def deinterleave(keys: str | list[str], sizes: list[int], tp: int | None = None, dim: int = 0) -> Deinterleave:
    """The inverse of :func:`interleave` (``tp`` omitted: the source's TP degree for that key)."""
    return Deinterleave(keys=keys, sizes=sizes, tp=tp, dim=dim)


def strip_prefix(prefix: str, optional: bool = False) -> StripPrefix:
    """Remove ``prefix`` (e.g. ``"model."``) from keys that start with it. ``_orig_mod.``,
    ``_checkpoint_wrapped_module.`` and ``_fsdp_wrapped_module.`` need no rule: planning removes them."""
    return StripPrefix(prefix=prefix, optional=optional)


def add_prefix(prefix: str, keys: str = "**") -> AddPrefix:
    """Put ``prefix`` in front of keys matching ``keys`` (the inverse of :func:`strip_prefix`)."""
    return AddPrefix(prefix=prefix, keys=keys)


def dequant_fp8(
    keys: str = "**.weight",
    block: tuple[int, int] = (128, 128),
    *,
    exclude: list[str] | None = None,
    scale_suffix: str = FP8_SCALE_SUFFIX,
    scale_format: ScaleFormat = "float32",
    scale_dtype: str | torch.dtype | None = None,
    dtype: str | torch.dtype | None = None,
) -> DequantFP8:
    """FP8 e4m3 weights matching ``keys`` (not ``exclude``) with ``block`` scales at
    ``key + scale_suffix`` (float32, ``"ue8m0"`` exponent bytes, or ``"ue8m0_float32"``
    powers of two stored as float32; ``scale_dtype`` pins the stored dtype) -> values in the
    dtype the model holds for each key (``dtype`` pins one; bfloat16 where there is no model)."""
    return DequantFP8(
        keys=keys,
        block=block,
        exclude=exclude or [],
        scale_suffix=scale_suffix,
        scale_format=scale_format,
        scale_dtype=None if scale_dtype is None else dtype_str(scale_dtype),
        dtype=None if dtype is None else dtype_str(dtype),
    )


def dequant_mxfp4(
    keys: str,
    *,
    blocks_suffix: str = MX_BLOCKS_SUFFIX,
    scales_suffix: str = MX_SCALES_SUFFIX,
    dtype: str | torch.dtype | None = None,
) -> DequantMXFP4:
    """MXFP4 ``<name>_blocks`` + ``<name>_scales`` -> ``<name>`` (values ``[..., G * 32]``) for names
    matching ``keys``, in the model's dtype for each (``dtype`` pins one)."""
    return DequantMXFP4(keys=keys, blocks_suffix=blocks_suffix, scales_suffix=scales_suffix,
                        dtype=None if dtype is None else dtype_str(dtype))


def dequant_scaled(
    keys: str = "**.weight",
    *,
    codec: Codec,
    strategy: Strategy = "tensor",
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    exclude: list[str] | None = None,
    values_suffix: str = "",
    scale_suffix: str = "_scale",
    scale_dtype: str | torch.dtype | None = None,
    zero_suffix: str | None = None,
    global_suffix: str | None = None,
    global_mode: GlobalMode = "divide",
    shape_suffix: str | None = None,
    drop: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
) -> DequantScaled:
    """Weights stored as codes times scales (compressed-tensors, ModelOpt, MXFP8, per-tensor
    FP8) -> values in the model's dtype for each key (``dtype`` pins one).

    Args:
        keys: the weights' keys (the dequantised keys); ``exclude``: patterns left alone.
        codec: ``"e4m3"``, ``"int8"``, ``"e2m1"`` (two per byte), ``"int4"`` or ``"int8_packed"``
            (in int32 words, compressed-tensors' ``pack-quantized``).
        strategy: one scale per ``"tensor"``, output ``"channel"``, ``"group"`` of
            ``group_size`` values along a row, or ``"block"`` of ``block`` rows x cols.
        values_suffix: the stored values' key is ``key + values_suffix`` (``"_packed"``).
        scale_suffix, zero_suffix, global_suffix, shape_suffix: the keys beside it (``key +
            suffix``) of the scales, zero points, per-tensor second scale (``global_mode``:
            ``"divide"`` as compressed-tensors, ``"multiply"`` as ModelOpt's ``weight_scale_2``)
            and compressed-tensors' ``weight_shape``.
        scale_dtype: the one dtype the scales must be stored in, and the one export writes
            (``"uint8"`` or ``"float8_e8m0fnu"``: e8m0 exponents, as MXFP8 / MXFP4 store them);
            ``None``: any scale dtype loads, and export writes float32 (e4m3 for NVFP4).
        drop: key patterns dropped on purpose (activation scales such as ``**.input_scale``).
        dtype: the values' dtype, or ``None`` for the model's.

    Returns:
        The rule.

    Example::

        rule = sdadapt.dequant_scaled(codec="e4m3", strategy="channel", drop=["**.input_scale"])
    """
    return DequantScaled(keys=keys, codec=codec, strategy=strategy, group_size=group_size, block=block,
                         exclude=exclude or [], values_suffix=values_suffix, scale_suffix=scale_suffix,
                         scale_dtype=None if scale_dtype is None else dtype_str(scale_dtype), zero_suffix=zero_suffix,
                         global_suffix=global_suffix, global_mode=global_mode,
                         shape_suffix=shape_suffix, drop=drop or [], dtype=None if dtype is None else dtype_str(dtype))  # fmt: skip
