"""``sdadapt.draft`` on GPTQ and AWQ releases written by auto-gptq 0.7.1 and AutoAWQ 0.2.9: the
packed tensors are matched as the weights they dequantise to (the release's own
``dequant_rules`` run first), so a transformers model lines up with a cast and a Meta-layout
model gets its renames and the rotary row order settled numerically; the drafted module loads
the release bit-equal to the tools' dequantisation, and the Meta model's logits equal theirs."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from support.quant_releases import quant_releases  # noqa: E402

import sdadapt  # noqa: E402


@pytest.fixture(scope="module")
def releases() -> str:
    return quant_releases()


def _hf_model(folder: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)


@pytest.mark.parametrize("name", ["gptq4_g32_asym_act", "awq4_g32"])
def test_draft_matches_the_release_to_a_transformers_model(releases: str, name: str) -> None:
    path = os.path.join(releases, name)
    model = _hf_model(path + ".oracle", torch.bfloat16)
    d = sdadapt.draft(model, path, reference=None)
    assert d.related and d.report.ok, d.format()
    assert d.adapter.rules[0].kind == "dequant_gptq" and {p.kind for p in d.proposals} == {"cast"}
    assert f"*sdadapt.dequant_rules({json.dumps(os.path.join(path, 'config.json'))})," in d.module
    scope: dict[str, Any] = {}
    exec(d.module, scope)  # the drafted module as a user keeps it
    sdadapt.load(model, path, scope["ADAPTER"])
    want = load_file(os.path.join(path + ".oracle", "model.safetensors"))
    got = model.state_dict()
    assert [k for k, v in want.items() if not torch.equal(got[k], v.to(torch.bfloat16))] == []


def test_draft_settles_a_meta_layout_model_numerically(releases: str, tmp_path: Any) -> None:
    """The numerical check runs on the plain model the release quantizes (its config without
    ``quantization_config``) and settles the rotary row order; the drafted adapter, the
    release's dequant rules first, gives transformers' logits on the tools' dequantised weights."""
    from support.reference_models import MetaLlama
    from transformers import AutoModelForCausalLM

    path = str(shutil.copytree(os.path.join(releases, "awq4_g32"), tmp_path / "awq4_g32"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["LlamaForCausalLM"]  # what a release on the Hub names (the tools' writer left it out)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    spec = dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                n_kv_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"], hidden_dim=cfg["intermediate_size"],
                norm_eps=cfg["rms_norm_eps"], rope_theta=cfg.get("rope_theta", 10000.0))  # fmt: skip
    with torch.device("meta"):
        model = MetaLlama(spec)
    d = sdadapt.draft(model, path)
    assert d.related and d.report.ok and d.report.values_checked, d.format()
    assert any(line.startswith("rotary: needed (checked numerically") for line in d.summary), d.format()
    assert d.adapter.rules[0].kind == "dequant_gptq"
    sdadapt.load(model, path, d.adapter)
    oracle = AutoModelForCausalLM.from_pretrained(os.path.join(releases, "awq4_g32.oracle"), dtype=torch.float32)
    tokens = torch.arange(18).remainder(cfg["vocab_size"]).view(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), oracle.eval()(tokens).logits, rtol=1e-4, atol=1e-4)


def test_a_rule_without_a_function_is_written_as_its_class() -> None:
    """``dequant_gptq`` has no ``sdadapt.<kind>`` function (``dequant_rules`` builds it): a draft
    that keeps a user's GPTQ rule writes ``sdadapt.rules.DequantGPTQ(...)``, which runs and builds
    the same rule; kinds with a function keep their short form."""
    from sdadapt._draft.render import rule_code
    from sdadapt.rules import DequantGPTQ

    rule = DequantGPTQ(keys="**", layout="awq", bits=4, group_size=64, dtype="bfloat16")
    code = rule_code(rule)
    assert code.startswith("sdadapt.rules.DequantGPTQ(") and eval(code, {"sdadapt": sdadapt}) == rule
    assert rule_code(sdadapt.rename("a.{i}.w", "b.{i}.w")) == 'sdadapt.rename("a.{i}.w", "b.{i}.w")'
