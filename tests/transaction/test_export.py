"""export(): write a model through the inverse adapter; round trips, shards, atomic output."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize, split_qkv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._export.exporting import ExportError, convert

QKV = sdadapt.Adapter(
    [sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}")], name="split-qkv"
)
FORMATS = ["safetensors", "torch", "dcp"]


def _model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_through_inverse_adapter(tmp_path, fmt):
    model = _model()
    dst = str(tmp_path / "out")
    rep = sdadapt.export(model, dst, QKV, fmt, max_shard_size=4000)
    src = sdadapt.sources.open_source(dst)
    want = split_qkv(model.state_dict())  # the checkpoint layout: q/k/v split
    assert set(src.schema) == set(want)
    for k, v in want.items():
        assert torch.equal(src.read(k, tuple((0, n) for n in v.shape)), v), k
    src.close()
    back = _model(seed=1)
    sdadapt.load(back, dst, QKV)
    _assert_same(model, back)
    assert rep.tensors == len(want)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_safetensors_shards_index_and_safe_open(tmp_path):
    model = _model()
    dst = tmp_path / "hf"
    limit = 3000
    rep = sdadapt.export(model, dst, format="safetensors", max_shard_size=limit)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and rep.files == sorted(os.listdir(dst))
    sd = model.state_dict()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    for name in shards:
        with safe_open(str(dst / name), "pt") as f:
            keys = list(f.keys())
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys]
            assert sum(sizes) <= limit or len(keys) == 1, (name, sizes)
            for k in keys:
                assert index["weight_map"][k] == name
                assert torch.equal(f.get_tensor(k), sd[k]), k
    # one shard: a plain model.safetensors, no index
    one = tmp_path / "one"
    sdadapt.export(model, one)
    assert sorted(os.listdir(one)) == ["model.safetensors"]


def test_torch_export_is_a_valid_zip_and_loads_with_mmap(tmp_path):
    import zipfile

    model = _model()
    dst = str(tmp_path / "m.pt")
    sdadapt.export(model, dst, format="torch")
    with zipfile.ZipFile(dst) as z:
        assert z.testzip() is None  # CRCs of the streamed records are right
    for mmap in (True, False):
        sd = torch.load(dst, mmap=mmap, weights_only=True)
        assert sd.keys() == model.state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_existing_destination(tmp_path):
    model = _model()
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists"):
        sdadapt.export(model, dst)
    assert os.listdir(dst) == ["keep.txt"]
    sdadapt.export(model, dst, overwrite=True)
    assert os.listdir(dst) == ["model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n != "out"]


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_disk_leaves_nothing(tmp_path, monkeypatch, fmt):
    import torch.distributed.checkpoint.filesystem as fs

    import sdadapt._export.writers.safetensors_writer as sw
    import sdadapt._export.writers.torch_writer as tw

    calls = {"n": 0}

    def fail_later(f, data):  # the first writes succeed, then the disk is full
        calls["n"] += 1
        if calls["n"] > 3:
            _enospc()
        f.write(data)

    monkeypatch.setattr(sw, "write_bytes", fail_later)
    monkeypatch.setattr(tw, "write_bytes", fail_later)
    monkeypatch.setattr(fs, "_write_item", _enospc)
    dst = tmp_path / "out"
    with pytest.raises(ExportError, match="disk is full"):
        sdadapt.export(_model(), dst, QKV, fmt, max_shard_size=2000)
    assert os.listdir(tmp_path) == []


def test_meta_model_and_bad_format(tmp_path):
    with torch.device("meta"):
        model = TinyTransformer()
    with pytest.raises(ExportError, match="meta device"):
        sdadapt.export(model, tmp_path / "x")
    with pytest.raises(ExportError, match="unknown format"):
        sdadapt.export(_model(), tmp_path / "x", format="npz")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ distributed (FSDP2 + TP 2x2)
def _export_dist(folder: str) -> dict:
    torch.manual_seed(0)
    ref = TinyTransformer()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    model = parallelize(TinyTransformer(), mesh)
    with torch.no_grad():
        for k, p in model.state_dict().items():  # give the sharded model ref's values
            p.copy_(sdadapt_distribute(ref.state_dict()[k], p))
    out = {}
    for fmt in FORMATS:
        rep = sdadapt.export(model, os.path.join(folder, fmt), QKV, fmt, max_shard_size=3000)
        out[fmt] = rep.tensors
    # a full disk on rank 0 mid-way (every rank writes its regions): every rank raises, nothing is left, no hang
    import sdadapt._export.spread as spread

    n = {"calls": 0}
    orig = spread.write_at

    def flaky(fd, data, offset):
        n["calls"] += 1
        if n["calls"] > 4 and dist.get_rank() == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        orig(fd, data, offset)

    spread.write_at = flaky
    try:
        sdadapt.export(model, os.path.join(folder, "full"), QKV, max_shard_size=2000)
    except sdadapt.SdadaptError as e:
        out["error"] = type(e).__name__
    finally:
        spread.write_at = orig
    dist.barrier()
    out["left"] = sorted(n for n in os.listdir(folder) if n.startswith("full"))
    return out


def sdadapt_distribute(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, like.device_mesh, like.placements)
    return full


def test_distributed_export_fsdp_tp(tmp_path):
    results = run_distributed(_export_dist, 4, str(tmp_path), timeout=180)
    torch.manual_seed(0)
    ref = TinyTransformer()
    for fmt in FORMATS:
        back = _model(seed=5)
        sdadapt.load(back, str(tmp_path / fmt), QKV)
        _assert_same(ref, back)
    assert [r["error"] for r in results] == ["ExportError", "RemoteRankError", "RemoteRankError", "RemoteRankError"]
    assert all(r["left"] == [] for r in results)


def test_hf_export_opens_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra (models)")
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    dst = tmp_path / "hf"
    sdadapt.export(model, dst, max_shard_size=20_000)  # several shards + index
    cfg.save_pretrained(dst)
    back = transformers.LlamaForCausalLM.from_pretrained(dst)
    _assert_same(model, back)


def test_convert_refuses_a_source_that_changes_while_read(tmp_path):
    """convert runs the load transaction's file check: a source file modified during the
    conversion fails it, naming the file, and nothing is left at the destination."""
    src = tmp_path / "src.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _model().state_dict().items()}, str(src))
    dst = tmp_path / "out"

    def touch(key: str, nbytes: int) -> None:  # another writer updates the file meanwhile
        st = os.stat(src)
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    with pytest.raises(sdadapt.errors.SourceError, match="changed while it was being converted") as e:
        convert(src, dst, on_progress=touch)
    assert str(src) in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["src.safetensors"]
    convert(src, dst)  # unchanged: converts
    assert sorted(os.listdir(dst)) == ["model.safetensors"]


def test_a_rank_that_cannot_see_the_shared_folder_is_told_where_to_write(tmp_path):
    """Every-rank writes go into one temporary folder beside ``dst``, named by rank 0; a rank
    that cannot see it gets an error naming the folder, the destination and the way out."""
    from sdadapt._export.writing import shared_temp, unseen

    dst = str(tmp_path / "out")
    folder = shared_temp(dst + os.sep, None)  # one process: its own name, beside dst
    assert os.path.dirname(folder) == str(tmp_path) and os.path.basename(folder).startswith("out.tmp-")
    assert unseen(str(tmp_path), dst, "export") is None
    err = unseen(folder, dst, "convert")
    assert isinstance(err, ExportError)
    assert folder in str(err) and dst in str(err) and "convert every rank to one shared filesystem" in str(err)
