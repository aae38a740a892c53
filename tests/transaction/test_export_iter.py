"""export_iter(): a model's weights streamed in the checkpoint's layout, one tensor at a time."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize, split_qkv
from torch.distributed.device_mesh import init_device_mesh

import sdadapt

QKV = sdadapt.Adapter(
    [sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}")], name="split-qkv"
)


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A split-q/k/v safetensors checkpoint of a seeded TinyTransformer; returns its tensors."""
    torch.manual_seed(0)
    sd = split_qkv(TinyTransformer().state_dict())
    save_file(sd, path)
    return sd


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _alive(refs: list[weakref.ref]) -> int:
    """How many distinct tensors ``refs`` still reach."""
    return len({id(r()) for r in refs if r() is not None})


def _settled_alive(refs: list[weakref.ref], patience: float = 2.0) -> int:
    """:func:`_alive` once references held outside the generator have had time to go.

    Two holders are not the generator's: torch's own reference cycles (e.g. pytree flattening's
    recursive helper, under DTensor's gathers), which keep an earlier tensor until Python's
    cycle collector runs, and the process group's backend, whose worker threads can still hold
    a finished collective's tensors for a moment after the waiting rank has woken up (seen on
    gloo: an earlier output alive with no Python object referring to it, gone within
    milliseconds). So when more than one tensor is alive: collect (only then: a collection per
    tensor costs seconds), and give the worker threads up to ``patience`` seconds. A tensor the
    generator kept stays alive through both."""
    n = _alive(refs)
    if n > 1:
        gc.collect()
        deadline = time.monotonic() + patience
        while (n := _alive(refs)) > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    return n


def _stream(model: torch.nn.Module, ckpt: str) -> dict:
    """Consume export_iter, comparing each tensor with the checkpoint file and counting how many
    of the tensors yielded so far are still alive while the next one is in hand."""
    keys, differ, most_alive = [], [], 0
    refs: list[weakref.ref] = []
    with safe_open(ckpt, "pt") as f:
        for key, t in sdadapt.export_iter(model, QKV):
            keys.append(key)
            want = f.get_tensor(key)
            if t.dtype != want.dtype or not torch.equal(t, want):
                differ.append(key)
            refs.append(weakref.ref(_base(t)))
            most_alive = max(most_alive, _settled_alive(refs))
            del t, want
    return {"keys": keys, "differ": differ, "most_alive": most_alive}


def test_stream_equals_checkpoint_and_holds_one_tensor(tmp_path):
    ckpt = str(tmp_path / "ck.safetensors")
    sd = _checkpoint(ckpt)
    model = TinyTransformer()
    sdadapt.load(model, ckpt, QKV)
    out = _stream(model, ckpt)
    assert sorted(out["keys"]) == sorted(sd) and len(out["keys"]) == len(sd)
    assert out["differ"] == []
    # the generator keeps no earlier tensor alive: only the one in hand (q/k/v share the gathered qkv)
    assert out["most_alive"] == 1


def test_stream_by_adapter_name_and_identity(tmp_path):
    torch.manual_seed(3)
    model = TinyTransformer()
    names = [k for k, _ in sdadapt.export_iter(model)]
    assert names == list(model.state_dict())
    json_path = tmp_path / "qkv.json"
    json_path.write_text(QKV.to_json())
    streamed = dict(sdadapt.export_iter(model, str(json_path)))  # an adapter given by file name
    want = split_qkv(model.state_dict())
    assert streamed.keys() == want.keys()
    assert all(torch.equal(streamed[k], want[k]) for k in want)


def test_stream_of_a_meta_model_fails_before_yielding():
    with torch.device("meta"):
        model = TinyTransformer()
    with pytest.raises(sdadapt.errors.ExportError, match="meta device"):
        next(sdadapt.export_iter(model))


def _stream_dist(ckpt: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    with torch.device("meta"):
        model = TinyTransformer()
    parallelize(model, mesh)
    sdadapt.load(model, ckpt, QKV)
    return _stream(model, ckpt)


def test_stream_fsdp_tp_every_rank_same_sequence(tmp_path):
    ckpt = str(tmp_path / "ck.safetensors")
    sd = _checkpoint(ckpt)
    results = run_distributed(_stream_dist, 4, ckpt, timeout=240)
    assert all(r["keys"] == results[0]["keys"] for r in results)
    assert sorted(results[0]["keys"]) == sorted(sd)
    assert [r["differ"] for r in results] == [[]] * 4
    assert [r["most_alive"] for r in results] == [1] * 4


def test_outer_first_regions_keep_a_row_shard_whole():
    """A rank owning rows 4-8 of an [8, 16] tensor gets the rows whole (one run), not two column
    blocks (a run per row each, what halving the longest dimension gave): for the every-rank
    export, refit's ``plan_regions`` and ``export_iter(local=True)`` alike."""
    from sdadapt._export.export_local import regions
    from sdadapt._recipes.nodes import Leaf

    leaf = Leaf("w", (8, 16), torch.bfloat16)
    owned = {"w": ((4, 8), (0, 16))}
    assert list(regions(leaf, ((0, 8), (0, 16)), owned, {"w": torch.bfloat16}, 1, "w")) == [((4, 8), (0, 16))]
    cols = {"w": ((0, 8), (0, 4))}  # a column shard: no halving of the rows settles anything
    assert list(regions(leaf, ((0, 8), (0, 16)), cols, {"w": torch.bfloat16}, 0, "w")) == [((0, 8), (0, 4))]


def test_a_window_is_free_only_once_the_upload_let_go_of_every_view():
    """An every-rank s3:// export hands the window it received to obstore as views and reuses
    the buffer only once the event ``_upload`` returns is set: set when the last view the
    writer holds is released, never before (the views in file order, the header first)."""
    from sdadapt._export import spread_remote
    from sdadapt._export.writers.safetensors_writer import FileLayout

    class Holding:  # obstore's writer as seen from here: it keeps what it is given
        def __init__(self) -> None:
            self.held: list[memoryview] = []

        def write(self, data: memoryview) -> None:
            self.held.append(data)

    f = FileLayout("m.safetensors", b"HEAD", {}, 12)
    data = torch.tensor([5, 6, 7, 8, 1, 2, 3, 4], dtype=torch.uint8)  # runs in rank order
    writer = Holding()
    released = spread_remote._upload(writer, f, 0, 12, [8, 4, 4, 4], data)
    assert b"".join(bytes(v) for v in writer.held) == b"HEAD" + bytes([1, 2, 3, 4, 5, 6, 7, 8])
    gc.collect()
    assert not released.is_set()
    writer.held.pop()
    assert not released.is_set()  # one view still held
    writer.held.clear()
    assert released.is_set()
    with pytest.raises(sdadapt.errors.ExportError, match="uncovered or twice covered"):
        spread_remote._upload(Holding(), f, 0, 12, [4, 4, 4, 4], data)


def test_a_round_sent_in_steps_lands_in_file_order():
    """A round whose bytes to send exceed the send half goes in steps: each step's bytes of each
    sender land behind the step before, so a run cut between two steps is read as two views
    (``segs``), and the window still comes out in file order, bit for bit."""
    from sdadapt._export import spread_remote
    from sdadapt._export.writers.safetensors_writer import FileLayout

    assert spread_remote.steps_of(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert spread_remote.steps_of(0, 4) == [(0, 0)]
    parts = [memoryview(bytes(range(0, 5))), memoryview(bytes(range(5, 8)))]
    buf = torch.zeros(4, dtype=torch.uint8)
    spread_remote._packed(parts, buf, 3, 7)  # bytes 3-6 of the parts laid one after the other
    assert buf.tolist() == [3, 4, 5, 6]
    # file bytes 0-11 after a 4-byte header; sender 0 holds file bytes 4-9 (one run), sender 1
    # bytes 0-3 and 10-11 (two runs); steps of 4 bytes per sender
    f = FileLayout("m.safetensors", b"HEAD", {}, 16)
    runs = [8, 6, 4, 4, 14, 2]  # (offset in the window, length): sender 0's, then sender 1's
    want = bytes(range(100, 112))
    theirs = [want[4:10], want[0:4] + want[10:12]]
    landing, segs, done, bases = bytearray(), [], 0, [0, 6]
    for lo, hi in spread_remote.steps_of(6, 4):
        for s, stream in enumerate(theirs):
            got = stream[lo:hi]
            if got:
                segs.append((bases[s] + lo, done, len(got)))
                landing += got
                done += len(got)
    segs.sort()
    views = spread_remote._in_file_order(f, 0, 16, runs, memoryview(bytes(landing)), segs)
    assert b"".join(bytes(v) for v in views) == b"HEAD" + want
    assert len(views) == 1 + 3 + 1  # the header, sender 0's run in two steps, sender 1's two runs
