"""Checkpoint sources: schemas from headers, lazy region reads, format dispatch."""

from __future__ import annotations

import json
import os
import resource

import pytest
import torch
from support.checkpoints import (
    random_state_dict,
    write_hf_sharded,
    write_raw_safetensors,
    write_safetensors,
    write_torch_save,
)

import sdadapt
from sdadapt._base.regions import full_box
from sdadapt.errors import SourceError
from sdadapt.sources import HFShardedSource, SafetensorsFile, TorchSaveFile, open_source

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compares float8 and NaNs bit-exactly)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool and t.numel() else t.reshape(-1).to(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def boxes_of(shape):
    """A few boxes: the whole tensor, the first half of dim 0, an inner box, an empty box."""
    out = [full_box(shape)]
    if shape:
        out.append(((0, (shape[0] + 1) // 2),) + full_box(shape[1:]))
        out.append(tuple((min(1, n), max(min(1, n), n - 1)) for n in shape))
        out.append(((0, 0),) + full_box(shape[1:]))
    return out


def check_reads(source, sd):
    assert set(source.schema) == set(sd)
    for k, v in sd.items():
        info = source.schema[k]
        assert (info.shape, info.dtype) == (tuple(v.shape), v.dtype), k
        for box in boxes_of(tuple(v.shape)):
            assert_bit_equal(source.read(k, box), v[tuple(slice(a, b) for a, b in box)])


SPEC = {
    "embed.weight": ((7, 5), torch.float32),
    "layers.0.w": ((4, 6), torch.bfloat16),
    "layers.1.w": ((4, 6), torch.bfloat16),
    "layers.0.b": ((3,), torch.float16),
    "count": ((), torch.int64),
    "empty": ((0, 3), torch.float32),
}


# --- torch.save ---------------------------------------------------------------------------


def test_torch_save_flat(tmp_path):
    sd = random_state_dict(SPEC, seed=1)
    src = open_source(write_torch_save(tmp_path / "m.pt", sd))
    assert isinstance(src, TorchSaveFile) and src.non_tensor == []
    check_reads(src, sd)
    src.close()


def test_torch_save_nested_and_subtree(tmp_path):
    sd = random_state_dict(SPEC, seed=2)
    opt = {"state": {"0": {"exp_avg": torch.randn(3), "step": 5}}, "param_groups": [{"lr": 0.1}]}
    path = write_torch_save(tmp_path / "ckpt.pt", {"model": sd, "optimizer": opt, "step": 3, "name": "run"})
    whole = open_source(path)
    assert "model.embed.weight" in whole.schema and "optimizer.state.0.exp_avg" in whole.schema
    assert sorted(whole.non_tensor) == ["name", "optimizer.param_groups", "optimizer.state.0.step", "step"]
    assert torch.equal(whole.read("optimizer.state.0.exp_avg", ((0, 3),)), opt["state"]["0"]["exp_avg"])

    model = open_source(path, subtree="model")
    assert model.non_tensor == []
    check_reads(model, sd)
    deep = open_source(path, subtree="optimizer.state.0")
    assert list(deep.schema) == ["exp_avg"] and deep.non_tensor == ["step"]

    with pytest.raises(SourceError, match=r"subtree 'modle': no entry 'modle' \(have \['model', 'name', 'optimizer', 'step'\]\)") as e:
        open_source(path, subtree="modle")
    assert str(path) in str(e.value)
    with pytest.raises(SourceError, match="no entry 'x'"):
        open_source(path, subtree="step.x")
    with pytest.raises(SourceError, match="expected a dict of tensors, found int"):
        open_source(path, subtree="step")


def test_torch_save_single_tensor_is_refused(tmp_path):
    torch.save(torch.ones(3), tmp_path / "t.pt")
    with pytest.raises(SourceError, match="single tensor, not a state dict"):
        open_source(tmp_path / "t.pt")


def test_torch_save_parameters_and_views(tmp_path):
    # nn.Parameter values and tensors that share one storage (views) load as their own values
    base = torch.arange(24.0)
    sd = {"p": torch.nn.Parameter(torch.randn(2, 3)), "view": base[4:16].view(3, 4), "base": base}
    src = open_source(write_torch_save(tmp_path / "v.pt", sd))
    check_reads(src, {k: v.detach() for k, v in sd.items()})


def test_torch_save_is_mapped_not_read(tmp_path):
    """Opening maps the file: tensor bytes are only read when a box is read. Overwriting the
    data on disk after opening shows through (the pages were never copied)."""
    marker = torch.arange(1000, 1256, dtype=torch.float32).reshape(16, 16)
    path = write_torch_save(tmp_path / "m.pt", {"w": marker, "b": torch.zeros(2)})
    src = open_source(path)
    data = open(path, "rb").read()
    offset = data.find(marker.numpy().tobytes())
    assert offset > 0
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(torch.full((16, 16), -3.0).numpy().tobytes())
    assert torch.equal(src.read("w", ((2, 4), (5, 9))), torch.full((2, 4), -3.0))
    src.close()


# --- safetensors ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_safetensors_all_dtypes(tmp_path, dtype):
    sd = random_state_dict({"a.x": ((3, 5), dtype), "b": ((4,), dtype), "s": ((), dtype), "e": ((2, 0), dtype)}, seed=3)
    if dtype.is_floating_point and dtype.itemsize > 1:
        sd["a.x"][0, 0] = float("nan")
        sd["a.x"][0, 1] = float("-inf")
    path = write_safetensors(tmp_path / "m.safetensors", sd, metadata={"format": "pt"})
    src = open_source(path)
    assert isinstance(src, SafetensorsFile) and src.metadata == {"format": "pt"}
    check_reads(src, sd)
    src.close()


def _header_bytes(header: dict, misalign: int) -> bytes:
    """JSON header padded with spaces so that the data area starts ``misalign`` bytes past a
    multiple of 8 (the safetensors writer pads to 8; other writers may not)."""
    raw = json.dumps(header).encode()
    raw += b" " * ((misalign - 8 - len(raw)) % 8)
    assert (8 + len(raw)) % 8 == misalign
    return raw


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("misalign", [0, 1, 2, 3, 4, 6])
def test_safetensors_unaligned_data_area(tmp_path, misalign):
    names = {torch.float64: "F64", torch.bfloat16: "BF16", torch.int32: "I32", torch.int64: "I64"}
    sd = random_state_dict(
        {"d": ((3, 4), torch.float64), "h": ((5, 2), torch.bfloat16), "i": ((2, 3, 2), torch.int32), "s": ((), torch.int64)},
        seed=5,
    )
    header: dict = {"__metadata__": {"k": "v"}}
    data = b""
    for k, v in sd.items():
        blob = _raw_bytes(v)
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    path = write_raw_safetensors(tmp_path / "u.safetensors", _header_bytes(header, misalign), data)
    src = open_source(path)
    check_reads(src, sd)
    src.close()


@pytest.mark.parametrize("misalign", [0, 2], ids=["aligned", "unaligned"])
def test_safetensors_opens_from_header_only(tmp_path, misalign):
    """A 2 GiB sparse data area opens without reading it and a box read copies only what it
    needs: the process's peak memory does not grow by anything like the file's size."""
    n = 1 << 29  # float32 elements: 2 GiB
    rows = n // 1024
    header = {"big": {"dtype": "F32", "shape": [rows, 1024], "data_offsets": [0, 4 * n]}}
    path = write_raw_safetensors(tmp_path / "sparse.safetensors", _header_bytes(header, misalign))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + 4 * n)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    src = open_source(path)
    assert src.schema["big"].shape == (rows, 1024)
    assert torch.equal(src.read("big", ((5, 7), (0, 3))), torch.zeros(2, 3))
    assert torch.equal(src.read("big", ((rows - 1, rows), (1020, 1024))), torch.zeros(1, 4))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown < 256 * 1024, f"peak RSS grew by {grown} KiB opening a sparse 2 GiB file"
    src.close()


def test_safetensors_reads_lazily(tmp_path):
    marker = torch.arange(5000, 5064, dtype=torch.int32).reshape(8, 8)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": marker})
    src = open_source(path)
    data = open(path, "rb").read()
    offset = data.find(marker.numpy().tobytes())
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(torch.full((8, 8), 9, dtype=torch.int32).numpy().tobytes())
    assert torch.equal(src.read("w", ((0, 2), (0, 8))), torch.full((2, 8), 9, dtype=torch.int32))


# --- HF sharded -------------------------------------------------------------------------------


def test_hf_sharded_follows_index(tmp_path):
    sd = random_state_dict({f"layers.{i}.w": ((8, 4), torch.bfloat16) for i in range(5)} | SPEC, seed=4)
    folder = write_hf_sharded(tmp_path / "hf", sd, max_shard_bytes=130)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    # stray files the index does not name: never read, whatever they hold
    write_safetensors(os.path.join(folder, "consolidated.safetensors"), {"stray": torch.ones(2)})
    with open(os.path.join(folder, "model-00099-of-00099.safetensors"), "wb") as f:
        f.write(b"garbage, not a safetensors file")
    src = open_source(folder)
    assert isinstance(src, HFShardedSource)
    check_reads(src, sd)
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    for k in sd:
        assert src.file_of(k) == os.path.join(folder, index["weight_map"][k])
    src.close()
    # the index file itself may be given
    src2 = open_source(os.path.join(folder, "model.safetensors.index.json"))
    assert isinstance(src2, HFShardedSource) and set(src2.schema) == set(sd)


def test_declared_capabilities(tmp_path):
    """Every source declares its files, key names and byte locations through the base class;
    a verifying wrapper delegates files and names but hands out no locations (every byte it
    serves is checked)."""
    from sdadapt.sources._integrity import ChecksummedSource, read_checksums, write_checksums

    sd = random_state_dict(SPEC, seed=5)
    st = str(write_safetensors(tmp_path / "m.safetensors", sd))
    pt = str(write_torch_save(tmp_path / "m.pt", sd))
    hf = str(write_hf_sharded(tmp_path / "hf", sd, max_shard_bytes=200))
    shards = sorted(os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors"))
    want_files = {st: [st], pt: [pt], hf: [os.path.join(hf, "model.safetensors.index.json"), *shards]}
    for path, files in want_files.items():
        with open_source(path) as src:
            assert src.files() == files, path
            for key, info in src.schema.items():
                assert src.stored_key(key) == key
                loc = src.locate(key)
                if loc is None:
                    assert src.locate_region(key, full_box(info.shape)) is None
                    continue
                box = tuple((0, max(1, n // 2)) if n else (0, 0) for n in info.shape)
                assert src.locate_region(key, box) == [(full_box(info.shape), loc)], (path, key)
    write_checksums(st)
    with open_source(st) as inner:
        sidecar, entries = read_checksums(inner)
        verifying = ChecksummedSource(inner, sidecar, entries, list(inner.schema))
        assert verifying.files() == [st]
        key = next(iter(inner.schema))
        assert inner.locate(key) is not None
        assert verifying.locate(key) is None
        assert verifying.locate_region(key, full_box(inner.schema[key].shape)) is None
        assert verifying.stored_key(key) == key


def test_hf_sharded_index_subset_of_shard(tmp_path):
    # a shard may hold tensors the index does not list: only the index's keys are the schema
    folder = tmp_path / "hf"
    folder.mkdir()
    write_safetensors(folder / "a.safetensors", {"x": torch.ones(2), "y": torch.zeros(3)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    src = open_source(folder)
    assert list(src.schema) == ["x"]


# --- dispatch -----------------------------------------------------------------------------------


def test_open_source_dispatch(tmp_path):
    sd = {"w": torch.randn(2, 3)}
    write_safetensors(tmp_path / "file.safetensors", sd)
    write_torch_save(tmp_path / "file.bin", sd)
    write_torch_save(tmp_path / "file.pt", sd)
    (tmp_path / "single").mkdir()
    write_safetensors(tmp_path / "single" / "model.safetensors", sd)
    write_hf_sharded(tmp_path / "sharded", sd)
    kinds = {
        "file.safetensors": SafetensorsFile,
        "file.bin": TorchSaveFile,
        "file.pt": TorchSaveFile,
        "single": SafetensorsFile,
        "sharded": HFShardedSource,
    }
    for name, kind in kinds.items():
        for p in (str(tmp_path / name), tmp_path / name):  # str and PathLike
            with open_source(p) as src:
                assert type(src) is kind, name
                assert torch.equal(src.read("w", full_box((2, 3))), sd["w"])
    src = open_source(tmp_path / "file.pt")
    assert open_source(src) is src  # a Source passes through
    assert "TorchSaveFile" in repr(src) and "1 tensors" in repr(src)


def test_diff_and_load_accept_every_format(tmp_path):
    model = torch.nn.Linear(3, 2)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_torch_save(tmp_path / "m.pt", sd)
    write_safetensors(tmp_path / "m.safetensors", sd)
    write_hf_sharded(tmp_path / "hf", sd, max_shard_bytes=8)
    for p in ("m.pt", "m.safetensors", "hf"):
        assert sdadapt.diff(model, tmp_path / p).ok
        target = torch.nn.Linear(3, 2)
        torch.nn.init.zeros_(target.weight)
        rep = sdadapt.load(target, tmp_path / p)
        assert rep.keys_loaded == 2
        assert torch.equal(target.weight, sd["weight"]) and torch.equal(target.bias, sd["bias"])
