"""Adapters by name: every function that takes an adapter also takes the strings the CLI's
``--adapter`` takes (a shipped name with options read from the source, ``file.py:ATTR``,
``module:ATTR``, ``.json``), resolved the same way."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import sdadapt
from sdadapt._plan import registry as registry
from sdadapt.errors import AdapterError, ResolveError

# the checkpoint keeps ``model.0.q`` (HF rotary rows), the model holds ``0.wq`` (Meta rows)
RENAME_ONLY = sdadapt.Adapter([sdadapt.rename("model.{i}.q", "{i}.wq")], name="rename-only")
W = torch.arange(8.0).reshape(8, 1)
META_ROWS = torch.tensor([0.0, 2, 1, 3, 4, 6, 5, 7])  # heads=2, head_dim=4: halves -> pairs


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.zeros(8, 1))


@pytest.fixture
def folder(monkeypatch, tmp_path):
    """An HF-style folder (config.json + model.safetensors) and the test registry (``tiny``)."""
    monkeypatch.setattr(registry, "PACKAGE", "support.fake_adapters")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 2, "hidden_size": 8}))
    save_file({"model.0.q": W}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _flat_model() -> nn.Module:
    """A model whose parameter is named ``0.wq`` (through a ModuleDict)."""
    return nn.ModuleDict({"0": _Block()})


def test_load_by_shipped_name_reads_options_from_source(folder):
    model = _flat_model()
    rep = sdadapt.load(model, folder, "tiny")  # heads=2 comes from config.json
    assert rep.report.ok
    assert torch.equal(model["0"].wq.detach().flatten(), META_ROWS)
    # the same as the Adapter object the registry builds
    ref = _flat_model()
    sdadapt.load(ref, folder, sdadapt.get_adapter("tiny", heads=2, dim=8))
    assert torch.equal(ref["0"].wq, model["0"].wq)
    _source, plan = sdadapt.plan_load(_flat_model(), folder, "tiny")
    _source.close()
    assert plan.report.ok


def test_diff_and_errors_by_name(folder, tmp_path_factory):
    assert sdadapt.diff(_flat_model(), folder, "tiny").ok
    rows_only = sdadapt.diff(_flat_model(), folder, RENAME_ONLY)  # an Adapter object still works
    assert rows_only.ok
    # no config to read the options from: the error names the options to pass
    bare = tmp_path_factory.mktemp("bare") / "model.safetensors"
    save_file({"model.0.q": W}, str(bare))
    with pytest.raises(AdapterError, match="needs option 'heads', 'dim'"):
        sdadapt.diff(_flat_model(), bare, "tiny")
    assert sdadapt.diff(_flat_model(), bare, sdadapt.get_adapter("tiny", heads=2, dim=8)).ok
    with pytest.raises((AdapterError, ResolveError), match="tinny"):
        sdadapt.load(_flat_model(), folder, "tinny")


def test_json_file_and_python_specs(folder, tmp_path_factory):
    other = tmp_path_factory.mktemp("specs")
    json_path = other / "rename.json"
    json_path.write_text(RENAME_ONLY.to_json())
    py_path = other / "my_adapters.py"
    py_path.write_text(
        "import sdadapt\n"
        "ADAPTER = sdadapt.Adapter([sdadapt.rename('model.{i}.q', '{i}.wq')], name='from-file')\n"
    )
    for spec in (str(json_path), f"{py_path}:ADAPTER", "test_adapter_by_name:RENAME_ONLY"):
        model = _flat_model()
        sdadapt.load(model, folder, spec)
        assert torch.equal(model["0"].wq.detach(), W), spec  # renamed only: rows as stored


def test_export_convert_and_state_by_name(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    model = _flat_model()
    sdadapt.load(model, folder, "tiny")
    # export with the adapter the model was loaded with: back to the checkpoint's bytes; a
    # shipped name reads its options from the folder sdadapt.load read
    (out / "tiny.json").write_text(sdadapt.get_adapter("tiny", heads=2, dim=8).to_json())
    sdadapt.export(model, out / "back", str(out / "tiny.json"))
    sdadapt.export(model, out / "by_name", "tiny")
    assert load_file(str(out / "by_name" / "model.safetensors")).keys() == {"model.0.q"}
    # a model never loaded from a folder (and without a config) needs the options given
    with pytest.raises(AdapterError, match="needs option 'heads', 'dim'"):
        sdadapt.export(_flat_model(), out / "never", "tiny")
    sdadapt.convert(folder, out / "conv", "tiny")  # checkpoint layout -> model layout
    assert torch.equal(load_file(str(out / "conv" / "model.safetensors"))["0.wq"].flatten(), META_ROWS)
    back = load_file(str(out / "back" / "model.safetensors"))
    assert back.keys() == {"model.0.q"} and torch.equal(back["model.0.q"], W)
    # by name in a DCP save/resume after a refactor: a JSON adapter renames on the way in
    sdadapt.save_state(model, out / "dcp")
    refactored = nn.ModuleDict({"b": _Block()})
    json_path = out / "refactor.json"
    json_path.write_text(sdadapt.Adapter([sdadapt.rename("0.wq", "b.wq")]).to_json())
    sdadapt.load_state(refactored, out / "dcp", adapter=str(json_path))
    assert torch.equal(refactored["b"].wq, model["0"].wq)


def test_draft_starts_from_a_named_adapter(folder):
    d = sdadapt.draft(_flat_model(), folder, "tiny")
    assert d.report.ok  # nothing left to propose after the given adapter
    assert d.adapter.rules == sdadapt.get_adapter("tiny", heads=2, dim=8).rules
    namespace: dict = {}
    exec(d.module, namespace)  # the written module builds the same adapter
    assert namespace["ADAPTER"].rules == d.adapter.rules
    # the CLI's --adapter does the same
    from sdadapt.cli import main

    assert main(["draft", str(folder), "--target", "test_adapter_by_name:_flat_model", "--adapter", "tiny"]) == 0
