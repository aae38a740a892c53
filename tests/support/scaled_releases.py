"""Releases in the scaled formats (compressed-tensors FP8 / NVFP4 / int4, ModelOpt, MXFP8): the
cases, the tiny model they load into, their writers, adapters and value references.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import sdadapt
from support.checkpoints import write_safetensors

ct_release = pytest.importorskip("support.ct_release")


V, D, F = 10, 64, 160


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


CT_FORMATS = ["fp8_tensor", "fp8_channel", "fp8_block", "nvfp4", "w4a16", "w4a16_asym", "w8a16", "mxfp8", "mxfp4"]


HAND_FORMATS = ["modelopt_nvfp4", "modelopt_fp8", "fp8_per_tensor", "mxfp8_e8m0", "mxfp8_method", "mxfp8_method_e8m0"]


LINEARS = {"model.layers.0.w1": (F, D), "model.layers.0.w2": (D, F)}


class Layer(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, F, bias=False, dtype=dtype)  # [160, 64]
        self.w2 = nn.Linear(F, D, bias=False, dtype=dtype)  # [64, 160]
        self.norm = nn.Parameter(torch.ones(D, dtype=dtype))


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D, dtype=dtype)
        self.layers = nn.ModuleList([Layer(dtype)])
        self.lm_head = nn.Linear(D, V, bias=False, dtype=dtype)


def ct_scheme(name: str) -> Any:
    group = 32 if name in ("w4a16", "w4a16_asym", "w8a16") else None
    return ct_release.scheme_of(name, group_size=group, block=[64, 64] if name == "fp8_block" else None)


def case_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16) for k, shape in LINEARS.items()}
    out["model.embed_tokens.weight"] = torch.randn(V, D, generator=g).to(torch.bfloat16)
    out["model.layers.0.norm"] = torch.randn(D, generator=g).to(torch.bfloat16)
    out["lm_head.weight"] = torch.randn(V, D, generator=g).to(torch.bfloat16)
    return out


def ct_float32_reference(stored: dict[str, torch.Tensor], name: str, scheme: Any) -> torch.Tensor:
    """compressed-tensors' ``dequantize`` on its own unpacked codes, scales given as float32."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = scheme.weights
    scale = stored["weight_scale"]
    zp, glob = stored.get("weight_zero_point"), stored.get("weight_global_scale")
    if "weight_packed" in stored and name in ("nvfp4", "mxfp4"):
        m, n = stored["weight_packed"].shape
        codes = unpack_fp4_from_uint8(stored["weight_packed"], m, n * 2, dtype=torch.float32)
    elif "weight_packed" in stored:
        shape = torch.Size(stored["weight_shape"].tolist())
        codes = unpack_from_int32(stored["weight_packed"], args.num_bits, shape)
        if zp is not None:
            zp = unpack_from_int32(zp, args.num_bits, (shape[0], scale.shape[-1]), packed_dim=0)
    else:
        codes = stored["weight"]
    if name in ("mxfp8", "mxfp4"):
        scale = decompress_mx_scale(scale)
    return dequantize(codes, scale.float(), zp, args, dtype=torch.float32, global_scale=glob)


def ct_case(folder: str, name: str, seed: int = 3) -> dict[str, dict[str, torch.Tensor]]:
    """Write a compressed-tensors release of ``Tiny`` into ``folder``; returns the references
    (model key -> values) for bf16 and float32 models."""
    scheme = ct_scheme(name)
    plain = case_weights(seed)
    tensors: dict[str, torch.Tensor] = {}
    want: dict[str, dict[str, torch.Tensor]] = {"bfloat16": {}, "float32": {}}
    for key, w in plain.items():
        mkey = key.removeprefix("model.")
        if key in LINEARS:
            stored = ct_release.compress(w, name, scheme)
            want["bfloat16"][mkey + ".weight"] = ct_release.decompress(stored, name, scheme).to(torch.bfloat16)
            want["float32"][mkey + ".weight"] = ct_float32_reference(stored, name, scheme)
            tensors.update({f"{key}.{k}": v for k, v in stored.items()})
            if name.startswith("fp8"):  # static FP8 stores its activation scale beside the weight
                tensors[f"{key}.input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        else:
            tensors[key] = w
            want["bfloat16"][mkey] = w
            want["float32"][mkey] = w.float()
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    cfg = {"model_type": "tiny", "quantization_config": ct_release.config(name, scheme, ["lm_head"])}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return want


def _e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def ref_nvfp4_modelopt(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Element by element: e2m1 value (low nibble first) * float(e4m3 scale of its 16) * scale_2."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float32)
    s2 = float(scale_2)
    for i in range(rows):
        for k in range(half):
            byte = int(packed[i, k])
            for j, nib in ((2 * k, byte & 15), (2 * k + 1, byte >> 4)):
                s = torch.tensor(float(scale[i, j // 16]), dtype=torch.float32) * torch.tensor(s2, dtype=torch.float32)
                out[i, j] = torch.tensor(FP4[nib], dtype=torch.float32) * s
    return out


def hand_case(folder: str, name: str, seed: int = 4) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    plain = case_weights(seed)
    tensors: dict[str, torch.Tensor] = {}
    want: dict[str, dict[str, torch.Tensor]] = {"bfloat16": {}, "float32": {}}
    for key, w in plain.items():
        mkey = key.removeprefix("model.")
        if key not in LINEARS:
            tensors[key] = w
            want["bfloat16"][mkey], want["float32"][mkey] = w, w.float()
            continue
        rows, cols = w.shape
        if name == "modelopt_nvfp4":
            codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
            packed = _e2m1_pack(codes)
            scale = (torch.rand(rows, cols // 16, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
            scale_2 = torch.tensor(0.00123, dtype=torch.float32)
            tensors |= {f"{key}.weight": packed, f"{key}.weight_scale": scale, f"{key}.weight_scale_2": scale_2,
                        f"{key}.input_scale": torch.tensor(0.5, dtype=torch.float32)}  # fmt: skip
            ref = ref_nvfp4_modelopt(packed, scale, scale_2)
        elif name == "mxfp8_e8m0":  # OCP MXFP8: e4m3 values, one e8m0 exponent per 32, stored as F8_E8M0
            q = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            exps = torch.randint(110, 135, (rows, cols // 32), generator=g, dtype=torch.uint8)
            tensors |= {f"{key}.weight": q, f"{key}.weight_scale": exps.view(torch.float8_e8m0fnu)}
            ref = torch.tensor([[float(v) * 2.0 ** (int(exps[i, j // 32]) - 127) for j, v in enumerate(row)]
                                for i, row in enumerate(q.float().tolist())], dtype=torch.float64).float()  # fmt: skip
        elif name.startswith("mxfp8_method"):  # quant_method mxfp8: e4m3 weight, e8m0 weight_scale_inv per 32
            q, s = mxfp8_method_release(w, "ocp" if name == "mxfp8_method" else "transformers")
            tensors |= {f"{key}.weight": q, f"{key}.weight_scale_inv": s}
            want["bfloat16"][mkey + ".weight"] = transformers_mxfp8_dequant(q, s, torch.bfloat16)
            want["float32"][mkey + ".weight"] = transformers_mxfp8_dequant(q, s, torch.float32)
            continue
        else:
            q = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = torch.tensor(0.0037, dtype=torch.float32)
            suffix = "_scale" if name == "modelopt_fp8" else "_scale_inv"
            tensors |= {f"{key}.weight": q, f"{key}.weight{suffix}": s, f"{key}.input_scale": torch.tensor(0.5)}
            ref = torch.tensor([[float(v) * float(s) for v in row] for row in q.float().tolist()], dtype=torch.float64).float()
        want["float32"][mkey + ".weight"], want["bfloat16"][mkey + ".weight"] = ref, ref.to(torch.bfloat16)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    if name == "modelopt_nvfp4":
        hq = {"producer": {"name": "modelopt", "version": "0.29.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}  # fmt: skip
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump(hq, f)
        cfg: dict[str, Any] = {"model_type": "tiny"}
    elif name == "modelopt_fp8":
        cfg = {"model_type": "tiny", "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                             "exclude_modules": ["lm_head"]}}  # fmt: skip
    elif name == "mxfp8_e8m0":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                   "scale_dtype": "torch.float8_e8m0fnu"}  # fmt: skip
        cfg = {"model_type": "tiny", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp8-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}  # fmt: skip
    elif name.startswith("mxfp8_method"):
        cfg = {"model_type": "tiny", "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32],
                                                             "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                                                             "modules_to_not_convert": ["lm_head"]}}  # fmt: skip
    else:
        cfg = {"model_type": "tiny", "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return want


def mxfp8_method_release(w: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., R, C]`` as a ``quant_method: mxfp8`` release stores it: e4m3 codes and one e8m0
    exponent per 32 values of a row. ``rule="transformers"``: transformers' own quantizer
    (``Fp8Quantize`` with ``scale_fmt: ue8m0``, block ``[1, 32]``: the scale ``2 ** ceil(log2(amax /
    448))``), exponents stored as ``F8_E8M0`` as it writes them. ``rule="ocp"``: the OCP MX rule
    (shared exponent ``floor(log2(amax)) - 8``, codes saturated at 448), exponents as ``U8``
    (SGLang's layout)."""
    if rule == "transformers":
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
        from transformers.utils.quantization_config import FineGrainedFP8Config

        config = FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=(1, 32), scale_fmt="ue8m0")
        out = Fp8Quantize(type("Quantizer", (), {"quantization_config": config})()).convert({"m.weight": w})
        return out["m.weight"], out["m.weight_scale_inv"]
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    _, exp = torch.frexp(x.abs().amax(-1))  # floor(log2(amax)) = exp - 1
    shared = (exp - 1 - 8).clamp(-127, 127)
    q = (x / torch.exp2(shared.float()).unsqueeze(-1)).clamp(-448, 448).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, (shared + 127).to(torch.uint8)


def transformers_mxfp8_dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` times its e8m0 scales, by transformers' own load-time op (``Fp8Dequantize``, which
    takes the block from the scale grid and rounds the float32 product once to the dtype of the
    parameter it loads into: a ``[R, C]`` linear of ``dtype`` here)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    with torch.device("meta"):
        layer = nn.Linear(q.shape[-1], q.shape[-2], bias=False, dtype=dtype)
    out = Fp8Dequantize(None).convert({"weight": [q], "weight_scale_inv": [s]}, full_layer_name="weight", model=layer)
    return out["weight"]


def write_case(folder: str, name: str) -> dict[str, dict[str, torch.Tensor]]:
    os.makedirs(folder, exist_ok=True)
    return hand_case(folder, name) if name in HAND_FORMATS else ct_case(folder, name)


def adapter_for(folder: str) -> sdadapt.Adapter:
    return sdadapt.Adapter([*sdadapt.dequant_rules(folder), sdadapt.rename("model.{rest:*}", "{rest}")], name="tiny")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def export_adapter(folder: str, dtype: torch.dtype) -> sdadapt.Adapter:
    """The release's rules, with casts and renames that invert (export writes the release's names)."""
    rules = sdadapt.dequant_rules(folder)
    casts = [sdadapt.cast(k, dtype, from_dtype="bfloat16") for k in ("model.embed_tokens.weight", "model.layers.0.norm", "lm_head.weight")]
    renames = [sdadapt.rename("model.layers.{rest:*}", "layers.{rest}"), sdadapt.rename("model.embed_tokens.weight", "embed_tokens.weight")]
    return sdadapt.Adapter([*rules, *(casts if dtype == torch.float32 else []), *renames])


def export_case(cases, name: str, dtype: torch.dtype, tmp_path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    folder, _ = cases[name]
    adapter = export_adapter(folder, dtype)
    model = Tiny(dtype)
    sdadapt.load(model, folder, adapter)
    sdadapt.export(model, str(tmp_path / name), adapter)
    return load_file(os.path.join(folder, "model.safetensors")), load_file(str(tmp_path / name / "model.safetensors"))
