"""The public constructors of the quantized formats' rules (``sdadapt.dequant_fp8(...)``,
``sdadapt.dequant_mxfp4(...)``, ``sdadapt.dequant_scaled(...)``). Apart from
:mod:`._functions` so that an adapter of plain rules does not import the quantized kernels."""

from __future__ import annotations

import torch

from .._recipes.quant import FP8_SCALE_SUFFIX, MX_BLOCKS_SUFFIX, MX_SCALES_SUFFIX, ScaleFormat
from .._recipes.quant_scaled import Codec, GlobalMode, Strategy
from ._base import dtype_str
from ._dequant import DequantFP8, DequantMXFP4
from ._dequant_scaled import DequantScaled


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
    dtype the model holds for each key (``dtype`` pins one; bfloat16 where there is no model).

    Args:
        keys: the weights' key pattern.
        block: the scale block, ``(rows, cols)``.
        exclude: key patterns left alone (unquantized weights).
        scale_suffix: a scale's key is the weight's key + this.
        scale_format: ``"float32"``, ``"ue8m0"`` or ``"ue8m0_float32"``.
        scale_dtype: the dtype the scales are stored in (``None``: any of the format's).
        dtype: the values' dtype (``None``: the model's for each key).

    Returns:
        The :class:`~sdadapt.rules.DequantFP8` rule; its ``inverse()`` quantizes on export.

    Example::

        sdadapt.Adapter([sdadapt.dequant_fp8(exclude=["**.mlp.gate.weight"]), sdadapt.strip_prefix("model.")])
    """
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
    matching ``keys``, in the model's dtype for each (``dtype`` pins one).

    Args:
        keys: the dequantised keys' pattern (without the suffixes).
        blocks_suffix: the packed values' key is ``key + blocks_suffix``.
        scales_suffix: the scales' key is ``key + scales_suffix``.
        dtype: the values' dtype (``None``: the model's for each key).

    Returns:
        The :class:`~sdadapt.rules.DequantMXFP4` rule.

    Example::

        sdadapt.dequant_mxfp4("**.mlp.experts.{proj}_proj")
    """
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
