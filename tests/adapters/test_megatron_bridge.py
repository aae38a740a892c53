"""Megatron-Bridge, the second reference: its HF export of Megatron-Core's own checkpoints equals ours.

``support/megatron_bridge.py`` runs in the Megatron-Bridge venv (``scripts/megatron_venv.py
--bridge``): Megatron's ``dist_checkpointing.load`` of each fixture into a ``GPTModel``, then
Bridge's ``save_hf_weights``. ``sdadapt.convert(ckpt, dst, "megatron_gpt")`` must write the same
keys with the same bytes (a tied model: ours also writes ``lm_head.weight``, the embeddings). The
dense fixtures only: Megatron-Bridge 0.3.1 exports neither MoE layout
of the local layer spec (that module's docstring says why); the MoE fixtures are checked against
Megatron's own state in test_megatron.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import torch
from support.megatron_ckpt import BRIDGE_SCRIPT, hf_config, megatron_checkpoints, megatron_python

import sdadapt

NAMES = ("dense", "dense_tp2")


def _everything(folder: str) -> dict[str, torch.Tensor]:
    with sdadapt.sources.open_source(folder) as s:
        return {k: s.read(k, tuple((0, n) for n in info.shape)) for k, info in s.schema.items()}


def test_bridge_export_equals_ours(tmp_path: str) -> None:
    ckpts = megatron_checkpoints()
    py = megatron_python(bridge=True)
    jobs = []
    for name in NAMES:
        config = os.path.join(tmp_path, f"{name}-config")
        hf_config(name).save_pretrained(config)
        jobs.append({"ckpt": os.path.join(ckpts, name), "hf_config": config, "out": os.path.join(tmp_path, f"{name}-bridge"),
                     "result": os.path.join(tmp_path, f"{name}.json")})  # fmt: skip
    with open(os.path.join(tmp_path, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    p = subprocess.run([py, str(BRIDGE_SCRIPT), os.path.join(tmp_path, "jobs.json")], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    for name, job in zip(NAMES, jobs, strict=True):
        ours = os.path.join(tmp_path, f"{name}-ours")
        sdadapt.convert(job["ckpt"], ours, "megatron_gpt")
        theirs, mine = _everything(job["out"]), _everything(ours)
        if name == "dense_tp2":  # tied: Bridge leaves lm_head.weight out, as tied HF releases do; ours writes the tie
            assert torch.equal(mine.pop("lm_head.weight"), mine["model.embed_tokens.weight"])
        assert sorted(theirs) == sorted(mine), (name, sorted(set(theirs) ^ set(mine)))
        for key, value in theirs.items():
            assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), (name, key)
