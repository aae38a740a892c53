"""A release's quantization config -> the dequant rules that read it.

``quantization_config`` of ``config.json`` (or ModelOpt's ``hf_quant_config.json``) is validated
through the pydantic models here, with strict types: a field of the wrong type is an
:class:`~sdadapt.errors.AdapterError` naming the file and the field, never a foreign exception.
Fields the models do not name are allowed (releases carry many) and ignored.

Methods read:

- ``fp8`` (DeepSeek/Qwen block scales: :class:`~sdadapt.rules.DequantFP8`; without
  ``weight_block_size``, per-tensor FP8 as Mistral-family releases store it);
- ``mxfp4`` (GPT-OSS: :class:`~sdadapt.rules.DequantMXFP4`);
- ``mxfp8`` (the layout SGLang's loader and transformers' fine-grained FP8 read: ``weight`` e4m3,
  ``weight_scale_inv`` one e8m0 exponent per 32 values, ``weight_block_size: [1, 32]``);
- ``compressed-tensors``: each config group's ``format`` and ``weights`` (``float-quantized``,
  ``naive-quantized``, ``int-quantized``, ``pack-quantized``, ``nvfp4-pack-quantized``,
  ``mxfp4-pack-quantized``, ``mxfp8-quantized``) with its ``targets`` and the ``ignore`` list;
- ``modelopt`` (NVFP4, FP8), from ``quantization_config`` or ``hf_quant_config.json``;
- ``gptq`` (AutoGPTQ's ``checkpoint_format: gptq``, 2 / 4 / 8 bits) and ``awq`` (AutoAWQ's
  ``version: gemm``, 4 bits): :class:`~sdadapt.rules._dequant_gptq.DequantGPTQ`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import AdapterError


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class FP8Config(_Model):
    """``quant_method: fp8`` (transformers' fine-grained FP8, and per-tensor FP8)."""

    quant_method: Literal["fp8"]
    weight_block_size: list[int] | None = Field(default=None, min_length=2, max_length=2)
    scale_fmt: str | None = None
    modules_to_not_convert: list[str] | None = None
    activation_scheme: str | None = None


class MXFP8Config(_Model):
    """``quant_method: mxfp8``: e4m3 weights, one e8m0 exponent (``U8`` or ``F8_E8M0``) per
    ``weight_block_size`` = ``[1, 32]`` values under ``<module>.weight_scale_inv``.
    ``ignored_layers`` is another name some releases give ``modules_to_not_convert``."""

    quant_method: Literal["mxfp8"]
    weight_block_size: list[int] = Field(default=[1, 32], min_length=2, max_length=2)
    scale_fmt: Literal["ue8m0"] | None = None
    modules_to_not_convert: list[str] | None = None
    ignored_layers: list[str] | None = None
    activation_scheme: str | None = None


class MXFP4Config(_Model):
    quant_method: Literal["mxfp4"]
    modules_to_not_convert: list[str] | None = None


class CTArgs(_Model):
    """compressed-tensors ``QuantizationArgs`` (the fields that say how weights are stored)."""

    num_bits: int = Field(gt=0, le=8)
    type: Literal["int", "float"]
    symmetric: bool = True
    strategy: Literal["tensor", "channel", "group", "block", "token", "tensor_group", "attn_head"] | None = None
    group_size: int | None = Field(default=None, gt=0)
    block_structure: list[int] | None = Field(default=None, min_length=2, max_length=2)
    scale_dtype: str | None = None


class CTGroup(_Model):
    targets: list[str] = Field(min_length=1)
    weights: CTArgs | None = None
    input_activations: CTArgs | None = None
    output_activations: CTArgs | None = None
    format: str | None = None


class CompressedTensorsConfig(_Model):
    quant_method: Literal["compressed-tensors"]
    format: str | None = None
    config_groups: dict[str, CTGroup] = {}
    ignore: list[str] = []
    kv_cache_scheme: dict[str, Any] | None = None


class ModelOptQuant(_Model):
    quant_algo: str | None = None
    group_size: int | None = Field(default=None, gt=0)
    exclude_modules: list[str] | None = None
    kv_cache_quant_algo: str | None = None


class ModelOptConfig(ModelOptQuant):
    """``quant_method: modelopt`` in ``config.json`` (the fields of ``hf_quant_config.json``'s
    ``quantization`` inlined; ``ignore`` is another name some releases use for the exclusions)."""

    quant_method: Literal["modelopt"]
    ignore: list[str] | None = None


class HFQuantConfig(_Model):
    """ModelOpt's ``hf_quant_config.json``: ``{"producer": {...}, "quantization": {...}}``."""

    quantization: ModelOptQuant


class GPTQConfig(_Model):
    """``quant_method: gptq`` (AutoGPTQ, GPTQModel, optimum): ``qweight`` / ``qzeros`` / ``scales``
    / ``g_idx`` per linear layer. ``desc_act`` (act-order) and ``sym`` change the values stored,
    not how they are read (``g_idx`` and ``qzeros`` say it); ``checkpoint_format`` other than
    ``gptq`` (GPTQModel's ``gptq_v2`` zero points, Marlin repacks) is refused by name."""

    quant_method: Literal["gptq"]
    bits: int
    group_size: int = -1
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    modules_in_block_to_quantize: list[Any] | None = None


class AWQConfig(_Model):
    """``quant_method: awq`` (AutoAWQ): ``version: gemm`` with zero points is read; the other
    versions (``gemv``, ``gemv_fast``, ``marlin``, ``exllama``, ``ipex``) pack differently and are refused by name."""

    quant_method: Literal["awq"]
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] | None = None


METHODS: dict[str, type[_Model]] = {
    "fp8": FP8Config,
    "mxfp4": MXFP4Config,
    "mxfp8": MXFP8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "modelopt": ModelOptConfig,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
}


def parse(qc: object, where: str) -> _Model:
    """``quantization_config`` (a dict) -> its model; an :class:`AdapterError` naming ``where``
    (the file) and the field that is wrong, or the method that is not read."""
    if not isinstance(qc, Mapping):
        raise AdapterError(f"{where}: quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    model = METHODS.get(method) if isinstance(method, str) else None
    if model is None:
        raise AdapterError(
            f"{where}: quantization_config.quant_method {method!r} is not supported; sdadapt reads "
            f"{', '.join(repr(m) for m in METHODS)}"
        )
    return validate(model, qc, f"{where}: quantization_config")


def validate(model: type[_Model], data: object, where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(the object)"
        raise AdapterError(f"{where}.{field}: {err['msg']} (got {err.get('input')!r:.80}); fix the release's config") from None


# --- compressed-tensors targets -------------------------------------------------------------------


def module_of(key: str) -> str:
    """``model.layers.0.mlp.down_proj.weight_packed`` -> ``model.layers.0.mlp.down_proj``."""
    return key.rsplit(".", 1)[0] if "." in key else ""


def matches_target(module: str, target: str) -> bool:
    """compressed-tensors' matching of a module name: ``re:<regex>`` (a full match of the
    name), an exact name, or a module class name (``Linear``: every quantized module, the
    stored dtypes tell which)."""
    if target.startswith("re:"):
        try:
            return re.fullmatch(target[3:], module) is not None
        except re.error as e:
            raise AdapterError(f"config.json: quantization_config target {target!r} is not a valid regex: {e}") from None
    if target[:1].isupper() and "." not in target:
        return True  # a class name: the checkpoint's stored dtypes decide
    return module == target or module.endswith("." + target)


def ignored(module: str, ignore: list[str]) -> bool:
    return any(matches_target(module, t) and not (t[:1].isupper() and "." not in t) for t in ignore)


def modelopt_excluded(module: str, patterns: list[str]) -> bool:
    """ModelOpt's ``exclude_modules`` are shell-style wildcards over module names."""
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module + ".weight", p) for p in patterns)


def ignored_modules(ignore: list[str], keys: Iterable[str]) -> list[str]:
    """The modules among a checkpoint's keys that a compressed-tensors ``ignore`` list names.

    compressed-tensors' ``ignore`` holds module names and ``re:<regex>`` patterns (matched in
    full); resolving them against the checkpoint's own keys once gives a literal list that
    :func:`sdadapt.dequant_rules` reads later without the checkpoint at hand. Class names
    (``Linear``) in the list are skipped: they name every module of a class, which key names do
    not tell.

    Args:
        ignore: the ``quantization_config.ignore`` list of a ``config.json``.
        keys: the checkpoint's key names (``source.schema``).

    Returns:
        The sorted module names (``model.layers.0.mlp.gate``) the list ignores.

    Raises:
        AdapterError: a ``re:`` pattern is no valid regular expression.

    Example::

        qc = cfg["quantization_config"]
        qc = {**qc, "ignore": sdadapt.rules.ignored_modules(qc["ignore"], src.schema)}
    """
    return [m for m in sorted({module_of(k) for k in keys}) if m and ignored(m, ignore)]
