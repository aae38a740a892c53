"""Every rank writes its regions of a safetensors export (issue 62, item 3), on 4 gloo ranks.

One launched group runs the cases in a row: a transformers Llama under FSDP2 exported into
several files (the folder read back by ``from_pretrained`` and ``safetensors``, bit for bit, and
each rank's share of the bytes); the TinyTransformer on a 2x2 FSDP x TP mesh through an adapter
that fuses q/k/v, with checksums (read back by ``sdadapt.load``, checking them); a rotary permutation whose rows are cut mid-head
(gathered, written by one rank); a full disk on one rank over an existing export (every rank
raises, nothing new is left, the old folder intact); and last, a rank killed mid-write (the others
raise instead of hanging, and leave no folder).
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from support.dist_helper import WorkerError, outcome, run_distributed
from support.models import TinyTransformer, parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import sdadapt
import sdadapt._export.spread as spread

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

QKV = sdadapt.Adapter(
    [sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}")], name="split-qkv"
)
# the fused qkv's rows permuted per head of 16 rows; its shards hold 12 rows: computed across shards
ROT = sdadapt.Adapter([sdadapt.rotary("layers.{i}.attn.qkv.weight", head_dim=16, to="interleaved")], name="rot")
WORLD = 4


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _tiny_2x2() -> torch.nn.Module:
    torch.manual_seed(0)
    ref = TinyTransformer()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    model = parallelize(TinyTransformer(), mesh)
    with torch.no_grad():
        for k, p in model.state_dict().items():
            full = ref.state_dict()[k]
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
    return model


def _failing_write(rank: int, after: int, fail) -> object:
    """``spread.write_at`` that calls ``fail()`` on ``rank`` after ``after`` writes."""
    orig = spread.write_at
    calls = {"n": 0}

    def write_at(fd: int, data: memoryview, offset: int) -> None:
        calls["n"] += 1
        if dist.get_rank() == rank and calls["n"] > after:
            fail()
        orig(fd, data, offset)

    return write_at


def _cases(folder: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    llama = _llama()
    for layer in llama.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(llama, mesh=mesh)
    rep = sdadapt.export(llama, os.path.join(folder, "llama"), max_shard_size=20_000)
    out["llama"] = (rep.bytes, rep.rank_bytes, rep.files)

    tiny = _tiny_2x2()
    rep = sdadapt.export(tiny, os.path.join(folder, "tiny"), QKV, max_shard_size=3000, checksums=True)
    out["tiny"] = (rep.bytes, rep.rank_bytes)

    # rows of wq permuted per head (rotary), the head cut across the FSDP x TP shards: gathered
    rep = sdadapt.export(tiny, os.path.join(folder, "rot"), ROT)
    out["rot"] = rep.rank_bytes

    # a full disk on rank 2 while replacing "tiny": every rank raises, "tiny" stays as it was
    def enospc() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    spread.write_at = _failing_write(2, 3, enospc)  # type: ignore[assignment]
    out["full"] = outcome(lambda: sdadapt.export(tiny, os.path.join(folder, "tiny"), QKV, max_shard_size=3000, overwrite=True))
    dist.barrier()
    out["left"] = sorted(n for n in os.listdir(folder) if not n.endswith(".json"))

    # last (the group is broken afterwards): rank 3 dies mid-write; the others raise, no hang
    spread.write_at = _failing_write(3, 2, lambda: os._exit(9))  # type: ignore[assignment]
    with open(os.path.join(folder, f"before-kill.{rank}.json"), "w") as f:
        json.dump(out, f)
    kill = outcome(lambda: sdadapt.export(tiny, os.path.join(folder, "killed"), QKV, max_shard_size=3000))
    with open(os.path.join(folder, f"kill.{rank}.json"), "w") as f:
        json.dump([kill[0], kill[1]], f)
    return out


def test_every_rank_writes_its_regions(tmp_path):
    with pytest.raises(WorkerError) as failed:
        run_distributed(_cases, WORLD, str(tmp_path), timeout=240)
    # only the killed rank crashed; the others returned (an error of theirs is a failure too)
    assert [(f.rank, f.type_name) for f in failed.value.failures] == [(3, "Crash")], str(failed.value)[:3000]
    results = [json.loads((tmp_path / f"before-kill.{r}.json").read_text()) for r in range(WORLD)]

    # the Llama folder: several files, an index, read unchanged by safetensors and transformers
    total, _, files = results[0]["llama"]
    shares = [r["llama"][1] for r in results]
    assert sum(shares) == total and max(shares) <= 1.2 * total / WORLD, shares
    assert "model.safetensors.index.json" in files and "config.json" in files
    ref = _llama().state_dict()
    index = json.loads((tmp_path / "llama" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(ref)
    for key, name in index.items():
        with safe_open(str(tmp_path / "llama" / name), "pt") as f:
            assert torch.equal(f.get_tensor(key), ref[key]), key
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "llama"))
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref[k]), k

    # the 2x2 model through the fused-qkv adapter: every rank wrote, sdadapt.load reads it back (checksums checked)
    assert (tmp_path / "tiny" / "sdadapt.checksums.json").is_file()
    total, _ = results[0]["tiny"]
    shares = [r["tiny"][1] for r in results]
    assert sum(shares) == total and min(shares) > 0, shares
    torch.manual_seed(0)
    want = TinyTransformer().state_dict()
    for name in ("tiny", "rot"):
        torch.manual_seed(5)
        back_tiny = TinyTransformer()
        sdadapt.load(back_tiny, str(tmp_path / name), QKV if name == "tiny" else ROT, checksums=name == "tiny")
        for k, v in back_tiny.state_dict().items():
            assert torch.equal(v, want[k]), (name, k)
    assert sum(r["rot"] for r in results) == sum(v.numel() * v.element_size() for v in want.values())

    # the full disk: rank 2 names it, the others name rank 2; the old "tiny" untouched
    kinds = [r["full"][0] for r in results]
    assert kinds == ["RemoteRankError", "RemoteRankError", "ExportError", "RemoteRankError"], kinds
    assert "disk is full" in results[2]["full"][1] and "rank 2" in results[0]["full"][1]
    assert results[0]["left"] == ["llama", "rot", "tiny"]

    # the killed rank: the others raised (a peer gone), and no folder was left for "killed"
    for r in range(WORLD - 1):
        kind, message = json.loads((tmp_path / f"kill.{r}.json").read_text())
        assert kind != "ok", (r, message)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("killed")]
