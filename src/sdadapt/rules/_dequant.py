"""The ``dequant`` rule family: quantized checkpoints (FP8 block scales, UE8M0, MXFP4) as rules.

- :class:`DequantFP8` (``sdadapt.dequant_fp8``): every key matching ``keys`` (and no
  ``exclude`` pattern) with two or more dims is an FP8 e4m3 weight with a scale beside it at
  ``key + scale_suffix``; the weight becomes its dequantised value in ``dtype`` and the scale
  key is folded into its recipe. Inverse: :class:`QuantizeFP8`.
- :class:`DequantMXFP4` (``sdadapt.dequant_mxfp4``): every ``<name>_blocks`` +
  ``<name>_scales`` pair whose ``<name>`` matches ``keys`` becomes ``<name>`` ``[..., G * 32]``.
  Inverse: :class:`QuantizeMXFP4`.

Both are value rules: they apply in order and take no part in the one-rule-per-key check, so a
later rename may match the scale keys' names without being reported as ambiguous. Put them
first (they act on the checkpoint's own key names); :func:`dequant_rules` builds them from a
release's ``config.json``.

Strict: a matched key that is not stored in the format (a bf16 embedding matched by
``**.weight``) is a plan problem naming ``exclude=``, because the inverse re-quantizes every key
the rule matches; so are a missing or misshapen scale. A scale no rule consumes shows up as an
unexpected key, and a quantized weight loaded without these rules as a dtype or shape mismatch;
:func:`~sdadapt._plan.report.quant_hint` turns either into a hint naming the rule that fixes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from .._base.schema import dtype_name
from .._recipes import quant as Q
from .._recipes import quant_nodes as QN
from ._base import dtype_str, parse_dtype
from ._custom import register_rule
from ._patterns import compile_pattern, union_of
from ._quant_rule import Block, QuantRule

if TYPE_CHECKING:
    from ._base import PlanContext


class _FP8Fields(QuantRule):
    """What FP8 dequantisation and re-quantization share: which keys, the block, the scale.

    ``scale_dtype``: the one dtype the scales are stored in, when the format allows several
    (``"ue8m0"``: ``uint8`` or ``float8_e8m0fnu``); loading then requires it and export writes
    it. ``None``: loading accepts any of the format's dtypes and export writes the first."""

    keys: str = "**.weight"
    exclude: list[str] = []
    block: Block
    scale_suffix: str = Field(default=Q.FP8_SCALE_SUFFIX, min_length=1)
    scale_format: Q.ScaleFormat = "float32"
    scale_dtype: str | None = None

    @field_validator("scale_dtype", mode="before")
    @classmethod
    def _check_scale_dtype(cls, v: object) -> str | None:
        return None if v is None else dtype_str(v)

    @model_validator(mode="after")
    def _scale_dtype_fits_format(self) -> _FP8Fields:
        allowed = Q.SCALE_DTYPES[self.scale_format]
        if self.scale_dtype is not None and parse_dtype(self.scale_dtype) not in allowed:
            raise ValueError(
                f"scale_dtype={self.scale_dtype!r} is not a storage of scale_format={self.scale_format!r} "
                f"(one of {', '.join(dtype_name(d) for d in allowed)})"
            )
        return self

    def _scale_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes the scales may be stored in; export writes the first."""
        return (parse_dtype(self.scale_dtype),) if self.scale_dtype else Q.SCALE_DTYPES[self.scale_format]

    def _targets(self, ctx: PlanContext) -> list[str]:
        """Keys this rule acts on: matching ``keys``, not ``exclude``, with two or more dims."""
        take, skip = compile_pattern(self.keys).regex.match, union_of(tuple(self.exclude)).match
        return [k for k in ctx.keys() if take(k) is not None and skip(k) is None and len(ctx.get(k).shape) >= 2]


class DequantFP8(_FP8Fields):
    """FP8 e4m3 weights with block scales ``key + scale_suffix`` -> values in ``dtype``:
    ``DequantFP8(keys="model.layers.**.weight", block=[128, 128])``.

    Args:
        **fields: the arguments of :func:`sdadapt.dequant_fp8`, with the same names and meaning.

    Example::

        rule = sdadapt.dequant_fp8(block=(128, 128))
        assert isinstance(rule, sdadapt.rules.DequantFP8)
        assert isinstance(rule.inverse(), sdadapt.rules.QuantizeFP8)
    """

    kind: Literal["dequant_fp8"] = "dequant_fp8"

    def apply(self, ctx: PlanContext, index: int) -> None:
        targets = self._targets(ctx)
        scales = {k + self.scale_suffix for k in targets if ctx.get(k).dtype == Q.FP8_DTYPE}
        to, follows = self._values_dtype()
        for key in targets:
            if key in scales:
                continue  # a float32 scale matched by a broad pattern is an input, not a weight
            node = ctx.get(key)
            skey = key + self.scale_suffix
            problem = self._problem(ctx, key, skey)
            if problem:
                ctx.issue(index, key, problem)
                continue
            scale = ctx.absorb(skey, index)
            ctx.replace(key, QN.DequantizedFP8(node, scale, self.block, self.scale_format, to, follows))

    def _problem(self, ctx: PlanContext, key: str, skey: str) -> str | None:
        node = ctx.get(key)
        if node.dtype != Q.FP8_DTYPE:
            return (
                f"is stored as {dtype_name(node.dtype)}, not float8_e4m3fn; add it to exclude=[...] of this "
                "rule (its inverse re-quantizes every key it matches)"
            )
        if not ctx.has(skey):
            return f"has no scale {skey!r}; the release stores it under another name? set scale_suffix="
        scale = ctx.get(skey)
        want = Q.fp8_scale_shape(tuple(node.shape), self.block)
        if tuple(scale.shape) != want:
            return (
                f"scale {skey!r} has shape {list(scale.shape)}, but block={list(self.block)} over "
                f"{list(node.shape)} needs {list(want)}; check block= (config.json weight_block_size)"
            )
        allowed = self._scale_dtypes()
        if scale.dtype not in allowed:
            what = f"scale_format={self.scale_format!r}" + (f", scale_dtype={self.scale_dtype!r}" if self.scale_dtype else "")
            return (
                f"scale {skey!r} is {dtype_name(scale.dtype)}, not what {what} stores "
                f"({', '.join(dtype_name(d) for d in allowed)}); {self._fix_hint(scale.dtype)}"
            )
        return None

    def _fix_hint(self, stored: torch.dtype) -> str:
        """The setting that reads scales stored as ``stored``, keeping power-of-two scales so;
        where no setting reads that dtype, says so (never a setting that refuses it too)."""
        if stored in Q.SCALE_DTYPES[self.scale_format]:
            return f"scale_dtype={dtype_name(stored)!r}?"
        if stored in Q.SCALE_DTYPES["ue8m0"]:
            return "scale_format='ue8m0'?"
        if stored in Q.SCALE_DTYPES["float32"]:
            if self.scale_format == "ue8m0":
                return "scale_format='ue8m0_float32'? (power-of-two scales stored as float32)"
            return "scale_format='float32'?"
        readable = sorted({dtype_name(d) for ds in Q.SCALE_DTYPES.values() for d in ds})
        return (f"no scale_format of dequant_fp8 reads {dtype_name(stored)} block scales (they are stored as "
                f"{', '.join(readable)}); is this the release's block scale, or a tensor of another format?")  # fmt: skip

    def inverse(self) -> list[Any]:
        return [QuantizeFP8(**self._fields())]


class QuantizeFP8(_FP8Fields):
    """The inverse of :class:`DequantFP8`: matched tensors become FP8 e4m3 weights with a scale
    grid ``key + scale_suffix`` (same block geometry and scale format).

    Args:
        **fields: the fields of :class:`DequantFP8` (the rule this one inverts), with the same meaning.

    Example::

        rule = sdadapt.rules.DequantFP8(keys="**.weight", block=[128, 128]).inverse()
        assert isinstance(rule, sdadapt.rules.QuantizeFP8)
    """

    kind: Literal["quantize_fp8"] = "quantize_fp8"

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key in self._targets(ctx):
            node = ctx.get(key)
            skey = key + self.scale_suffix
            if not node.dtype.is_floating_point:
                ctx.issue(index, key, f"is {dtype_name(node.dtype)}; only floating tensors can be quantized")
                continue
            if ctx.has(skey):
                ctx.issue(index, key, f"{skey!r} exists already; the scale would overwrite it")
                continue
            ctx.mark(index)
            scales = QN.QuantizedFP8(node, self.block, self.scale_format, "scales", self._scale_dtypes()[0])
            ctx.replace(key, QN.QuantizedFP8(node, self.block, self.scale_format, "values"))
            ctx.put(skey, scales, index, origin=key)

    def inverse(self) -> list[Any]:
        return [DequantFP8(**self._fields())]


class _MXFP4Fields(QuantRule):
    """What MXFP4 dequantisation and re-quantization share: the suffixes of the packed pair."""

    blocks_suffix: str = Field(default=Q.MX_BLOCKS_SUFFIX, min_length=1)
    scales_suffix: str = Field(default=Q.MX_SCALES_SUFFIX, min_length=1)


class DequantMXFP4(_MXFP4Fields):
    """``<name>_blocks`` (uint8 ``[..., G, 16]``) + ``<name>_scales`` (uint8 ``[..., G]``) ->
    ``<name>`` ``[..., G * 32]`` in ``dtype``, for each ``<name>`` matching ``keys``:
    ``DequantMXFP4(keys="model.layers.{i}.mlp.experts.{proj}")``. The packed dim (32 values per
    block) is the last one, as the format defines it; a transpose rule after it gives another
    orientation.

    Args:
        **fields: the arguments of :func:`sdadapt.dequant_mxfp4`, with the same names and meaning.

    Example::

        rule = sdadapt.dequant_mxfp4("**.mlp.experts.{proj}_proj")
        assert isinstance(rule.inverse(), sdadapt.rules.QuantizeMXFP4)
    """

    kind: Literal["dequant_mxfp4"] = "dequant_mxfp4"

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        to, follows = self._values_dtype()
        for bkey in ctx.keys():
            if not bkey.endswith(self.blocks_suffix):
                continue
            name = bkey[: -len(self.blocks_suffix)]
            if pat.match(name) is None:
                continue
            skey = name + self.scales_suffix
            problem = self._problem(ctx, name, bkey, skey)
            if problem:
                ctx.issue(index, name, problem)
                continue
            blocks, scales = ctx.absorb(bkey, index), ctx.absorb(skey, index)
            ctx.put(name, QN.DequantizedMXFP4(blocks, scales, to, follows), index, origin=[bkey, skey])

    def _problem(self, ctx: PlanContext, name: str, bkey: str, skey: str) -> str | None:
        blocks = ctx.get(bkey)
        if blocks.dtype != torch.uint8 or len(blocks.shape) < 2 or blocks.shape[-1] != Q.MX_BYTES:
            return f"{bkey!r} is {dtype_name(blocks.dtype)} {list(blocks.shape)}; MXFP4 blocks are uint8 [..., G, 16]"
        if not ctx.has(skey):
            return f"has blocks {bkey!r} but no scales {skey!r}; set scales_suffix="
        scales = ctx.get(skey)
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            return (
                f"scales {skey!r} are {dtype_name(scales.dtype)} {list(scales.shape)}; blocks "
                f"{list(blocks.shape)} need uint8 {list(blocks.shape[:-1])}"
            )
        if ctx.has(name):
            return f"{name!r} exists already beside its blocks; the dequantised value would overwrite it"
        return None

    def inverse(self) -> list[Any]:
        return [QuantizeMXFP4(**self._fields())]


class QuantizeMXFP4(_MXFP4Fields):
    """The inverse of :class:`DequantMXFP4`: each key matching ``keys`` (two or more dims, the
    last a multiple of 32) becomes ``<key>_blocks`` + ``<key>_scales``. ``keys`` must name the
    packed tensors only (GPT-OSS: ``**.mlp.experts.{proj}_proj``, not the ``_bias`` beside them).

    Args:
        **fields: the fields of :class:`DequantMXFP4` (the rule this one inverts), with the same meaning.

    Example::

        rule = sdadapt.rules.DequantMXFP4(keys="**.weight").inverse()
        assert isinstance(rule, sdadapt.rules.QuantizeMXFP4)
    """

    kind: Literal["quantize_mxfp4"] = "quantize_mxfp4"

    def apply(self, ctx: PlanContext, index: int) -> None:
        pat = compile_pattern(self.keys)
        for key in ctx.keys():
            if pat.match(key) is None:
                continue
            node = ctx.get(key)
            if not node.dtype.is_floating_point or len(node.shape) < 2 or node.shape[-1] % Q.MX_BLOCK:
                ctx.issue(index, key, f"{dtype_name(node.dtype)} {list(node.shape)}: MXFP4 needs a floating tensor "
                          f"whose last dim is a multiple of {Q.MX_BLOCK}")  # fmt: skip
                continue
            ctx.absorb(key, index)
            ctx.put(key + self.blocks_suffix, QN.QuantizedMXFP4(node, "values"), index, origin=key)
            ctx.put(key + self.scales_suffix, QN.QuantizedMXFP4(node, "scales"), index, origin=key)

    def inverse(self) -> list[Any]:
        return [DequantMXFP4(**self._fields())]


# adapters read these kinds from JSON through the rule registry
for _cls in (DequantFP8, QuantizeFP8, DequantMXFP4, QuantizeMXFP4):
    register_rule(_cls)
