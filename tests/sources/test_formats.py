"""The table of formats: every open path and suffix list derives from its entries."""

from __future__ import annotations

import os

import pytest
import torch
from support.checkpoints import random_state_dict, write_hf_sharded, write_safetensors, write_torch_save

from sdadapt.sources import FILE_SUFFIXES, _assets, _formats, _remote, open_source, recordable
from sdadapt.sources._base import Format

SPEC = {"a.weight": ((64, 32), torch.float32), "b.weight": ((16, 8), torch.bfloat16), "c.bias": ((16,), torch.float16)}


def test_every_suffix_list_comes_from_the_table() -> None:
    suffixes = {s for f in _formats.FORMATS for s in f.suffixes}
    assert suffixes <= set(FILE_SUFFIXES)
    assert {s for s in suffixes if s != ".index.json"} <= set(_assets.WEIGHT_SUFFIXES)
    assert _assets.WEIGHT_SUFFIXES is _formats.WEIGHT_SUFFIXES
    assert not hasattr(_remote, "_WEIGHTS")  # the remote side asks the table, keeps no list of its own
    names = [f.name for f in _formats.FORMATS]
    assert len(set(names)) == len(names)
    assert [f.any_file for f in _formats.FORMATS][-1] and sum(f.any_file for f in _formats.FORMATS) == 1


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("model-00001-of-00002.safetensors", "safetensors"),
        ("model.safetensors.index.json", "hf_sharded"),
        ("__0_0.distcp", "dcp"),
        ("pytorch_model.bin", "torch_save"),
        ("consolidated.00.pth", "torch_save"),
        ("config.json", None),
        (".metadata", None),
        ("tokenizer.model", None),
    ],
)
def test_an_object_name_picks_its_format(name: str, fmt: str | None) -> None:
    got = _formats.format_of_name(name)
    assert (got.name if got else None) == fmt


def test_a_single_object_of_unknown_ending_is_a_torch_save_file() -> None:
    got = _formats.format_of_name("weights.data", single=True)
    assert got is not None and got.name == "torch_save"
    assert _formats.format_of_name("params.json", single=True) is None


def test_local_paths_open_through_the_format_that_claims_them(tmp_path: str) -> None:
    sd = random_state_dict(SPEC, seed=3)
    folder = os.path.join(tmp_path, "hf")
    write_hf_sharded(folder, sd, max_shard_bytes=4096)
    single = os.path.join(tmp_path, "one")
    os.makedirs(single)
    write_safetensors(os.path.join(single, "model.safetensors"), sd)
    pt = os.path.join(tmp_path, "w.pt")
    write_torch_save(pt, sd)
    cases = {
        folder: "hf_sharded",
        os.path.join(folder, "model.safetensors.index.json"): "hf_sharded",
        single: "safetensors",
        os.path.join(single, "model.safetensors"): "safetensors",
        pt: "torch_save",
    }
    for path, name in cases.items():
        fmt = _formats.format_of(path)
        assert fmt is not None and fmt.name == name, path
        with open_source(path) as src:
            assert set(src.schema) == set(sd)
            key = next(iter(sd))
            info = src.schema[key]
            assert torch.equal(src.read(key, tuple((0, n) for n in info.shape)), sd[key])
    assert _formats.format_of(str(tmp_path)) is None  # a folder of folders: no format claims it


def test_recordable_follows_the_table(tmp_path: str) -> None:
    sd = random_state_dict(SPEC, seed=4)
    folder = os.path.join(tmp_path, "hf")
    write_hf_sharded(folder, sd, max_shard_bytes=4096)
    pt = os.path.join(tmp_path, "w.pt")
    write_torch_save(pt, sd)
    assert recordable(folder) and recordable(os.path.join(folder, "model.safetensors.index.json"))
    assert recordable("s3://bucket/model.safetensors")
    assert not recordable(pt) and not recordable("s3://bucket/folder")
    with open_source(folder) as src:
        assert not recordable(src)  # an open source: nothing to record
    for fmt in _formats.FORMATS:
        assert isinstance(fmt, Format)
        if fmt.recordable:
            assert fmt.header_ranges is not None  # what one rank records, a URL's opening fetches


def test_header_ranges_fetch_exactly_what_opening_reads(tmp_path: str) -> None:
    """Each format's declared header ranges, fetched into a sparse copy, are enough to open it."""
    sd = random_state_dict({"big.weight": ((512, 256), torch.float32), **SPEC}, seed=5)
    pt = os.path.join(tmp_path, "w.pt")
    write_torch_save(pt, sd)
    st = os.path.join(tmp_path, "w.safetensors")
    write_safetensors(st, sd)
    for path in (pt, st):
        size = os.path.getsize(path)
        copy = os.path.join(tmp_path, "copy" + os.path.splitext(path)[1])
        with open(copy, "wb") as f:
            f.truncate(size)
        fmt = _formats.format_of_name(path)
        assert fmt is not None and fmt.header_ranges is not None
        fetched = 0
        for ranges in fmt.header_ranges(copy, size):
            with open(path, "rb") as src, open(copy, "r+b") as dst:
                for a, b in ranges:
                    src.seek(a)
                    dst.seek(a)
                    dst.write(src.read(b - a))
                    fetched += b - a
        assert 0 < fetched < size
        with open_source(copy) as src:
            assert set(src.schema) == set(sd)


def test_the_tables_lazy_torch_save_entry_agrees_with_the_modules_format(tmp_path: str) -> None:
    """The table declares ``torch.save`` files without importing their reader (a plain
    safetensors load never does); it is the reader's own ``FORMAT``."""
    from sdadapt.sources import _torch_save

    pt = os.path.join(tmp_path, "w.pt")
    write_torch_save(pt, random_state_dict(SPEC, seed=7))
    lazy, own = _formats.format_of(pt), _torch_save.FORMAT
    assert lazy is not None and lazy is not own and lazy is _formats.FORMATS[-1]
    for field in ("name", "suffixes", "recordable", "folder_file", "members", "any_file", "config"):
        assert getattr(lazy, field) == getattr(own, field), field
    assert lazy.claims(pt) and own.claims(pt) and not lazy.claims(pt + ".missing")
    size = os.path.getsize(pt)
    assert lazy.header_ranges is not None and own.header_ranges is not None
    assert list(lazy.header_ranges(pt, size)) == list(own.header_ranges(pt, size))
    with lazy.open(pt, None) as src, own.open(pt, None) as other:
        assert isinstance(src, _torch_save.TorchSaveFile) and src.schema == other.schema
