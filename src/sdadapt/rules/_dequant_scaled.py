"""The ``dequant_scaled`` rule: weights stored as codes times a grid of scales, as
compressed-tensors, NVIDIA ModelOpt and MXFP8 releases store them (formats in
:mod:`sdadapt._recipes.quant_scaled`). :func:`sdadapt.dequant_rules` builds it from a release's config.

For every key matching ``keys`` (and no ``exclude`` pattern) whose stored values lie at ``key +
values_suffix`` with the codec's dtype, the rule folds in ``key + scale_suffix`` and, when set,
``key + zero_suffix``, ``key + global_suffix`` and ``key + shape_suffix``, and puts the
dequantised ``key``. Keys matching ``drop`` (activation scales such as ``**.input_scale``:
a loader of weights has no use for them) are dropped on purpose and listed in the report's
dropped keys. Strict: a scale, zero point or global scale of the wrong shape or dtype, or a
missing one, is a plan problem naming both keys; a scale no rule consumes stays an unexpected
key. Inverse: :class:`QuantizeScaled`, in the same format and geometry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from .._base.schema import dtype_name
from .._recipes import quant_scaled as S
from .._recipes import quant_scaled_nodes as SN
from .._recipes.nodes import Node
from ..errors import AdapterError
from ._base import dtype_str, parse_dtype, target_info
from ._custom import register_rule
from ._patterns import compile_pattern, union_of
from ._quant_rule import Block, QuantRule

if TYPE_CHECKING:
    from ._base import PlanContext

log = logging.getLogger(__name__)

ACTIVATION_SCALES = ["**.input_scale", "**.input_global_scale", "**.input_zero_point", "**.output_scale"]
"""Activation (and output) scales that quantized releases store beside their weights: a weight
loader has no use for them, so the rules built from a config drop them on purpose."""


class _ScaledFields(QuantRule):
    """What dequantising and re-quantizing a scaled format share."""

    keys: str = "**.weight"
    exclude: list[str] = []
    codec: S.Codec = "e4m3"
    strategy: S.Strategy = "tensor"
    group_size: int | None = Field(default=None, gt=0)
    block: Block | None = None
    values_suffix: str = ""
    scale_suffix: str = Field(default="_scale", min_length=1)
    scale_dtype: str | None = None
    zero_suffix: str | None = None
    global_suffix: str | None = None
    global_mode: S.GlobalMode = "divide"
    shape_suffix: str | None = None
    drop: list[str] = []
    tensor_scale_shape: list[int] = Field(default=[1], max_length=1)  # a per-tensor scale as stored: [1] or 0-d []

    @field_validator("scale_dtype", mode="before")
    @classmethod
    def _check_scale_dtype(cls, v: object) -> str | None:
        if v is None:
            return None
        name = dtype_str(v)
        if parse_dtype(name) not in S.FLOAT_SCALE_DTYPES + S.E8M0_DTYPES:
            raise ValueError(f"scale_dtype={name!r} stores no scales (float32, bfloat16, float16, float8_e4m3fn, uint8 or float8_e8m0fnu)")
        return name

    @model_validator(mode="after")
    def _geometry(self) -> _ScaledFields:
        if self.strategy == "group" and self.group_size is None:
            raise ValueError("strategy='group' needs group_size=")
        if self.strategy == "block" and self.block is None:
            raise ValueError("strategy='block' needs block=[rows, cols]")
        if self.zero_suffix is not None and self.codec not in ("int8", "int4", "int8_packed"):
            raise ValueError(f"zero points belong to integer codecs, not {self.codec!r}")
        return self

    def input_patterns(self) -> list[str]:
        return [self.keys, *self.drop]

    def tile(self, rows: int, cols: int) -> tuple[int, int]:
        """The block of values one scale covers, for a weight of ``rows x cols``."""
        if self.strategy == "tensor":
            return (rows, cols)
        if self.strategy == "channel":
            return (1, cols)
        if self.strategy == "group":
            assert self.group_size is not None
            return (1, self.group_size)
        assert self.block is not None
        return self.block

    def _names(self, ctx: PlanContext) -> list[str]:
        """The weight keys this rule acts on: ``key + values_suffix`` is stored, ``key`` matches."""
        take, skip = compile_pattern(self.keys).regex.match, union_of(tuple(self.exclude)).match
        out = []
        for k in ctx.keys():
            if self.values_suffix and not k.endswith(self.values_suffix):
                continue
            name = k[: len(k) - len(self.values_suffix)] if self.values_suffix else k
            if take(name) is not None and skip(name) is None and len(ctx.get(k).shape) >= 2:
                out.append(name)
        return out


class DequantScaled(_ScaledFields):
    """Codes times scales -> values: ``DequantScaled(codec="e4m3", strategy="channel")`` reads
    compressed-tensors' FP8-dynamic releases (``weight`` + ``weight_scale [R, 1]``).

    Args:
        **fields: the arguments of :func:`sdadapt.dequant_scaled`, with the same names and meaning.
        tensor_scale_shape: the shape of a per-tensor scale (``[1]``, or ``[]`` as some releases store it).

    Example::

        rule = sdadapt.dequant_scaled(codec="e4m3", strategy="channel")
        assert isinstance(rule, sdadapt.rules.DequantScaled)
    """

    kind: Literal["dequant_scaled"] = "dequant_scaled"

    def apply(self, ctx: PlanContext, index: int) -> None:
        for pat in self.drop:
            p = compile_pattern(pat)
            for key in [k for k in ctx.keys() if p.match(k) is not None]:
                ctx.absorb(key, index)  # a value rule's drop: later renames may match the name, unambiguously
                ctx.dropped.append(key)
                log.debug("%s: dropped %s (an activation scale: weights do not use it)", self.kind, key)
        names = self._names(ctx)
        scale_keys = {n + self.scale_suffix for n in names}
        to, follows = self._values_dtype()
        for name in names:
            vkey = name + self.values_suffix
            if vkey in scale_keys:
                continue  # a scale matched by a broad pattern is an input, not a weight
            problem, cols = self._problem(ctx, index, name)
            if problem:
                ctx.issue(index, name, problem)
                continue
            values = ctx.absorb(vkey, index) if self.values_suffix else ctx.get(name)
            scale = ctx.absorb(name + self.scale_suffix, index)
            zero = ctx.absorb(name + self.zero_suffix, index) if self.zero_suffix else None
            glob = ctx.absorb(name + self.global_suffix, index) if self.global_suffix else None
            if self.shape_suffix and ctx.has(name + self.shape_suffix):
                ctx.absorb(name + self.shape_suffix, index)
            rows = values.shape[-2]
            node = SN.DequantizedScaled(values, scale, zero, glob, self.codec, self.tile(rows, cols), cols, self.global_mode, to, follows)
            if self.values_suffix:
                ctx.put(name, node, index, origin=vkey)
            else:
                ctx.replace(name, node)
            ctx.mark(index)

    def _cols(self, ctx: PlanContext, index: int, name: str, packed: int) -> int:
        """The weight's column count: stored as is, or unpacked (taken from the model where its
        size packs to the stored width, else from the group scales, else every pack full)."""
        unit = S.PER_UNIT[self.codec]
        if unit == 1:
            return packed
        info = target_info(ctx, name, index)
        if info is not None and len(info.shape) >= 2 and S.cdiv(info.shape[-1], unit) == packed:
            return int(info.shape[-1])
        skey = name + self.scale_suffix
        if self.strategy == "group" and ctx.has(skey) and self.group_size is not None:
            cols = ctx.get(skey).shape[-1] * self.group_size
            if S.cdiv(cols, unit) == packed:
                return int(cols)
        return packed * unit

    def _problem(self, ctx: PlanContext, index: int, name: str) -> tuple[str | None, int]:
        vkey = name + self.values_suffix
        values = ctx.get(vkey)
        want = S.STORED[self.codec]
        if values.dtype != want:
            return (f"{vkey!r} is stored as {dtype_name(values.dtype)}, not {dtype_name(want)} ({self.codec} values); "
                    "add it to exclude=[...] of this rule, or check codec="), 0  # fmt: skip
        if self.values_suffix and ctx.has(name):
            return f"{name!r} exists already beside {vkey!r}; the dequantised value would overwrite it", 0
        cols = self._cols(ctx, index, name, values.shape[-1])
        lead, rows = tuple(values.shape[:-2]), values.shape[-2]
        b0, b1 = self.tile(rows, cols)
        grid = lead + (S.cdiv(rows, b0), S.cdiv(cols, b1))
        skey = name + self.scale_suffix
        if not ctx.has(skey):
            return f"has no scale {skey!r}; the release stores it under another name? set scale_suffix=", cols
        scale = ctx.get(skey)
        per_tensor = self.strategy == "tensor"
        if (per_tensor and _numel(scale.shape) != 1) or (not per_tensor and tuple(scale.shape) != grid):
            need = "one element" if per_tensor else str(list(grid))
            return (f"scale {skey!r} has shape {list(scale.shape)}, but strategy={self.strategy!r}"
                    f"{self._geometry_text()} over {list(values.shape[:-1]) + [cols]} needs {need}; check the "
                    "quantization config (strategy, group_size, block)"), cols  # fmt: skip
        scale_dtypes = (_scale_dtype(self.scale_dtype, self.codec),) if self.scale_dtype else S.FLOAT_SCALE_DTYPES + S.E8M0_DTYPES
        if scale.dtype not in scale_dtypes:
            names = ", ".join(dtype_name(d) for d in scale_dtypes)
            return f"scale {skey!r} is {dtype_name(scale.dtype)}; {self.codec} scales are stored as {names}", cols
        for suffix, what in ((self.zero_suffix, "zero point"), (self.global_suffix, "global scale")):
            if suffix is None:
                continue
            key = name + suffix
            if not ctx.has(key):
                return f"has no {what} {key!r}; set {'zero_suffix' if what == 'zero point' else 'global_suffix'}=", cols
            node = ctx.get(key)
            problem = self._side_problem(key, node, what, grid, rows)
            if problem:
                return problem, cols
        return None, cols

    def _side_problem(self, key: str, node: Node, what: str, grid: tuple[int, ...], rows: int) -> str | None:
        if what == "global scale":
            if _numel(node.shape) != 1 or node.dtype != torch.float32:
                return f"global scale {key!r} is {dtype_name(node.dtype)} {list(node.shape)}; it is one float32 value"
            return None
        if self.codec in ("int4", "int8_packed"):
            per = 32 // S.BITS[self.codec]
            want, dtype = grid[:-2] + (S.cdiv(grid[-2], per), grid[-1]), torch.int32
        else:
            want, dtype = grid, torch.int8
        if tuple(node.shape) != want or node.dtype != dtype:
            have = f"{dtype_name(node.dtype)} {list(node.shape)}"
            return f"zero point {key!r} is {have}; the scales' grid needs {dtype_name(dtype)} {list(want)}"
        return None

    def _geometry_text(self) -> str:
        if self.strategy == "group":
            return f", group_size={self.group_size}"
        if self.strategy == "block" and self.block is not None:
            return f", block={list(self.block)}"
        return ""

    def inverse(self) -> list[Any]:
        problem = S.quantize_problem(self.codec, _scale_dtype(self.scale_dtype, self.codec), self.zero_suffix is not None,
                                     self.global_suffix is not None)  # fmt: skip
        if problem is not None:
            raise AdapterError(f"{self.label()} cannot be inverted: {problem}; export the dequantised values instead "
                               "(an adapter without this rule)")  # fmt: skip
        return [QuantizeScaled(**self._fields())]


class QuantizeScaled(_ScaledFields):
    """The inverse of :class:`DequantScaled`: each matched floating tensor becomes its codes,
    scales and (with ``zero_suffix``) zero points with the same keys, geometry, packing and
    dtypes (scales in ``scale_dtype``, by default float32, e4m3 for NVFP4, whose global scale is
    chosen again from the tensor's largest magnitude as the release's tool does:
    :class:`~sdadapt._recipes.quant_scaled_nodes.GlobalScaleOf`; e8m0 exponent bytes for the MX formats). FP8 and NVFP4 with float
    scales, MXFP8 / MXFP4 with e8m0 scales, and int8 / int4 codes (packed or not) with float
    scales and optional zero points; how each scale is chosen is in :func:`S.quantize`.

    Args:
        **fields: the fields of :class:`DequantScaled` (the rule this one inverts), with the same meaning.

    Example::

        rule = sdadapt.rules.DequantScaled(keys="**.weight", codec="e4m3").inverse()
        assert isinstance(rule, sdadapt.rules.QuantizeScaled)
    """

    kind: Literal["quantize_scaled"] = "quantize_scaled"

    def apply(self, ctx: PlanContext, index: int) -> None:
        take, skip = compile_pattern(self.keys).regex.match, union_of(tuple(self.exclude)).match
        sdt = _scale_dtype(self.scale_dtype, self.codec)
        problem = S.quantize_problem(self.codec, sdt, self.zero_suffix is not None, self.global_suffix is not None)
        for key in [k for k in ctx.keys() if take(k) is not None and skip(k) is None and len(ctx.get(k).shape) >= 2]:
            node = ctx.get(key)
            if problem is not None:
                ctx.issue(index, key, f"cannot be quantized: {problem}")
                continue
            if not node.dtype.is_floating_point:
                ctx.issue(index, key, f"is {dtype_name(node.dtype)}; only floating tensors can be quantized")
                continue
            rows, cols = node.shape[-2:]
            tile = self.tile(rows, cols)
            glob: Node | None = None
            if self.global_suffix is not None:
                glob = SN.GlobalScaleOf(node, self.global_mode)
                ctx.put(key + str(self.global_suffix), glob, index, origin=key)
            shape = tuple(self.tensor_scale_shape) if self.strategy == "tensor" else None
            zero = self.zero_suffix is not None
            scales = SN.QuantizedScaled(node, self.codec, tile, "scales", sdt, glob, self.global_mode, shape, zero)
            values = SN.QuantizedScaled(node, self.codec, tile, "values", sdt, glob, self.global_mode, None, zero)
            ctx.mark(index)
            if self.values_suffix:
                ctx.absorb(key, index)
                ctx.put(key + self.values_suffix, values, index, origin=key)
            else:
                ctx.replace(key, values)
            ctx.put(key + self.scale_suffix, scales, index, origin=key)
            if self.zero_suffix is not None:
                zeros = SN.QuantizedScaled(node, self.codec, tile, "zeros", sdt, glob, self.global_mode, None, zero)
                ctx.put(key + self.zero_suffix, zeros, index, origin=key)
            if self.shape_suffix:
                ctx.put(key + self.shape_suffix, SN.ShapeOf(node), index, origin=key)

    def inverse(self) -> list[Any]:
        return [DequantScaled(**self._fields())]


def _scale_dtype(name: str | None, codec: S.Codec) -> torch.dtype:
    if name is not None:
        return parse_dtype(name)
    return S.STORED["e4m3"] if codec == "e2m1" else torch.float32


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


for _cls in (DequantScaled, QuantizeScaled):
    register_rule(_cls)
