"""A tiny Llama released by compressed-tensors (FP8-dynamic per channel, NVFP4, W4A16 with zero
points), loaded by name (``sdadapt.load(model, folder, "llama")``): the adapter reads the
release's ``quantization_config`` itself. The oracle is transformers: its ``LlamaForCausalLM``
loaded (``from_pretrained``) from a plain copy of the release dequantised by compressed-tensors
(in float32, its own ``dequantize``); the Meta-layout model's logits must equal its logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.checkpoints import write_safetensors

import sdadapt

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("compressed_tensors")

from support import ct_release  # noqa: E402
from support.scaled_releases import ct_float32_reference  # noqa: E402

VOCAB, DIM, HIDDEN, HEADS, KV = 40, 64, 96, 4, 2
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _release(root: str, name: str) -> tuple[str, torch.Tensor, torch.Tensor, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV, vocab_size=VOCAB, rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    scheme = ct_release.scheme_of(name, group_size=32 if name.startswith("w4") else None)
    folder, plain = os.path.join(root, name), os.path.join(root, name + "_plain")
    tensors, values = {}, {}
    for key, w in hf.state_dict().items():
        w = w.to(torch.bfloat16)
        if key.endswith(".weight") and key.split(".")[-2] in LINEAR:
            stored = ct_release.compress(w, name, scheme)
            tensors.update({key.removesuffix(".weight") + "." + k: v for k, v in stored.items()})
            values[key] = ct_float32_reference(stored, name, scheme)
        else:
            tensors[key] = w
            values[key] = w.float()
    os.makedirs(folder)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    qc = ct_release.config(name, scheme, ["lm_head"])
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "quantization_config": qc}, f)
    os.makedirs(plain)
    write_safetensors(os.path.join(plain, "model.safetensors"), values)
    cfg.save_pretrained(plain)
    ref = LlamaForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ref(tokens).logits.float()
    spec = dict(dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=HIDDEN, norm_eps=1e-6,
                rope_theta=cfg.rope_parameters["rope_theta"])  # fmt: skip
    return folder, tokens, logits, spec


@pytest.mark.parametrize("name", ["fp8_channel", "nvfp4", "w4a16_asym"])
def test_llama_release_by_name_gives_transformers_logits(tmp_path, name: str) -> None:
    from support.reference_models import MetaLlama

    folder, tokens, want, spec = _release(str(tmp_path), name)
    with torch.device("meta"):
        model = MetaLlama(spec)  # float32, as FSDP2 keeps master weights
    rep = sdadapt.load(model, folder, "llama")  # no dtype option: FSDP2's float32 master weights just load
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in rep.report.unexpected
    # the dequantised weights are computed in float32; what the release stores as bf16 (embeddings,
    # norms, head) is widened exactly, and the report says so
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(rep.report.widened)
    assert "layers.0.attention.wq.weight" not in rep.report.widened
    assert "widened exactly" in rep.report.format()
    with torch.no_grad():
        got = model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a bf16 model loads the same release with no option at all
    with torch.device("meta"):
        bf16 = MetaLlama(spec).to(torch.bfloat16)
    sdadapt.load(bf16, folder, "llama")
    assert torch.equal(bf16.layers[1].feed_forward.w2.weight.float(), model.layers[1].feed_forward.w2.weight.bfloat16().float())


def test_qwen3_adapter_resolves_a_regex_ignore_list(tmp_path) -> None:
    """A compressed-tensors Qwen3 release whose ``ignore`` holds a regular expression (the k
    projections stay bf16): the adapter resolves it to the checkpoint's modules from its headers,
    and the plan lines up with the model, every weight a dequantisation or a plain read."""
    from support.reference_models import Qwen3
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV, head_dim=16, vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip
    hf = Qwen3ForCausalLM(cfg)
    scheme = ct_release.scheme_of("w4a16_asym", group_size=32)
    tensors = {}
    for key, w in hf.state_dict().items():
        w = w.to(torch.bfloat16)
        if key.endswith("proj.weight") and "k_proj" not in key:
            tensors.update({key.removesuffix(".weight") + "." + k: v for k, v in ct_release.compress(w, "w4a16_asym", scheme).items()})
        else:
            tensors[key] = w
    write_safetensors(tmp_path / "model.safetensors", tensors)
    qc = ct_release.config("w4a16_asym", scheme, ["lm_head", "re:.*self_attn\\.k_proj$"])
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "quantization_config": qc}))
    spec = dict(dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV, head_dim=16, vocab_size=VOCAB, hidden_dim=HIDDEN,
                norm_eps=1e-6, rope_theta=1e6, attention_bias=False)  # fmt: skip
    with torch.device("meta"):
        model = Qwen3(spec).to(torch.bfloat16)
    _, plan = sdadapt.plan_load(model, str(tmp_path), "qwen3")
    assert plan.report.ok, plan.report
    assert plan.recipes["layers.0.attention.wq.weight"].describe().startswith("dequant_scaled(")
    assert plan.recipes["layers.0.attention.wk.weight"].describe() == "model.layers.0.self_attn.k_proj.weight"
