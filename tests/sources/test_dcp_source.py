"""DCP folders as a source: schema from .metadata, chunk-intersecting region reads, bad input."""

from __future__ import annotations

import os
import pickle
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from support.dist_helper import run_distributed
from support.models import TinyTransformer, split_qkv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import sdadapt
from sdadapt.sources import open_source
from sdadapt.sources._dcp_dir import DCPSource

QKV = sdadapt.Adapter(
    [sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}")], name="split-qkv"
)


def _save_single(folder, sd) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)
    return str(folder)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(13, 7, generator=g),
        "b": torch.randn(10, generator=g).to(torch.bfloat16),
        "i": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
        "s": torch.tensor(5.0),
    }


def _save_sharded(folder: str) -> None:
    """Each tensor saved as a DTensor sharded over 2 ranks (uneven along its last dim)."""
    mesh = init_device_mesh("cpu", (2,))
    sd = {k: distribute_tensor(v, mesh, [Shard(v.dim() - 1)]) if v.dim() else v for k, v in _tensors().items()}
    sd["note"] = "hello"
    dcp.save(sd, checkpoint_id=folder)
    dist.barrier()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("dcp") / "sharded")
    run_distributed(_save_sharded, 2, folder, timeout=120)
    return folder


def test_schema_and_chunks(sharded):
    src = open_source(sharded)
    assert isinstance(src, DCPSource)
    want = _tensors()
    assert {k: (i.shape, i.dtype) for k, i in src.schema.items()} == {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
    assert src.non_tensor == ["note"]
    assert src.read_object("note") == "hello"
    assert src.chunks_of("w") == [((0, 13), (0, 4)), ((0, 13), (4, 7))]  # 7 columns over 2 ranks
    assert src.file_of("w").endswith(".distcp")


def test_random_boxes_bit_exact(sharded):
    src = open_source(sharded)
    rnd = random.Random(1)
    for key, full in _tensors().items():
        for _ in range(40):
            box = []
            for n in full.shape:
                a = rnd.randrange(0, n + 1)
                b = rnd.randrange(a, n + 1)
                box.append((a, b))
            box = tuple(box)
            got = src.read(key, box)
            assert got.dtype == full.dtype
            assert torch.equal(got, full[tuple(slice(a, b) for a, b in box)]), (key, box)


def test_read_touches_only_intersecting_chunks(sharded, monkeypatch):
    src = open_source(sharded)
    seen = []
    orig = src._reader.read_data

    def spy(plan, planner):
        seen.append([(i.storage_index.offset, tuple(i.lengths)) for i in plan.items])
        return orig(plan, planner)

    monkeypatch.setattr(src._reader, "read_data", spy)
    monkeypatch.setattr(src, "locate_region", lambda key, box: None)  # DCP's reader, not the raw fast path
    src.read("w", ((0, 2), (0, 2)))  # inside the first chunk only
    src.read("w", ((3, 5), (3, 6)))  # across both
    assert seen == [[(torch.Size([0, 0]), (2, 2))], [(torch.Size([0, 0]), (2, 1)), (torch.Size([0, 4]), (2, 2))]]


def test_raw_chunk_locations(sharded, monkeypatch):
    """The fast path: each stored chunk's raw bytes are found inside its torch.save zip and
    read from the file directly; only the chunks a region intersects; DCP's reader unused."""
    src = open_source(sharded)
    monkeypatch.setattr(src._reader, "read_data", lambda *a: pytest.fail("FileSystemReader used"))
    inside = src.locate_region("w", ((0, 2), (0, 2)))
    across = src.locate_region("w", ((3, 5), (3, 6)))
    assert [cb for cb, _ in inside] == [((0, 13), (0, 4))]
    assert [cb for cb, _ in across] == [((0, 13), (0, 4)), ((0, 13), (4, 7))]
    full = _tensors()
    for cb, loc in across:
        with open(loc.path, "rb") as f:
            f.seek(loc.offset)
            raw = bytearray(f.read(loc.dtype.itemsize * (cb[0][1] - cb[0][0]) * (cb[1][1] - cb[1][0])))
        got = torch.frombuffer(raw, dtype=loc.dtype).view(loc.shape)
        assert torch.equal(got, full["w"][cb[0][0] : cb[0][1], cb[1][0] : cb[1][1]])
    for key, t in full.items():
        assert torch.equal(src.read(key, tuple((0, n) for n in t.shape)), t), key
    src.close()


def test_engine_reads_raw_chunks_bit_exact(sharded):
    """The I/O engine over a chunked DCP source: random regions (across chunk boundaries,
    contiguous and strided destinations, direct, staged and strided-copy paths) equal the
    saved tensors, with every byte read from the raw chunks (no Source.read fallback)."""
    from sdadapt._engine import EngineConfig, IOEngine, Job
    from sdadapt._recipes import nodes as N

    full = _tensors()
    rnd = random.Random(3)
    configs = [
        EngineConfig(threads=2, direct_min_bytes=0, chunk_bytes=4096, min_span_bytes=0),
        EngineConfig(threads=3, direct_min_bytes=1 << 40, chunk_bytes=4096, staging_bytes=3 * 4096, min_span_bytes=0),
        EngineConfig(threads=1),
    ]
    with open_source(sharded) as src:
        for cfg in configs:
            jobs, want = [], []
            for key, t in full.items():
                for _ in range(6):
                    box = tuple((a, rnd.randrange(a + 1, n + 1)) for n in t.shape for a in [rnd.randrange(0, n)])
                    ref = t[tuple(slice(a, b) for a, b in box)]
                    dest = torch.full(ref.shape, 7, dtype=t.dtype)
                    if ref.dim() == 2 and rnd.random() < 0.4:
                        dest = torch.full((ref.shape[0], ref.shape[1] + 2), 7, dtype=t.dtype)[:, 1:-1]
                    jobs.append(Job(key, N.Leaf(key, tuple(t.shape), t.dtype), box, dest))
                    want.append(ref)
            engine = IOEngine(src, cfg)
            engine.run(jobs)
            for job, ref in zip(jobs, want, strict=True):
                assert torch.equal(job.dest, ref), (job.key, job.box)
            nbytes = sum(r.numel() * r.element_size() for r in want)
            assert engine.stats.bytes_read == nbytes
            if cfg.min_span_bytes == 0:
                assert engine.stats.computed == 0  # every piece read from the file directly


def test_raw_chunk_fallbacks(tmp_path, monkeypatch):
    """Chunks whose bytes cannot be proven raw and contiguous go through DCP's reader: a
    transposed (non-contiguous) save, a damaged zip record; values stay right or the error says
    the file is corrupt."""
    sd = {"t": torch.randn(5, 7).t(), "w": torch.randn(6, 3)}
    folder = _save_single(tmp_path / "ck", sd)
    src = open_source(folder)
    assert src.locate_region("t", ((0, 7), (0, 5))) is None
    assert src.locate_region("w", ((0, 6), (0, 3))) is not None
    assert torch.equal(src.read("t", ((1, 4), (0, 5))), sd["t"][1:4])
    src.close()
    info = next(v for k, v in src.metadata.storage_data.items() if k.fqn == "w")
    path = os.path.join(folder, info.relative_path)
    with open(path, "r+b") as f:  # break the zip's central directory of item "w"
        f.seek(info.offset + info.length - 22)
        f.write(b"XXXX")
    src = open_source(folder)
    assert src.locate_region("w", ((0, 6), (0, 3))) is None
    try:
        got = src.read("w", ((0, 6), (0, 3)))
    except sdadapt.errors.SourceError as e:
        assert "corrupt" in str(e)
    else:
        assert torch.equal(got, sd["w"])


def test_load_single_file_dcp_through_adapter(tmp_path):
    torch.manual_seed(0)
    ref = TinyTransformer()
    folder = _save_single(tmp_path / "ck", split_qkv(ref.state_dict()))
    model = TinyTransformer()
    rep = sdadapt.load(model, folder, QKV)
    assert rep.keys_loaded == len(ref.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


def test_subtree(tmp_path):
    sd = _tensors()
    folder = _save_single(tmp_path / "ck", {"model": sd, "other": {"x": torch.ones(2)}})
    src = open_source(folder, subtree="model")
    assert set(src.schema) == set(sd)
    assert torch.equal(src.read("w", ((1, 4), (0, 7))), sd["w"][1:4])
    # declared capabilities: the checkpoint's own names, every file it reads, chunk locations
    assert src.stored_key("w") == "model.w"
    data = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".distcp"))
    assert src.files() == [os.path.join(folder, ".metadata"), *data]
    assert src.locate("w") is None  # stored in chunks: located by region
    (cb, loc), = src.locate_region("w", ((1, 4), (0, 7)))
    assert cb == ((0, 13), (0, 7)) and loc.path in data
    with pytest.raises(sdadapt.errors.SourceError, match="subtree 'nope'"):
        open_source(folder, subtree="nope")


def test_interrupted_save_without_metadata(tmp_path):
    folder = _save_single(tmp_path / "ck", _tensors())
    os.remove(os.path.join(folder, ".metadata"))
    with pytest.raises(sdadapt.errors.SourceError, match="no .metadata.*interrupted") as e:
        open_source(folder)
    assert folder in str(e.value)
    with pytest.raises(sdadapt.errors.SourceError, match="no .metadata"):
        sdadapt.load(TinyTransformer(), folder)


def test_missing_data_file(tmp_path):
    folder = _save_single(tmp_path / "ck", _tensors())
    os.remove(os.path.join(folder, "__0_0.distcp"))
    with pytest.raises(sdadapt.errors.SourceError, match=r"__0_0\.distcp.*missing"):
        open_source(folder)


def test_truncated_data_file(tmp_path):
    folder = _save_single(tmp_path / "ck", _tensors())
    path = os.path.join(folder, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
    with pytest.raises(sdadapt.errors.SourceError, match="corrupt or truncated") as e:  # found at open (item past the end)
        src = open_source(folder)
        for k, info in src.schema.items():
            src.read(k, tuple((0, n) for n in info.shape))
    assert "__0_0.distcp" in str(e.value)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_cannot_run_code(tmp_path):
    folder = _save_single(tmp_path / "ck", _tensors())
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(sdadapt.errors.SourceError, match="refusing to read DCP metadata"):
        open_source(folder)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(sdadapt.errors.SourceError, match="metadata"):
        open_source(folder)
