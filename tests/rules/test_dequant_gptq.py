"""GPTQ and AWQ releases written by auto-gptq 0.7.1 and AutoAWQ 0.2.9 (``support.quant_releases``)
load into transformers models with no adapter, every weight bit-equal to the tools' own
dequantisation, in bfloat16 and float32; logits equal those of the tools' dequantised model;
broken releases fail naming the tensor or file, nothing loaded."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from support.quant_releases import NAMES, copy_release, quant_releases  # noqa: E402

import sdadapt  # noqa: E402
from sdadapt.errors import AdapterError, LoadError, PlanError  # noqa: E402


@pytest.fixture(scope="module")
def releases() -> str:
    return quant_releases()


def _meta_model(folder: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _oracle_model(releases: str, name: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(releases, name + ".oracle"), dtype=dtype).eval()


@pytest.mark.parametrize("name", NAMES)
def test_every_weight_is_bit_equal_to_the_tools_dequantisation(releases: str, name: str) -> None:
    want = load_file(os.path.join(releases, name + ".oracle", "model.safetensors"))
    for dtype in (torch.bfloat16, torch.float32):
        model = _meta_model(os.path.join(releases, name + ".oracle"), dtype)
        sdadapt.load(model, os.path.join(releases, name))
        got = model.state_dict()
        assert set(got) == set(want)
        bad = [k for k, v in want.items() if not torch.equal(got[k].view(torch.uint8), v.to(dtype).view(torch.uint8))]
        assert bad == [], (dtype, bad)


@pytest.mark.parametrize("name", ["gptq4_g32_asym_act", "awq4_g32"])
def test_logits_equal_the_tools_dequantised_model(releases: str, name: str) -> None:
    model = _meta_model(os.path.join(releases, name + ".oracle"), torch.bfloat16)
    sdadapt.load(model, os.path.join(releases, name))
    oracle = _oracle_model(releases, name, torch.bfloat16)
    tokens = torch.arange(24).remainder(128).view(2, 12)
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, oracle(tokens).logits)


def _rewrite(path: str, change: Any) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _edit_config(path: str, **qc: Any) -> None:
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    cfg["quantization_config"].update(qc)
    json.dump(cfg, open(f, "w"))


def _fails(path: str, error: type[Exception], *texts: str) -> None:
    model = _meta_model(path, torch.bfloat16)
    with pytest.raises(error) as e:
        sdadapt.load(model, path)
    for t in texts:
        assert t in str(e.value), str(e.value)
    assert all(p.is_meta for p in model.parameters())  # nothing loaded


def test_broken_releases_fail_naming_the_tensor_or_file(releases: str, tmp_path: Any) -> None:
    key = "model.layers.1.mlp.down_proj"
    p = copy_release(releases, "gptq4_g32_asym_act", str(tmp_path / "groups"))
    _rewrite(p, lambda t: t.update({f"{key}.scales": t[f"{key}.scales"][:-1].clone()}))
    _fails(p, PlanError, f"{key}.scales", "groups", "group_size")
    p = copy_release(releases, "gptq4_g32_sym", str(tmp_path / "bits"))
    _edit_config(p, bits=8)
    _fails(p, PlanError, ".qweight", "bits=8")
    p = copy_release(releases, "awq4_g32", str(tmp_path / "awq_group"))
    _edit_config(p, group_size=64)
    _fails(p, PlanError, ".scales", "group_size=64")
    p = copy_release(releases, "gptq4_g32_sym", str(tmp_path / "method"))
    _edit_config(p, quant_method="gptq_nf4")
    _fails(p, AdapterError, "config.json", "'gptq_nf4' is not supported")
    p = copy_release(releases, "gptq4_g32_sym", str(tmp_path / "v2"))
    _edit_config(p, checkpoint_format="gptq_v2")
    _fails(p, AdapterError, "config.json", "checkpoint_format 'gptq_v2'")
    p = copy_release(releases, "gptq4_g32_asym_act", str(tmp_path / "g_idx"))
    _rewrite(p, lambda t: t[f"{key}.g_idx"].__setitem__(5, 99))
    _fails(p, LoadError, f"{key}.g_idx", "g_idx[5] = 99", "out of range")


def test_the_rule_reads_back_from_json_and_refuses_to_invert() -> None:
    (rule,) = sdadapt.dequant_rules({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}})
    adapter = sdadapt.Adapter([rule])
    again = sdadapt.Adapter.model_validate_json(adapter.model_dump_json())
    assert again.rules[0] == rule and type(again.rules[0]).__name__ == "DequantGPTQ"
    with pytest.raises(AdapterError, match="does not write AWQ"):
        adapter.inverse()
    with pytest.raises(AdapterError, match="bits=3 is not read"):
        sdadapt.dequant_rules({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}})


@pytest.mark.parametrize("name", ["gptq4_g32_sym", "awq4_g32"])
def test_inspect_and_diff_read_the_release(releases: str, name: str, capsys: Any, tmp_path: Any) -> None:
    from sdadapt.cli import main

    path = os.path.join(releases, name)
    model = _meta_model(os.path.join(releases, name + ".oracle"), torch.float32)
    assert sdadapt.diff(model, path).ok
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "qweight" in out and "int32" in out and "qzeros" in out and ("g_idx" in out) == name.startswith("gptq")
    target = tmp_path / "target.py"
    target.write_text("import torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n\n\ndef build():\n"
                      "    with torch.device('meta'):\n"
                      f"        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({path + '.oracle'!r}))\n")
    assert main(["diff", path, "--target", f"{target}:build"]) == 0
    assert "dequant+hf:LlamaForCausalLM" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gptq4_g32_asym_act", "awq4_g64"])
def test_the_llama_adapter_reads_the_release_and_gives_the_oracles_logits(releases: str, name: str) -> None:
    """The shipped ``llama`` adapter (Meta layout, rotary rows permuted) reads the release's
    ``quantization_config`` itself; a float32 model's logits equal transformers' on the tools'
    dequantised weights, and a bf16 model gets the same weights rounded once."""
    from support.reference_models import MetaLlama

    cfg = json.load(open(os.path.join(releases, name, "config.json")))
    spec = dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                n_kv_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"], hidden_dim=cfg["intermediate_size"],
                norm_eps=cfg["rms_norm_eps"], rope_theta=cfg.get("rope_theta", 10000.0))  # fmt: skip
    with torch.device("meta"):
        model = MetaLlama(spec)
    sdadapt.load(model, os.path.join(releases, name), "llama")
    oracle = _oracle_model(releases, name, torch.float32)
    tokens = torch.arange(18).remainder(cfg["vocab_size"]).view(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), oracle(tokens).logits, rtol=1e-4, atol=1e-4)
    with torch.device("meta"):
        bf16 = MetaLlama(spec).to(torch.bfloat16)
    sdadapt.load(bf16, os.path.join(releases, name), "llama")
    assert torch.equal(bf16.layers[1].feed_forward.w2.weight, model.layers[1].feed_forward.w2.weight.bfloat16())


def test_a_model_holding_the_same_packed_layers_gets_them_as_stored(releases: str) -> None:
    """Kept packed: where the model holds ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` under a
    layer's name, the rule leaves that layer alone and its tensors are read bit for bit."""
    stored = load_file(os.path.join(releases, "gptq4_g32_asym_act", "model.safetensors"))

    class Packed(torch.nn.Module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            for k in ("qweight", "qzeros", "scales", "g_idx"):
                v = stored[f"{prefix}.{k}"]
                self.register_buffer(k, torch.empty(v.shape, dtype=v.dtype, device="meta"))

    model = _meta_model(os.path.join(releases, "gptq4_g32_asym_act.oracle"), torch.float16)
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(sub, torch.nn.Linear) and f"{full}.qweight" in stored:
                setattr(module, child, Packed(full))
    sdadapt.load(model, os.path.join(releases, "gptq4_g32_asym_act"))
    got = model.state_dict()
    assert set(got) == set(stored)
    assert [k for k, v in stored.items() if not torch.equal(got[k], v)] == []
