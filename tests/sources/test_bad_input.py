"""Bad input, single process: every case is a SdadaptError naming the file (and key), and a
failed ``sdadapt.load`` leaves the model as it was. (Distributed variants live elsewhere.)"""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch
from support.checkpoints import INDEX_NAME, write_hf_sharded, write_raw_safetensors, write_safetensors, write_torch_save
from support.dist_helper import run_distributed
from torch import nn

import sdadapt
from sdadapt.errors import PlanError, SdadaptError, SourceError
from sdadapt.sources import open_source


def expect_source_error(path, *fragments, key=None, opener=open_source, **kw) -> SourceError:
    with pytest.raises(SourceError) as info:
        opener(path, **kw)
    err = info.value
    msg = str(err)
    assert isinstance(err, SdadaptError) and isinstance(err, Exception)
    assert os.fspath(err.path) in msg, msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    if key is not None:
        assert err.key == key and repr(key) in msg, msg
    return err


SD = {"w": torch.arange(16.0).reshape(4, 4), "b": torch.arange(4.0)}


# --- paths and folders ---------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.safetensors"
    err = expect_source_error(missing, "no such file or folder")
    assert err.path == str(missing)
    with pytest.raises(SourceError, match="no such file"):
        sdadapt.diff(nn.Linear(2, 2), missing)
    with pytest.raises(SourceError, match="no such file"):
        sdadapt.load(nn.Linear(2, 2), missing)


def test_folder_without_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    write_safetensors(tmp_path / "weights.safetensors", SD)  # not named model.safetensors: we do not guess
    expect_source_error(tmp_path, "holds no checkpoint", "pass the checkpoint file itself", str(tmp_path / "weights.safetensors"))
    (tmp_path / "weights.safetensors").unlink()
    expect_source_error(tmp_path, "holds no checkpoint", "notes.txt")


def test_shards_without_an_index_are_not_told_to_pass_one_file(tmp_path):
    """One shard of several would load a part of the model: the missing index is named."""
    for i in range(1, 4):
        write_safetensors(tmp_path / f"model-0000{i}-of-00003.safetensors", SD)
    err = expect_source_error(tmp_path, "model.safetensors.index.json", "is missing", "3 weight files",
                              "model-00001-of-00003.safetensors", "only a part of the model")
    assert "pass the checkpoint file itself:" not in str(err)


def test_folder_with_an_index_of_another_name_points_at_it(tmp_path):
    write_safetensors(tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors", SD)
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {}}')
    expect_source_error(tmp_path, "diffusion_pytorch_model.safetensors.index.json", "pass that file")


def test_empty_file(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"")
    expect_source_error(tmp_path / "m.safetensors", "empty file")


# --- HF index -------------------------------------------------------------------------------


def _hf(tmp_path, weight_map=None, raw=None, name="hf"):
    folder = tmp_path / name
    folder.mkdir()
    write_safetensors(folder / "a.safetensors", {"x": torch.ones(2)})
    text = raw if raw is not None else json.dumps({"weight_map": weight_map})
    (folder / INDEX_NAME).write_text(text)
    return folder


def test_index_names_missing_shard(tmp_path):
    folder = _hf(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    err = expect_source_error(folder, "'b.safetensors'", "does not exist", key="y")
    assert err.path.endswith(INDEX_NAME)


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS", "", ["a"], 3])
def test_index_names_path_outside_folder(tmp_path, name):
    write_safetensors(tmp_path / "outside.safetensors", {"y": torch.ones(2)})
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    folder = _hf(tmp_path, {"x": "a.safetensors", "y": name})
    if isinstance(name, str):
        expect_source_error(folder, "not a plain file name inside the folder", key="y")
    else:  # not a file name at all: the index's field is named
        expect_source_error(folder, "field weight_map.y: Input should be a valid string")


def test_index_shard_symlink_leading_out(tmp_path):
    write_safetensors(tmp_path / "outside.safetensors", {"y": torch.ones(2)})
    folder = _hf(tmp_path, {"x": "a.safetensors", "y": "b.safetensors", "z": "sub/c.safetensors"})
    os.symlink(tmp_path / "outside.safetensors", folder / "b.safetensors")
    expect_source_error(folder, "outside the checkpoint folder", "symlink", key="y")
    # a symlinked sub-folder leading out is refused too
    folder2 = _hf(tmp_path, {"x": "a.safetensors", "z": "sub/outside.safetensors"}, name="hf2")
    os.symlink(tmp_path, folder2 / "sub")
    expect_source_error(folder2, "outside the checkpoint folder", key="z")


def test_index_symlink_inside_folder_is_fine(tmp_path):
    folder = _hf(tmp_path, {"x": "link.safetensors"})
    os.symlink(folder / "a.safetensors", folder / "link.safetensors")
    assert list(open_source(folder).schema) == ["x"]


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ('{"weight_map": ', "not valid JSON"),
        ('{"metadata": {}}', "field weight_map: Field required"),
        ('{"weight_map": ["a.safetensors"]}', "field weight_map: Input should be a valid dictionary"),
        ('{"weight_map": {"x": 3}}', "field weight_map.x: Input should be a valid string"),
        ("[1, 2]", "index must be a JSON object"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 100 + b"]" * 100, "nests 100 levels deep"),
    ],
)
def test_corrupt_index(tmp_path, raw, fragment):
    folder = _hf(tmp_path, raw="")
    (folder / INDEX_NAME).write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    err = expect_source_error(folder, fragment)
    assert err.path.endswith(INDEX_NAME)


def test_index_key_not_in_its_shard(tmp_path):
    folder = _hf(tmp_path, {"x": "a.safetensors", "ghost": "a.safetensors"})
    err = expect_source_error(folder, "no such tensor", key="ghost")
    assert err.path.endswith("a.safetensors")


def test_key_in_two_shards(tmp_path):
    folder = _hf(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    write_safetensors(folder / "b.safetensors", {"x": torch.zeros(2), "y": torch.ones(2)})
    expect_source_error(folder, "'x' is stored in two shards", "ambiguous")


def test_corrupt_shard_names_the_shard(tmp_path):
    folder = write_hf_sharded(tmp_path / "hf", SD, max_shard_bytes=16)
    shard = os.path.join(folder, json.load(open(os.path.join(folder, INDEX_NAME)))["weight_map"]["b"])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    err = expect_source_error(folder, "outside the data area", key="b")
    assert err.path == shard


# --- safetensors ----------------------------------------------------------------------------

E = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "header, data, header_len, fragments, key",
    [
        # header length past the end of the file
        ({"w": E}, bytes(16), 10**6, ["header length 1000000 does not fit the file size"], None),
        ({"w": E}, bytes(16), 2**63, ["header length"], None),
        # offsets past the end (truncated data area)
        ({"w": E}, bytes(12), None, ["data_offsets [0, 16] point outside the data area of 12 bytes"], "w"),
        ({"w": {**E, "data_offsets": [8, 4]}}, bytes(16), None, ["point outside"], "w"),
        ({"w": {**E, "data_offsets": [-4, 12]}}, bytes(16), None, ["point outside"], "w"),
        # overlapping tensors
        (
            {"a": {**E, "shape": [2], "data_offsets": [0, 8]}, "b": {**E, "shape": [2], "data_offsets": [4, 12]}},
            bytes(16),
            None,
            ["'a' and 'b' overlap"],
            None,
        ),
        # size disagrees with shape
        ({"w": {**E, "shape": [3, 2]}}, bytes(24), None, ["span 16 bytes but shape [3, 2] of F32 needs 24"], "w"),
        # bad JSON, wrong types
        (b'{"w": {"dtype": "F32", ', bytes(16), None, ["not valid JSON"], None),
        (b"\xff\xfe\xfd", b"", None, ["not valid JSON"], None),
        ([1, 2], b"", None, ["not a JSON object"], None),
        ({"w": E, "__metadata__": [1]}, bytes(16), None, ["__metadata__ is not an object"], None),
        ({"w": {**E, "dtype": "F4"}}, bytes(16), None, ["unsupported dtype 'F4'"], "w"),
        ({"w": {**E, "shape": [2, -2]}}, bytes(16), None, ["corrupt shape"], "w"),
        ({"w": {**E, "shape": "2x2"}}, bytes(16), None, ["corrupt shape"], "w"),
        ({"w": {**E, "data_offsets": [0]}}, bytes(16), None, ["corrupt data_offsets"], "w"),
        ({"w": {**E, "data_offsets": [0.0, 16.0]}}, bytes(16), None, ["corrupt data_offsets"], "w"),
        # JSON booleans are no sizes or offsets (Python's bool is an int)
        ({"w": {**E, "shape": [True, 4]}}, bytes(16), None, ["corrupt shape"], "w"),
        ({"w": {**E, "shape": [2, 2.0]}}, bytes(16), None, ["corrupt shape"], "w"),
        ({"w": {**E, "data_offsets": [False, 16]}}, bytes(16), None, ["corrupt data_offsets"], "w"),
        ({"w": {"dtype": "F32", "shape": [2, 2], "offsets": [0, 16]}}, bytes(16), None, ["needs dtype, shape, data_offsets"], "w"),
        ({"w": {**E, "extra": 1}}, bytes(16), None, ["needs dtype, shape, data_offsets"], "w"),
        ({"w": [1]}, bytes(16), None, ["needs dtype, shape, data_offsets"], "w"),
    ],
)
def test_corrupt_safetensors(tmp_path, header, data, header_len, fragments, key):
    path = write_raw_safetensors(tmp_path / "bad.safetensors", header, data, header_len=header_len)
    expect_source_error(path, *fragments, key=key)


def test_truncated_safetensors(tmp_path):
    path = write_safetensors(tmp_path / "m.safetensors", SD)
    data = open(path, "rb").read()
    for cut, fragment in ((len(data) - 1, "point outside the data area"), (40, "does not fit the file size"), (5, "shorter than")):
        with open(path, "wb") as f:
            f.write(data[:cut])
        expect_source_error(path, fragment)


# --- torch.save -----------------------------------------------------------------------------


def test_truncated_zip(tmp_path):
    path = write_torch_save(tmp_path / "m.pt", SD)
    data = open(path, "rb").read()
    for cut in (len(data) // 2, len(data) - 30, 10):
        with open(path, "wb") as f:
            f.write(data[:cut])
        expect_source_error(path, "corrupt or truncated torch.save file", "save or download it again")


def test_zip_record_shorter_than_tensor(tmp_path):
    """A damaged archive whose data record is shorter than the tensor it holds: torch would
    map the neighbouring bytes as values; we refuse it, naming the key."""
    src = write_torch_save(tmp_path / "ok.pt", {"w": torch.arange(16.0), "b": torch.arange(4.0)})
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data/0"):
                data = data[:20]
            zout.writestr(info, data)
    expect_source_error(bad, "data record in the zip is shorter than the tensor", key="w")


def test_corrupt_pickle_inside_zip(tmp_path):
    src = write_torch_save(tmp_path / "ok.pt", SD)
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = data[: len(data) // 2]
            zout.writestr(info, data)
    expect_source_error(bad, "torch.save file")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "m.pt").write_text("hello, I am text")
    expect_source_error(tmp_path / "m.pt", "not a torch.save (zip) file")


def test_legacy_torch_save(tmp_path):
    path = write_torch_save(tmp_path / "old.pt", SD, legacy=True)
    expect_source_error(path, "legacy (non-zip) torch.save format", "re-save it")


class _Unsafe:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _Plain:
    pass


def test_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "evil": _Unsafe(str(marker))}, tmp_path / "evil.pt")
    expect_source_error(tmp_path / "evil.pt", "refusing to unpickle", "mkdir", "never runs code")
    assert not marker.exists()
    torch.save({"w": torch.ones(2), "obj": _Plain()}, tmp_path / "obj.pt")
    expect_source_error(tmp_path / "obj.pt", "refusing to unpickle", "_Plain")


def _save_dtensor(path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.save({"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]), "b": torch.ones(2)}, path)
    torch.save({"model": {"layer.w": distribute_tensor(torch.ones(2), mesh, [Shard(0)])}}, path + ".nested")
    return True


def test_torch_save_of_dtensor(tmp_path):
    path = str(tmp_path / "sharded.pt")
    assert run_distributed(_save_dtensor, 1, path, timeout=90) == [True]
    expect_source_error(path, "holds sharded pieces (DTensor)", "full_state_dict=True", key="w")
    expect_source_error(path + ".nested", "sharded pieces", key="layer.w", subtree="model")


# --- plan-level bad input: reported, nothing loaded ---------------------------------------------


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 3)


def _good_sd():
    torch.manual_seed(1)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def test_non_tensor_entries(tmp_path):
    path = write_torch_save(tmp_path / "m.pt", {**_good_sd(), "epoch": 3, "cfg": {"lr": 0.1}})
    model = Net()
    before = _snapshot(model)
    with pytest.raises(PlanError) as e:
        sdadapt.load(model, path)
    msg = str(e.value)
    assert str(path) in msg and "not tensors" in msg and "epoch" in msg and "cfg.lr" in msg
    assert e.value.report.non_tensor == ["cfg.lr", "epoch"]
    _assert_untouched(model, before)
    # dropping them (or allowing them) is the fix the message suggests
    sdadapt.load(model, path, sdadapt.Adapter([sdadapt.drop("epoch"), sdadapt.drop("cfg.**")]))
    _assert_untouched(model, _good_sd())


def test_dtype_change_without_rule(tmp_path):
    sd = _good_sd()
    sd["proj.weight"] = sd["proj.weight"].to(torch.float64)  # a narrowing: bfloat16 would widen exactly
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    model = Net()
    before = _snapshot(model)
    with pytest.raises(PlanError) as e:
        sdadapt.load(model, path)
    msg = str(e.value)
    assert str(path) in msg and "proj.weight: model float32, checkpoint gives float64" in msg
    assert 'sdadapt.cast("**", "model")' in msg
    _assert_untouched(model, before)
    rep = sdadapt.load(model, path, sdadapt.Adapter([sdadapt.cast("proj.weight", "float32", from_dtype="float64")]))
    assert rep.keys_loaded == 3
    assert torch.equal(model.proj.weight, sd["proj.weight"].float())


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
def test_failed_validation_leaves_model_untouched(tmp_path, meta):
    sd = _good_sd()
    bad = dict(sd)
    bad["proj.wieght"] = bad.pop("proj.weight")  # misspelt
    bad["extra"] = torch.ones(1)
    bad["embed.weight"] = torch.ones(6, 4)  # wrong shape
    cases = {
        "plan": write_torch_save(tmp_path / "bad.pt", bad),
        "corrupt": write_raw_safetensors(tmp_path / "c.safetensors", {"w": E}, bytes(4)),
        "missing": str(tmp_path / "absent.pt"),
    }
    for name, path in cases.items():
        if meta:
            with torch.device("meta"):
                model = Net()
        else:
            model = Net()
            before = _snapshot(model)
            params = {k: (p, p.data_ptr()) for k, p in model.named_parameters()}
        with pytest.raises(SdadaptError) as e:
            sdadapt.load(model, path)
        assert str(path) in str(e.value), name
        if meta:
            assert all(p.is_meta for p in model.parameters()), name
        else:
            _assert_untouched(model, before)
            assert {k: (p, p.data_ptr()) for k, p in model.named_parameters()} == params
    # strict=False with problems still loads what lines up, and only that
    model = Net()
    before = _snapshot(model)
    rep = sdadapt.load(model, cases["plan"], strict=False)
    assert rep.keys_loaded == 1  # proj.bias
    assert torch.equal(model.proj.bias, sd["proj.bias"])
    assert torch.equal(model.proj.weight, before["proj.weight"]) and torch.equal(model.embed.weight, before["embed.weight"])
