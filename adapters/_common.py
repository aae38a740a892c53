"""Helpers shared by the shipped adapters: config and key-name readers, option checks, and the
rule groups that several families have in common (HF decoder blocks -> Meta/torchtitan names,
Meta rotary attention, stacked MoE experts, embeddings/output, quantized sources: FP8 block
scaling through ``sdadapt.dequant_rules``).

HF side: ``model.layers.{i}.`` (:data:`HF`); model side: ``layers.{i}.`` (:data:`META`).
"""

from __future__ import annotations

import os
from typing import Any

import sdadapt
from sdadapt.errors import AdapterError
from sdadapt.rules import (
    FP8_SCALE_SUFFIX,
    MX_BLOCKS_SUFFIX,
    SCALE_DTYPES,
    DequantFP8,
    ScaleFormat,
    ignored_modules,
    parse_dtype,
)
from sdadapt.sources import Source, dtype_name, open_source, read_config_file

HF = "model.layers.{i}."
HF_QUANT = "hf_quant_config.json"
"""ModelOpt's quantization file; :func:`read_config` puts its ``quantization`` object under this key."""
META = "layers.{i}."


# --- reading a checkpoint folder ----------------------------------------------------------------
def read_config(path: str, names: tuple[str, ...] = ("config.json", "params.json")) -> dict[str, Any]:
    """The first of ``names`` found in ``path`` (a folder, or the folder of a file); ``{}`` if none.
    Read by :func:`sdadapt.sources.read_config_file`: the fields adapters use are type-checked,
    and a broken file is a :class:`~sdadapt.errors.SourceError` naming it and the field."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    found = _first_config(folder, names)
    hq = os.path.join(folder, HF_QUANT)
    if "config.json" in names and os.path.isfile(hq):
        data = read_config_file(hq)
        if isinstance(data.get("quantization"), dict):
            found[HF_QUANT] = data["quantization"]
    return found


def _first_config(folder: str, names: tuple[str, ...]) -> dict[str, Any]:
    for name in names:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            return read_config_file(p)
    return {}


def checkpoint_keys(path: str | Source) -> list[str]:
    """Key names of the checkpoint at ``path`` (headers only), or ``[]`` when there is none.

    ``path`` may be a checkpoint file, a folder sdadapt opens as one checkpoint, or a folder
    holding exactly one checkpoint file (``.safetensors``, ``.pt``, ``.pth``, ``.bin``, ``.ckpt``);
    or the open :class:`~sdadapt.sources.Source` a load hands its adapter's ``options_from_config``
    (its schema, nothing read again)."""
    schema, non_tensor = _headers(path)
    return list(schema) + non_tensor


def checkpoint_schema(path: str | Source) -> dict[str, Any]:
    """Shapes and dtypes (``TensorInfo``) of the tensors of the checkpoint at ``path`` (headers
    only, found as in :func:`checkpoint_keys`), or ``{}`` when there is none."""
    return _headers(path)[0]


def _headers(path: str | Source) -> tuple[dict[str, Any], list[str]]:
    if isinstance(path, Source):  # opened by the caller, which closes it
        return dict(path.schema), list(path.non_tensor)
    candidates = [path]
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".pt", ".pth", ".bin", ".ckpt")))
        if len(files) == 1:
            candidates.append(os.path.join(path, files[0]))
    for candidate in candidates:
        try:
            with open_source(candidate) as src:
                return dict(src.schema), list(src.non_tensor)
        except sdadapt.SdadaptError:
            continue
    return {}, []


# --- checking options ---------------------------------------------------------------------------
def need(name: str, value: Any, adapter: str) -> Any:
    """``value``, or an :class:`AdapterError` saying that the ``adapter`` needs option ``name``."""
    if value is None:
        raise AdapterError(
            f"the {adapter} adapter needs {name}=...; pass it as a keyword argument, or give the "
            "checkpoint folder (its config.json supplies it)"
        )
    return value


def positive(name: str, value: int, adapter: str) -> int:
    """``value`` if it is a positive integer, else an :class:`AdapterError` naming option ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"the {adapter} adapter: {name} must be a positive integer, got {value!r}")
    return value


def head_counts(n_heads: int, n_kv_heads: int | None, adapter: str) -> tuple[int, int]:
    """``n_heads`` and ``n_kv_heads`` (default ``n_heads``), checked: positive, GQA groups whole."""
    n_heads = positive("n_heads", n_heads, adapter)
    n_kv_heads = positive("n_kv_heads", n_heads if n_kv_heads is None else n_kv_heads, adapter)
    if n_heads % n_kv_heads:
        raise AdapterError(f"the {adapter} adapter: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    return n_heads, n_kv_heads


def head_dim_of(dim: int | None, n_heads: int, head_dim: int | None, adapter: str) -> int | None:
    """``head_dim`` if given, else ``dim // n_heads`` (``dim`` must divide), else ``None``."""
    if head_dim is not None:
        return head_dim
    if dim is None:
        return None
    if dim % n_heads:
        raise AdapterError(f"the {adapter} adapter: dim {dim} is not divisible by n_heads {n_heads}; pass head_dim=...")
    return dim // n_heads


# --- options read from an HF config.json and the checkpoint's key names ------------------------
def tied_from(cfg: dict[str, Any], keys: list[str]) -> bool | None:
    """Whether ``output.weight`` must come from the embeddings: the checkpoint's key names say
    so when known (no ``lm_head.weight``), else ``tie_word_embeddings`` of the config."""
    if keys:
        return "lm_head.weight" not in keys
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    return None


def attention_options(cfg: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Options shared by the Llama-family adapters, from an HF ``config.json`` and the
    checkpoint's key names: head counts, ``dim``, ``head_dim``, ``tie_embeddings``."""
    opts: dict[str, Any] = {}
    if "num_attention_heads" in cfg:
        opts["n_heads"] = cfg["num_attention_heads"]
        opts["n_kv_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if "hidden_size" in cfg:
        opts["dim"] = cfg["hidden_size"]
    if cfg.get("head_dim"):
        opts["head_dim"] = cfg["head_dim"]
    tied = tied_from(cfg, keys)
    if tied is not None:
        opts["tie_embeddings"] = tied
    return opts


STACKED_EXPERTS = "mlp.experts.gate_up_proj"
"""Key suffix of transformers 5.x fused experts (``[E, 2*hidden, dim]``, gate rows then up rows)."""


def experts_layout(keys: list[str]) -> str | None:
    """``"stacked"`` when the key names hold transformers 5.x fused 3-D experts, else ``None``
    (the adapter's default, per-expert keys, applies)."""
    return "stacked" if any(k.endswith(STACKED_EXPERTS) for k in keys) else None


# --- quantized sources --------------------------------------------------------------------------
QUANT_KEY_SUFFIXES = {"fp8": (FP8_SCALE_SUFFIX,), "mxfp4": (MX_BLOCKS_SUFFIX,)}
"""Key-name suffixes that mark a quantized checkpoint when its ``config.json`` is not at hand."""

Quantization = dict[str, Any] | str | None
"""An adapter's ``quantization`` option: the checkpoint's ``quantization_config`` (as its
``config.json`` holds it), a bare ``quant_method`` when only the key names told, or ``None``."""


def quantization_of(cfg: dict[str, Any], keys: list[str]) -> Quantization:
    """The quantization of a checkpoint: the ``quantization_config`` of its ``config.json``
    (``quant_method`` ``"fp8"``, ``"mxfp4"``, ...), else the method its key names show (FP8 block
    scales ``*_scale_inv``, MXFP4 ``*_blocks``), else ``None`` (plain weights)."""
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method"):
        return dict(qc)
    if isinstance(cfg.get(HF_QUANT), dict):  # ModelOpt's hf_quant_config.json, read beside config.json
        return {"quant_method": "modelopt", **cfg[HF_QUANT]}
    for method, suffixes in QUANT_KEY_SUFFIXES.items():
        if any(k.endswith(suffixes) for k in keys):
            return method
    return None


def quantization_options(cfg: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization`` option of a checkpoint (see :func:`quantization_of`) and, for FP8,
    ``scale_format`` as its ``schema`` (:func:`checkpoint_schema`) stores the scales:
    ``"float32"``, ``"ue8m0"`` (exponent bytes) or, for DeepSeek-V3.1's ``scale_fmt: ue8m0``
    with float32 scales, ``"ue8m0_float32"`` (powers of two, which export keeps so). Exponent
    bytes also give ``scale_dtype``, the one dtype they are stored in (``uint8`` or
    ``float8_e8m0fnu``), so that export writes the release's dtype name back."""
    opts: dict[str, Any] = {}
    quantization = quantization_of(cfg, list(schema))
    if quantization is None:
        return opts
    if isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors" and schema:
        quantization = _literal_ignore(quantization, schema)
    opts["quantization"] = quantization
    stored = {info.dtype for key, info in schema.items() if key.endswith(FP8_SCALE_SUFFIX)}
    if stored and stored <= set(SCALE_DTYPES["float32"]):
        pow2 = isinstance(quantization, dict) and quantization.get("scale_fmt") == "ue8m0"
        opts["scale_format"] = "ue8m0_float32" if pow2 else "float32"
    elif stored and stored <= set(SCALE_DTYPES["ue8m0"]):
        opts["scale_format"] = "ue8m0"
        if len(stored) == 1:
            opts["scale_dtype"] = dtype_name(stored.pop())
    return opts


def _literal_ignore(qc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors config whose ``ignore`` list (regular expressions included) is
    resolved to the checkpoint's module names, so that the rules need no schema later."""
    ignore = qc.get("ignore")
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        return qc  # dequant_rules names the bad field
    return {**qc, "ignore": ignored_modules(ignore, schema)}


def dequant_rules(
    quantization: Quantization,
    adapter: str,
    *,
    scale_format: ScaleFormat | None = None,
    scale_dtype: str | None = None,
    dtype: str | None = None,
    keep: tuple[str, ...] = (),
) -> list[Any]:
    """The rules that turn a quantized checkpoint's weights into plain ones, placed before an
    adapter's renames (they act on the checkpoint's own key names); ``[]`` for plain weights.

    Every adapter that accepts quantized releases asks here, so the quantized variants are
    chosen in this one place. FP8 block scaling (``quant_method: fp8``) gives
    ``sdadapt.dequant_rules``' FP8 rule: block size from ``weight_block_size``, UE8M0 scales from
    ``scale_fmt``, ``modules_to_not_convert`` excluded; ``scale_format`` (``"float32"``,
    ``"ue8m0"`` or ``"ue8m0_float32"``, from the stored scales) overrides how the scales are
    read; ``scale_dtype`` pins the dtype they are stored in and export writes (``None``: loading
    accepts any of the format's dtypes and export writes ``uint8`` for ``"ue8m0"``); ``dtype`` is
    the values' dtype (``None``: the model's); ``keep``: patterns of further weights the family's
    releases keep unquantized. compressed-tensors, ModelOpt and per-tensor FP8 configs (given as
    ``quantization_config``) give ``sdadapt.dequant_rules``' rules for them, and so does MXFP8
    (``quant_method: mxfp8``, its exponents' dtype from ``scale_dtype``); GPTQ and AWQ releases
    their ``dequant_gptq`` rule and a cast of the rest (float16) to the model's dtypes. Other methods (MXFP4
    is GPT-OSS's) are refused before anything is planned."""
    if quantization is None:
        return []
    qc = dict(quantization) if isinstance(quantization, dict) else {"quant_method": quantization}
    method = str(qc.get("quant_method"))
    if method == "fp8" and not qc.get("weight_block_size") and not isinstance(quantization, dict):
        raise AdapterError(
            f"the {adapter} adapter: an FP8 checkpoint needs its block size (config.json "
            "quantization_config.weight_block_size); give the checkpoint folder with its config.json, or pass "
            "quantization={'quant_method': 'fp8', 'weight_block_size': [128, 128]}"
        )
    if method in ("gptq", "awq"):  # their other tensors are float16: cast to the model's, as from_pretrained does
        return [*sdadapt.dequant_rules({"quantization_config": qc}, dtype=dtype), sdadapt.cast("**", "model")]
    if method in ("compressed-tensors", "modelopt", "mxfp8") or (method == "fp8" and not qc.get("weight_block_size")):
        rules = sdadapt.dequant_rules({"quantization_config": qc}, dtype=dtype)
        update: dict[str, Any] = {}
        if method == "mxfp8" and scale_dtype is not None:  # the exponents' stored dtype, which export writes back
            update["scale_dtype"] = _scale_dtype_of("ue8m0", scale_dtype, adapter)
        return [r.model_copy(update={**update, "exclude": [*getattr(r, "exclude", []), *keep]}) for r in rules]
    if method != "fp8":
        raise AdapterError(
            f"the {adapter} adapter: {method.upper()} checkpoints need the dequant rules: not supported by this adapter "
            f"(config.json quantization_config / key names say quant_method {method!r}); it reads plain and FP8 "
            "(block-scaled) releases"
        )
    (rule,) = sdadapt.dequant_rules({"quantization_config": qc}, dtype=dtype)
    assert isinstance(rule, DequantFP8), rule  # quant_method fp8 gives the FP8 rule
    fmt = scale_format or rule.scale_format
    rule = sdadapt.dequant_fp8(rule.keys, rule.block, exclude=[*rule.exclude, *keep], scale_suffix=rule.scale_suffix,
                               scale_format=fmt, scale_dtype=_scale_dtype_of(fmt, scale_dtype, adapter),
                               dtype=dtype)  # fmt: skip
    return [rule]


def _scale_dtype_of(fmt: ScaleFormat, scale_dtype: str | None, adapter: str) -> str | None:
    """``scale_dtype`` as a dtype name, or an :class:`AdapterError` naming both options unless it
    is a dtype that stores ``fmt``'s scales."""
    if scale_dtype is None:
        return None
    allowed = [dtype_name(d) for d in SCALE_DTYPES.get(fmt, ())]
    name = dtype_name(parse_dtype(str(scale_dtype)))
    if name not in allowed:
        raise AdapterError(
            f"the {adapter} adapter: scale_dtype={scale_dtype!r} does not store scale_format={fmt!r} scales "
            f"(those are stored as {' or '.join(allowed) or 'nothing known'}); pass a scale_dtype that fits, or "
            "scale_dtype=None"
        )
    return name


# --- rule groups ---------------------------------------------------------------------------------
def top_level_rules(tie: bool) -> list[Any]:
    """Embeddings, final norm and output; ``tie``: the checkpoint has no ``lm_head.weight`` and
    ``output.weight`` is filled from the embeddings."""
    rules: list[Any] = [
        sdadapt.rename("model.embed_tokens.weight", "tok_embeddings.weight"),
        sdadapt.rename("model.norm.weight", "norm.weight"),
    ]
    if tie:
        rules.append(sdadapt.tie("output.weight", "tok_embeddings.weight"))
    else:
        rules.append(sdadapt.rename("lm_head.weight", "output.weight"))
    return rules


def block_rules(bias: bool = False) -> list[Any]:
    """Per-layer renames every HF Llama-family block shares: the two norms and the q/k/v/o
    projections (``bias``: also their ``.bias``), with the rows kept in HF order."""
    rules: list[Any] = [
        sdadapt.rename(HF + "input_layernorm.weight", META + "attention_norm.weight"),
        sdadapt.rename(HF + "post_attention_layernorm.weight", META + "ffn_norm.weight"),
    ]
    params = ("weight", "bias") if bias else ("weight",)
    for hf, meta in (("o", "wo"), ("q", "wq"), ("k", "wk"), ("v", "wv")):
        for p in params:
            rules.append(sdadapt.rename(HF + f"self_attn.{hf}_proj.{p}", META + f"attention.{meta}.{p}"))
    return rules


def attention_rules(*, n_heads: int, n_kv_heads: int, head_dim: int | None, fused_qkv: bool, tp: int | None, adapter: str) -> list[Any]:
    """HF Llama-family attention + norms -> Meta names, Meta rotary order, optional fused wqkv."""
    rules: list[Any] = [
        *block_rules(),
        sdadapt.rotary(META + "attention.wq.weight", heads=n_heads, to="interleaved"),
        sdadapt.rotary(META + "attention.wk.weight", heads=n_kv_heads, to="interleaved"),
    ]
    if fused_qkv:
        hd = need("head_dim (or dim)", head_dim, adapter)
        sizes = [n_heads * hd, n_kv_heads * hd, n_kv_heads * hd]
        rules += [
            sdadapt.fuse(
                [META + "attention.wq.weight", META + "attention.wk.weight", META + "attention.wv.weight"],
                META + "attention.wqkv.weight",
                sizes=sizes,
            ),
            sdadapt.interleave(META + "attention.wqkv.weight", sizes=sizes, tp=tp),
        ]
    return rules


def mlp_rules(hf: str = HF, meta: str = META) -> list[Any]:
    """HF ``mlp.gate_proj|down_proj|up_proj.weight`` -> ``feed_forward.w1|w2|w3.weight`` for the
    layers under ``hf`` (a pattern such as ``model.layers.{i}.``, or one layer's literal prefix)."""
    return [
        sdadapt.rename(hf + "mlp.gate_proj.weight", meta + "feed_forward.w1.weight"),
        sdadapt.rename(hf + "mlp.down_proj.weight", meta + "feed_forward.w2.weight"),
        sdadapt.rename(hf + "mlp.up_proj.weight", meta + "feed_forward.w3.weight"),
    ]


def moe_rules(experts: str, *, block: str, names: tuple[str, str, str], n_experts: int | None, adapter: str) -> list[Any]:
    """Router and experts of an HF MoE block -> ``moe.router.gate.weight`` ``[E, dim]`` and stacked
    ``moe.experts.w1|w3`` ``[E, hidden, dim]`` (gate, up), ``moe.experts.w2`` ``[E, dim, hidden]``.

    ``experts="per_expert"``: the MoE block lives under ``HF + block`` (``"mlp."``,
    ``"block_sparse_moe."``) with ``gate.weight`` and ``experts.{e}.<name>.weight`` for ``names``
    = the (gate, down, up) weight names; the stack rules check the expert count when
    ``n_experts`` is known.
    ``experts="stacked"``: transformers 5.x fused tensors ``mlp.experts.gate_up_proj``
    ``[E, 2*hidden, dim]`` (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, dim, hidden]``.
    """
    if n_experts is not None:
        positive("n_experts", n_experts, adapter)
    moe = META + "moe."
    if experts == "per_expert":
        src = HF + block
        rules: list[Any] = [sdadapt.rename(src + "gate.weight", moe + "router.gate.weight")]
        for w, name in zip(("w1", "w2", "w3"), names, strict=True):
            rules.append(sdadapt.stack(src + "experts.{e}." + name + ".weight", moe + "experts." + w, over="e", dim=0, count=n_experts))
        return rules
    if experts == "stacked":
        return [
            sdadapt.rename(HF + "mlp.gate.weight", moe + "router.gate.weight"),
            sdadapt.split(HF + STACKED_EXPERTS, [moe + "experts.w1", moe + "experts.w3"], dim=1),
            sdadapt.rename(HF + "mlp.experts.down_proj", moe + "experts.w2"),
        ]
    raise AdapterError(f"the {adapter} adapter: experts must be 'per_expert' or 'stacked', got {experts!r}")
