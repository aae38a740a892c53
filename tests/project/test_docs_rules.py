"""docs/rules.md: every JSON example reads as an adapter and plans, both ways.

Each ```json block of the page is read with ``sdadapt.Adapter.from_json`` and planned (headers
only, ``build_plan``) from the tiny checkpoint schema of :data:`CASES` (by the
adapter's ``name``) to the model schema there; the plan must have no problem and a recipe for
every model key, and the adapter's inverse must plan the model back to the checkpoint. An
example without a case here fails, so a new example gets checked too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import sdadapt
from sdadapt._plan.plan import build_plan
from sdadapt.sources import TensorInfo

RULES_MD = Path(__file__).resolve().parents[2] / "docs" / "rules.md"
BF16, F32, U8, FP8 = torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn

Schema = dict[str, TensorInfo]


def fp8_release() -> tuple[Schema, Schema]:
    """A DeepSeek-V3-like FP8 release (ragged 200 x 136 weight, 128 x 128 tiles) and its bf16 model."""
    ckpt = {
        "model.embed_tokens.weight": TensorInfo((50, 136), BF16),
        "model.layers.0.self_attn.q_proj.weight": TensorInfo((200, 136), FP8),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": TensorInfo((2, 2), F32),
        "model.layers.0.mlp.gate.weight": TensorInfo((4, 136), BF16),
        "model.layers.0.input_layernorm.weight": TensorInfo((136,), BF16),
        "model.layers.1.shared_head.head.weight": TensorInfo((50, 136), BF16),
        "lm_head.weight": TensorInfo((50, 136), BF16),
    }
    model = {k: TensorInfo(v.shape, BF16) for k, v in ckpt.items() if not k.endswith("_scale_inv")}
    return ckpt, model


def bf16_to_fp8_ue8m0() -> tuple[Schema, Schema]:
    ckpt = {
        "model.embed_tokens.weight": TensorInfo((50, 136), BF16),
        "model.layers.0.self_attn.q_proj.weight": TensorInfo((200, 136), BF16),
        "model.layers.0.mlp.gate.weight": TensorInfo((4, 136), BF16),
        "model.layers.0.input_layernorm.weight": TensorInfo((136,), BF16),
    }
    out = dict(ckpt)
    out["model.layers.0.self_attn.q_proj.weight"] = TensorInfo((200, 136), FP8)
    out["model.layers.0.self_attn.q_proj.weight_scale_inv"] = TensorInfo((2, 2), U8)  # exponent bytes
    return ckpt, out


E, D, F = 2, 96, 32  # GPT-OSS-like experts: gate_up [E, 2F, D], down [E, D, F] as the format packs them
EXPERTS = "model.layers.0.mlp.experts."


def mxfp4_release() -> tuple[Schema, Schema]:
    """GPT-OSS's packed experts and the HF model's ``[E, in, out]`` parameters."""
    ckpt = {
        EXPERTS + "gate_up_proj_blocks": TensorInfo((E, 2 * F, D // 32, 16), U8),
        EXPERTS + "gate_up_proj_scales": TensorInfo((E, 2 * F, D // 32), U8),
        EXPERTS + "gate_up_proj_bias": TensorInfo((E, 2 * F), BF16),
        EXPERTS + "down_proj_blocks": TensorInfo((E, D, F // 32, 16), U8),
        EXPERTS + "down_proj_scales": TensorInfo((E, D, F // 32), U8),
    }
    model = {
        EXPERTS + "gate_up_proj": TensorInfo((E, D, 2 * F), BF16),
        EXPERTS + "gate_up_proj_bias": TensorInfo((E, 2 * F), BF16),
        EXPERTS + "down_proj": TensorInfo((E, F, D), BF16),
    }
    return ckpt, model


def bf16_to_mxfp4() -> tuple[Schema, Schema]:
    ckpt = {EXPERTS + "down_proj": TensorInfo((E, D, F), BF16)}
    out = {EXPERTS + "down_proj_blocks": TensorInfo((E, D, F // 32, 16), U8), EXPERTS + "down_proj_scales": TensorInfo((E, D, F // 32), U8)}
    return ckpt, out


CASES = {
    "deepseek-v3-fp8": fp8_release,
    "gpt-oss-mxfp4": mxfp4_release,
    "to-fp8-ue8m0": bf16_to_fp8_ue8m0,
    "to-mxfp4": bf16_to_mxfp4,
}


def json_examples() -> list[str]:
    return re.findall(r"```json\n(.*?)```", RULES_MD.read_text(), flags=re.S)


def test_every_json_example_has_a_case() -> None:
    names = [json.loads(text)["name"] for text in json_examples()]
    assert len(names) >= 4 and len(set(names)) == len(names), names
    assert sorted(names) == sorted(CASES), "a JSON example of docs/rules.md without a case in CASES, or the reverse"


@pytest.mark.parametrize("text", json_examples(), ids=lambda t: json.loads(t)["name"])
def test_json_example_parses_and_plans_both_ways(text: str) -> None:
    adapter = sdadapt.Adapter.from_json(text)
    assert sdadapt.Adapter.from_json(adapter.to_json()) == adapter
    ckpt, model = CASES[adapter.name]()
    plan = build_plan(ckpt, model, adapter)
    assert plan.report.ok, plan.report.format()
    assert sorted(plan.recipes) == sorted(model)
    back = build_plan(model, ckpt, adapter.inverse())
    assert back.report.ok, back.report.format()
    assert sorted(back.recipes) == sorted(ckpt)
    quant = {r.kind for r in adapter.rules} & {"dequant_fp8", "dequant_mxfp4", "quantize_fp8", "quantize_mxfp4"}
    assert quant and all(any(k in node.describe() for node in plan.recipes.values()) for k in quant), quant


def test_fp8_example_is_what_dequant_rules_returns() -> None:
    """The page says the DeepSeek-V3 example is ``dequant_rules``' answer for such a release."""
    (text,) = [t for t in json_examples() if json.loads(t)["name"] == "deepseek-v3-fp8"]
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    assert sdadapt.Adapter.from_json(text).rules == sdadapt.dequant_rules(config)
