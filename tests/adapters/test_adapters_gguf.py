"""GGUF Llama / Qwen2 / Qwen3 files into transformers models with no adapter, and into our
layout with the shipped ``gguf`` adapter: bit-equal to transformers' own GGUF loading, logits equal."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from support.gguf_files import LISTED  # noqa: E402
from support.gguf_models import HEADS, KV_HEADS, empty_like, oracle_model, types_in, write_family  # noqa: E402

import sdadapt  # noqa: E402
from sdadapt.errors import AdapterError  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf-families")
    return {f: write_family(str(root / f), f) for f in FAMILIES}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gguf_file_loads_into_a_transformers_model_with_no_adapter(files: dict[str, str], family: str, dtype: torch.dtype) -> None:
    path = files[family]
    assert set(LISTED) <= types_in(path) | {"BF16"}
    oracle = oracle_model(path, dtype)
    model = empty_like(oracle, dtype)  # on the meta device: the load materialises it (rotary buffers too)
    rep = sdadapt.load(model, path, device="cpu")
    assert rep.report.ok
    want, got = oracle.state_dict(), model.state_dict()
    assert set(want) == set(got)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(_bits(got[k]), _bits(want[k]))]
    assert bad == []
    # transformers may keep a GGUF model's weights packed and compute in float32: the logits'
    # reference is a plain model of the class holding the oracle's weights
    plain = type(oracle)(oracle.config).to(dtype).eval()
    plain.load_state_dict(want)
    model.eval()
    tokens = torch.arange(12).reshape(1, 12) % 90
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, plain(tokens).logits)


def test_the_shipped_adapter_reads_its_options_from_the_file(files: dict[str, str]) -> None:
    adapter = sdadapt.get_adapter("gguf", files["llama"])
    assert f"n_heads={HEADS}, n_kv_heads={KV_HEADS}" in adapter.description
    assert any(r.kind == "rotary" for r in adapter.rules)
    assert not any(r.kind == "rotary" for r in sdadapt.get_adapter("gguf", files["qwen3"]).rules)
    with pytest.raises(AdapterError, match="maps the families llama, qwen2, qwen3"):
        sdadapt.get_adapter("gguf", arch="gpt2")


def test_llama_into_our_layout_equals_the_llama_adapter_on_transformers_checkpoint(files: dict[str, str], tmp_path: str) -> None:
    """Our layout holds Meta's rotary pairs (llama.cpp's rows as stored): loading the GGUF file
    with ``to="native"`` equals loading the oracle model's own HF checkpoint with ``llama``."""
    from support.gguf_models import FFN, HIDDEN, LAYERS, VOCAB, config
    from support.reference_models import MetaLlama

    path = files["llama"]
    oracle = oracle_model(path, torch.float32)
    plain = type(oracle)(config("llama"))  # a GGUF-loaded model refuses save_pretrained: its weights, plainly held
    plain.load_state_dict(oracle.state_dict())
    hf_dir = os.path.join(tmp_path, "hf")
    plain.save_pretrained(hf_dir)
    cfg = {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "vocab_size": VOCAB,
           "hidden_dim": FFN, "norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip
    ours, theirs = MetaLlama(cfg), MetaLlama(cfg)
    native = sdadapt.get_adapter("gguf", path, to="native")
    assert not any(r.kind == "rotary" for r in native.rules)
    assert sdadapt.load(ours, path, native, dtype="model").report.ok
    assert sdadapt.load(theirs, hf_dir, "llama").report.ok
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_diff_inspect_and_draft_work_on_a_gguf_file(files: dict[str, str]) -> None:
    from support.gguf_models import config
    from transformers import LlamaForCausalLM

    from sdadapt.sources import embedded_config, inventory, open_source

    path = files["llama"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config("llama"))
    assert sdadapt.diff(model, path).ok
    cfg = embedded_config(path)
    assert cfg is not None and cfg["model_type"] == "llama" and cfg["num_attention_heads"] == HEADS
    assert cfg["num_key_value_heads"] == KV_HEADS and cfg["tie_word_embeddings"] is False
    with open_source(path) as src:
        assert "blk.{0..1}.attn_q.weight" in str(inventory(src.schema, source=path, kind=src.kind))
    text = str(sdadapt.draft(model, path))
    assert "model_type 'llama', 4 heads, 2 kv heads" in text
    assert "blocks blk.{i} ~ model.layers.{i}" in text and "21 of 21 model tensors have a counterpart" in text
