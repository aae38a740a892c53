"""The adapter registry (``sdadapt.get_adapter`` / ``list_adapters``) and ``sdadapt adapters``.

Most cases point the registry at ``tests/support/fake_adapters`` (a throwaway package) so that they do
not depend on the shipped adapters; the last ones check the shipped package's contract.
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch
from support.checkpoints import DictIO

import sdadapt
from sdadapt._plan import registry as registry
from sdadapt._plan.plan import build_plan
from sdadapt.cli import main
from sdadapt.errors import AdapterError


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(registry, "PACKAGE", "support.fake_adapters")


def test_list_adapters(fake):
    rows = dict(sdadapt.list_adapters())
    assert sorted(rows) == ["broken", "notanadapter", "tiny"]
    assert rows["tiny"] == "tiny test adapter: model.{i}.q -> {i}.wq (rotary)"
    assert rows["broken"].startswith("(unavailable:") and "sdadapt_no_such_dependency" in rows["broken"]
    assert "not an adapter" in rows["notanadapter"]


def test_get_adapter_with_options(fake):
    a = sdadapt.get_adapter("tiny", heads=2, dim=8)
    assert [r.kind for r in a.rules] == ["rename", "rotary"] and a.rules[1].heads == 2
    assert [r.kind for r in sdadapt.get_adapter("tiny", heads=2, dim=8, tied=True).rules][-1] == "tie"
    # the adapter works: rows of each head reordered, key renamed
    w = torch.arange(8.0).reshape(8, 1)
    io = DictIO({"model.0.q": w})
    plan = build_plan(io.schema(), io.schema() | {"0.wq": io.schema()["model.0.q"]}, a)
    assert torch.equal(plan.recipes["0.wq"].full(io).flatten(), torch.tensor([0.0, 2, 1, 3, 4, 6, 5, 7]))


def test_options_from_config_folder_and_file(fake, tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 16, "vocab_size": 9}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    for source in (tmp_path, tmp_path / "model.safetensors", str(tmp_path)):
        a = sdadapt.get_adapter("tiny", source)
        assert a.rules[1].heads == 4
    # explicit options override the config, with a warning naming both values
    with caplog.at_level(logging.WARNING, logger="sdadapt._plan.registry"):
        a = sdadapt.get_adapter("tiny", tmp_path, heads=8)
    assert a.rules[1].heads == 8
    assert "heads=8 overrides 4" in caplog.text
    # a source that does not exist gives no config: the options must then be explicit
    with pytest.raises(AdapterError, match="needs option 'heads', 'dim'"):
        sdadapt.get_adapter("tiny", tmp_path / "nope")


def test_missing_unknown_and_inconsistent_options(fake, tmp_path):
    with pytest.raises(AdapterError, match=r"needs option 'dim' and no checkpoint folder was given.*dim=\.\.\."):
        sdadapt.get_adapter("tiny", heads=2)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 3, "hidden_size": 16}))
    with pytest.raises(AdapterError, match="dim=16 does not divide by heads=3"):
        sdadapt.get_adapter("tiny", tmp_path)
    with pytest.raises(AdapterError, match="has no option 'hedas'; its options: heads, dim, tied"):
        sdadapt.get_adapter("tiny", heads=2, dim=4, hedas=2)
    with pytest.raises(AdapterError, match="invalid adapter rule 'rotary'"):
        sdadapt.get_adapter("tiny", heads=-1, dim=2)
    with pytest.raises(AdapterError, match=r"cannot be built with heads=0, dim=0, tied=False: ZeroDivisionError"):
        sdadapt.get_adapter("tiny", heads=0, dim=0, tied=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="cannot read options from the config in"):
        sdadapt.get_adapter("tiny", tmp_path)


def test_unknown_and_bad_names(fake):
    with pytest.raises(AdapterError, match="no adapter named 'llama2'; shipped adapters: broken, notanadapter, tiny"):
        sdadapt.get_adapter("llama2")
    with pytest.raises(AdapterError, match=r"no adapter named '\.\./x'; shipped adapters"):
        sdadapt.get_adapter("../x")
    with pytest.raises(AdapterError, match="needs the package 'sdadapt_no_such_dependency'"):
        sdadapt.get_adapter("broken")
    with pytest.raises(AdapterError, match="is not an adapter"):
        sdadapt.get_adapter("notanadapter")


def test_cli_adapters(fake, capsys):
    assert main(["adapters"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("tiny ") and out[2].endswith("(rotary)")
    assert main(["adapters", "tiny"]) == 0
    text = capsys.readouterr().out
    assert "heads  required" in text and "tied   default False" in text and "config files" in text
    assert main(["adapters", "nope"]) == 2
    assert "no adapter named 'nope'" in capsys.readouterr().err


def test_shipped_adapters_follow_the_contract():
    """Whatever ships in sdadapt.adapters: importable, a one-line SUMMARY, build() with keyword options."""
    rows = sdadapt.list_adapters()
    assert [n for n, _ in rows] == registry.adapter_names()
    for name, summary in rows:
        assert summary and "\n" not in summary and not summary.startswith("(unavailable"), (name, summary)
        mod = registry.adapter_module(name)
        params = inspect.signature(mod.build).parameters.values()
        assert all(p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_KEYWORD) for p in params), name


def test_aliases_and_other_spellings_name_the_shipped_adapter():
    """torchtitan calls the Llama family ``llama3``; releases say ``Llama-3.1``, ``Qwen-3``, ``DeepSeek-V3``."""
    for given, name in (("llama", "llama"), ("llama3", "llama"), ("Llama-3.1", "llama"), ("llama_2", "llama"),
                        ("Qwen-3", "qwen3"), ("qwen3-moe", "qwen3_moe"), ("DeepSeek-V3", "deepseek_v3"),
                        ("deepseek-r1", "deepseek_v3"), ("GPT-OSS", "gpt_oss")):
        assert registry.canonical_name(given) == name, given
        assert registry.is_shipped(given)
    assert registry.canonical_name("lama") is None and not registry.is_shipped("llama4")
    alias = sdadapt.get_adapter("llama3", n_heads=4, n_kv_heads=2, dim=32)
    assert alias == sdadapt.get_adapter("llama", n_heads=4, n_kv_heads=2, dim=32)


def test_unknown_name_says_did_you_mean_in_the_callers_spelling(capsys):
    with pytest.raises(AdapterError) as e:
        sdadapt.get_adapter("lama")
    text = str(e.value)
    assert "no adapter named 'lama'; did you mean 'llama'" in text
    # Python's spelling for a Python caller: no command-line option
    assert "adapter='my_adapters.py:ADAPTER'" in text and "--adapter" not in text
    with pytest.raises(AdapterError, match="did you mean 'deepseek_v3'"):
        sdadapt.get_adapter("deepseek")
    # the command line prints its own option
    assert main(["adapters", "lama"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'llama'" in err and "--adapter my_adapters.py:ADAPTER" in err and "adapter='" not in err


def test_every_engine_adapter_follows_the_engine_layout_protocol():
    """Each shipped ``vllm_*`` module is a :class:`~sdadapt._plan.registry.EngineAdapter`: ``build``,
    ``layout`` and ``parameter_shapes``; its layout places a rank's shard in the whole tensor."""
    import importlib

    engines = [n for n in registry.adapter_names() if n.startswith("vllm_")]
    assert {"vllm_llama", "vllm_qwen3_moe", "vllm_fp8", "vllm_deepseek_v3"} <= set(engines)
    for name in engines:
        module = importlib.import_module(f"sdadapt.adapters.{name}")
        assert isinstance(module, registry.EngineAdapter), name
    vllm_llama = importlib.import_module("sdadapt.adapters.vllm_llama")
    shapes = vllm_llama.parameter_shapes(n_layers=1, vocab_size=100, dim=32, n_heads=4, n_kv_heads=2, hidden_dim=48, tp=2)
    key = "model.layers.0.mlp.down_proj.weight"
    layout: registry.EngineLayout = vllm_llama.layout(tp=2, rank=1)
    assert layout(key, torch.zeros(shapes[key])) == ((32, 48), ((0, 32), (24, 48)))
