"""Megatron-Core's own checkpoints for the tests, and the reference that turns Megatron's state into HF tensors.

:func:`megatron_checkpoints` makes the megatron venv (``scripts/megatron_venv.py``) and runs
``megatron_fixtures.py`` there once per :data:`FIXTURES_VERSION` (cached beside the venv, under
``${TMPDIR:-/tmp}/sdadapt-compat``; once cached, the venv is not needed); the tests skip, saying why, only where megatron-core cannot be
installed. :func:`hf_reference` is an independent reading of Megatron's layout: its module state dict
(``model.state_dict()``, per-layer keys, TP 1) written out with HF names by plain tensor slicing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from support.venv_needed import venv_missing

ROOT = Path(__file__).resolve().parents[2]
FIXTURES_SCRIPT = Path(__file__).with_name("megatron_fixtures.py")
BRIDGE_SCRIPT = Path(__file__).with_name("megatron_bridge.py")
NAMES = ("dense", "dense_tp2", "moe_sequential", "moe_grouped")
FIXTURES_VERSION = 1
"""Bumped whenever megatron_fixtures.py writes other checkpoints or oracles: the cached ones are then
written again (its load-checking half may change without that)."""
SPEC = {"n_heads": 4, "n_groups": 2, "head_dim": 16}


@functools.cache
def megatron_python(bridge: bool = False) -> str:
    """The megatron venv's python (``bridge``: the Megatron-Bridge venv's), made or checked once per
    test process (the check imports megatron-core there: seconds of CPU). Where it cannot be made:
    a failure in CI (``CI`` set), where the registry is reachable and a broken venv must not pass as
    a skip; elsewhere a skip quoting pip (an offline machine, a Python that megatron-core 0.16.1 does
    not support)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "megatron_venv.py"), *(["--bridge"] if bridge else [])]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        which = "Megatron-Bridge" if bridge else "megatron-core"
        venv_missing("scripts/megatron_venv.py" + (" --bridge" if bridge else ""), which, p.stderr.strip()[-600:])
    return p.stdout.strip().splitlines()[-1]


def megatron_checkpoints() -> str:
    """The folder holding each fixture ``NAME/`` (written by Megatron-Core) and ``NAME.oracle.pt``.
    Cached fixtures are read without making or checking the venv (the check imports megatron-core
    there: seconds of CPU, and reading them needs no megatron-core)."""
    where = subprocess.run([sys.executable, str(ROOT / "scripts" / "megatron_venv.py"), "--path"], capture_output=True, text=True)
    folder = os.path.join(os.path.dirname(os.path.dirname(where.stdout.strip())), f"fixtures-v{FIXTURES_VERSION}")
    if where.returncode == 0 and all(os.path.isfile(os.path.join(folder, f"{n}.oracle.pt")) for n in NAMES):
        return folder
    py = megatron_python()
    folder = os.path.join(os.path.dirname(os.path.dirname(py)), f"fixtures-v{FIXTURES_VERSION}")
    if all(os.path.isfile(os.path.join(folder, f"{n}.oracle.pt")) for n in NAMES):
        return folder
    work = tempfile.mkdtemp(prefix="fixtures-", dir=os.path.dirname(folder))
    p = subprocess.run([py, str(FIXTURES_SCRIPT), work], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"Megatron-Core could not write the fixtures:\n{p.stderr[-4000:]}")
    try:
        os.rename(work, folder)
    except OSError:  # another process made it first
        shutil.rmtree(work, ignore_errors=True)
    return folder


def oracle(folder: str, name: str) -> dict[str, Any]:
    return torch.load(os.path.join(folder, f"{name}.oracle.pt"), weights_only=False)


def hf_reference(state: dict[str, torch.Tensor], experts_to: str = "per_expert") -> dict[str, torch.Tensor]:
    """Megatron's module state (TP 1) with HF names: QKV rows cut per query group, fc1 halves,
    the norms, router, expert bias and experts (SequentialMLP's ``local_experts`` or GroupedMLP's
    ``weight1`` / ``weight2``)."""
    nh, ng, hd = SPEC["n_heads"], SPEC["n_groups"], SPEC["head_dim"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.")})
    for i in layers:
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"]
        groups = qkv.view(ng, (nh // ng + 2) * hd, -1)
        q_rows = nh // ng * hd
        out[h + "self_attn.q_proj.weight"] = groups[:, :q_rows].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.k_proj.weight"] = groups[:, q_rows : q_rows + hd].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.v_proj.weight"] = groups[:, q_rows + hd :].reshape(-1, qkv.shape[-1])
        out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        for a, b in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if m + f"self_attention.{a}.weight" in state:
                out[h + f"self_attn.{b}.weight"] = state[m + f"self_attention.{a}.weight"]
        if m + "mlp.linear_fc1.weight" in state:
            gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, 0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
            continue
        out[h + "mlp.gate.weight"] = state[m + "mlp.router.weight"]
        if m + "mlp.router.expert_bias" in state:
            out[h + "mlp.gate.e_score_correction_bias"] = state[m + "mlp.router.expert_bias"]
        if m + "mlp.experts.weight1" in state:  # GroupedMLP: [H, E * 2F] and [E * F, H], experts side by side
            n = state[m + "mlp.router.weight"].shape[0]
            hidden = state[m + "mlp.experts.weight1"].shape[0]
            fc1 = state[m + "mlp.experts.weight1"].view(n, hidden, -1).transpose(1, 2)
            fc2 = state[m + "mlp.experts.weight2"].view(n, -1, hidden).transpose(1, 2)
        else:
            n = state[m + "mlp.router.weight"].shape[0]
            fc1 = torch.stack([state[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(n)])
            fc2 = torch.stack([state[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(n)])
        if experts_to == "stacked":
            out[h + "mlp.experts.gate_up_proj"], out[h + "mlp.experts.down_proj"] = fc1, fc2
            continue
        for e in range(n):
            gate, up = fc1[e].chunk(2, 0)
            out[h + f"mlp.experts.{e}.gate_proj.weight"], out[h + f"mlp.experts.{e}.up_proj.weight"] = gate, up
            out[h + f"mlp.experts.{e}.down_proj.weight"] = fc2[e]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(name: str) -> Any:
    """The transformers config of the family each fixture is shaped like."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000, max_position_embeddings=64)
    if name == "dense":
        return LlamaConfig(**common, tie_word_embeddings=False, attention_bias=False)
    if name == "dense_tp2":
        return Qwen3Config(**common, tie_word_embeddings=True)
    return Qwen3MoeConfig(**common, tie_word_embeddings=False, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def hf_model(name: str, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(name)).eval()


def dense_model() -> Any:
    """The transformers Llama the ``dense`` fixture is shaped like, on the meta device (a CLI ``--target``)."""
    return hf_model("dense", "meta")


def titan_dense() -> Any:
    """torchtitan's own Llama3 model of the ``dense`` fixture's sizes, on the meta device (flex
    attention, run exactly on CPU as ``support.titan_models`` sets it up)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    import support.titan_models  # noqa: F401 - flex attention exact on this CPU

    layers = _build_llama3_layers(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=16, max_seq_len=64, theta=10000.0))  # fmt: skip
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = 1e-6
    config = Llama3Model.Config(dim=64, vocab_size=256, tok_embeddings=Embedding.Config(num_embeddings=256, embedding_dim=64),
                                norm=RMSNorm.Config(normalized_shape=64, eps=1e-6),
                                lm_head=Linear.Config(in_features=64, out_features=256), layers=layers)  # fmt: skip
    with torch.device("meta"):
        return config.build()
