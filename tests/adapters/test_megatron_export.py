"""``torch_dist`` written by sdadapt, read by Megatron-Core's own ``dist_checkpointing.load``.

The round trip Megatron -> sdadapt -> Megatron: each fixture Megatron-Core wrote is loaded into
a transformers model (or converted through HF names), exported as ``torch_dist`` (the adapter's own
format, not named), and Megatron loads it into a ``GPTModel`` at another TP degree than the writer's (in the megatron venv,
``megatron_fixtures.py --load``): every rank's parameters equal its part of Megatron's original
state bit for bit, and the logits equal Megatron's. A transformers model never loaded from Megatron
exports too, and Megatron's forward of it matches transformers'.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
import torch
from support.megatron_ckpt import FIXTURES_SCRIPT, hf_model, megatron_checkpoints, megatron_python, oracle

import sdadapt

CASES = [("dense", 2), ("dense_tp2", 1), ("moe_sequential", 1), ("moe_grouped", 1)]


def _export(ckpts: str, name: str, dst: str, tmp: str) -> Any:
    src = os.path.join(ckpts, name)
    if name == "moe_grouped":  # no transformers family has its sigmoid router with expert bias: through HF names
        adapter = sdadapt.get_adapter("megatron_gpt", src)
        sdadapt.convert(src, os.path.join(tmp, "hf"), adapter)
        return sdadapt.convert(os.path.join(tmp, "hf"), dst, adapter.inverse(), format="torch_dist")
    adapter = sdadapt.get_adapter("megatron_gpt", src, experts_to="stacked") if name.startswith("moe") else "megatron_gpt"
    model = hf_model(name)
    sdadapt.load(model, src, adapter)
    return sdadapt.export(model, dst, adapter)  # the adapter's own format: torch_dist


def _from_transformers(ckpts: str, dst: str, tmp: str) -> str:
    """A transformers Llama never loaded from Megatron, exported; its oracle: its own state in
    Megatron's module names and its logits."""
    torch.manual_seed(3)
    model = hf_model("dense")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    sdadapt.export(model, dst, "megatron_gpt")  # the adapter's own format: torch_dist
    o = oracle(ckpts, "dense")
    with torch.no_grad():
        logits = model(o["tokens"]).logits
    path = os.path.join(tmp, "from-hf.oracle.pt")
    torch.save({"spec": o["spec"], "tokens": o["tokens"], "logits": logits, "state": megatron_state(model)}, path)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every export, then one run of Megatron's load over all of them (its processes start once
    per TP degree): ``{case: (export report, Megatron's reports per rank)}``."""
    ckpts = megatron_checkpoints()
    tmp = str(tmp_path_factory.mktemp("megatron-export"))
    jobs, reports = [], {}
    for name, tp in CASES:
        dst = os.path.join(tmp, name)
        os.makedirs(os.path.join(tmp, f"{name}-work"))
        reports[name] = _export(ckpts, name, dst, os.path.join(tmp, f"{name}-work"))
        jobs.append({"ckpt": dst, "tp": tp, "oracle": os.path.join(ckpts, f"{name}.oracle.pt"), "result": dst + ".json"})
    dst = os.path.join(tmp, "from-hf")
    jobs.append({"ckpt": dst, "tp": 2, "oracle": _from_transformers(ckpts, dst, tmp), "result": dst + ".json"})
    with open(os.path.join(tmp, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    p = subprocess.run([megatron_python(), str(FIXTURES_SCRIPT), "--load", os.path.join(tmp, "jobs.json")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    out: dict[str, Any] = {"ckpts": ckpts, "tmp": tmp}
    for job, name in zip(jobs, [n for n, _ in CASES] + ["from-hf"], strict=True):
        with open(job["result"]) as f:
            out[name] = (reports.get(name), json.load(f))
    return out


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_round_trip_megatron_sdadapt_megatron(written: dict[str, Any], name: str, tp: int) -> None:
    report, ranks = written[name]
    dst = os.path.join(written["tmp"], name)
    assert report.format == "torch_dist"
    assert {"metadata.json", "common.pt", ".metadata"} <= set(os.listdir(dst))
    assert sdadapt.sources.read_megatron_common(dst)["checkpoint_version"] == 3.0
    assert len(ranks) == tp
    for r in ranks:
        assert r["keys_equal"] and r["unequal"] == [], r
        if "logits_max_diff" in r:
            assert r["logits_max_diff"] <= (0.0 if tp == 1 else 2e-5), r
    # every tensor as Megatron wrote it
    with sdadapt.sources.open_source(dst) as back, sdadapt.sources.open_source(os.path.join(written["ckpts"], name)) as orig:
        assert sorted(back.schema) == sorted(orig.schema)
        for key, info in orig.schema.items():
            box = tuple((0, n) for n in info.shape)
            assert torch.equal(back.read(key, box), orig.read(key, box)), key


def test_a_transformers_model_exports_for_megatron(written: dict[str, Any]) -> None:
    """A model never loaded from Megatron: the options come from its config; Megatron loads the
    written checkpoint at TP 2, each rank's parameters equal to its part of the model's, and its
    forward gives transformers' logits."""
    _, ranks = written["from-hf"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["keys_equal"] and r["unequal"] == [], r
        assert r["logits_max_diff"] < 2e-5, r


def megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The Megatron module state (TP 1, local spec) of a transformers Llama: the inverse of
    ``support.megatron_ckpt.hf_reference``, by plain tensor operations."""
    sd = model.state_dict()
    nh, ng, hd = 4, 2, 16
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"], "output_layer.weight": sd["lm_head.weight"]}
    for i in range(2):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[h + "self_attn.q_proj.weight"].view(ng, nh // ng * hd, -1)
        k = sd[h + "self_attn.k_proj.weight"].view(ng, hd, -1)
        v = sd[h + "self_attn.v_proj.weight"].view(ng, hd, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    return {k: v.contiguous() for k, v in out.items()}
