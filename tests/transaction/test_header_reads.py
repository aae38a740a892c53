"""One source per call: a checkpoint's headers are read once per file per rank (once per job with
the headers broadcast), however the call gets its adapter.

Every header a source's opening reads is counted where it is parsed
(:func:`sdadapt.sources._safetensors_file.read_header` for each safetensors file,
:func:`sdadapt.sources._json.read_bytes` for the index, :func:`sdadapt.sources._dcp_dir.read_dcp_metadata`
for a DCP folder) and where it is read from disk (``_headers.note``). A load that resolves a
shipped adapter by name (its options read from the config and the key names), derives a
transformers model's adapter (``hf_adapter``) or dequantises a release described by its
``config.json`` opens the checkpoint once and hands the open source to each of those steps.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.dist_helper import run_distributed

import sdadapt
from sdadapt.sources import _dcp_dir, _headers, _json, _safetensors_file

pytest.importorskip("transformers", reason="the test extra installs transformers: the checkpoints' writer")

DIM, LAYERS, HEADS, KV, VOCAB, FFN = 16, 2, 4, 2, 32, 40
INDEX = "model.safetensors.index.json"


class Counts:
    """Header parses and disk reads per file name while installed."""

    def __init__(self) -> None:
        self.parsed: collections.Counter[str] = collections.Counter()
        self.from_disk: collections.Counter[str] = collections.Counter()

    def install(self, patch: Any) -> Counts:
        def counted(fn: Any, into: collections.Counter[str], name: str | None = None) -> Any:
            def inner(path: Any, *a: Any, **k: Any) -> Any:
                into[name or os.path.basename(os.fspath(path))] += 1
                return fn(path, *a, **k)

            return inner

        patch(_safetensors_file, "read_header", counted(_safetensors_file.read_header, self.parsed))
        patch(_json, "read_bytes", counted(_json.read_bytes, self.parsed))
        patch(_dcp_dir, "read_dcp_metadata", counted(_dcp_dir.read_dcp_metadata, self.parsed, ".metadata"))
        patch(_headers, "note", counted(_headers.note, self.from_disk))
        return self

    def clear(self) -> None:
        self.parsed.clear()
        self.from_disk.clear()

    def headers(self) -> dict[str, int]:
        """The parses of checkpoint headers (the config files adapters read are not headers)."""
        return {k: v for k, v in self.parsed.items() if k.endswith((".safetensors", ".index.json")) or k == ".metadata"}


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    yield Counts().install(monkeypatch.setattr)


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip


def _meta_llama() -> torch.nn.Module:
    from support.reference_models import MetaLlama

    return MetaLlama(dict(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN,
                          norm_eps=1e-6, rope_theta=10000.0))  # fmt: skip


def _release(folder: str) -> str:
    """A transformers llama saved in several shards with its index and config.json."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(folder, max_shard_size="12KB")
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) >= 3
    return folder


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _release(str(tmp_path_factory.mktemp("hdr") / "llama"))


def _json_file(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _shards(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def _once_each(folder: str) -> dict[str, int]:
    return {INDEX: 1, **dict.fromkeys(_shards(folder), 1)}


def test_a_shipped_adapter_by_name_reads_each_header_once(release: str, counts: Counts, tmp_path: Any) -> None:
    rep = sdadapt.load(_meta_llama(), release, "llama")  # options from config.json and the key names
    assert rep.report.ok
    assert counts.headers() == _once_each(release)
    counts.clear()
    source, plan = sdadapt.plan_load(_meta_llama(), release, "llama")
    source.close()
    assert plan.report.ok and counts.headers() == _once_each(release)
    counts.clear()
    assert sdadapt.diff(_meta_llama(), release, "llama").ok
    assert counts.headers() == _once_each(release)
    counts.clear()
    sdadapt.convert(release, str(tmp_path / "meta"), "llama")
    assert counts.headers()[INDEX] == 1 and all(counts.headers()[s] == 1 for s in _shards(release))


def test_a_transformers_model_derives_its_adapter_from_the_open_source(release: str, counts: Counts) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    rep = sdadapt.load(model, release)  # hf_adapter(model, the open source)
    assert rep.report.ok
    assert counts.headers() == _once_each(release)


def _fp8_release(plain: str, folder: str) -> dict[str, torch.Tensor]:
    """``plain``'s projections as FP8 with unit block scales (``weight_block_size`` 16x16), in one
    file with a ``config.json`` carrying ``quantization_config``; returns the values it holds."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(plain):
        tensors |= load_file(os.path.join(plain, shard))
    out, values = {}, {}
    for key, t in tensors.items():
        if key.endswith("_proj.weight"):
            q = t.to(torch.float8_e4m3fn)
            out[key] = q
            out[key + "_scale_inv"] = torch.ones(-(-t.shape[0] // 16), -(-t.shape[1] // 16))
            values[key] = q.float()
        else:
            out[key] = values[key] = t
    os.makedirs(folder)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = _json_file(os.path.join(plain, "config.json"))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return values


def test_a_quantized_release_reads_its_header_once(release: str, counts: Counts, tmp_path: Any) -> None:
    folder = str(tmp_path / "fp8")
    values = _fp8_release(release, folder)
    counts.clear()
    model = _meta_llama()
    assert sdadapt.load(model, folder, "llama").report.ok  # the FP8 rule chosen from config.json and the headers
    assert counts.headers() == {"model.safetensors": 1}
    ref = _meta_llama()
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    save_file(values, os.path.join(plain, "model.safetensors"))
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump({k: v for k, v in _json_file(os.path.join(folder, "config.json")).items() if k != "quantization_config"}, f)
    sdadapt.load(ref, plain, "llama")
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # a user's own adapter: dequant_rules of the open source, which load then takes as it is
    counts.clear()
    with sdadapt.sources.open_source(folder) as src:
        rules = sdadapt.dequant_rules(src)
        assert [type(r).__name__ for r in rules] == ["DequantFP8"]
        llama = sdadapt.get_adapter("llama", src)  # its options from the open source too
        adapter = sdadapt.Adapter([*rules, *(r for r in llama.rules if type(r).__name__ != "DequantFP8")], name="mine")
        assert sdadapt.load(_meta_llama(), src, adapter).report.ok
    assert counts.headers() == {"model.safetensors": 1}


def test_a_dcp_folder_reads_its_metadata_once(release: str, counts: Counts, tmp_path: Any) -> None:
    model = _meta_llama()
    sdadapt.load(model, release, "llama")
    state = str(tmp_path / "state")
    sdadapt.save_state(model, state)
    counts.clear()
    sdadapt.load_state(_meta_llama(), state)
    assert counts.headers() == {".metadata": 1}
    counts.clear()
    sdadapt.load_state(_meta_llama(), state, adapter=sdadapt.Adapter([]))
    assert counts.headers() == {".metadata": 1}
    counts.clear()
    sdadapt.convert(state, str(tmp_path / "st"), subtree="model")
    assert counts.headers() == {".metadata": 1}


def _rank_counts(folder: str) -> dict[str, dict[str, int]]:
    counts = Counts().install(setattr)
    out = {}
    rep = sdadapt.load(_meta_llama(), folder, "llama")
    assert rep.report.ok
    out["load"] = {"parsed": counts.headers(), "from_disk": dict(counts.from_disk)}
    return out


def test_headers_once_per_job_and_once_per_rank(release: str) -> None:
    results = run_distributed(_rank_counts, 2, release, timeout=300)
    once = _once_each(release)
    for rank, res in enumerate(results):
        assert res["load"]["parsed"] == once, rank  # every rank parses each header once
    headers_from_disk = {k: v for k, v in results[0]["load"]["from_disk"].items() if k in once}
    assert headers_from_disk == once  # the first rank read each once for the job
    assert not any(k in once for k in results[1]["load"]["from_disk"])  # the other received them
