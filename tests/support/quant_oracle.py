"""GPTQ and AWQ releases written by the tools themselves, and their own dequantisation.

Run in the quant venv (``scripts/quant_venv.py``: auto-gptq 0.7.1, autoawq 0.2.9, transformers
4.51.3), never imported by the suite::

    python tests/support/quant_oracle.py OUT [NAME ...]

Each variant ``NAME`` (:data:`VARIANTS`) is a tiny Llama (transformers' ``LlamaForCausalLM`` from a
config, float16 as the tools quantize) whose decoder linears are packed by the tool's own code:
auto-gptq's ``QuantLinear.pack`` (``qlinear_cuda``: ``qweight``, ``qzeros`` stored less one,
``scales``, ``g_idx``) or AutoAWQ's ``WQLinear_GEMM.from_linear``. Calibration-free: codes, scales,
zero points (and the act-order permutation behind ``g_idx``) are drawn from a seeded generator and
the float weight handed to the packer is the one they make. ``OUT/NAME`` is the release
(``model.safetensors`` + ``config.json`` with its ``quantization_config``); ``OUT/NAME.oracle``
the same model with every packed layer replaced by the tool's dequantisation of what it packed
(auto-gptq: its ``QuantLinear`` forward, torch path, on an identity; AutoAWQ: ``dequantize_gemm``),
as a plain float16 release that transformers loads for the logits comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import torch

VARIANTS: dict[str, dict[str, Any]] = {
    "gptq4_g32_sym": dict(method="gptq", bits=4, group=32, sym=True, act_order=False),
    "gptq4_g32_asym_act": dict(method="gptq", bits=4, group=32, sym=False, act_order=True),
    "gptq8_gall_sym": dict(method="gptq", bits=8, group=-1, sym=True, act_order=False),
    "gptq8_g32_asym_act": dict(method="gptq", bits=8, group=32, sym=False, act_order=True),
    "gptq2_g64_asym": dict(method="gptq", bits=2, group=64, sym=False, act_order=False),
    "awq4_g32": dict(method="awq", bits=4, group=32),
    "awq4_g64": dict(method="awq", bits=4, group=64),
}

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(sizes: dict[str, int] | None = None) -> Any:
    from transformers import LlamaConfig

    s = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="float16")
    s.update(sizes or {})
    return LlamaConfig(**s)


def _draw(out: int, inp: int, v: dict[str, Any], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(codes [out, in], scales [out, G], zeros [out, G], g_idx [in]) of one layer."""
    bits, group = v["bits"], (v["group"] if v["group"] != -1 else inp)
    maxq = 2**bits - 1
    groups = -(-inp // group)
    g_idx = torch.arange(inp) // group
    if v.get("act_order"):
        perm = torch.randperm(inp, generator=gen)  # GPTQ's act-order: inputs quantized in this order
        g_idx = torch.empty(inp, dtype=torch.int64)
        g_idx[perm] = torch.arange(inp) // group
    codes = torch.randint(0, maxq + 1, (out, inp), generator=gen)
    scales = (torch.rand(out, groups, generator=gen) * 0.02 + 0.005).half()
    if v.get("sym", False):
        zeros = torch.full((out, groups), (maxq + 1) // 2)
    else:
        zeros = torch.randint(0, maxq + 1, (out, groups), generator=gen)
    return codes, scales, zeros, g_idx.to(torch.int32)


def _float_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    gi = g_idx.long()
    return ((codes - zeros[:, gi]).float() * scales[:, gi].float()).half()


def _gptq_layer(linear: torch.nn.Linear, v: dict[str, Any], gen: torch.Generator,
                oracle: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:  # fmt: skip
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear

    out, inp = linear.weight.shape
    codes, scales, zeros, g_idx = _draw(out, inp, v, gen)
    linear.weight.data = _float_weight(codes, scales, zeros, g_idx)
    q = QuantLinear(v["bits"], v["group"], inp, out, bias=False, weight_dtype=torch.float16)
    q.pack(linear, scales, zeros.clone(), g_idx)
    tensors = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx.to(torch.int32)}
    if not oracle:
        return tensors, None
    with torch.no_grad():
        deq = q(torch.eye(inp, dtype=torch.float16))  # [in, out]: the tool's own dequantised weight
    return tensors, deq.t().contiguous()


def _awq_layer(linear: torch.nn.Linear, v: dict[str, Any], gen: torch.Generator,
               oracle: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:  # fmt: skip
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    out, inp = linear.weight.shape
    codes, scales, zeros, g_idx = _draw(out, inp, v, gen)
    linear.weight.data = _float_weight(codes, scales, zeros, g_idx)
    q = WQLinear_GEMM.from_linear(linear, v["bits"], v["group"], scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
    tensors = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}
    if not oracle:
        return tensors, None
    deq = dequantize_gemm(q.qweight, q.qzeros, q.scales, v["bits"], v["group"])  # [in, out]
    return tensors, deq.t().contiguous()


def quantization_config(v: dict[str, Any]) -> dict[str, Any]:
    if v["method"] == "gptq":  # as auto-gptq's BaseQuantizeConfig.to_dict() writes it
        return {"quant_method": "gptq", "bits": v["bits"], "group_size": v["group"], "desc_act": v["act_order"],
                "sym": v["sym"], "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
                "model_name_or_path": None, "model_file_base_name": "model", "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "zero_point": True, "group_size": v["group"], "bits": v["bits"], "version": "gemm",
            "modules_to_not_convert": None}  # as AutoAWQ's AwqConfig writes it


def write(out: str, name: str, v: dict[str, Any], seed: int = 0, sizes: dict[str, int] | None = None) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(sizes)).half().eval()
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    layer = _gptq_layer if v["method"] == "gptq" else _awq_layer
    for mname, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and mname.rsplit(".", 1)[-1] in LINEARS:
            tensors, deq = layer(module, v, gen)
            packed.update({f"{mname}.{k}": t.contiguous() for k, t in tensors.items()})
            plain[f"{mname}.weight"] = deq
    for k, t in model.state_dict().items():
        if k.rsplit(".", 2)[-2] not in LINEARS:
            packed[k] = plain[k] = t.contiguous()
    for folder, tensors, qc in ((os.path.join(out, name), packed, quantization_config(v)),
                                (os.path.join(out, name + ".oracle"), plain, None)):  # fmt: skip
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(folder)
        path = os.path.join(folder, "config.json")
        cfg = json.load(open(path))
        cfg.pop("quantization_config", None)
        if qc is not None:
            cfg["quantization_config"] = qc
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


def write_large(folder: str, v: dict[str, Any], sizes: dict[str, int], seed: int = 0) -> int:
    """A release of the config ``sizes`` with no oracle, one linear layer in memory at a time
    (for the bench); returns the parameter count."""
    from safetensors.torch import save_file

    cfg = config(sizes)
    gen = torch.Generator().manual_seed(seed)
    h, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer = _gptq_layer if v["method"] == "gptq" else _awq_layer
    tensors: dict[str, torch.Tensor] = {}
    params = 0
    for name, shape in (("model.embed_tokens.weight", (cfg.vocab_size, h)), ("lm_head.weight", (cfg.vocab_size, h))):
        tensors[name] = (torch.randn(shape, generator=gen) * 0.02).half()
        params += tensors[name].numel()
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.float16)
    for i in range(n):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(h, dtype=torch.float16)
        for mod, out, inp in (("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                              ("self_attn.o_proj", h, h), ("mlp.gate_proj", f, h), ("mlp.up_proj", f, h),
                              ("mlp.down_proj", h, f)):  # fmt: skip
            linear = torch.nn.Linear(inp, out, bias=False, dtype=torch.float16)
            packed, _ = layer(linear, v, gen, oracle=False)
            tensors.update({f"{p}{mod}.{k}": t.contiguous() for k, t in packed.items()})
            params += out * inp
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    data = json.load(open(path))
    data["quantization_config"] = quantization_config(v)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
    return params


def main() -> int:
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("names", nargs="*", default=list(VARIANTS))
    ap.add_argument("--sizes", default="{}", help="LlamaConfig fields as JSON (the bench's larger model)")
    args = ap.parse_args()
    for name in args.names:
        base = name.split("@")[0]
        write(args.out, name, VARIANTS[base], sizes=json.loads(args.sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
