"""The quantized twins beyond block FP8 and the two compressed-tensors twins of ``checkpoint``
(FP8 per channel, NVFP4), each written in the layout its tool writes, and each format's own
reference decompression, against which the loaded values are checked.

Twins (``safetensors-<fmt>``, read by the path ``sdadapt-<fmt>``):

- written by the ``compressed-tensors`` package itself (its scale choice ``calculate_qparams``
  over each strategy's min/max, its compressors, its ``QuantizationConfig`` dumped into
  ``config.json``), as the compressed-tensors tests write their releases:
  ``fp8tensor`` (preset ``FP8``: e4m3 ``weight`` + one bf16 ``weight_scale [1]`` per tensor and a
  static ``input_scale``), ``int8ch`` (``W8A8``, ``int-quantized``: int8 ``weight`` + bf16
  ``weight_scale [R, 1]``), ``w4a16`` (``W4A16``, ``pack-quantized``: int32 ``weight_packed``,
  8 int4 per word, bf16 ``weight_scale`` per group of 128 and ``weight_shape``), ``w4a16asym``
  (``W4A16_ASYM``: the same with int4 ``weight_zero_point`` packed along rows), ``mxfp8``
  (``MXFP8``, ``mxfp8-quantized``: e4m3 ``weight`` + one uint8 e8m0 exponent per 32 values),
  ``fp8block`` (``FP8_BLOCK``, ``float-quantized``, ``strategy: block``: e4m3 ``weight`` + one
  bf16 ``weight_scale`` per 128x128 block, partial blocks at the edges), ``w8a16`` (``W8A16``,
  ``pack-quantized``: int32 ``weight_packed``, 4 int8 per word, bf16 ``weight_scale`` per group
  of 128 and ``weight_shape``) and ``mxfp8e8m0`` (``MXFP8`` whose exponents are stored as
  ``F8_E8M0``, ``torch.float8_e8m0fnu``, and the config's ``scale_dtype`` says so: the
  package's compressor writes the exponents, their bytes are stored in that dtype);
- written by hand from the published layout with sdadapt's quantizers, as sdadapt's tests write
  them: ``fp8static`` (``quant_method: fp8`` without ``weight_block_size``, ``activation_scheme:
  static``: e4m3 ``weight``, one float32 ``weight_scale_inv`` per tensor and ``input_scale``, the
  per-tensor FP8 of Mistral-family releases) and ``nvfp4modelopt`` (NVIDIA ModelOpt NVFP4,
  ``hf_quant_config.json``: uint8 ``weight`` two e2m1 per byte, e4m3 ``weight_scale`` per 16
  values, float32 ``weight_scale_2`` which multiplies them, ``input_scale``) and ``fp8modelopt``
  (NVIDIA ModelOpt FP8, ``quantization_config: {quant_method: modelopt, quant_algo: FP8}``: e4m3
  ``weight``, one float32 ``weight_scale`` per tensor, ``input_scale``).

The layers' matrices (:meth:`Shape.fp8_keys`) are quantized, on the GPU when there is one; the
embeddings, norms and ``lm_head`` stay as they are (``lm_head`` in the config's ignore list). A
group that does not divide the model's widths (the tiny preset) is halved until it does, and the
config says the group written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from .common import BenchError

CT_WRITTEN = {"fp8tensor": ("FP8", "float-quantized"), "int8ch": ("W8A8", "int-quantized"),
              "w4a16": ("W4A16", "pack-quantized"), "w4a16asym": ("W4A16_ASYM", "pack-quantized"),
              "mxfp8": ("MXFP8", "mxfp8-quantized"), "fp8block": ("FP8_BLOCK", "float-quantized"),
              "w8a16": ("W8A16", "pack-quantized"), "mxfp8e8m0": ("MXFP8", "mxfp8-quantized")}  # fmt: skip
"""Twin -> (compressed-tensors preset, format) of the twins the package writes."""
GROUPED = ("w4a16", "w4a16asym", "w8a16")
"""The ``pack-quantized`` twins, whose group of 128 is halved until it divides the model's widths."""
E8M0_STORED = ("mxfp8e8m0",)
"""MXFP8 twins whose exponents are stored as ``F8_E8M0`` (``torch.float8_e8m0fnu``), not ``U8``."""
HAND_WRITTEN = ("fp8static", "nvfp4modelopt", "fp8modelopt")
TWINS = (*CT_WRITTEN, *HAND_WRITTEN)
"""Every twin of this module, as ``safetensors-<twin>``."""
INT4_GROUP = 128
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def group_for(widths: list[int], want: int) -> int:
    """``want``, halved until it divides every width (at least 1)."""
    g = want
    while g > 1 and any(w % g for w in widths):
        g //= 2
    return g


def _ct() -> Any:
    try:
        import compressed_tensors
    except ImportError as e:
        raise BenchError(f"the compressed-tensors twins are written by the compressed-tensors package, which is not "
                         f"installed here ({e}); install it (pip install compressed-tensors==0.20.1, as the test extra "
                         "pins it) or leave those paths out") from None  # fmt: skip
    return compressed_tensors


def ct_scheme(kind: str, widths: list[int]) -> Any:
    """The compressed-tensors ``QuantizationScheme`` of twin ``kind`` for a model whose quantized
    matrices have these column counts (an int4 group halved until it divides them)."""
    _ct()
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme

    preset, _ = CT_WRITTEN[kind]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    w = scheme.weights
    if kind in GROUPED:
        scheme = scheme.model_copy(update={"weights": w.model_copy(update={"group_size": group_for(widths, INT4_GROUP)})})
    elif kind in E8M0_STORED:  # the config says the exponents' stored dtype, for weights and activations
        e8m0 = {"scale_dtype": torch.float8_e8m0fnu}
        acts = scheme.input_activations
        scheme = scheme.model_copy(update={"weights": w.model_copy(update=e8m0),
                                           "input_activations": acts.model_copy(update=e8m0) if acts else None})  # fmt: skip
    elif w.group_size and any(c % w.group_size for c in widths):
        raise BenchError(f"{kind}: its groups of {w.group_size} values do not divide the model's widths {sorted(set(widths))}")
    return scheme


def _extremes(w: Any, scheme: Any) -> tuple[Any, Any]:
    """Per-strategy minimum and maximum of ``w [R, C]``, as compressed-tensors' min-max observer takes them."""
    a = scheme.weights
    rows, cols = w.shape
    strategy = getattr(a.strategy, "value", a.strategy)
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == "group":
        x = w.reshape(rows, cols // a.group_size, a.group_size)
        return x.amin(-1), x.amax(-1)
    if strategy == "block":  # partial blocks at the edges, padded with zeros as the observer sees them
        import torch

        b0, b1 = a.block_structure
        x = torch.nn.functional.pad(w, (0, -cols % b1, 0, -rows % b0))
        x = x.reshape(x.shape[0] // b0, b0, x.shape[1] // b1, b1)
        return x.amin(dim=(1, 3)), x.amax(dim=(1, 3))
    raise BenchError(f"no min-max for strategy {strategy!r}")


def ct_compress(w: Any, kind: str, scheme: Any) -> dict[str, Any]:
    """``w`` (a float weight ``[R, C]``) quantized and compressed by compressed-tensors: the
    tensors its format stores for one module (``weight`` or ``weight_packed``, ``weight_scale``, ...).

    An ``F8_E8M0`` MXFP8 twin is compressed as the package's MXFP8 (its uint8 exponents) and its
    exponent bytes stored as ``float8_e8m0fnu``: the package's own conversion to that dtype
    (``.to``) would convert the exponents' values, not keep their bits."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    _, fmt = CT_WRITTEN[kind]
    if kind in E8M0_STORED:
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"scale_dtype": torch.uint8})})
    mn, mx = _extremes(w.float(), scheme)
    scale, zp = calculate_qparams(mn, mx, scheme.weights)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype)}
    if not scheme.weights.symmetric:
        sd["weight_zero_point"] = zp
    out = BaseCompressor.load_from_registry(fmt).compress(sd, scheme)
    if kind in E8M0_STORED:
        out["weight_scale"] = out["weight_scale"].view(torch.float8_e8m0fnu)
    return {k: v.contiguous() for k, v in out.items()}


def quantized_twin(sd: dict[str, Any], quantized: set[str], stored_of: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``sd`` with each key of ``quantized`` (a ``....weight``) replaced by what its format stores
    for it: ``stored_of(x)`` gets the tensor (on the GPU when there is one) and names the stored
    tensors relative to the key's module (``weight``, ``weight_scale``, ...); the rest as is."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    twin: dict[str, Any] = {}
    for k, t in sd.items():
        if k not in quantized:
            twin[k] = t
            continue
        base = k.removesuffix(".weight")
        twin.update({f"{base}.{name}": v.contiguous().cpu() for name, v in stored_of(t.to(dev)).items()})
    return twin


def nbytes(tensors: dict[str, Any]) -> int:
    """The bytes of ``tensors``' values."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_twin(folder: str, sd: dict[str, Any], quantized: set[str], dtype: str, kind: str, write_shards: Any) -> None:
    """The twin ``kind`` of ``sd`` in ``folder``: the keys in ``quantized`` in its format, the
    rest as is, sharded by ``write_shards(folder, tensors, total_bytes)``, with its
    ``config.json`` (and ModelOpt's ``hf_quant_config.json``)."""
    import torch

    from sdadapt._recipes import quant_scaled as S

    if kind not in TWINS:
        raise BenchError(f"unknown quantized twin {kind!r} (known: {', '.join(TWINS)})")
    widths = sorted({int(sd[k].shape[-1]) for k in quantized})
    scheme = ct_scheme(kind, widths) if kind in CT_WRITTEN else None

    def stored_of(x: torch.Tensor) -> dict[str, torch.Tensor]:
        if scheme is not None:
            stored = ct_compress(x, kind, scheme)
            if kind == "fp8tensor":  # static FP8 stores its activation scale beside the weight
                stored["input_scale"] = torch.tensor([0.02], dtype=x.dtype)
            return stored
        if kind in ("fp8static", "fp8modelopt"):  # one float32 scale amax / 448 per tensor
            w, s = S.quantize_fp8_scaled(x, tuple(x.shape), torch.float32)  # type: ignore[arg-type]
            field = "weight_scale_inv" if kind == "fp8static" else "weight_scale"
            return {"weight": w, field: s.reshape(()), "input_scale": torch.tensor(0.5)}
        # ModelOpt NVFP4: weight_scale_2 = amax / (6 * 448) multiplies the e4m3 group scales
        glob = (x.float().abs().amax() / (S.E2M1_MAX * S.E4M3_MAX)).reshape(())
        packed, s = S.quantize_nvfp4(x, glob, "multiply")
        return {"weight": packed, "weight_scale": s, "weight_scale_2": glob, "input_scale": torch.tensor(0.5)}

    twin = quantized_twin(sd, quantized, stored_of)
    write_shards(folder, twin, nbytes(twin))
    cfg: dict[str, Any] = {"model_type": "llama", "torch_dtype": dtype}
    if scheme is not None:
        from compressed_tensors.quantization import QuantizationConfig

        qc = QuantizationConfig(config_groups={"group_0": scheme}, format=CT_WRITTEN[kind][1], ignore=["lm_head"],
                                quantization_status="compressed")  # fmt: skip
        cfg["quantization_config"] = qc.model_dump(mode="json")
    elif kind == "fp8static":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]}
    elif kind == "fp8modelopt":  # ModelOpt FP8 as the HF export writes it: its algorithm in config.json
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    else:
        hq = {"producer": {"name": "modelopt", "version": "0.29.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": S.NVFP4_GROUP, "exclude_modules": ["lm_head"]}}  # fmt: skip
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump(hq, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


# --- each format's own reference decompression --------------------------------------------------


class FormatReference:
    """The dequantisation of one quantized release's weights by its format's own reference, from
    the folder's configs: compressed-tensors' decompressors (``quant_method:
    compressed-tensors``, with ``F8_E8M0`` exponents given as the integers it reads); for
    ModelOpt NVFP4, block FP8 and per-tensor FP8 (``quant_method: fp8``, ModelOpt FP8; no package
    writes them here) the published formula over whole tensors, in float32, rounded once.

    ``name`` says which; :meth:`dequantize` gives the weight of one module from its stored
    tensors (``weight*`` fields, by field name), or ``None`` for a weight stored unquantized."""

    def __init__(self, folder: str) -> None:
        with open(os.path.join(folder, "config.json")) as f:
            qc = json.load(f).get("quantization_config") or {}
        self.scheme: Any = None
        self.block: tuple[int, int] | None = None
        if os.path.isfile(os.path.join(folder, "hf_quant_config.json")):
            self.kind, self.name = "modelopt", "the ModelOpt NVFP4 formula"
        elif qc.get("quant_method") == "compressed-tensors":
            self.kind, self.name = "ct", "compressed-tensors' decompression"
            _ct()
            from compressed_tensors.quantization import QuantizationConfig

            parsed = QuantizationConfig.model_validate(qc)
            if len(parsed.config_groups) != 1:
                raise BenchError(f"{folder}: one config group expected, found {len(parsed.config_groups)}")
            self.scheme = next(iter(parsed.config_groups.values()))
            self.format = self.scheme.format or parsed.format
        elif qc.get("quant_method") == "fp8" and qc.get("weight_block_size"):
            self.kind, self.name = "fp8block", "float(w) * scale_inv per block"
            b0, b1 = qc["weight_block_size"]
            self.block = (int(b0), int(b1))
        elif qc.get("quant_method") == "fp8" or (qc.get("quant_method") == "modelopt" and qc.get("quant_algo") == "FP8"):
            self.kind, self.name = "fp8tensor", "float(w) * scale per tensor"
        else:
            raise BenchError(f"{folder}: no reference decompression for its quantization config")

    def applies_to(self, dtype: Any) -> bool:
        """Whether the reference gives a model of ``dtype`` its values: compressed-tensors
        computes in its scales' dtype, which is a bf16 model's arithmetic (sdadapt computes in
        float32 and rounds once, the same bits for a bf16 target only), so only for a bf16 model;
        the formulas in float32 for any."""
        import torch

        return self.kind != "ct" or dtype == torch.bfloat16

    def dequantize(self, stored: dict[str, Any], dtype: Any) -> Any:
        """The module's weight in ``dtype`` from its stored ``weight*`` tensors (``None``: stored plainly)."""
        import torch

        if self.kind == "ct":
            if "weight_packed" not in stored and "weight_scale" not in stored:
                return None
            from compressed_tensors.compressors import BaseCompressor

            stored = dict(stored)
            if stored["weight_scale"].dtype == torch.float8_e8m0fnu:  # its MX decompression reads exponents as integers
                stored["weight_scale"] = stored["weight_scale"].view(torch.uint8)
            # its arithmetic is the scales' dtype (bf16 here): a reference for a bf16 model only
            return BaseCompressor.load_from_registry(self.format).decompress(stored, self.scheme)["weight"].to(dtype)
        w = stored["weight"]
        if self.kind == "modelopt":
            if "weight_scale_2" not in stored:
                return None
            lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
            codes = torch.stack([w & 15, w >> 4], dim=-1).reshape(w.shape[0], -1).long()
            s = stored["weight_scale"].float() * stored["weight_scale_2"].float()
            return (lut[codes] * s.repeat_interleave(16, dim=-1)).to(dtype)
        if self.kind == "fp8block":
            if "weight_scale_inv" not in stored:
                return None
            assert self.block is not None
            rows, cols = w.shape
            s = stored["weight_scale_inv"].float()
            s = s.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(self.block[1], 1)[:, :cols]
            return (w.float() * s).to(dtype)
        scale = stored.get("weight_scale_inv", stored.get("weight_scale"))
        return None if scale is None else (w.float() * scale.float()).to(dtype)
