"""The ``qwen3`` and ``qwen3_moe`` adapters, proven against transformers' own model classes.

Tiny ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` models are built from configs (no
downloads), every weight perturbed (norm scales near 1 but not 1, biases non-zero, q/k norms
differing per row) so that a wrong name, row order or expert order changes the logits. Their
checkpoints are written as transformers writes them (``save_pretrained``, single file or
sharded with ``model.safetensors.index.json``; per-expert MoE keys) or, for the fused 3-D
experts of transformers 5.x (``mlp.experts.gate_up_proj``), as the model's state dict in
safetensors shards with an index. Each is loaded with ``sdadapt.load`` through
``sdadapt.get_adapter(name, source=...)`` (options from ``config.json`` and key names) into
:class:`reference_models.Qwen3`, on a 2x2 FSDP2+TP gloo mesh and on 3 ranks with uneven FSDP
shards (one 4-rank launch), and the logits must equal transformers' (fp32, tight tolerance).
The loaded state dict exported through ``adapter.inverse()`` must give the checkpoint's tensors
byte for byte.

Single-process tests: options read from each checkpoint; a wrong adapter or a wrong option
(expert count, dense layers, tying) fails while planning, naming rule and keys, with nothing
read; a quantized ``config.json`` is refused; ``sdadapt adapters qwen3_moe`` lists the options.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapter_check import TOL, case_named, cases_fixture, check_on_meshes, plan_error
from support.hf_families import perturb_model

import sdadapt

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

L, H, KV, HEAD_DIM, DIM, FFN, MOE_FFN, E, VOCAB, SEQ = 3, 4, 2, 16, 32, 48, 24, 4, 40, 7


def _save_sharded(sd: dict[str, torch.Tensor], path: str, parts: int) -> None:
    """``sd`` as ``parts`` safetensors shards with a ``model.safetensors.index.json``."""
    keys = sorted(sd)
    weight_map: dict[str, str] = {}
    for n in range(parts):
        name = f"model-{n + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: sd[k].contiguous() for k in keys[n::parts]}
        save_file(chunk, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())}, "weight_map": weight_map}, f)


# ----------------------------------------------------------------------------------------------
# checkpoints + expected logits, written once by the parent process
# ----------------------------------------------------------------------------------------------
def _write_cases(root: str) -> list[dict]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    common = dict(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB, rms_norm_eps=1e-6)  # fmt: skip
    cases: list[dict] = []

    def add(name: str, hf: Any, path: str, adapter: str, **kw: Any) -> None:
        cfg = hf.config
        spec = dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB,
                    hidden_dim=FFN, norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_parameters["rope_theta"],
                    attention_bias=cfg.attention_bias)  # fmt: skip
        if adapter == "qwen3_moe":
            dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
            spec.update(n_experts=E, top_k=cfg.num_experts_per_tok, moe_hidden_dim=MOE_FFN,
                        norm_topk=cfg.norm_topk_prob, dense_layers=dense)  # fmt: skip
        with torch.no_grad():
            logits = hf(tokens).logits.float()
        tied = cfg.tie_word_embeddings
        cases.append(dict(name=name, path=path, adapter=adapter, spec=spec, tokens=tokens, expected=logits,
                          export_unexpected=["output.weight"] if tied else []))  # fmt: skip

    # Qwen3, untied, with attention biases: save_pretrained sharded (index + several files)
    torch.manual_seed(20)
    hf = Qwen3ForCausalLM(Qwen3Config(**common, attention_bias=True, tie_word_embeddings=False)).eval()
    perturb_model(hf, 20)
    path = os.path.join(root, "qwen3_sharded")
    hf.save_pretrained(path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")), "save_pretrained did not shard"
    add("qwen3_sharded_bias", hf, path, "qwen3")

    # Qwen3, tied embeddings (no lm_head.weight in the file), single file
    torch.manual_seed(21)
    hf = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True)).eval()
    perturb_model(hf, 21)
    path = os.path.join(root, "qwen3_tied")
    hf.save_pretrained(path)
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    add("qwen3_tied", hf, path, "qwen3")

    # Qwen3-MoE: save_pretrained writes per-expert keys; layer 1 dense (mlp_only_layers)
    moe = dict(common, moe_intermediate_size=MOE_FFN, num_experts=E, num_experts_per_tok=2)
    torch.manual_seed(22)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**moe, mlp_only_layers=[1], norm_topk_prob=False)).eval()
    perturb_model(hf, 22)
    path = os.path.join(root, "qwen3_moe_per_expert")
    hf.save_pretrained(path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in load_file(os.path.join(path, "model.safetensors"))
    add("qwen3_moe_per_expert", hf, path, "qwen3_moe")

    # Qwen3-MoE, fused 3-D experts (transformers 5.x state dict), tied, decoder_sparse_step=2
    # (layers 0 and 2 dense), renormalised top-k, in two shards with an index
    torch.manual_seed(23)
    mcfg = Qwen3MoeConfig(**moe, decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True)
    hf = Qwen3MoeForCausalLM(mcfg).eval()
    perturb_model(hf, 23)
    path = os.path.join(root, "qwen3_moe_stacked")
    os.makedirs(path)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: not stored
    assert sd["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * MOE_FFN, DIM)
    _save_sharded(sd, path, parts=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(mcfg.to_json_string())
    add("qwen3_moe_stacked_tied", hf, path, "qwen3_moe")
    return cases


# ----------------------------------------------------------------------------------------------
# the launched check: every case on both meshes (tests/support/adapter_check.py)
# ----------------------------------------------------------------------------------------------
def _target(case: dict, mesh: Any) -> torch.nn.Module:
    from support.reference_models import Qwen3, parallelize_meta_llama

    with torch.device("meta"):
        model = Qwen3(case["spec"]).eval()
    return parallelize_meta_llama(model, mesh)


cases_root = cases_fixture("adapters_qwen", _write_cases)


def test_qwen_adapters_load_real_checkpoints(cases_root: str) -> None:
    check_on_meshes(cases_root, _target)


# ----------------------------------------------------------------------------------------------
# single process: options, wrong adapters and options (planning only), quantized configs, CLI
# ----------------------------------------------------------------------------------------------
def _meta_model(case: dict, **spec: Any) -> torch.nn.Module:
    from support.reference_models import Qwen3

    with torch.device("meta"):
        return Qwen3({**case["spec"], **spec})


def _plan_error(case: dict, adapter: sdadapt.Adapter) -> str:
    return plan_error(_meta_model(case), case["path"], adapter)


def test_options_from_checkpoints(cases_root: str) -> None:
    """What each adapter reads from config.json and key names (headers only, sharded too)."""
    from sdadapt._plan.registry import config_folder

    def opts(name: str, case: str) -> dict:
        path = case_named(cases_root, case)["path"]
        mod = __import__(f"sdadapt.adapters.{name}", fromlist=["options_from_config"])
        return mod.options_from_config(config_folder(path), path)

    assert opts("qwen3", "qwen3_sharded_bias") == dict(tie_embeddings=False, attention_bias=True)
    assert opts("qwen3", "qwen3_tied") == dict(tie_embeddings=True, attention_bias=False)
    assert opts("qwen3_moe", "qwen3_moe_per_expert") == dict(tie_embeddings=False, attention_bias=False, n_experts=E, dense_layers=[1])
    assert opts("qwen3_moe", "qwen3_moe_stacked_tied") == dict(
        tie_embeddings=True, attention_bias=False, n_experts=E, dense_layers=[0, 2], experts="stacked"
    )


def test_dense_layers_from_config_alone() -> None:
    """Without key names, transformers' rule: mlp_only_layers, decoder_sparse_step, num_experts."""
    from sdadapt.adapters.qwen3_moe import dense_layers_from

    assert dense_layers_from({"num_hidden_layers": 4, "num_experts": 8}, []) == []
    assert dense_layers_from({"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": [0, 3]}, []) == [0, 3]
    assert dense_layers_from({"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 2}, []) == [0, 2]
    assert dense_layers_from({"num_hidden_layers": 3, "num_experts": 0}, []) == [0, 1, 2]
    assert dense_layers_from({}, []) is None


def test_wrong_adapter_or_options_fail_while_planning(cases_root: str) -> None:
    dense, tied = case_named(cases_root, "qwen3_sharded_bias"), case_named(cases_root, "qwen3_tied")
    per_expert, stacked = case_named(cases_root, "qwen3_moe_per_expert"), case_named(cases_root, "qwen3_moe_stacked_tied")

    # the dense adapter on an MoE checkpoint: the experts are unexpected, the model's moe.* missing
    rep = sdadapt.diff(_meta_model(per_expert), per_expert["path"], sdadapt.get_adapter("qwen3", source=per_expert["path"]))
    text = rep.format()
    assert not rep.ok
    assert "layers.0.moe.experts.w1" in rep.missing and "layers.2.moe.router.gate.weight" in rep.missing, text
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in rep.unexpected, text
    assert len(rep.missing) == 8 and len(rep.unexpected) == 26  # layers 0 and 2 (layer 1 is dense and loads)
    assert "layers.{0,2}.moe.experts.w1" in text and "model.layers.{0,2}.mlp.experts.{0..3}.down_proj.weight" in text

    # an expert count that differs from the checkpoint's (config num_experts 5)
    msg = _plan_error(per_expert, sdadapt.get_adapter("qwen3_moe", source=per_expert["path"], n_experts=5))
    assert "stack(src='model.layers.{i}.mlp.experts.{e}.gate_proj.weight'" in msg
    assert "found 4 entries (e=0..3) but count=5" in msg

    # dense layers that are not the checkpoint's: the rule of layer 0 matched nothing, layer 1's
    # dense weights pass unrenamed (unexpected) and the model's layer-1 feed_forward is missing
    msg = _plan_error(per_expert, sdadapt.get_adapter("qwen3_moe", source=per_expert["path"], dense_layers=[0]))
    assert "rename(src='model.layers.0.mlp.gate_proj.weight', dst='layers.0.feed_forward.w1.weight')" in msg
    assert "model.layers.1.mlp.gate_proj.weight" in msg and "layers.1.feed_forward.w1.weight" in msg

    # the stacked layout read as per-expert: nothing stacks, fused tensors unexpected
    msg = _plan_error(stacked, sdadapt.get_adapter("qwen3_moe", source=stacked["path"], experts="per_expert"))
    assert "stack(src='model.layers.{i}.mlp.experts.{e}.gate_proj.weight'" in msg
    assert "model.layers.1.mlp.experts.gate_up_proj" in msg and "layers.1.moe.experts.w1" in msg

    # untied option on a tied checkpoint: lm_head.weight is not there
    msg = _plan_error(tied, sdadapt.get_adapter("qwen3", source=tied["path"], tie_embeddings=False))
    assert "rename(src='lm_head.weight', dst='output.weight')" in msg and "output.weight" in msg

    # biases the checkpoint does not hold
    msg = _plan_error(tied, sdadapt.get_adapter("qwen3", source=tied["path"], attention_bias=True))
    for proj in "qkvo":
        assert f"rename(src='model.layers.{{i}}.self_attn.{proj}_proj.bias'" in msg, msg

    # a model whose heads differ from the checkpoint's: shapes named
    msg = _plan_error({**dense, "spec": {**dense["spec"], "head_dim": 8}}, sdadapt.get_adapter("qwen3", source=dense["path"]))
    assert "layers.{0..2}.attention.wq.weight: model [32, 32], checkpoint gives [64, 32]" in msg
    assert "layers.{0..2}.attention.q_norm.weight: model [8], checkpoint gives [16]" in msg


def test_bf16_release_loads_without_casts(tmp_path: Any, cases_root: str) -> None:
    """A bf16 release (``save_pretrained`` of the bf16 model, as the Hub holds them) loads into a
    bf16 model with no cast; the values are transformers' (logits of both upcast to fp32 agree),
    and into an fp32 model every tensor widens exactly (listed as widened; no cast rule)."""
    from transformers import Qwen3MoeForCausalLM

    case = case_named(cases_root, "qwen3_moe_per_expert")
    hf = Qwen3MoeForCausalLM.from_pretrained(case["path"], dtype=torch.bfloat16).eval()
    path = str(tmp_path / "bf16")
    hf.save_pretrained(path)
    adapter = sdadapt.get_adapter("qwen3_moe", source=path)
    rep = sdadapt.diff(_meta_model(case), path, adapter)
    assert rep.ok and len(rep.widened) == rep.target_keys and "widened exactly" in rep.format()
    model = _meta_model(case).to(torch.bfloat16)
    model.to_empty(device="cpu")
    assert sdadapt.load(model, path, adapter).keys_loaded == rep.target_keys
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        out, expected = model.float()(case["tokens"]), hf.float()(case["tokens"]).logits
    torch.testing.assert_close(out, expected, **TOL)


def test_quantized_configs_are_refused(tmp_path: Any) -> None:
    """Quantized releases the Qwen adapters cannot read are refused before planning, with a clear
    message: FP8 scale keys without a config.json (no block size), and MXFP4. (FP8 releases with
    their config.json load: tests/adapters/test_adapters_fp8.py.)"""
    folder = tmp_path / "fp8"
    folder.mkdir()
    save_file(
        {"model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4), "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.ones(1, 1)},
        str(folder / "model.safetensors"),
    )
    for name in ("qwen3", "qwen3_moe"):
        with pytest.raises(sdadapt.errors.AdapterError, match=f"the {name} adapter: an FP8 checkpoint needs its block size"):
            sdadapt.get_adapter(name, source=str(folder))
    with pytest.raises(sdadapt.errors.AdapterError, match="MXFP4 checkpoints need the dequant rules: not supported by this adapter"):
        sdadapt.get_adapter("qwen3_moe", quantization="mxfp4")
    with pytest.raises(sdadapt.errors.AdapterError, match="experts must be 'per_expert' or 'stacked'"):
        sdadapt.get_adapter("qwen3_moe", experts="fused")
    with pytest.raises(sdadapt.errors.AdapterError, match="dense_layers must be non-negative integers"):
        sdadapt.get_adapter("qwen3_moe", dense_layers=[-1])


def test_cli_lists_qwen_adapters_and_options(cases_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    def cli(*args: str) -> str:
        capsys.readouterr()
        assert main(list(args)) == 0
        return capsys.readouterr().out

    listing = cli("adapters")
    assert "qwen3  " in listing and "qwen3_moe  " in listing and "_common" not in listing
    text = cli("adapters", "qwen3_moe")
    for line in ("experts         default 'per_expert'", "n_experts       default None", "dense_layers    default ()",
                 "tie_embeddings  default False", "attention_bias  default False", "quantization    default None"):  # fmt: skip
        assert line in text, text
    # a diff with the options from config.json and key names: the sharded checkpoint lines up
    case = case_named(cases_root, "qwen3_moe_stacked_tied")
    rep = sdadapt.diff(_meta_model(case), case["path"], sdadapt.get_adapter("qwen3_moe", source=case["path"]))
    assert rep.ok, rep.format()
