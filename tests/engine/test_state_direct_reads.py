"""A resume load reads its bytes with the I/O engine's file reads, not through ``Source.read``.

``load_state`` reads the model and each optimizer moment through a namespaced view of the DCP
checkpoint (``optim.state.{fqn}.exp_avg``...). The view forwards the checkpoint's byte
locations, so every region is read with ``preadv`` straight from the ``.distcp`` files (direct
into the destination, or staged), and each rank reads exactly the bytes of its own shards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from support.models import TinyTransformer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._engine.engine import EngineStats
from sdadapt._transaction import transaction as _transaction
from sdadapt.sources._dcp_dir import DCPSource
from sdadapt.sources._namespaced import NamespacedSource

VOCAB = 600


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with tensors above and below the engine's direct-read size, and its AdamW."""
    torch.manual_seed(seed)
    model = TinyTransformer(layers=2, dim=128, heads=4, ffn=512, vocab=VOCAB)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def local_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes of this rank's shards of ``tensors``."""
    out = 0
    for t in tensors.values():
        t = t._local_tensor if isinstance(t, DTensor) else t
        out += t.numel() * t.element_size()
    return out


@contextlib.contextmanager
def recorded_parts() -> Iterator[dict[str, tuple[EngineStats, int]]]:
    """Part name -> (the engine's stats of its read, the bytes of this rank's shards it loads),
    for every part a load transaction reads while the context is open."""
    seen: dict[str, tuple[EngineStats, int]] = {}
    original = _transaction.Transaction._read

    def recording(self: _transaction.Transaction, part: _transaction.Part) -> list[str]:
        errors = original(self, part)
        assert part.reader is not None
        seen[part.name] = (part.reader.stats, local_bytes(part.into))
        return errors

    _transaction.Transaction._read = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        _transaction.Transaction._read = original  # type: ignore[method-assign]


def check_read_from_files(seen: dict[str, tuple[EngineStats, int]]) -> list[str]:
    """Every part read exactly its shards' bytes, all with the engine's file reads; returns the
    parts that did not, with their counts."""
    bad = []
    for name, (st, want) in seen.items():
        if not (st.bytes_read == st.direct_bytes + st.staged_bytes == want and st.computed == 0 and want > 0):
            bad.append(f"{name}: read {st.bytes_read} (direct {st.direct_bytes}, staged {st.staged_bytes}, "
                       f"via Source.read {st.computed} pieces), shards hold {want}")  # fmt: skip
    return bad


def same_state(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> list[str]:
    """Keys whose values differ (full tensors, compared bit for bit)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    bad = [k for k, v in a[0].state_dict().items() if not torch.equal(full(v), full(b[0].state_dict()[k]))]
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    bad += [f"{i}.{n}" for i in sa for n in sa[i] if not torch.equal(full(sa[i][n]), full(sb[i][n]))]
    return bad


def test_single_process_resume_reads_every_part_from_the_files(tmp_path):
    saved = build(seed=0)
    train(*saved)
    dst = str(tmp_path / "ck")
    sdadapt.save_state(saved[0], dst, *saved[1:], extra={"step": 2})

    model, opt = build(seed=1)
    with recorded_parts() as seen:
        rep = sdadapt.load_state(model, dst, opt, {"step": 0})
    assert sorted(seen) == ["model", "optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step"]
    assert check_read_from_files(seen) == []
    assert seen["model"][0].direct_bytes > 0 and seen["optimizer exp_avg"][0].direct_bytes > 0
    assert rep.optimizer_state_names == ["exp_avg", "exp_avg_sq", "step"]
    assert same_state((model, opt), saved) == []


def test_namespace_forwards_locations_files_and_names(tmp_path):
    saved = build(seed=0)
    train(*saved, steps=1)
    dst = str(tmp_path / "ck")
    sdadapt.save_state(saved[0], dst, *saved[1:])
    with DCPSource(dst, subtree="") as full:
        view = NamespacedSource(full, "optim.state.{}.exp_avg")
        stored = "optim.state.head.weight.exp_avg"
        box = ((0, 7), (0, 128))
        assert view.stored_key("head.weight") == stored
        assert view.file_of("head.weight") == full.file_of(stored)
        assert view.files() == full.files() and len(view.files()) > 1
        assert view.locate_region("head.weight", box) == full.locate_region(stored, box) is not None
        assert view.schema["head.weight"] == full.schema[stored]
        assert torch.equal(view.read("head.weight", box), full.read(stored, box))


def _save_then_resume_sharded(folder: str) -> dict[str, Any]:
    """Save from a replicated model (each tensor stored whole), resume into FSDP2 over both
    ranks: each rank reads the rows of its shards out of the whole stored tensors."""
    saved = build(seed=0)
    train(*saved)
    dst = os.path.join(folder, "ck")
    sdadapt.save_state(saved[0], dst, *saved[1:])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model, _ = build(seed=1)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with recorded_parts() as seen:
        sdadapt.load_state(model, dst, opt)
    sharded = {name: (st.bytes_read, want) for name, (st, want) in seen.items()}
    return {"bad_reads": check_read_from_files(seen), "bad_values": same_state((model, opt), saved), "bytes": sharded}


def test_two_ranks_each_read_only_their_shards_from_the_files(tmp_path):
    results = run_distributed(_save_then_resume_sharded, 2, str(tmp_path), timeout=240)
    model, opt = build(seed=0)
    whole = {"model": local_bytes(dict(model.state_dict()))}
    for r in results:
        assert r["bad_reads"] == [] and r["bad_values"] == [], r
    # the two ranks' shards make up the whole model once (dims divide by 2: no padding)
    assert sum(r["bytes"]["model"][0] for r in results) == whole["model"]
    assert all(r["bytes"]["model"][0] < whole["model"] for r in results)
