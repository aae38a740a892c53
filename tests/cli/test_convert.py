"""`sdadapt convert`: formats, adapter, --read-back, --subtree, progress, bad input (one process)."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch
from support.models import TinyTransformer, split_qkv

import sdadapt
from sdadapt import convert
from sdadapt.cli import main
from sdadapt.errors import ExportError

QKV = sdadapt.Adapter(
    [sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}")], name="split-qkv"
)


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    ref = TinyTransformer()
    path = tmp_path / "ck.pt"
    torch.save({"model": split_qkv(ref.state_dict()), "step": 3}, path)
    (tmp_path / "qkv.json").write_text(QKV.to_json())
    return tmp_path, ref


def _read_all(path):
    with sdadapt.sources.open_source(path) as src:
        return {k: src.read(k, tuple((0, n) for n in i.shape)).clone() for k, i in src.schema.items()}


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_cli_convert_with_adapter_and_verify(ckpt, capsys, fmt):
    folder, ref = ckpt
    dst = folder / f"out-{fmt}"
    rc = main(["convert", str(folder / "ck.pt"), str(dst), "--to", fmt, "--adapter", str(folder / "qkv.json"),
               "--subtree", "model", "--read-back", "--shard-size", "3KB"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "read back and compared" in out and "29 tensors" in out
    assert err == ""  # stderr is not a terminal here: no progress bar
    got = _read_all(dst)
    assert got.keys() == ref.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def test_cli_convert_without_adapter_skips_non_tensors(ckpt, capsys):
    folder, ref = ckpt
    rc = main(["convert", str(folder / "ck.pt"), str(folder / "flat.pt"), "--to", "torch", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0 and "B/s" not in err  # --no-progress
    assert "not written (not tensors): step" in out
    got = _read_all(folder / "flat.pt")
    want = {f"model.{k}": v for k, v in split_qkv(ref.state_dict()).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_progress_bars_on_a_terminal_only(ckpt, monkeypatch):
    folder, _ = ckpt
    argv = ["convert", str(folder / "ck.pt"), "", "--to", "torch", "--subtree", "model", "--read-back"]
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main([*argv[:2], str(folder / "a.pt"), *argv[3:]]) == 0
    shown = term.getvalue()
    assert "write" in shown and "read back" in shown and "B/s" in shown  # tqdm's bars, one per pass
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main([*argv[:2], str(folder / "b.pt"), *argv[3:], "--no-progress"]) == 0
    assert term.getvalue() == ""


def test_cli_existing_destination_and_bad_size(ckpt, capsys):
    folder, _ = ckpt
    (folder / "taken").mkdir()
    rc = main(["convert", str(folder / "ck.pt"), str(folder / "taken"), "--to", "dcp", "--no-progress"])
    assert rc == 2 and "exists" in capsys.readouterr().err
    rc = main(["convert", str(folder / "ck.pt"), str(folder / "x"), "--to", "safetensors", "--shard-size", "lots", "--no-progress"])
    assert rc == 2 and "shard size" in capsys.readouterr().err
    assert sorted(os.listdir(folder)) == ["ck.pt", "qkv.json", "taken"]


def test_read_back_catches_a_wrong_output_and_leaves_nothing(ckpt, monkeypatch):
    folder, _ = ckpt
    import sdadapt._export.writers.safetensors_writer as sw
    from sdadapt._base.tensor_bytes import tensor_bytes

    def corrupt(t):  # flip every byte of one tensor on its way to disk
        data = tensor_bytes(t)
        return bytes(255 - b for b in data) if t.shape == (16,) and len(data) else data

    monkeypatch.setattr(sw, "tensor_bytes", corrupt)
    with pytest.raises(ExportError, match="differs from the source"):
        convert(folder / "ck.pt", folder / "bad", QKV, "safetensors", subtree="model", read_back=True)
    assert sorted(os.listdir(folder)) == ["ck.pt", "qkv.json"]


def test_convert_adapter_that_does_not_apply(ckpt):
    folder, _ = ckpt
    half = sdadapt.Adapter([sdadapt.fuse(["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.nope.{p}"], "layers.{i}.attn.x.{p}")])
    with pytest.raises(ExportError, match="does not apply cleanly"):
        convert(folder / "ck.pt", folder / "bad", half, "torch", subtree="model")
    assert sorted(os.listdir(folder)) == ["ck.pt", "qkv.json"]
