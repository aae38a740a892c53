"""LoRA merge on load on a 2x2 (fsdp, tp) gloo mesh, against peft's ``merge_and_unload``.

A tiny transformers Llama and a peft LoRA of it (``r=4, lora_alpha=8`` on q/k/v/o/gate, random
``B``) are saved with ``save_pretrained``; the reference is the logits of peft's merged model.
sdadapt loads the base checkpoint and the LoRA folder into Meta's layout
(``tests/support/reference_models.py``, meta device, TP + FSDP2) through the shipped ``llama`` adapter:

- split q/k/v (the merge, then the rotary row order of wq/wk);
- fused ``wqkv`` / ``w13`` with rsLoRA: the q/k/v and gate LoRAs merge in the checkpoint's key
  space, then the adapter fuses and interleaves the merged values per TP rank.

Every rank's logits must equal peft's within float32 tolerance, and each rank must read only its
own rows of ``B`` and columns of ``A``: for weights that reach the model with no row permutation
(``wv``, ``w1``, ``wo``), the rows of ``B`` a rank reads add up to its local rows and every read of
``A`` spans exactly its local columns. One 4-rank launch runs both cases.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from support.dist_helper import run_distributed
from support.lora_cases import LLAMA, TARGETS, llama, write_peft_case

import sdadapt

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("peft", reason="the test extra installs peft")

TOL = dict(rtol=1e-5, atol=2e-5)
# model key -> the LoRA module whose pair merges into it (layer 1)
UNPERMUTED = {
    "layers.1.attention.wv.weight": "model.layers.1.self_attn.v_proj",
    "layers.1.feed_forward.w1.weight": "model.layers.1.mlp.gate_proj",
    "layers.1.attention.wo.weight": "model.layers.1.self_attn.o_proj",
}


def _meta_spec(fused: bool) -> dict[str, Any]:
    cfg = transformers.LlamaConfig(**LLAMA)
    spec = dict(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size, hidden_dim=cfg.intermediate_size,
                norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_parameters["rope_theta"])  # fmt: skip
    return {**spec, "fused_qkv": True, "fused_w13": True} if fused else spec


def _write_cases(root: str) -> list[dict[str, Any]]:
    cases = []
    for name, fused, lora in (
        ("split", False, dict(r=4, lora_alpha=8, target_modules=TARGETS)),
        ("fused_rslora", True, dict(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True)),
    ):
        folder = os.path.join(root, name)
        case = write_peft_case(folder, llama(20 + fused), 20 + fused, **lora)
        options = dict(fused_qkv=True, fused_w13=True) if fused else {}
        cases.append(dict(name=name, base=case["base"], lora=case["lora"], tokens=case["tokens"],
                          logits=case["logits"], spec=_meta_spec(fused), options=options))  # fmt: skip
    return cases


def _run(root: str) -> dict[str, dict[str, Any]]:
    """Worker on 4 ranks: each case loaded on a 2x2 (fsdp, tp) mesh; returns the logits error,
    the local shapes of the unpermuted weights and every region of A/B this rank read."""
    from support.reference_models import MetaLlama, parallelize_meta_llama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from sdadapt.rules._lora import LORA_NAMESPACE
    from sdadapt.sources._joined import JoinedSource

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    reads: list[tuple[str, Any]] = []
    read = JoinedSource.read

    def spy(self: JoinedSource, key: str, box: Any) -> torch.Tensor:
        if key.startswith(LORA_NAMESPACE):
            reads.append((key[len(LORA_NAMESPACE) :], box))  # list.append: safe from the engine's threads
        return read(self, key, box)

    JoinedSource.read = spy  # type: ignore[method-assign]
    out: dict[str, dict[str, Any]] = {}
    try:
        for case in torch.load(os.path.join(root, "cases.pt"), weights_only=False):
            reads.clear()
            with torch.device("meta"):
                model = MetaLlama(case["spec"])
            model = parallelize_meta_llama(model.eval(), mesh)
            adapter = sdadapt.get_adapter("llama", source=case["base"], **case["options"])
            rep = sdadapt.load(model, case["base"], adapter, lora=case["lora"])
            with torch.no_grad():
                logits = model(case["tokens"])
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            params = dict(model.named_parameters())
            local = {k: tuple(params[k].to_local().shape) for k in UNPERMUTED if k in params}
            out[case["name"]] = dict(err=(logits.float() - case["logits"]).abs().max().item(),
                                     close=torch.allclose(logits.float(), case["logits"], **TOL),
                                     ok=rep.report.ok, reads=list(reads), local=local)  # fmt: skip
    finally:
        JoinedSource.read = read  # type: ignore[method-assign]
    return out


def test_lora_merge_on_2x2_mesh_matches_peft(tmp_path: Any) -> None:
    root = str(tmp_path)
    torch.save(_write_cases(root), os.path.join(root, "cases.pt"))
    results = run_distributed(_run, 4, root, timeout=300)
    r = 4
    for rank, res in enumerate(results):
        for name, got in res.items():
            where = f"{name}, rank {rank}"
            assert got["ok"], where
            assert got["close"], f"{where}: logits differ from peft's merge_and_unload by {got['err']:.3g}"
            assert got["reads"], f"{where}: no LoRA region was read"
            for key, module in UNPERMUTED.items():
                if key not in got["local"]:
                    continue  # fused in this case
                rows, cols = got["local"][key]
                b = [box for k, box in got["reads"] if k == f"base_model.model.{module}.lora_B.weight"]
                a = [box for k, box in got["reads"] if k == f"base_model.model.{module}.lora_A.weight"]
                assert b and len(a) == len(b), (where, key, a, b)
                assert sum(hi - lo for (lo, hi), _ in b) == rows, (where, key, b, rows)
                assert all(box[1] == (0, r) for box in b) and all(box[0] == (0, r) for box in a), (where, key)
                assert all(hi - lo == cols for _, (lo, hi) in a), (where, key, a, cols)
        assert set(res) == {"split", "fused_rslora"}
    # the ranks' shards of wo differ: between them they read every row of B, each rank only its own
    wo_b = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    spans = {tuple(box[0] for k, box in res["split"]["reads"] if k == wo_b) for res in results}
    assert len(spans) == 2, spans  # two row halves (fsdp), each read by both tp ranks
