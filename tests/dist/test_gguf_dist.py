"""GGUF files on 2 gloo ranks: transformers Llama / Qwen2 / Qwen3 models sharded with FSDP2
(``fully_shard``) load with no adapter, every shard bit-equal to transformers' own GGUF loading,
each rank reading about half of the file; our layout (``to="native"``) on sharded ranks as on one
process; broken files fail on both ranks, nothing loaded, no hang.
One launched group runs every case."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from support.dist_helper import run_distributed, shard_of  # noqa: E402
from support.gguf_models import empty_like, oracle_model, write_family  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3"]
_RESULTS: dict[str, Any] = {}


def _cases(folder: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt
    from sdadapt.errors import SdadaptError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for family in FAMILIES:
        path = os.path.join(folder, family, "model.gguf")
        for dtype in (torch.bfloat16, torch.float32):
            oracle = oracle_model(path, dtype)
            want = oracle.state_dict()
            model = empty_like(oracle, dtype)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            rep = sdadapt.load(model, path)
            bad = []
            for k, v in model.state_dict().items():
                local, region = shard_of(v, want[k])
                same = torch.equal(local.contiguous().view(torch.uint8), region.contiguous().view(torch.uint8))
                if local.dtype != region.dtype or not same:
                    bad.append(k)
            out[f"{family}/{dtype}"] = {"bad": bad, "read": rep.bytes_read, "size": os.path.getsize(path)}
    out["llama/native"] = _native(os.path.join(folder, "llama", "model.gguf"), mesh)
    oracle = oracle_model(os.path.join(folder, "llama", "model.gguf"), torch.float32)
    for broken in ("truncated", "block_count"):
        path = os.path.join(folder, "broken", f"{broken}.gguf")
        model = empty_like(oracle, torch.float32)
        fully_shard(model, mesh=mesh)
        try:
            sdadapt.load(model, path)
            out[broken] = "loaded"
        except SdadaptError as e:
            out[broken] = f"{type(e).__name__}: {e}"
        out[f"{broken}/meta"] = all(p.is_meta for p in model.parameters())  # nothing materialised or written
    return out


def _native(path: str, mesh: Any) -> list[str]:
    """The shipped ``gguf`` adapter to our layout (``to="native"``) into an FSDP2-sharded
    Meta-layout Llama: every shard equal to the same load on one process (which
    tests/adapters/test_adapters_gguf.py checks against transformers' checkpoint); the keys
    that differ."""
    from support.gguf_models import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB
    from support.reference_models import MetaLlama
    from support.sharded_load import sharded_differs

    import sdadapt

    cfg = {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "vocab_size": VOCAB,
           "hidden_dim": FFN, "norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip
    native = sdadapt.get_adapter("gguf", path, to="native")
    return sharded_differs(lambda: MetaLlama(cfg).to(torch.bfloat16), path, native, mesh, dtype="model")


def test_our_layout_on_sharded_ranks_equals_one_process(results: dict) -> None:
    assert results[0]["llama/native"] == [] and results[1]["llama/native"] == []


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("gguf-dist"))
    for family in FAMILIES:
        write_family(os.path.join(folder, family), family)
    os.makedirs(os.path.join(folder, "broken"))
    good = os.path.join(folder, "llama", "model.gguf")
    cut = os.path.join(folder, "broken", "truncated.gguf")
    shutil.copy(good, cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(good) - 1000)
    write_family(os.path.join(folder, "broken", "bc"), "llama")
    data = bytearray(open(os.path.join(folder, "broken", "bc", "model.gguf"), "rb").read())
    at = data.index(b"llama.block_count") + len(b"llama.block_count") + 4
    data[at : at + 4] = (3).to_bytes(4, "little")
    with open(os.path.join(folder, "broken", "block_count.gguf"), "wb") as f:
        f.write(bytes(data))
    if not _RESULTS:
        _RESULTS.update(enumerate(run_distributed(_cases, 2, folder, timeout=600)))
    return _RESULTS


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
def test_fsdp2_shards_are_bit_equal_and_each_rank_reads_its_half(results: dict, family: str, dtype: str) -> None:
    for rank in (0, 1):
        case = results[rank][f"{family}/{dtype}"]
        assert case["bad"] == []
        assert case["read"] < 0.75 * case["size"], case  # its own rows' blocks, not the file


@pytest.mark.parametrize("broken", ["truncated", "block_count"])
def test_a_broken_file_fails_on_both_ranks_naming_it(results: dict, broken: str) -> None:
    texts = [results[rank][broken] for rank in (0, 1)]
    want = "truncated GGUF file" if broken == "truncated" else "llama.block_count=3"
    assert all(t.startswith("SourceError") and want in t and f"{broken}.gguf" in t for t in texts), texts
    assert all(results[rank][f"{broken}/meta"] for rank in (0, 1))
