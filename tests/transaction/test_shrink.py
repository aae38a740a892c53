"""sdadapt shrink: a sharded tiny Llama (and an FP8-style quantized checkpoint) cut to its first layers."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.checkpoints import write_hf_sharded

from sdadapt._tools.shrinking import layer_index, shrink, shrink_config
from sdadapt.cli import main
from sdadapt.errors import ShrinkError


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(str(folder / name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False,
                      layer_types=["full_attention"] * 4)  # fmt: skip
    path = tmp_path_factory.mktemp("shrink") / "llama"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="30KB")
    (path / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    assert (path / "model.safetensors.index.json").is_file()
    return path


def test_shrink_sharded_llama(hf_llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "small"
    rep = shrink(hf_llama, dst, 2, max_shard_size="20KB")
    src_t, dst_t = _tensors(hf_llama), _tensors(dst)
    want = sorted(k for k in src_t if layer_index(k) is None or layer_index(k) < 2)
    assert sorted(dst_t) == want
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(dst_t)
    assert not any(k.startswith("model.layers.2.") or k.startswith("model.layers.3.") for k in dst_t)
    for k in want:  # as stored: same dtype, shape and bytes
        assert dst_t[k].dtype == src_t[k].dtype == torch.bfloat16 and _raw(dst_t[k]) == _raw(src_t[k]), k
    assert rep.layers_before == 4 and rep.tensors == len(want) and rep.tensors_dropped == len(src_t) - len(want)

    cfg = json.loads((dst / "config.json").read_text())
    src_cfg = json.loads((hf_llama / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in src_cfg.items() if k not in ("num_hidden_layers", "layer_types")
    }
    assert (dst / "tokenizer_config.json").read_text() == '{"model_max_length": 16}'
    assert (dst / "generation_config.json").is_file()

    # the index is rewritten: it names exactly the kept keys, each in a file that holds it
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == want
    for key, fname in index["weight_map"].items():
        with safe_open(str(dst / fname), framework="pt") as f:
            assert key in f.keys()  # noqa: SIM118
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in dst_t.values())

    # the result is itself a checkpoint sdadapt opens (and shrinks again)
    again = shrink(dst, tmp_path / "one", 1)
    assert again.layers_before == 2 and not any(layer_index(k) == 1 for k in _tensors(tmp_path / "one"))


def test_shrink_quantized_keeps_scales(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16)}
    for i in range(3):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = torch.randn(8, 8, generator=gen).to(torch.float8_e4m3fn)
        sd[p + "self_attn.q_proj.weight_scale_inv"] = torch.rand(1, 1, generator=gen)
        sd[p + "mlp.experts.gate_up_proj_blocks"] = torch.randint(0, 255, (2, 4, 1, 16), generator=gen, dtype=torch.uint8)
        sd[p + "mlp.experts.gate_up_proj_scales"] = torch.randint(0, 255, (2, 4, 1), generator=gen, dtype=torch.uint8)
    sd["model.norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    src = Path(write_hf_sharded(tmp_path / "q", sd, max_shard_bytes=200))
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config = {"num_hidden_layers": 3, "mlp_only_layers": [0, 2], "first_k_dense_replace": 3, "num_nextn_predict_layers": 1}
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    shrink(src, tmp_path / "q1", 1)
    got = _tensors(tmp_path / "q1")
    assert sorted(got) == sorted(k for k in sd if layer_index(k) in (None, 0))
    for k, t in got.items():
        assert t.dtype == sd[k].dtype and _raw(t) == _raw(sd[k]), k
    cfg = json.loads((tmp_path / "q1" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["mlp_only_layers"] == [0] and cfg["first_k_dense_replace"] == 1
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["quantization_config"]["quant_method"] == "fp8"


def test_shrink_errors(hf_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ShrinkError, match="the checkpoint has 4"):
        shrink(hf_llama, tmp_path / "x", 5)
    with pytest.raises(ShrinkError, match="no key matches"):
        shrink(hf_llama, tmp_path / "x", 1, pattern="blocks.{i}.")
    with pytest.raises(ShrinkError, match="exactly once"):
        shrink(hf_llama, tmp_path / "x", 1, pattern="layers.")
    assert not (tmp_path / "x").exists()
    # a pattern that would separate a weight from its scale is refused
    sd = {f"layers.{i}.{name}": torch.zeros(2) for i in range(2) for name in ("w", "w_scale_inv")}
    src = write_hf_sharded(tmp_path / "split", sd)
    with pytest.raises(ShrinkError, match="'layers.1.w' is kept but its companion 'layers.1.w_scale_inv'"):
        shrink(src, tmp_path / "y", 1, pattern="{i}.w_")


def test_shrink_config_nested() -> None:
    text = {"num_hidden_layers": 8, "layer_types": ["a", "b"] * 4}
    cfg = {"model_type": "x", "text_config": text, "vision_config": {"num_hidden_layers": 4}}
    out = shrink_config(cfg, 3)
    assert out["text_config"] == {"num_hidden_layers": 3, "layer_types": ["a", "b", "a"]}
    assert out["vision_config"] == {"num_hidden_layers": 4} and cfg["text_config"]["num_hidden_layers"] == 8


def test_cli_shrink(hf_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "cli"
    assert main(["shrink", str(hf_llama), str(dst), "--layers", "1", "--shard-size", "1GB"]) == 0
    out, err = capsys.readouterr()
    assert "1 of 4 layers" in out and err == ""  # no progress bar when stderr is not a terminal
    assert (dst / "model.safetensors").is_file() and not (dst / "model.safetensors.index.json").exists()
    assert main(["shrink", str(hf_llama), str(dst), "--layers", "1"]) == 2  # exists
    assert "exists" in capsys.readouterr().err
    assert main(["shrink", str(hf_llama), str(dst), "--layers", "9", "--overwrite"]) == 2
    assert "cannot keep 9 layers" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_with_logging_on(hf_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    shrink(hf_llama, tmp_path / "a", 1)
    assert "shrink" in term.getvalue() and "B/s" in term.getvalue()  # tqdm's bar
    term2 = _Terminal()
    monkeypatch.setattr(sys, "stderr", term2)
    shrink(hf_llama, tmp_path / "b", 1, progress=False)
    logging.disable(logging.CRITICAL)
    try:
        shrink(hf_llama, tmp_path / "c", 1)
    finally:
        logging.disable(logging.NOTSET)
    assert term2.getvalue() == ""
