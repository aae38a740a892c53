"""What a newcomer runs into first: swapped arguments named as such, reports that print as a
summary, and ``--target`` models built on the meta device (or a note saying they were not)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel
from torch import nn

import sdadapt
from sdadapt._plan.resolve import resolve_target, resolve_target_on_meta
from sdadapt._transaction.export import ExportReport
from sdadapt._transaction.shrink import ShrinkReport
from sdadapt.cli import main
from sdadapt.errors import UsageError
from sdadapt.sources._inventory import Inventory, InventoryRow


def _model() -> nn.Module:
    return nn.Linear(4, 4)


@pytest.mark.parametrize(
    "call, signature",
    [
        (lambda m: sdadapt.load("ckpt_dir", m), "sdadapt.load(model, src"),
        (lambda m: sdadapt.load("ckpt_dir", m, "llama"), "sdadapt.load(model, src"),
        (lambda m: sdadapt.plan_load("ckpt_dir", m), "sdadapt.plan_load(model, src"),
        (lambda m: sdadapt.save_state(m, "ckpt/step1"), "sdadapt.save_state(dst, model"),
        (lambda m: sdadapt.load_state(m, "ckpt/step1"), "sdadapt.load_state(src, model"),
        (lambda m: sdadapt.export("hf_out", m), "sdadapt.export(model, dst"),
        (lambda m: sdadapt.diff("ckpt_dir", m), "sdadapt.diff(target, src"),
    ],
    ids=["load", "load-adapter", "plan_load", "save_state", "load_state", "export", "diff"],
)
def test_swapped_arguments_are_named_as_swapped(call, signature, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model()
    with pytest.raises(UsageError) as info:
        call(model)
    msg = str(info.value)
    assert "the arguments are swapped" in msg and signature in msg and "a model (Linear)" in msg, msg
    assert isinstance(info.value, TypeError) and isinstance(info.value, sdadapt.SdadaptError)
    assert "n_heads" not in msg  # not the adapter's complaint about the wrong folder
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_convert_given_a_model_points_at_export(tmp_path):
    with pytest.raises(UsageError, match=r"sdadapt.convert: src must be a checkpoint path, not a model \(Linear\).*sdadapt.export"):
        sdadapt.convert(_model(), str(tmp_path / "out"))
    with pytest.raises(UsageError, match=r"sdadapt.convert: dst must be a checkpoint path, not a model \(Linear\)"):
        sdadapt.convert("out", _model())


def test_a_model_that_is_not_a_module_is_named():
    with pytest.raises(UsageError, match=r"sdadapt.load: model must be a torch.nn.Module, not the path 'a.pt'"):
        sdadapt.load("a.pt", "b.pt")
    with pytest.raises(UsageError, match=r"export_iter: model must be a torch.nn.Module, not a dict"):
        next(sdadapt.export_iter({"w": torch.zeros(1)}))


def test_reports_print_as_a_summary():
    export = ExportReport(dst="out", format="safetensors", tensors=3, bytes=2**20, files=["model.safetensors"], seconds=0.5)
    assert str(export) == export.format_text() and str(export).startswith("wrote out (safetensors: 3 tensors, 1.0 MiB")
    shrink = ShrinkReport(dst="small", layers=2, layers_before=4, tensors=9, tensors_dropped=8, bytes=10, files=["a"], seconds=0.1)
    assert str(shrink) == shrink.format_text() and str(shrink).startswith("wrote small: 2 of 4 layers")
    rows = [InventoryRow(keys="w", count=1, shape=[2, 2], dtype="float32", bytes=16)]
    inv = Inventory(source="ck.pt", kind="torch.save", tensors=1, bytes=16, dtypes={"float32": 16}, rows=rows)
    assert str(inv) == inv.format() and "total: 1 tensors" in str(inv)


def test_every_public_report_has_a_readable_str():
    """A public pydantic result with a text form (``format`` / ``format_text``) prints that form,
    not its fields."""
    found = []
    for name in sdadapt.reports.__all__:
        obj = getattr(sdadapt.reports, name)
        if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
            continue
        if not any(callable(vars(obj).get(m)) for m in ("format", "format_text")):
            continue
        found.append(name)
        assert obj.__str__ is not BaseModel.__str__, f"sdadapt.reports.{name} prints its pydantic fields"
    assert {"ExportReport", "LoadReport", "StateLoadReport", "Report", "ShrinkReport"} <= set(found), found


TARGETS = textwrap.dedent(
    """
    import torch
    from torch import nn

    BUILT = []

    class Net(nn.Module):
        def __init__(self, dim: int = 4):
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            BUILT.append(self.fc.weight.device.type)

    def on_cpu():
        return Net().to_empty(device="cpu")

    def broken():
        raise ValueError("broken builder")

    def needs_values():
        net = Net()
        float(net.fc.weight.detach().sum())  # .item() on meta fails: this builder needs real values
        return net
    """
)


@pytest.fixture
def targets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nets.py").write_text(TARGETS)
    torch.save({"fc.weight": torch.zeros(4, 4), "fc.bias": torch.zeros(4)}, tmp_path / "ck.pt")
    return tmp_path


def test_target_is_built_on_meta(targets):
    model, note = resolve_target_on_meta("nets.py:Net", dim=8)
    assert note is None and all(p.is_meta for p in model.parameters()) and model.fc.weight.shape == (8, 8)
    # the Python function keeps building as the function does
    assert not resolve_target("nets.py:Net").fc.weight.is_meta
    assert resolve_target_on_meta("ck.pt") == ("ck.pt", None)


@pytest.mark.parametrize("spec, says", [("nets.py:on_cpu", "put its tensors on cpu"), ("nets.py:needs_values", "failed")])
def test_target_with_real_tensors_is_said(targets, spec, says, capsys):
    model, note = resolve_target_on_meta(spec)
    assert not model.fc.weight.is_meta and note and says in note and "80 B of real tensors" in note, note
    for command in (["diff", "ck.pt", "--target", spec], ["draft", "ck.pt", "--target", spec]):
        capsys.readouterr()
        assert main(command) == 0
        err = capsys.readouterr().err
        assert err.startswith("note: ") and says in err, err


def test_target_that_fails_either_way_raises_its_own_error(targets):
    with pytest.raises(sdadapt.errors.ResolveError, match="broken builder"):
        resolve_target_on_meta("nets.py:broken")


def test_module_that_needs_values_at_import_is_built_without_meta(targets):
    Path("eager.py").write_text(TARGETS + "\nSIZE = int(torch.tensor(4).item())  # needs a value at import\n")
    model, note = resolve_target_on_meta("eager.py:Net")
    assert not model.fc.weight.is_meta and note and "failed" in note and "importing" in note, note


def test_cli_target_on_meta_prints_no_note(targets, capsys):
    assert main(["diff", "ck.pt", "--target", "nets.py:Net"]) == 0
    captured = capsys.readouterr()
    assert "note:" not in captured.err and "OK" in captured.out
    assert Path("ck.pt").exists()
