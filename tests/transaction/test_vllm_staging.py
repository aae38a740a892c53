"""sdadapt.vllm without vLLM: the shared-memory staging both sides map, and the trainer side's
errors before anything moves (the live engine: tests/transaction/test_vllm_live.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from sdadapt.adapters import vllm_llama

import sdadapt.vllm
from sdadapt._refit import vllm_staging
from sdadapt.errors import RefitError

SHAPE = dict(n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48)


def test_staging_is_shared_between_the_two_sides(tmp_path) -> None:
    """What the trainer writes into its mapping, the engine's mapping of the same file reads."""
    params = [("a.weight", torch.bfloat16, (3, 5)), ("b.bias", torch.float32, (7,)), ("c.w", torch.float8_e4m3fn, (2, 2))]
    manifest = vllm_staging.layout_params(1, 2, params)
    assert all(offset % vllm_staging.ALIGN == 0 for *_, offset in manifest.params)
    engine = vllm_staging.create(str(tmp_path), manifest)
    got, trainer = vllm_staging.read(str(tmp_path), 1)
    assert got == manifest and {k: (v.dtype, tuple(v.shape)) for k, v in trainer.items()} == {n: (d, s) for n, d, s in params}
    trainer["a.weight"].copy_(torch.arange(15.0).reshape(3, 5))
    trainer["b.bias"].fill_(2.5)
    assert torch.equal(engine["a.weight"], torch.arange(15.0, dtype=torch.bfloat16).reshape(3, 5))
    assert torch.equal(engine["b.bias"], torch.full((7,), 2.5))
    vllm_staging.remove(str(tmp_path), 1)
    with pytest.raises(RefitError, match="did not lay out its staging"):
        vllm_staging.read(str(tmp_path), 1)


class _Engine:
    """Stands in for vLLM's LLM on the trainer side: lays out a TP-1 Llama's raw parameters where
    asked, as the worker does, and records the calls."""

    def __init__(self, n_kv_heads: int = 2) -> None:
        self.calls: list[str] = []
        self.sizes = vllm_llama.parameter_shapes(n_layers=1, vocab_size=100, dim=32, **(SHAPE | {"n_kv_heads": n_kv_heads}))
        self.llm_engine = object()  # vLLM's LLM takes requests: {"init_info": ...}

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append("init")
        params = [(k, torch.bfloat16, s) for k, s in self.sizes.items()]
        self.staged = vllm_staging.create(request["init_info"]["staging"], vllm_staging.layout_params(0, 1, params))

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, request: dict) -> None:
        self.calls.append(f"update {request['update_info']['names']}")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(100, 32, generator=g), "model.norm.weight": torch.randn(32, generator=g),
          "lm_head.weight": torch.randn(100, 32, generator=g)}  # fmt: skip
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (32, 32)), ("self_attn.k_proj", (16, 32)), ("self_attn.v_proj", (16, 32)),
                        ("self_attn.o_proj", (32, 32)), ("mlp.gate_proj", (48, 32)), ("mlp.up_proj", (48, 32)),
                        ("mlp.down_proj", (32, 48)), ("input_layernorm", (32,)), ("post_attention_layernorm", (32,))):  # fmt: skip
        sd[p + name + ".weight"] = torch.randn(*shape, generator=g)
    return sd


def test_connect_moves_into_the_staging_then_drives_the_engine(tmp_path) -> None:
    engine, trainer = _Engine(), _trainer()
    refit = sdadapt.vllm.connect(trainer, engine, vllm_llama.build(**SHAPE), vllm_llama.layout, staging=str(tmp_path), delta=True)
    assert engine.calls == ["init"] and refit.tp == 1
    refit()
    qkv = torch.cat([trainer[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]).bfloat16()
    assert torch.equal(engine.staged["model.layers.0.self_attn.qkv_proj.weight"], qkv)
    assert engine.calls[1:] == ["start", f"update {sorted(engine.sizes)}", "finish"]
    trainer["model.norm.weight"].mul_(2.0)
    refit()
    assert engine.calls[4:] == ["start", "update ['model.norm.weight']", "finish"]
    refit()  # nothing changed: the engine is not called
    assert len(engine.calls) == 7


def test_connect_refuses_before_anything_moves(tmp_path) -> None:
    """A wrong adapter (another KV head count), and no engine to drive: our error, the staging untouched."""
    engine = _Engine()
    with pytest.raises(RefitError, match="do not line up"):
        sdadapt.vllm.connect(_trainer(), engine, vllm_llama.build(**(SHAPE | {"n_kv_heads": 4})), vllm_llama.layout, staging=str(tmp_path))
    assert engine.calls == ["init"] and all(bool((t == 0).all()) for t in engine.staged.values())
    with pytest.raises(RefitError, match="pass client="):
        sdadapt.vllm.connect(_trainer(), None, vllm_llama.build(**SHAPE), vllm_llama.layout, staging=str(tmp_path))
    sdadapt.vllm.register()  # without vLLM installed: nothing to register, no error


def test_a_staging_folder_the_engine_refused_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """connect() makes the shared-memory folder for the engine (its shutdown removes it); where the
    engine refuses to set up there, connect() removes it again."""
    made: list[str] = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real(*a, **k)) or made[-1])

    class Refuses(_Engine):
        def init_weight_transfer_engine(self, request: dict) -> None:
            super().init_weight_transfer_engine(request)  # its files made, then a failure
            raise RuntimeError("no sdadapt backend here")

    with pytest.raises(RefitError, match="did not set up the sdadapt staging"):
        sdadapt.vllm.connect(_trainer(), Refuses(), vllm_llama.build(**SHAPE), vllm_llama.layout)
    assert len(made) == 1 and "sdadapt-vllm-" in made[0] and not os.path.exists(made[0]), made
