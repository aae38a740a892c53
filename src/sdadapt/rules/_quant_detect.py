"""The dequant rules for the formats other tools write, built from a validated quantization config
(:mod:`sdadapt.rules._quant_config`): compressed-tensors (one rule per config group), NVIDIA ModelOpt,
per-tensor FP8 (``quant_method: fp8`` without ``weight_block_size``) and MXFP8 (``quant_method: mxfp8``).

Given the checkpoint's schema (its headers), a config group's ``targets`` and the ``ignore``
list are resolved against the checkpoint's module names, and a module whose weight is stored as
plain floats is left alone (``targets: ["Linear"]`` does not say which 2-D weights are linear
layers; the stored dtypes do); each rule then excludes exactly the weights it must not touch.
Without the schema, ``targets`` of module classes match every 2-D ``*.weight`` but the matrices
releases keep unquantized (:data:`FP8_EXCLUDE`) and the ``ignore`` names;
a regular-expression ``ignore`` or target then needs the schema.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._base.schema import dtype_name
from .._recipes import quant as Q
from .._recipes import quant_scaled as S
from ..errors import AdapterError
from ..sources import Source, read_json
from . import _quant_config as C
from ._base import RuleBase, dtype_str
from ._dequant_scaled import ACTIVATION_SCALES, DequantScaled

if TYPE_CHECKING:
    from .._base.schema import TensorInfo

# The FP8 block and MXFP4 rules (``sdadapt.rules._dequant``) are imported by the releases that
# use them only: compressed-tensors and ModelOpt releases, the common ones, do not pay for
# their kernels' modules.

FP8_EXCLUDE = ["**embed_tokens.weight", "lm_head.weight", "**.mlp.gate.weight", "**.shared_head.head.weight"]
"""Matrices that FP8 releases keep in bf16: embeddings, the output head (and DeepSeek's MTP copy
of it) and MoE routers (norms and biases are 1-D and never matched)."""

KV_SCALES = ["**.k_scale", "**.v_scale"]
"""KV-cache scales (compressed-tensors' ``kv_cache_scheme``, ModelOpt's FP8 KV cache): activations
too, dropped on purpose."""


def _stored_quantized(schema: Mapping[str, TensorInfo], module: str, fields: dict[str, Any]) -> bool:
    """Whether ``module``'s weight is stored in the codec of ``fields`` (so a rule may take it)."""
    key = module + ".weight" + fields.get("values_suffix", "")
    info = schema.get(key)
    return info is not None and len(info.shape) >= 2 and info.dtype == S.STORED[fields["codec"]]


def _weights(schema: Mapping[str, TensorInfo]) -> list[str]:
    """Modules with a 2-D (or more) weight, stored plain or packed."""
    out = set()
    for k, info in schema.items():
        for suffix in (".weight", ".weight_packed"):
            if k.endswith(suffix) and len(info.shape) >= 2:
                out.add(k[: -len(suffix)])
    return sorted(out)


def _resolve(groups: list[tuple[list[str], dict[str, Any]]], ignore: list[str], excluded: Any,
             schema: Mapping[str, TensorInfo]) -> list[list[str]]:  # fmt: skip
    """Per group, the modules it takes: not ignored, stored in its codec, first group whose
    targets match."""
    taken: list[list[str]] = [[] for _ in groups]
    for module in _weights(schema):
        if excluded(module, ignore):
            continue
        for i, (targets, fields) in enumerate(groups):
            if any(C.matches_target(module, t) for t in targets) and _stored_quantized(schema, module, fields):
                taken[i].append(module)
                break
    return taken


def _rules(groups: list[tuple[list[str], dict[str, Any]]], ignore: list[str], excluded: Any, to_pattern: Any,
           schema: Mapping[str, TensorInfo] | None, dtype: str | None, drop: list[str]) -> list[DequantScaled]:  # fmt: skip
    rules: list[DequantScaled] = []
    if schema:
        taken = _resolve(groups, ignore, excluded, schema)
        for (_, fields), mine in zip(groups, taken, strict=True):
            if not mine:
                continue
            others = sorted(set(_weights(schema)) - set(mine))
            stored = {schema[k].dtype for m in mine if (k := m + ".weight" + fields.get("scale_suffix", "_scale")) in schema}
            if len(stored) == 1:  # the one dtype the scales are stored in: required, and what export writes
                fields = {**fields, "scale_dtype": dtype_name(stored.pop())}
            shapes = {tuple(schema[k].shape) for m in mine if (k := m + ".weight" + fields.get("scale_suffix", "_scale")) in schema}
            if fields["strategy"] == "tensor" and len(shapes) == 1 and len(next(iter(shapes))) <= 1:
                fields = {**fields, "tensor_scale_shape": list(shapes.pop())}
            rules.append(DequantScaled(keys="**.weight", exclude=[m + ".weight" for m in others], dtype=dtype,
                                       drop=drop if not rules else [], **fields))  # fmt: skip
        return rules
    for targets, fields in groups:
        if any(t.startswith("re:") for t in targets) and len(groups) > 1:
            raise AdapterError("config.json: quantization_config has several config groups with regular-expression "
                               "targets; give the release folder (or schema=) so that they are resolved to its keys")  # fmt: skip
        exclude = list(FP8_EXCLUDE) + [to_pattern(m) for m in ignore]
        rules.append(DequantScaled(keys="**.weight", exclude=exclude, dtype=dtype, drop=drop if not rules else [], **fields))
    return rules


def _ct_fields(fmt: str, w: C.CTArgs, where: str) -> dict[str, Any] | None:
    """The rule fields of one compressed-tensors config group (``None``: stored unquantized)."""
    if fmt == "dense":
        return None
    strategy = w.strategy or "tensor"
    strategy = "group" if strategy == "tensor_group" else strategy
    if strategy not in ("tensor", "channel", "group", "block"):
        raise AdapterError(f"{where}: weights.strategy {w.strategy!r} is an activation strategy; weights use tensor, "
                           "channel, group or block")  # fmt: skip
    fields: dict[str, Any] = {"strategy": strategy}
    if strategy == "group":
        implied = {"nvfp4-pack-quantized": S.NVFP4_GROUP, "mxfp4-pack-quantized": S.MX_GROUP, "mxfp8-quantized": S.MX_GROUP}
        if w.group_size is None and fmt not in implied:
            raise AdapterError(f"{where}: weights.strategy 'group' needs weights.group_size")
        fields["group_size"] = w.group_size or implied[fmt]
    if strategy == "block":
        if not w.block_structure:
            raise AdapterError(f"{where}: weights.strategy 'block' needs weights.block_structure")
        fields["block"] = w.block_structure
    kind = (fmt, w.type, w.num_bits)
    if fmt in ("float-quantized", "naive-quantized", "mxfp8-quantized") and kind[1:] == ("float", 8):
        fields["codec"] = "e4m3"
    elif fmt in ("int-quantized", "naive-quantized") and kind[1:] == ("int", 8):
        fields["codec"] = "int8"
    elif fmt == "pack-quantized" and w.type == "int" and w.num_bits in (4, 8):
        fields.update(codec="int4" if w.num_bits == 4 else "int8_packed", values_suffix="_packed", shape_suffix="_shape")
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") and kind[1:] == ("float", 4):
        fields.update(codec="e2m1", values_suffix="_packed")
        if fmt == "nvfp4-pack-quantized":
            fields.update(global_suffix="_global_scale", global_mode="divide")
    else:
        raise AdapterError(f"{where}: format {fmt!r} with {w.type} {w.num_bits}-bit weights is not read by sdadapt "
                           "(it reads float-/int-/naive-quantized 8-bit, pack-quantized int4/int8, nvfp4-pack-quantized, "
                           "mxfp4-pack-quantized and mxfp8-quantized)")  # fmt: skip
    if fmt in ("mxfp8-quantized", "mxfp4-pack-quantized"):  # e8m0 exponents: the config's dtype, else uint8 as written
        stored = (w.scale_dtype or "").removeprefix("torch.")
        fields["scale_dtype"] = stored if stored in ("uint8", "float8_e8m0fnu") else "uint8"
    if not w.symmetric and fields["codec"] in ("int8", "int4", "int8_packed"):
        fields["zero_suffix"] = "_zero_point"
    fields["scale_suffix"] = "_scale"
    return fields


def _ct_pattern(name: str) -> str:
    if name.startswith("re:"):
        raise AdapterError(f"config.json: quantization_config.ignore {name!r} is a regular expression; give the release "
                           "folder (or schema=) so that it is resolved to the checkpoint's keys")  # fmt: skip
    return f"**{name}.weight" if not name.startswith("**") else name + ".weight"


def compressed_tensors_rules(qc: C.CompressedTensorsConfig, schema: Mapping[str, TensorInfo] | None,
                             dtype: str | None) -> list[DequantScaled]:  # fmt: skip
    """One :class:`DequantScaled` per quantized config group of a compressed-tensors release."""
    groups = []
    for name, group in qc.config_groups.items():
        if group.weights is None:
            continue  # activations only: nothing stored
        fmt = group.format or qc.format
        if fmt is None:
            raise AdapterError(f"config.json: quantization_config.config_groups.{name} has no format (nor has the config)")
        fields = _ct_fields(fmt, group.weights, f"config.json: quantization_config.config_groups.{name}")
        if fields is not None:
            groups.append((group.targets, fields))
    drop = ACTIVATION_SCALES + (KV_SCALES if qc.kv_cache_scheme else [])
    return _rules(groups, qc.ignore, C.ignored, _ct_pattern, schema, dtype, drop)


def _glob_pattern(name: str) -> str:
    if any(c in name for c in "?["):
        raise AdapterError(f"quantization exclude_modules {name!r} uses wildcards sdadapt cannot translate; give the "
                           "release folder (or schema=) so that it is resolved to the checkpoint's keys")  # fmt: skip
    pat = name.replace("*", "**")
    return pat if pat.endswith(".weight") else pat + ".weight"


def modelopt_rules(q: C.ModelOptQuant, exclude: list[str], schema: Mapping[str, TensorInfo] | None,
                   dtype: str | None) -> list[DequantScaled]:  # fmt: skip
    """ModelOpt NVFP4 (``weight`` uint8, ``weight_scale`` e4m3 per 16, ``weight_scale_2``) or FP8
    (``weight`` e4m3, ``weight_scale`` per tensor)."""
    algo = (q.quant_algo or "").upper()
    fields: dict[str, Any]
    if algo == "NVFP4":
        fields = {"codec": "e2m1", "strategy": "group", "group_size": q.group_size or S.NVFP4_GROUP,
                  "global_suffix": "_scale_2", "global_mode": "multiply"}  # fmt: skip
    elif algo == "FP8":
        fields = {"codec": "e4m3", "strategy": "tensor", "tensor_scale_shape": []}
    else:
        raise AdapterError(f"ModelOpt quant_algo {q.quant_algo!r} is not read by sdadapt (it reads NVFP4 and FP8)")
    fields["scale_suffix"] = "_scale"
    drop = ACTIVATION_SCALES + KV_SCALES
    return _rules([(["Linear"], fields)], exclude, C.modelopt_excluded, _glob_pattern, schema, dtype, drop)


def per_tensor_fp8_rules(qc: C.FP8Config, schema: Mapping[str, TensorInfo] | None, dtype: str | None,
                         exclude: list[str]) -> list[DequantScaled]:  # fmt: skip
    """``quant_method: fp8`` without ``weight_block_size``: one scale per tensor (or per output
    channel, where the stored scales say so), under ``weight_scale_inv`` or ``weight_scale``."""
    scales = {k: i for k, i in (schema or {}).items() if k.endswith((".weight_scale_inv", ".weight_scale"))}
    suffix = "_scale_inv" if any(k.endswith("_scale_inv") for k in scales) else "_scale"
    channel = bool(scales) and all(len(i.shape) == 2 and i.shape[-1] == 1 and i.shape[-2] > 1 for i in scales.values())
    fields: dict[str, Any] = {"codec": "e4m3", "strategy": "channel" if channel else "tensor", "scale_suffix": suffix}
    names = [m for m in qc.modules_to_not_convert or []]
    drop = ACTIVATION_SCALES + ["**.activation_scale"] + KV_SCALES
    return _rules([(["Linear"], fields)], names, C.ignored, _ct_pattern, schema, dtype, drop) if schema else [
        DequantScaled(keys="**.weight", exclude=exclude + [_ct_pattern(m) for m in names], dtype=dtype, drop=drop, **fields)
    ]


def mxfp8_rules(qc: C.MXFP8Config, schema: Mapping[str, TensorInfo] | None, dtype: str | None,
                exclude: list[str]) -> list[DequantScaled]:  # fmt: skip
    """``quant_method: mxfp8``: ``<module>.weight`` e4m3 and ``<module>.weight_scale_inv``, one e8m0
    exponent per ``weight_block_size`` (``[1, 32]``: 32 values of a row), stored as ``U8`` or
    ``F8_E8M0``. ``modules_to_not_convert`` (or ``ignored_layers``) names the modules kept as
    they are. Given the schema, the exponents' stored dtype is kept for export; without it,
    ``uint8`` is assumed (a release storing ``F8_E8M0`` then needs the folder or ``schema=``)."""
    b0, b1 = qc.weight_block_size
    if b0 <= 0 or b1 <= 0:
        raise AdapterError(f"config.json: quantization_config.weight_block_size {qc.weight_block_size} must be two "
                           "positive integers ([1, 32] for MXFP8)")  # fmt: skip
    fields: dict[str, Any] = {"codec": "e4m3", "scale_suffix": "_scale_inv", "scale_dtype": "uint8"}
    fields |= {"strategy": "group", "group_size": b1} if b0 == 1 else {"strategy": "block", "block": [b0, b1]}
    names = list(qc.modules_to_not_convert or []) + list(qc.ignored_layers or [])
    drop = ACTIVATION_SCALES + ["**.activation_scale"] + KV_SCALES
    if schema:
        return _rules([(["Linear"], fields)], names, C.ignored, _ct_pattern, schema, dtype, drop)
    return [DequantScaled(keys="**.weight", exclude=exclude + [_ct_pattern(m) for m in names], dtype=dtype, drop=drop, **fields)]


# --- the entry point: a release folder or config -> its dequant rules ---

def dequant_rules(
    config: Mapping[str, Any] | str | os.PathLike[str] | Source,
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
    ``hf_quant_config.json`` beside it) describes; or an open checkpoint (a
    :class:`~sdadapt.sources.Source`): its folder's config, and its schema as it is (the headers
    are not read again):

    - ``quant_method: fp8`` with ``weight_block_size``: one :class:`DequantFP8` (``scale_fmt:
      ue8m0`` means power-of-two scales; ``modules_to_not_convert`` extends ``fp8_exclude``,
      which defaults to :data:`FP8_EXCLUDE`); without it, per-tensor (or per-channel) FP8 as a
      :class:`~sdadapt.rules._dequant_scaled.DequantScaled`;
    - ``quant_method: mxfp4``: one :class:`DequantMXFP4` (``mxfp4_keys``);
    - ``quant_method: mxfp8``: one ``DequantScaled`` (e4m3 ``weight``, e8m0 ``weight_scale_inv``
      per 32 values as ``U8`` or ``F8_E8M0``; ``modules_to_not_convert`` left alone);
    - ``compressed-tensors``: one ``DequantScaled`` per quantized config group (``format``,
      ``weights``, ``targets``, ``ignore``); activation and KV-cache scales are dropped on purpose;
    - ``modelopt`` (NVFP4, FP8): one ``DequantScaled``;
    - ``gptq`` (``checkpoint_format: gptq``, 2 / 4 / 8 bits, any ``group_size``, act-order) and
      ``awq`` (``version: gemm``): one :class:`~sdadapt.rules._dequant_gptq.DequantGPTQ` over
      every module storing a ``qweight`` (``modules_to_not_convert`` store plain weights).

    Args:
        config: the ``config.json`` dict, its path, the release folder, or the open source of
            the release. A folder's checkpoint headers are read (when ``schema`` is not given;
            an open source's schema is used) to resolve targets and exclusions to its keys, and
            how FP8 block scales are stored.
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

    if isinstance(config, Source):
        schema = config.schema if schema is None else schema
        p = config.path  # the config.json of its folder (a file's folder)
        config = p if os.path.isdir(p) else os.path.join(os.path.dirname(os.path.abspath(p)), "config.json")
    cfg, where, folder = _read_config(config)
    if schema is None and folder is not None:
        schema = _headers(folder)
    qc = cfg.get("quantization_config")
    to = _dtype_arg(dtype)
    if not qc:
        hf_quant = os.path.join(folder, "hf_quant_config.json") if folder else None
        if hf_quant and os.path.isfile(hf_quant):
            q = C.validate(C.HFQuantConfig, _read_json(hf_quant), hf_quant).quantization
            return list(modelopt_rules(q, q.exclude_modules or [], schema, to))
        return []
    parsed = C.parse(qc, where)
    if isinstance(parsed, C.CompressedTensorsConfig):
        return list(compressed_tensors_rules(parsed, schema, to))
    if isinstance(parsed, C.ModelOptConfig):
        return list(modelopt_rules(parsed, parsed.exclude_modules or parsed.ignore or [], schema, to))
    if isinstance(parsed, (C.GPTQConfig, C.AWQConfig)):
        return [gptq_rule(parsed, where, to)]
    if isinstance(parsed, C.MXFP4Config):
        from ._dequant import DequantMXFP4

        return [DequantMXFP4(keys=mxfp4_keys, dtype=to)]
    if isinstance(parsed, C.MXFP8Config):
        return list(mxfp8_rules(parsed, schema, to, list(FP8_EXCLUDE if fp8_exclude is None else fp8_exclude)))
    assert isinstance(parsed, C.FP8Config)
    exclude = list(FP8_EXCLUDE if fp8_exclude is None else fp8_exclude)
    if parsed.weight_block_size is None:
        return list(per_tensor_fp8_rules(parsed, schema, to, exclude))
    fmt, scale_dtype = _fp8_scale_storage(qc, schema)
    exclude += [f"**{m}.weight" for m in parsed.modules_to_not_convert or []]
    b0, b1 = parsed.weight_block_size
    from ._dequant import DequantFP8

    return [DequantFP8(keys=fp8_keys, exclude=exclude, block=(b0, b1), scale_format=fmt,
                       scale_dtype=scale_dtype, dtype=to)]  # fmt: skip


def gptq_rule(qc: C.GPTQConfig | C.AWQConfig, where: str, dtype: str | None) -> RuleBase:
    """The one rule of a GPTQ or AWQ release; a layout it does not read is an :class:`AdapterError`
    naming ``where`` and the field."""
    from .._recipes import quant_gptq as G
    from ._dequant_gptq import DequantGPTQ

    field = f"{where}: quantization_config"
    if isinstance(qc, C.GPTQConfig):
        if qc.checkpoint_format != "gptq":
            raise AdapterError(f"{field}.checkpoint_format {qc.checkpoint_format!r} is not read; sdadapt reads GPTQ's "
                               "'gptq' layout (zero points stored less one), as AutoGPTQ writes it")  # fmt: skip
        layout: G.Layout = "gptq"
    else:
        if qc.version != "gemm" or not qc.zero_point:
            raise AdapterError(f"{field}: AWQ version {qc.version!r} (zero_point={qc.zero_point}) is not read; sdadapt "
                               "reads AutoAWQ's 'gemm' layout with zero points")  # fmt: skip
        layout = "awq"  # modules_to_not_convert store a plain weight, no qweight: the rule passes them by
    try:
        return DequantGPTQ(keys="**", layout=layout, bits=qc.bits, group_size=qc.group_size, dtype=dtype)
    except ValueError as e:
        msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
        raise AdapterError(f"{field}: {msg}; fix the release's config") from None


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
    from ..sources import local_path  # noqa: PLC0415 - a URL or Hub id: its local folder

    path = local_path(config)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise AdapterError(f"{path!r} is not a JSON object")
    return data, path, folder


# the scaled formats' rule kinds register with this module, so that adapters read them from JSON
