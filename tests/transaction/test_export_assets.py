"""Adapter names without a checkpoint, and the side files of what export / convert write.

A shipped adapter's name in ``export_iter`` / ``export`` / ``save_state`` takes its options from
the checkpoint folder the model was loaded from (``sdadapt.load`` records it), else from the
model's own config (torchtitan's model config: tests/adapters/test_torchtitan_real.py builds those;
here a transformers-style ``config``), else the error says exactly what to pass. ``export`` and
``convert`` write ``config.json`` and copy the tokenizer and generation files, so that the result
opens in transformers (logits equal) and with ``--adapter llama``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import sdadapt
from sdadapt._plan.resolve import adapter_or_none

DIM, L, H, KV, FFN, VOCAB = 32, 2, 4, 2, 64, 96
SIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tokenizer(path: str) -> None:
    """A tiny word-level tokenizer saved as transformers saves one (offline: no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    path = str(tmp_path_factory.mktemp("assets") / "hf_llama")
    model.save_pretrained(path)
    _tokenizer(path)
    # files of many releases that transformers 5 no longer writes itself: copied as they are
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(b"\x00sentencepiece stand-in bytes")
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        f.write('{"eos_token": "</s>", "unk_token": "<unk>"}\n')
    return path, model


def _meta_llama() -> torch.nn.Module:
    from support.reference_models import MetaLlama

    return MetaLlama(dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN, norm_eps=1e-6,
                          rope_theta=10000.0))  # fmt: skip


def _logits_equal(folder: str, reference: Any) -> None:
    from transformers import AutoModelForCausalLM

    reopened = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reopened(tokens).logits, reference(tokens).logits)


def test_export_by_name_after_load_opens_in_transformers(hf_llama: tuple[str, Any], tmp_path: Any) -> None:
    path, hf = hf_llama
    model = _meta_llama()
    sdadapt.load(model, path, "llama")
    names = [k for k, _ in sdadapt.export_iter(model, "llama")]  # options from the folder it was loaded from
    assert sorted(names) == sorted(hf.state_dict())
    out = str(tmp_path / "exported")
    sdadapt.export(model, out, "llama")
    for name in (*SIDE, "tokenizer.model"):
        with open(os.path.join(path, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), f"{name} is not the checkpoint's"
    _logits_equal(out, hf)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("w1 w5").input_ids == [1, 5]
    # and with --adapter llama: its options come from the copied config.json
    again = _meta_llama()
    sdadapt.load(again, out, "llama")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_export_with_assets_and_save_state_by_name(hf_llama: tuple[str, Any], tmp_path: Any) -> None:
    path, hf = hf_llama
    model = _meta_llama()
    sdadapt.load(model, path, sdadapt.get_adapter("llama", source=path))
    fresh = _meta_llama()  # never loaded: the folder comes from assets=
    fresh.load_state_dict(model.state_dict())
    out = str(tmp_path / "with_assets")
    sdadapt.export(fresh, out, "llama", assets=path)
    assert all(os.path.isfile(os.path.join(out, n)) for n in SIDE)
    _logits_equal(out, hf)
    sdadapt.save_state(model, str(tmp_path / "state"), adapter="llama")  # the name resolves from the load's folder


def test_a_name_without_any_source_says_what_to_pass() -> None:
    with pytest.raises(sdadapt.errors.AdapterError) as e:
        list(sdadapt.export_iter(_meta_llama(), "llama"))
    msg = str(e.value)
    assert "n_heads" in msg and "sdadapt.get_adapter('llama', n_heads=...)" in msg and "source=" in msg


def test_options_from_a_models_own_config() -> None:
    """A model with a transformers-style ``config`` (``to_dict()`` with HF keys) gives the options."""

    class Config:
        model_type = "llama"

        def to_dict(self) -> dict[str, Any]:
            return {"num_attention_heads": H, "num_key_value_heads": KV, "hidden_size": DIM, "tie_word_embeddings": True}

    model = _meta_llama()
    model.config = Config()  # type: ignore[assignment]
    adapter = adapter_or_none("llama", None, model)
    assert adapter is not None and f"n_heads={H}, n_kv_heads={KV}" in adapter.description
    assert any(getattr(r, "dst", None) == "output.weight" and r.kind == "tie" for r in adapter.rules)


def test_convert_copies_the_side_files(hf_llama: tuple[str, Any], tmp_path: Any) -> None:
    path, hf = hf_llama
    meta = str(tmp_path / "meta")
    sdadapt.convert(path, meta, "llama")  # HF -> our layout: the folder keeps config and tokenizer
    assert all(os.path.isfile(os.path.join(meta, n)) for n in SIDE)
    back = str(tmp_path / "back")
    sdadapt.convert(meta, back, sdadapt.get_adapter("llama", source=path).inverse(), read_back=True)
    _logits_equal(back, hf)


def test_shrink_keeps_the_side_files_and_opens_in_transformers(hf_llama: tuple[str, Any], tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = hf_llama
    out = str(tmp_path / "one_layer")
    sdadapt.shrink(path, out, layers=1)
    for name in SIDE[1:]:
        with open(os.path.join(path, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), f"{name} is not the checkpoint's"
    # the first layer of the original, as transformers itself builds it from the full checkpoint
    _logits_equal(out, AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1).eval())
