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
:func:`quant_hint` turns either into a hint naming the rule that fixes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator

from .._recipes import quant as Q
from .._recipes import quant_nodes as QN
from ..errors import AdapterError
from ..sources._base import dtype_name
from ..sources._json import read_json
from . import RuleBase, parse_dtype, register_rule
from ._base import dtype_str
from ._patterns import compile_pattern, union_of

if TYPE_CHECKING:
    from .._plan.plan import PlanContext
    from .._plan.report import Report
    from ..sources._base import TensorInfo

FP8_EXCLUDE = ["**embed_tokens.weight", "lm_head.weight", "**.mlp.gate.weight", "**.shared_head.head.weight"]
"""Matrices that FP8 releases keep in bf16: embeddings, the output head (and DeepSeek's MTP copy
of it) and MoE routers (norms and biases are 1-D and never matched)."""


def _block(v: object) -> tuple[int, int]:
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(isinstance(b, int) and b > 0 for b in v):
        raise ValueError(f"block must be two positive integers [rows, cols], got {v!r}")
    return (int(v[0]), int(v[1]))


VALUES_DTYPE = torch.bfloat16
"""The dtype of dequantised values where nothing says another: no ``dtype=`` on the rule, and no
model tensor to take the dtype from (``convert`` to a plain release)."""


class _QuantRule(RuleBase):
    """What every rule of the family has: the keys it acts on and the dtype of the values.

    ``dtype=None`` (the default): the values take the dtype the model holds for each key
    (float32 master weights get ``float(w) * scale`` in float32, computed so, not widened from
    bfloat16), or :data:`VALUES_DTYPE` where there is no model; a dtype pins it."""

    moves_keys: ClassVar[bool] = False
    keys: str
    dtype: str | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _check_dtype(cls, v: object) -> str | None:
        return None if v is None else dtype_str(v)

    def _values_dtype(self) -> tuple[torch.dtype, bool]:
        """The dtype the dequantised nodes start with, and whether the target's replaces it."""
        return (VALUES_DTYPE, True) if self.dtype is None else (parse_dtype(self.dtype), False)

    def input_patterns(self) -> list[str]:
        return [self.keys]

    def _fields(self) -> dict[str, Any]:
        return self.model_dump(exclude={"kind"})


class _FP8Fields(_QuantRule):
    """What FP8 dequantisation and re-quantization share: which keys, the block, the scale.

    ``scale_dtype``: the one dtype the scales are stored in, when the format allows several
    (``"ue8m0"``: ``uint8`` or ``float8_e8m0fnu``); loading then requires it and export writes
    it. ``None``: loading accepts any of the format's dtypes and export writes the first."""

    keys: str = "**.weight"
    exclude: list[str] = []
    block: tuple[int, int]
    scale_suffix: str = Field(default=Q.FP8_SCALE_SUFFIX, min_length=1)
    scale_format: Q.ScaleFormat = "float32"
    scale_dtype: str | None = None

    @field_validator("block", mode="before")
    @classmethod
    def _check_block(cls, v: object) -> tuple[int, int]:
        return _block(v)

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

    Built by :func:`sdadapt.dequant_fp8`, whose arguments are these fields.

    Args:
        keys: the weights' key pattern.
        dtype: the values' dtype (``None``: the model's for each key).
        exclude: key patterns left alone (unquantized weights).
        block: the scale block, ``(rows, cols)``.
        scale_suffix: a scale's key is the weight's key + this.
        scale_format: ``"float32"``, ``"ue8m0"`` or ``"ue8m0_float32"``.
        scale_dtype: the dtype the scales are stored in (``None``: any of the format's).

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
            ctx.replace(key, QN.DequantFP8(node, scale, self.block, self.scale_format, to, follows))

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
            scales = QN.QuantizeFP8(node, self.block, self.scale_format, "scales", self._scale_dtypes()[0])
            ctx.replace(key, QN.QuantizeFP8(node, self.block, self.scale_format, "values"))
            ctx.put(skey, scales, index, origin=key)

    def inverse(self) -> list[Any]:
        return [DequantFP8(**self._fields())]


class _MXFP4Fields(_QuantRule):
    """What MXFP4 dequantisation and re-quantization share: the suffixes of the packed pair."""

    blocks_suffix: str = Field(default=Q.MX_BLOCKS_SUFFIX, min_length=1)
    scales_suffix: str = Field(default=Q.MX_SCALES_SUFFIX, min_length=1)


class DequantMXFP4(_MXFP4Fields):
    """``<name>_blocks`` (uint8 ``[..., G, 16]``) + ``<name>_scales`` (uint8 ``[..., G]``) ->
    ``<name>`` ``[..., G * 32]`` in ``dtype``, for each ``<name>`` matching ``keys``:
    ``DequantMXFP4(keys="model.layers.{i}.mlp.experts.{proj}")``. The packed dim (32 values per
    block) is the last one, as the format defines it; a transpose rule after it gives another
    orientation.

    Built by :func:`sdadapt.dequant_mxfp4`, whose arguments are these fields.

    Args:
        keys: the dequantised keys' pattern (without the suffixes).
        dtype: the values' dtype (``None``: the model's for each key).
        blocks_suffix: the packed values' key is ``key + blocks_suffix``.
        scales_suffix: the scales' key is ``key + scales_suffix``.

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
            ctx.put(name, QN.DequantMXFP4(blocks, scales, to, follows), index, origin=[bkey, skey])

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
            ctx.put(key + self.blocks_suffix, QN.QuantizeMXFP4(node, "values"), index, origin=key)
            ctx.put(key + self.scales_suffix, QN.QuantizeMXFP4(node, "scales"), index, origin=key)

    def inverse(self) -> list[Any]:
        return [DequantMXFP4(**self._fields())]


# adapters read these kinds from JSON through the rule registry
for _cls in (DequantFP8, QuantizeFP8, DequantMXFP4, QuantizeMXFP4):
    register_rule(_cls)


# --- config.json ----------------------------------------------------------------------------------


def dequant_rules(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    schema: Mapping[str, TensorInfo] | None = None,
    fp8_keys: str = "**.weight",
    fp8_exclude: list[str] | None = None,
    mxfp4_keys: str = "**.mlp.experts.{proj}_proj",
) -> list[RuleBase]:
    """The rules to put first in an adapter for a release described by ``config`` (a
    ``config.json`` dict, file or release folder): none for an unquantized release, else the
    rules that dequantise what its ``quantization_config`` (or ModelOpt's
    ``hf_quant_config.json`` beside it) describes:

    - ``quant_method: fp8`` with ``weight_block_size``: one :class:`DequantFP8` (``scale_fmt:
      ue8m0`` means power-of-two scales; ``modules_to_not_convert`` extends ``fp8_exclude``,
      which defaults to :data:`FP8_EXCLUDE`); without it, per-tensor (or per-channel) FP8 as a
      :class:`~sdadapt.rules._dequant_scaled.DequantScaled`;
    - ``quant_method: mxfp4``: one :class:`DequantMXFP4` (``mxfp4_keys``);
    - ``compressed-tensors``: one ``DequantScaled`` per quantized config group (``format``,
      ``weights``, ``targets``, ``ignore``); activation and KV-cache scales are dropped on purpose;
    - ``modelopt`` (NVFP4, FP8): one ``DequantScaled``.

    Args:
        config: the ``config.json`` dict, its path, or the release folder. A folder's checkpoint
            headers are read (when ``schema`` is not given) to resolve targets and exclusions to
            its keys, and how FP8 block scales are stored.
        dtype: the dequantised values' dtype; ``None``: the model's dtype for each key.
        schema: the checkpoint's ``key -> TensorInfo`` (``source.schema``).
        fp8_keys, fp8_exclude, mxfp4_keys: the keys of the FP8 block and MXFP4 rules.

    Returns:
        The rules, to put first in an adapter (they act on the checkpoint's own key names).

    Example::

        rules = sdadapt.dequant_rules("path/to/release")
        adapter = sdadapt.Adapter([*rules, sdadapt.strip_prefix("model.")])

    ``scale_fmt: ue8m0`` says the scales are powers of two, not how they are stored: some
    releases (DeepSeek-V3.1) keep them as float32 (``scale_format="ue8m0_float32"``), others
    as exponent bytes (``uint8`` or ``float8_e8m0fnu``, kept as ``scale_dtype`` so that export
    writes the same dtype). Given the checkpoint's ``schema``, the stored dtype of the scales
    decides; without it, exponent bytes are assumed and a float32 release is a plan problem
    that says ``scale_format='ue8m0_float32'``. A config field of the wrong type is an
    :class:`~sdadapt.errors.AdapterError` naming the file and the field."""
    from . import _quant_config as C
    from . import _quant_detect as D

    cfg, where, folder = _read_config(config)
    if schema is None and folder is not None:
        schema = _headers(folder)
    qc = cfg.get("quantization_config")
    to = _dtype_arg(dtype)
    if not qc:
        hf_quant = os.path.join(folder, "hf_quant_config.json") if folder else None
        if hf_quant and os.path.isfile(hf_quant):
            q = C.validate(C.HFQuantConfig, _read_json(hf_quant), hf_quant).quantization
            return list(D.modelopt_rules(q, q.exclude_modules or [], schema, to))
        return []
    parsed = C.parse(qc, where)
    if isinstance(parsed, C.CompressedTensorsConfig):
        return list(D.compressed_tensors_rules(parsed, schema, to))
    if isinstance(parsed, C.ModelOptConfig):
        return list(D.modelopt_rules(parsed, parsed.exclude_modules or parsed.ignore or [], schema, to))
    if isinstance(parsed, C.MXFP4Config):
        return [DequantMXFP4(keys=mxfp4_keys, dtype=to)]
    assert isinstance(parsed, C.FP8Config)
    exclude = list(FP8_EXCLUDE if fp8_exclude is None else fp8_exclude)
    if parsed.weight_block_size is None:
        return list(D.per_tensor_fp8_rules(parsed, schema, to, exclude))
    fmt, scale_dtype = _fp8_scale_storage(qc, schema)
    exclude += [f"**{m}.weight" for m in parsed.modules_to_not_convert or []]
    b0, b1 = parsed.weight_block_size
    return [DequantFP8(keys=fp8_keys, exclude=exclude, block=(b0, b1), scale_format=fmt,
                       scale_dtype=scale_dtype, dtype=to)]  # fmt: skip


def _headers(folder: str) -> dict[str, TensorInfo] | None:
    """The checkpoint's schema in ``folder`` (headers only), or ``None`` when none opens."""
    from ..errors import SdadaptError
    from ..sources import open_source

    try:
        with open_source(folder) as src:
            return dict(src.schema)
    except SdadaptError:
        return None


def _dtype_arg(dtype: str | torch.dtype | None) -> str | None:
    return None if dtype is None else dtype_str(dtype)


def _fp8_scale_storage(qc: Mapping[str, Any], schema: Mapping[str, TensorInfo] | None) -> tuple[Q.ScaleFormat, str | None]:
    """``(scale_format, scale_dtype)`` of an FP8 release: ``scale_fmt: ue8m0`` means power-of-two
    scales, and the stored dtype of the ``*_scale_inv`` tensors (when ``schema`` shows one) says
    how they are kept: float32 ``2.0 ** k`` (``"ue8m0_float32"``) or exponent bytes, whose dtype
    export then keeps."""
    if qc.get("scale_fmt") != "ue8m0":
        return "float32", None
    stored = {i.dtype for k, i in (schema or {}).items() if k.endswith(Q.FP8_SCALE_SUFFIX)}
    if stored == {torch.float32}:
        return "ue8m0_float32", None
    if len(stored) == 1 and stored <= set(Q.SCALE_DTYPES["ue8m0"]):
        return "ue8m0", dtype_name(stored.pop())
    return "ue8m0", None


def _read_json(path: str) -> object:
    """The release's JSON file ``path``, read within the size and nesting limits of
    :mod:`sdadapt.sources._json` (a broken file is a ``SourceError`` naming it)."""
    return read_json(path, what=os.path.basename(path))


def _read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Mapping[str, Any], str, str | None]:
    """``(config dict, the name errors give it, the release folder or None)``."""
    if isinstance(config, Mapping):
        return config, "config.json", None
    path = os.fspath(config)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise AdapterError(f"{path!r} is not a JSON object")
    return data, path, folder


# --- report hint ----------------------------------------------------------------------------------

_SCALE_SUFFIXES = (Q.FP8_SCALE_SUFFIX, "weight_scale", Q.MX_BLOCKS_SUFFIX, Q.MX_SCALES_SUFFIX, "weight_packed",
                   "weight_zero_point", "weight_global_scale", "weight_scale_2", "weight_shape", "input_scale")


def quant_hint(report: Report) -> str | None:
    """A hint line when a report's problems look like a quantized checkpoint read without its
    dequant rule: unexpected scale/packed keys, or FP8/uint8 data where the model wants floats."""
    fp8 = [m for m in report.dtype_mismatch if m.checkpoint.startswith("float8")]
    packed = [k for k in report.unexpected if k.endswith(_SCALE_SUFFIXES)]
    packed += [m.key for m in report.dtype_mismatch if m.checkpoint in ("uint8", "int32", "int8")]
    own = [i for i in report.rule_issues if i.rule.startswith("dequant")]
    if own:  # the adapter has its dequant rule, which could not read these tensors: say what it said
        first = own[0]
        more = f" (and {len(own) - 1} more rule problem(s))" if len(own) > 1 else ""
        return f"hint: the dequant rule #{first.index} cannot read the quantized tensors: {first.key}: {first.message}{more}"
    if not fp8 and not packed:
        return None
    mx = [k for k in packed if k.endswith((Q.MX_BLOCKS_SUFFIX, Q.MX_SCALES_SUFFIX))]
    other = [m.key for m in fp8] + [k for k in packed if k not in mx]
    have = [r for r in report.dequant_rules if r.endswith(" dequant_mxfp4") == bool(mx and not other)]
    if have:  # the adapter has a rule of the format, yet quantized tensors are left: its keys miss them
        report_rules, left = have, sorted(set(mx) | set(other))
        return (
            f"hint: the adapter's dequant rule(s) {', '.join(report_rules)} left quantized tensors unread "
            f"({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}); widen the rule's keys= or take them out of "
            "its exclude=[...] (a cast rule is not enough: the values would miss their scales)"
        )
    return (
        "hint: the checkpoint is quantized (FP8 scales, packed or MXFP4 blocks); put sdadapt.dequant_rules(config.json) "
        "first in the adapter, or sdadapt.dequant_fp8(keys=..., block=[128, 128]) / sdadapt.dequant_mxfp4(keys=...) / "
        "sdadapt.dequant_scaled(...); "
        "a cast rule is not enough (the values would miss their scales)"
    )


# the scaled formats' rule kinds register with this module, so that adapters read them from JSON
from . import _dequant_scaled as _scaled_rules  # noqa: E402,F401
