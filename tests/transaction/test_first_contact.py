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
from sdadapt._export import ExportReport
from sdadapt._plan.resolve import resolve_target, resolve_target_on_meta
from sdadapt._tools import ShrinkReport
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
        (lambda m: sdadapt.save_state("ckpt/step1", m), "sdadapt.save_state(model, dst"),
        (lambda m: sdadapt.save_state("ckpt/step1", m, torch.optim.SGD(m.parameters(), lr=0.1)), "sdadapt.save_state(model, dst"),
        (lambda m: sdadapt.load_state("ckpt/step1", m), "sdadapt.load_state(model, src"),
        (lambda m: sdadapt.load_state("ckpt/step1", m, None, {"step": 0}), "sdadapt.load_state(model, src"),
        (lambda m: sdadapt.export("hf_out", m), "sdadapt.export(model, dst"),
        (lambda m: sdadapt.diff("ckpt_dir", m), "sdadapt.diff(target, src"),
        (lambda m: sdadapt.draft("ckpt_dir", m), "sdadapt.draft(target, src"),
    ],
    ids=["load", "load-adapter", "plan_load", "save_state", "save_state-optimizer", "load_state", "load_state-extra",
         "export", "diff", "draft"],
)
def test_swapped_arguments_are_named_as_swapped(call, signature, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model()
    with pytest.raises(UsageError) as info:
        call(model)
    msg = str(info.value)
    assert "the arguments are swapped" in msg and signature in msg and "a model (Linear)" in msg, msg
    assert ("the model comes first, then the checkpoint" in msg) == ("(model, " in signature), msg
    assert isinstance(info.value, TypeError) and isinstance(info.value, sdadapt.SdadaptError)
    assert "n_heads" not in msg  # not the adapter's complaint about the wrong folder
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_model_first_then_checkpoint_runs(tmp_path):
    """The new order works: save_state(model, dst) then load_state(model, src), bit-exact."""
    torch.manual_seed(0)
    model = _model()
    dst = str(tmp_path / "ck")
    assert sdadapt.save_state(model, dst, extra={"step": 3}) == dst
    other = _model()
    extra = {"step": 0}
    rep = sdadapt.load_state(other, dst, None, extra)
    assert rep.model_keys == 2 and extra["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    "call, start, new",
    [
        (lambda m: sdadapt.load(m, "ckpt_dir", stage=True), "sdadapt.load: the keyword stage= is now atomic=",
         "call sdadapt.load(..., atomic=True)"),
        (lambda m: sdadapt.load(m, "ckpt_dir", verify=True), "sdadapt.load: the keyword verify= is now checksums=",
         "call sdadapt.load(..., checksums=True)"),
        (lambda m: sdadapt.load_state(m, "ckpt/step1", stage=True), "sdadapt.load_state: the keyword stage= is now atomic=",
         "call sdadapt.load_state(..., atomic=True)"),
        (lambda m: sdadapt.convert("ckpt.pt", "out", verify=True), "sdadapt.convert: the keyword verify= is now read_back=",
         "call sdadapt.convert(..., read_back=True)"),
        (lambda m: sdadapt.convert("ckpt.pt", "out", progress=print), "sdadapt.convert: the keyword progress= is now on_progress=",
         "call sdadapt.convert(..., on_progress=<built-in function print>)"),
    ],
    ids=["load-stage", "load-verify", "load_state-stage", "convert-verify", "convert-progress"],
)
def test_renamed_keywords_name_the_new_one(call, start, new, tmp_path, monkeypatch):
    """An old keyword is refused with a UsageError naming the new keyword, before anything is
    opened (the paths do not exist: reaching them would be a SourceError) or written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as info:
        call(_model())
    msg = str(info.value)
    assert msg.startswith(start) and new in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_renamed_keywords_keep_the_signature():
    import inspect

    load = inspect.signature(sdadapt.load).parameters
    assert list(load)[:2] == ["model", "src"] and "atomic" in load and "checksums" in load
    assert "stage" not in load and "verify" not in load
    assert list(inspect.signature(sdadapt.load_state).parameters)[:2] == ["model", "src"]
    assert list(inspect.signature(sdadapt.save_state).parameters)[:2] == ["model", "dst"]
    assert "read_back" in inspect.signature(sdadapt.convert).parameters
    assert sdadapt.load.__doc__ and "atomic=True" in sdadapt.load.__doc__


def test_convert_cli_old_verify_flag_names_read_back(tmp_path, capsys):
    code = main(["convert", str(tmp_path / "missing.pt"), str(tmp_path / "out"), "--to", "torch", "--verify"])
    err = capsys.readouterr().err
    assert code == 2 and "--verify is now --read-back" in err, err
    assert not (tmp_path / "out").exists()


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
