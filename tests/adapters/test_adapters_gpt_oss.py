"""The ``gpt_oss`` adapter, proven against transformers' ``GptOssForCausalLM``.

A tiny GPT-OSS is built from a config (no downloads), every weight perturbed (norm scales near
1 but not 1, attention and expert biases, router bias and sinks non-zero; a small
``swiglu_limit`` so that the clamps act; a sliding window shorter than the sequence). The
hidden size equals the expert width F, so the down projection is square as in the released
models, and a wrong orientation would not show in any shape. Two checkpoints:

- ``bf16``: ``save_pretrained`` of the bf16 model (sharded, with an index), the experts in
  transformers' ``[E, in, out]`` layout; loaded into the fp32 reference model through the
  adapter plus ``cast(bfloat16 -> float32)``; expected logits: the same bf16 values upcast;
- ``mxfp4``: the released format, experts as ``*_blocks`` + ``*_scales`` ``[E, out, in/32, ...]``
  (quantized here with sdadapt's MXFP4 quantiser) and ``quantization_config`` in
  ``config.json``; expected logits: transformers reading that folder itself
  (``Mxfp4Config(dequantize=True)``), so the dequantisation and the gate/up order are its own.

Each is loaded with ``sdadapt.load`` through ``sdadapt.get_adapter("gpt_oss", source=...)``
into :class:`reference_models.GptOss` on a 2x2 FSDP2+TP gloo mesh (TP also shards the experts'
F dim, so two TP ranks share each 32-value block of ``w2``) and on 3 ranks with uneven FSDP
shards (one 4-rank launch); the logits must equal transformers'. The loaded state dict exported
through ``adapter.inverse()`` must give the checkpoint's tensors byte for byte (for MXFP4: the
blocks and scales re-quantized with the same block geometry).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support.adapter_check import TOL, case_named, cases_fixture, check_on_meshes, checkpoint_tensors, plan_error

import sdadapt
from sdadapt._recipes.quant import quantize_mxfp4

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

L, H, KV, HEAD_DIM, DIM, F, E, TOP_K, VOCAB, SEQ, WINDOW = 3, 4, 2, 8, 32, 32, 4, 2, 40, 7, 3
TO_FP32 = sdadapt.cast("**", "float32", from_dtype="bfloat16")


def _config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        hidden_size=DIM, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
        head_dim=HEAD_DIM, vocab_size=VOCAB, num_local_experts=E, num_experts_per_tok=TOP_K, sliding_window=WINDOW,
        swiglu_limit=1.5, rms_norm_eps=1e-5,
    )  # fmt: skip


def _hf_model(seed: int) -> Any:
    """A perturbed fp32 ``GptOssForCausalLM``: std 0.2 weights and biases, sinks std 1, norm scales 1 + noise."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    hf = GptOssForCausalLM(_config()).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else (1.0 if name.endswith("sinks") else 0.2) * noise)
    return hf


def _write_mxfp4(hf: Any, path: str) -> None:
    """``hf`` as the MXFP4 release stores it: each expert matrix transposed to ``[E, out, in]``
    and packed along ``in``; everything else as it is; ``quantization_config`` in ``config.json``."""
    os.makedirs(path)
    sd: dict[str, torch.Tensor] = {}
    for key, value in hf.state_dict().items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantize_mxfp4(value.transpose(1, 2))
            sd[key + "_blocks"], sd[key + "_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            sd[key] = value.contiguous()
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# ----------------------------------------------------------------------------------------------
# checkpoints + expected logits, written once by the parent process
# ----------------------------------------------------------------------------------------------
def _write_cases(root: str) -> list[dict]:
    from transformers import GptOssForCausalLM, Mxfp4Config

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    cfg = _config()
    spec = dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB, hidden_dim=F,
                n_experts=E, top_k=TOP_K, norm_eps=cfg.rms_norm_eps, sliding_window=WINDOW,
                swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, rope=dict(cfg.rope_parameters))  # fmt: skip
    assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"] and spec["rope"]["rope_type"] == "yarn"
    cases: list[dict] = []

    # bf16, save_pretrained in shards with an index; the expected logits come from the fp32
    # model holding the bf16 values (its rotary tables stay fp32, as in the reference model)
    hf = _hf_model(30)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16))
        expected = hf(tokens).logits.float()
    path = os.path.join(root, "bf16")
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")), "save_pretrained did not shard"
    assert checkpoint_tensors(path)["model.layers.0.mlp.experts.down_proj"].shape == (E, F, DIM)
    cases.append(dict(name="bf16", path=path, options={}, extra=[TO_FP32], spec=spec, tokens=tokens, expected=expected))

    # MXFP4: the released layout; transformers dequantises the file itself for the expected logits
    path = os.path.join(root, "mxfp4")
    _write_mxfp4(_hf_model(31), path)
    ref = GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    with torch.no_grad():
        expected = ref.eval()(tokens).logits.float()
    cases.append(dict(name="mxfp4", path=path, options=dict(dtype="float32"), extra=[], spec=spec, tokens=tokens,
                      expected=expected))  # fmt: skip
    return cases


def _adapter(case: dict) -> sdadapt.Adapter:
    adapter = sdadapt.get_adapter("gpt_oss", source=case["path"], **case["options"])
    return sdadapt.Adapter([*adapter.rules, *case["extra"]], name=adapter.name) if case["extra"] else adapter


# ----------------------------------------------------------------------------------------------
# the launched check: every case on both meshes (tests/support/adapter_check.py)
# ----------------------------------------------------------------------------------------------
def _target(case: dict, mesh: Any) -> torch.nn.Module:
    from support.reference_models import GptOss, parallelize_gpt_oss

    with torch.device("meta"):
        model = GptOss(case["spec"]).eval()
    return parallelize_gpt_oss(model, mesh)


cases_root = cases_fixture("adapters_gpt_oss", _write_cases)


def test_gpt_oss_adapter_loads_real_checkpoints(cases_root: str) -> None:
    check_on_meshes(cases_root, _target, _adapter)


# ----------------------------------------------------------------------------------------------
# single process: the reference model alone, options, wrong formats and options (planning only)
# ----------------------------------------------------------------------------------------------
def _meta_model(case: dict, **spec: Any) -> torch.nn.Module:
    from support.reference_models import GptOss

    with torch.device("meta"):
        return GptOss({**case["spec"], **spec})


def _plan_error(case: dict, adapter: sdadapt.Adapter) -> str:
    return plan_error(_meta_model(case), case["path"], adapter)


def test_reference_model_matches_transformers_on_one_process(cases_root: str) -> None:
    """Unsharded, the MXFP4 release through the adapter gives transformers' logits; the experts
    equal transformers' own dequantisation of the blocks, de-interleaved (gate even, up odd)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    case = case_named(cases_root, "mxfp4")
    model = _meta_model(case)
    model.to_empty(device="cpu")
    sdadapt.load(model, case["path"], _adapter(case))
    with torch.no_grad():
        torch.testing.assert_close(model(case["tokens"]), case["expected"], **TOL)
    ckpt = checkpoint_tensors(case["path"])
    prefix = "model.layers.1.mlp.experts."
    gate_up = convert_moe_packed_tensors(ckpt[prefix + "gate_up_proj_blocks"], ckpt[prefix + "gate_up_proj_scales"],
                                         dtype=torch.float32)  # fmt: skip
    down = convert_moe_packed_tensors(ckpt[prefix + "down_proj_blocks"], ckpt[prefix + "down_proj_scales"], dtype=torch.float32)
    experts = model.layers[1].moe.experts
    assert torch.equal(experts.w1, gate_up[..., ::2].transpose(1, 2)) and torch.equal(experts.w3, gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(experts.w2, down.transpose(1, 2))
    bias = ckpt[prefix + "gate_up_proj_bias"]
    assert torch.equal(experts.b1, bias[:, ::2]) and torch.equal(experts.b3, bias[:, 1::2])


def test_options_from_checkpoints(cases_root: str) -> None:
    """What the adapter reads from config.json and key names (headers only, sharded too)."""
    from sdadapt.adapters.gpt_oss import options_from_config

    from sdadapt._plan.registry import config_folder

    def opts(case: str) -> dict:
        path = case_named(cases_root, case)["path"]
        return options_from_config(config_folder(path), path)

    assert opts("bf16") == dict(intermediate_size=F, attention_bias=True, tie_embeddings=False)
    assert opts("mxfp4") == dict(intermediate_size=F, attention_bias=True, tie_embeddings=False, quantization="mxfp4")


def test_key_names_alone_pick_mxfp4(tmp_path: Any, cases_root: str) -> None:
    """Without ``quantization_config`` the ``*_blocks`` keys say MXFP4; the plan lines up."""
    case = case_named(cases_root, "mxfp4")
    folder = tmp_path / "no_quant_config"
    folder.mkdir()
    cfg = json.loads(open(os.path.join(case["path"], "config.json")).read())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(case["path"], "model.safetensors"), folder / "model.safetensors")
    rep = sdadapt.diff(_meta_model(case), str(folder), sdadapt.get_adapter("gpt_oss", source=str(folder), dtype="float32"))
    assert rep.ok, rep.format()


def test_wrong_format_or_options_fail_while_planning(cases_root: str) -> None:
    bf16, mxfp4 = case_named(cases_root, "bf16"), case_named(cases_root, "mxfp4")

    # the MXFP4 release read as plain weights: blocks and scales unexpected, experts missing, a hint
    msg = _plan_error(mxfp4, sdadapt.get_adapter("gpt_oss", source=mxfp4["path"], quantization=None))
    assert "model.layers.{0..2}.mlp.experts.gate_up_proj_blocks" in msg and "layers.{0..2}.moe.experts.w1" in msg, msg
    assert "sdadapt.dequant_mxfp4" in msg, msg

    # the bf16 release read as MXFP4: the square down projection alone would pass, but the
    # gate/up rows are not where the MXFP4 orientation has them, and the plan says so
    adapter = sdadapt.Adapter([*sdadapt.get_adapter("gpt_oss", source=bf16["path"], quantization="mxfp4",
                                                    dtype="float32").rules, TO_FP32])  # fmt: skip
    msg = _plan_error(bf16, adapter)
    assert "split(src='model.layers.{i}.mlp.experts.gate_up_proj'" in msg, msg
    assert f"sizes [{F}, {F}] (taken from the target) add up to {2 * F}, but dim 1 has {DIM}" in msg, msg

    # a wrong expert width: the de-interleave sizes do not add up
    msg = _plan_error(mxfp4, sdadapt.get_adapter("gpt_oss", source=mxfp4["path"], dtype="float32", intermediate_size=16))
    assert f"sizes [16, 16] add up to 32, but dim 1 has {2 * F}" in msg, msg

    # dequantised values take the fp32 model's dtype with no option; pinned to bf16 (dtype=) for
    # an fp32 model, a dtype mismatch per key, never a silent cast
    assert sdadapt.diff(_meta_model(mxfp4), mxfp4["path"], sdadapt.get_adapter("gpt_oss", source=mxfp4["path"])).ok
    rep = sdadapt.diff(_meta_model(mxfp4), mxfp4["path"], sdadapt.get_adapter("gpt_oss", source=mxfp4["path"], dtype="bfloat16"))
    assert not rep.ok and "layers.{0..2}.moe.experts.w1" in rep.format() and "bfloat16" in rep.format()

    with pytest.raises(sdadapt.errors.AdapterError, match="reads bf16 releases and MXFP4 ones .* not quant_method 'fp8'"):
        sdadapt.get_adapter("gpt_oss", intermediate_size=F, quantization={"quant_method": "fp8"})
    with pytest.raises(sdadapt.errors.AdapterError, match="needs option 'intermediate_size'"):
        sdadapt.get_adapter("gpt_oss")
    with pytest.raises(sdadapt.errors.AdapterError, match="intermediate_size must be a positive integer"):
        sdadapt.get_adapter("gpt_oss", intermediate_size=0)


def test_cli_lists_gpt_oss(capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    assert main(["adapters"]) == 0
    assert "gpt_oss  " in capsys.readouterr().out
    assert main(["adapters", "gpt_oss"]) == 0
    text = capsys.readouterr().out
    for line in ("intermediate_size  required", "quantization       default None", "dtype              default None"):
        assert line in text, text
