"""The ``deepseek_v3`` adapter, proven against transformers' own ``DeepseekV3ForCausalLM``.

Tiny models are built from configs (no downloads), every weight perturbed (norm scales near 1
but not 1, the router's ``e_score_correction_bias`` non-zero) so that a wrong name, row order or
expert order changes the logits. Three checkpoints cover the layouts:

- low-rank q (``q_lora_rank``), DeepSeek's interleaved rotary rows (``rope_interleave: true``),
  one dense layer, ``save_pretrained``'s per-expert keys, plus a multi-token-prediction layer
  ``model.layers.{num_hidden_layers}`` as the releases ship it (dropped by default), sharded;
- one ``q_proj``, HF "half" rotary rows (``rope_interleave: false``: the adapter permutes the
  rope rows of q and ``wkv_a`` to interleaved), two dense layers, tied embeddings, one file;
- transformers 5.x fused 3-D experts (``mlp.experts.gate_up_proj``), every layer MoE, sharded.

Each is loaded with ``sdadapt.load`` through ``sdadapt.get_adapter("deepseek_v3", source=...)``
(options from ``config.json`` and key names) into :class:`reference_models.DeepSeekV3` on a 2x2
FSDP2+TP gloo mesh and on 3 ranks with uneven FSDP shards (one 4-rank launch); the logits must
equal transformers' and the export through ``adapter.inverse()`` must give the checkpoint's
tensors byte for byte (the dropped MTP layer aside). :func:`load_all` serves the FP8 tests too.

Single-process tests: options read from each checkpoint; the MTP layer mapped to ``mtp.0.``
(values and export); wrong options fail while planning, naming rule and keys.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from support.adapter_check import (
    case_named,
    cases_fixture,
    check_results,
    checkpoint_tensors,
    load_cases,
    plan_error,
    same_bytes,
)
from support.checkpoints import write_hf_sharded
from support.dist_helper import run_distributed
from support.hf_families import (
    DIM,
    KV_RANK,
    MOE_FFN,
    NOPE,
    ROPE,
    SEQ,
    VOCAB,
    E,
    H,
    L,
    hf_config,
    hf_model,
    load_all,
    mtp_layer,
    spec_of,
    target_model,
)

import sdadapt
from sdadapt._plan.plan import build_plan

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")


def case_of(name: str, hf: Any, path: str, tokens: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """A case for :func:`load_all`: the checkpoint, the reference model's spec and the logits."""
    with torch.no_grad():
        expected = hf(tokens).logits.float()
    tied = hf.config.tie_word_embeddings
    case = dict(name=name, path=path, family="deepseek_v3", adapter="deepseek_v3", spec=spec_of(hf.config), tokens=tokens,
                expected=expected, export_unexpected=["output.weight"] if tied else [], export_skip=())  # fmt: skip
    return {**case, **extra}


# ----------------------------------------------------------------------------------------------
# checkpoints + expected logits, written once by the parent process
# ----------------------------------------------------------------------------------------------
def _write_cases(root: str) -> list[dict]:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    cases: list[dict] = []

    # low-rank q, interleaved rotary rows, one dense layer; per-expert keys + an MTP layer, sharded
    hf = hf_model(hf_config(), 30)
    path = os.path.join(root, "dsv3_q_lora_mtp")
    hf.save_pretrained(path)
    sd = checkpoint_tensors(path)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sd
    write_hf_sharded(path, {**sd, **mtp_layer(sd, L, 31)}, max_shard_bytes=40_000)
    os.remove(os.path.join(path, "model.safetensors"))
    cases.append(case_of("dsv3_q_lora_mtp", hf, path, tokens, export_skip=(f"model.layers.{L}.",)))

    # one q_proj, HF "half" rotary rows, two dense layers, tied embeddings, one file
    hf = hf_model(hf_config(q_lora_rank=None, rope_interleave=False, first_k_dense_replace=2, tie_word_embeddings=True), 32)
    path = os.path.join(root, "dsv3_wq_half_tied")
    hf.save_pretrained(path)
    assert "lm_head.weight" not in checkpoint_tensors(path)
    cases.append(case_of("dsv3_wq_half_tied", hf, path, tokens))

    # fused 3-D experts (transformers 5.x state dict), every layer MoE, sharded with an index
    cfg = hf_config(first_k_dense_replace=0)
    hf = hf_model(cfg, 33)
    path = os.path.join(root, "dsv3_stacked")
    sd = hf.state_dict()
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * MOE_FFN, DIM)
    write_hf_sharded(path, sd, max_shard_bytes=40_000)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(cfg.to_json_string())
    cases.append(case_of("dsv3_stacked", hf, path, tokens))
    return cases


cases_root = cases_fixture("adapters_deepseek", _write_cases)


def test_deepseek_v3_loads_real_checkpoints(cases_root: str) -> None:
    results = run_distributed(load_all, 4, cases_root, timeout=300)
    check_results(results, [c["name"] for c in load_cases(cases_root)])


# ----------------------------------------------------------------------------------------------
# single process: options, MTP mapped, wrong options (planning only), CLI
# ----------------------------------------------------------------------------------------------
def _opts(case: dict) -> dict:
    from sdadapt.adapters.deepseek_v3 import options_from_config

    from sdadapt._plan.registry import config_folder

    return options_from_config(config_folder(case["path"]), case["path"])


def test_options_from_checkpoints(cases_root: str) -> None:
    """What the adapter reads from config.json and key names (headers only, sharded too)."""
    dims = dict(n_layers=L, n_experts=E, n_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, kv_lora_rank=KV_RANK)
    assert _opts(case_named(cases_root, "dsv3_q_lora_mtp")) == dict(
        dims, rope_interleave=True, q_lora=True, first_k_dense_replace=1, mtp_layers=1, tie_embeddings=False
    )
    assert _opts(case_named(cases_root, "dsv3_wq_half_tied")) == dict(
        dims, rope_interleave=False, q_lora=False, first_k_dense_replace=2, mtp_layers=0, tie_embeddings=True
    )
    assert _opts(case_named(cases_root, "dsv3_stacked")) == dict(
        dims, rope_interleave=True, q_lora=True, first_k_dense_replace=0, mtp_layers=0, tie_embeddings=False,
        experts="stacked",
    )  # fmt: skip
    # without key names: config.json alone (DeepSeek-V3's num_nextn_predict_layers: 1)
    from sdadapt.adapters.deepseek_v3 import options_from

    cfg = json.loads(hf_config(first_k_dense_replace=3).to_json_string())
    opts = options_from(cfg, [])
    assert (opts["q_lora"], opts["first_k_dense_replace"], opts["mtp_layers"]) == (True, 3, 1)


def test_mtp_layer_mapped(cases_root: str) -> None:
    """``mtp="map"``: the MTP layer's block becomes ``mtp.0.block.*``, its extras ``mtp.0.*``, with the checkpoint's
    values (experts stacked), and the inverse writes every tensor back byte for byte."""
    from support.checkpoints import DictIO

    case = case_named(cases_root, "dsv3_q_lora_mtp")
    original = checkpoint_tensors(case["path"])
    model_schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in target_model(case, None).state_dict().items()}
    last, mtp = f"layers.{L - 1}.", "mtp.0."
    target = dict(model_schema)
    target.update({mtp + "block." + k[len(last) :]: v for k, v in model_schema.items() if k.startswith(last)})
    for name, shape in (("tok_embeddings", (VOCAB, DIM)), ("enorm", (DIM,)), ("hnorm", (DIM,)), ("eh_proj", (DIM, 2 * DIM)),
                        ("norm", (DIM,)), ("output", (VOCAB, DIM))):  # fmt: skip
        target[f"{mtp}{name}.weight"] = sdadapt.sources.TensorInfo(shape, torch.float32)
    source = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in original.items()}

    adapter = sdadapt.get_adapter("deepseek_v3", source=case["path"], mtp="map")
    plan = build_plan(source, target, adapter)
    assert plan.report.ok, plan.report.format()
    io = DictIO(original)
    values = {k: node.full(io) for k, node in plan.recipes.items()}
    hf = f"model.layers.{L}."
    assert torch.equal(values[mtp + "output.weight"], original[hf + "shared_head.head.weight"])
    assert torch.equal(values[mtp + "block.attention.wq_a.weight"], original[hf + "self_attn.q_a_proj.weight"])
    assert torch.equal(values[mtp + "block.moe.expert_bias"], original[hf + "mlp.gate.e_score_correction_bias"])
    assert torch.equal(values[mtp + "block.moe.experts.w2"][3], original[hf + "mlp.experts.3.down_proj.weight"])

    back = build_plan({k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in values.items()}, source, adapter.inverse())
    assert back.report.ok, back.report.format()
    out = DictIO(values)
    assert [k for k, node in back.recipes.items() if not same_bytes(node.full(out), original[k])] == []

    # the default drops it, and says so
    rep = sdadapt.diff(target_model(case, None), case["path"], sdadapt.get_adapter("deepseek_v3", source=case["path"]))
    assert rep.ok, rep.format()
    assert f"model.layers.{L}.enorm.weight" in rep.dropped and f"model.layers.{L}.mlp.experts.3.down_proj.weight" in rep.dropped


def test_mtp_layer_dropped_whole_when_stripped(cases_root: str, tmp_path: Any) -> None:
    """``mtp="drop"`` drops the MTP layer as a layer: a release whose MTP layer lacks the
    duplicated ``embed_tokens`` and ``shared_head.head`` (derivatives strip them) loads, with the
    same values as the full release, and every key of the layer is reported dropped."""
    import shutil

    case = case_named(cases_root, "dsv3_q_lora_mtp")
    sd = checkpoint_tensors(case["path"])
    hf = f"model.layers.{L}."
    stripped = {k: v for k, v in sd.items() if k not in (hf + "embed_tokens.weight", hf + "shared_head.head.weight")}
    assert len(stripped) == len(sd) - 2
    path = str(tmp_path / "stripped")
    write_hf_sharded(path, stripped, max_shard_bytes=40_000)
    shutil.copy(os.path.join(case["path"], "config.json"), path)
    full, lean = target_model(case, None), target_model(case, None)
    sdadapt.load(full, case["path"], "deepseek_v3")
    rep = sdadapt.load(lean, path, "deepseek_v3")
    dropped = [k for k in stripped if k.startswith(hf)]
    assert sorted(rep.report.dropped) == sorted(dropped)
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in lean.state_dict().items())


def _plan_error(case: dict, adapter: sdadapt.Adapter) -> str:
    return plan_error(target_model(case, None), case["path"], adapter)


def test_wrong_options_fail_while_planning(cases_root: str) -> None:
    mtp_case, half, stacked = (case_named(cases_root, n) for n in ("dsv3_q_lora_mtp", "dsv3_wq_half_tied", "dsv3_stacked"))
    get = sdadapt.get_adapter

    # low-rank q expected, one q_proj in the checkpoint: rules and keys named
    msg = _plan_error(half, get("deepseek_v3", source=half["path"], q_lora=True))
    assert "rename(src='model.layers.{i}.self_attn.q_a_proj.weight', dst='layers.{i}.attention.wq_a.weight')" in msg, msg

    # fewer dense layers than the checkpoint's: layer 1's MLP passes unrenamed and the model's is missing
    msg = _plan_error(half, get("deepseek_v3", source=half["path"], first_k_dense_replace=1))
    assert "model.layers.1.mlp.gate_proj.weight" in msg and "layers.1.feed_forward.w1.weight" in msg, msg

    # an expert count that differs from the checkpoint's
    msg = _plan_error(mtp_case, get("deepseek_v3", source=mtp_case["path"], n_experts=5))
    assert "found 4 entries (e=0..3) but count=5" in msg, msg

    # the MTP layer not declared: its block and extras are unexpected, nothing read
    adapter = get("deepseek_v3", source=mtp_case["path"], mtp_layers=0)
    msg = _plan_error(mtp_case, adapter)
    assert f"layers.{L}.attention.wq_a.weight" in msg, msg
    unexpected = sdadapt.diff(target_model(mtp_case, None), mtp_case["path"], adapter).unexpected
    assert len(unexpected) == 23 and f"model.layers.{L}.enorm.weight" in unexpected, unexpected

    # fused experts read as per-expert
    msg = _plan_error(stacked, get("deepseek_v3", source=stacked["path"], experts="per_expert"))
    assert "model.layers.{0..2}.mlp.experts.gate_up_proj" in msg and "layers.{0..2}.moe.experts.w1" in msg, msg

    # options that cannot make an adapter
    with pytest.raises(sdadapt.errors.AdapterError, match="needs n_layers=..."):
        get("deepseek_v3", mtp_layers=1)
    with pytest.raises(sdadapt.errors.AdapterError, match="rope_interleave=False needs n_heads, qk_nope_head_dim"):
        get("deepseek_v3", rope_interleave=False)
    with pytest.raises(sdadapt.errors.AdapterError, match="mtp must be 'drop' or 'map'"):
        get("deepseek_v3", mtp="keep")
    with pytest.raises(sdadapt.errors.AdapterError, match="first_k_dense_replace must be a non-negative integer"):
        get("deepseek_v3", first_k_dense_replace=-1)


def test_half_rotary_rows_are_permuted(cases_root: str) -> None:
    """The rope rows of q and ``wkv_a`` are permuted half -> interleaved per head, the others
    kept: loaded values against a plain-torch permutation of the checkpoint's tensors."""
    case = case_named(cases_root, "dsv3_wq_half_tied")
    model = target_model(case, None)
    sdadapt.load(model, case["path"], sdadapt.get_adapter("deepseek_v3", source=case["path"]))
    sd = checkpoint_tensors(case["path"])
    perm = torch.cat([torch.arange(0, ROPE, 2), torch.arange(1, ROPE, 2)]).argsort()  # interleaved row r <- half row perm[r]
    q = sd["model.layers.0.self_attn.q_proj.weight"].reshape(H, NOPE + ROPE, DIM)
    want_q = torch.cat([q[:, :NOPE], q[:, NOPE:][:, perm]], dim=1).reshape(-1, DIM)
    kv = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    want_kv = torch.cat([kv[:KV_RANK], kv[KV_RANK:][perm]])
    attn = model.layers[0].attention
    assert torch.equal(attn.wq.weight.detach(), want_q) and torch.equal(attn.wkv_a.weight.detach(), want_kv)
    assert not torch.equal(want_q, sd["model.layers.0.self_attn.q_proj.weight"])


def test_cli_lists_deepseek_options(capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    assert main(["adapters"]) == 0
    assert "deepseek_v3  " in capsys.readouterr().out
    assert main(["adapters", "deepseek_v3"]) == 0
    text = capsys.readouterr().out
    for option in ("q_lora", "first_k_dense_replace", "experts", "n_experts", "mtp_layers", "mtp ", "rope_interleave"):
        assert option in text, text
