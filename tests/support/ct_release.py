"""Quantized weights written by the ``compressed-tensors`` package itself (its scale choice,
``calculate_qparams``, and its compressors), and the reference values its own decompressors
give back. Shared by the compressed-tensors tests."""

from __future__ import annotations

import pytest
import torch

ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

PRESETS = {
    # name: (preset, format)
    "fp8_tensor": ("FP8", "float-quantized"),
    "fp8_channel": ("FP8_DYNAMIC", "float-quantized"),
    "fp8_block": ("FP8_BLOCK", "float-quantized"),
    "nvfp4": ("NVFP4", "nvfp4-pack-quantized"),
    "w4a16": ("W4A16", "pack-quantized"),
    "w4a16_asym": ("W4A16_ASYM", "pack-quantized"),
    "w8a16": ("W8A16", "pack-quantized"),
    "w8a8": ("W8A8", "int-quantized"),
    "mxfp8": ("MXFP8", "mxfp8-quantized"),
    "mxfp4": ("MXFP4", "mxfp4-pack-quantized"),
}


def scheme_of(name: str, group_size: int | None = None, block: list[int] | None = None) -> QuantizationScheme:
    preset, _ = PRESETS[name]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    update = {}
    if group_size is not None and scheme.weights.group_size is not None:
        update["group_size"] = group_size
    if block is not None and scheme.weights.block_structure is not None:
        update["block_structure"] = block
    if update:
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update=update)})
    return scheme


def _extremes(w: torch.Tensor, scheme: QuantizationScheme) -> tuple[torch.Tensor, torch.Tensor]:
    a = scheme.weights
    rows, cols = w.shape
    s = a.strategy.value if hasattr(a.strategy, "value") else a.strategy
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = a.group_size
        x = w.reshape(rows, cols // g, g)
        return x.amin(-1), x.amax(-1)
    b0, b1 = a.block_structure
    x = torch.nn.functional.pad(w, (0, -cols % b1, 0, -rows % b0))
    x = x.reshape(x.shape[0] // b0, b0, x.shape[1] // b1, b1)
    return x.amin(dim=(1, 3)), x.amax(dim=(1, 3))


def compress(w: torch.Tensor, name: str, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """``w`` (a float weight ``[R, C]``) quantized and compressed by compressed-tensors: the
    tensors its format stores for one module (``weight`` or ``weight_packed``, ``weight_scale``, ...)."""
    _, fmt = PRESETS[name]
    mn, mx = _extremes(w.float(), scheme)
    glob = None
    if fmt == "nvfp4-pack-quantized":
        glob = generate_gparam(w.float().amin(), w.float().amax())
    scale, zp = calculate_qparams(mn, mx, scheme.weights, global_scale=glob)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype) if fmt != "nvfp4-pack-quantized" else scale}
    if not scheme.weights.symmetric:
        sd["weight_zero_point"] = zp
    if glob is not None:
        sd["weight_global_scale"] = glob.reshape(1)
    out = BaseCompressor.load_from_registry(fmt).compress(sd, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def decompress(stored: dict[str, torch.Tensor], name: str, scheme: QuantizationScheme) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's stored tensors."""
    _, fmt = PRESETS[name]
    return BaseCompressor.load_from_registry(fmt).decompress(dict(stored), scheme)["weight"]


def config(name: str, scheme: QuantizationScheme, ignore: list[str]) -> dict:
    """The ``quantization_config`` compressed-tensors writes into ``config.json``."""
    _, fmt = PRESETS[name]
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=ignore, quantization_status="compressed")
    return qc.model_dump(mode="json")
