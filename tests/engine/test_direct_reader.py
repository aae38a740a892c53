"""A load into tensors runs the engine without ``dcp.load`` (``sdadapt._engine.direct``); the
targets only DCP can read still go through it. Both give the model the same bytes and the
report the same counts, with the engine and with the one-thread ``simple`` reader; a rank's
jobs against DCP's own plan are checked on meshes in ``tests/dist/test_dist_load.py``."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file
from support.models import TinyTransformer

import sdadapt
from sdadapt._engine import direct
from sdadapt._transaction import transaction


class _Sub(torch.Tensor):
    pass


def test_direct_targets_are_plain_tensors_and_parameters():
    t = torch.zeros(2)
    assert direct.direct_targets({"a": t, "b": torch.nn.Parameter(t.clone())})
    assert not direct.direct_targets({"a": t, "n": 3})  # a non-tensor value: DCP's path
    assert not direct.direct_targets({"a": t.as_subclass(_Sub)})  # a tensor subclass DCP may know
    assert direct.direct_targets({})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    sd = {k: v.to(torch.bfloat16) for k, v in TinyTransformer().state_dict().items()}
    path = tmp_path_factory.mktemp("direct") / "model.safetensors"
    save_file(sd, str(path))
    return str(path), sd


def _load(path: str, **kw: object) -> tuple[TinyTransformer, sdadapt.reports.LoadReport]:
    with torch.device("meta"):
        model = TinyTransformer().to(torch.bfloat16)
    return model, sdadapt.load(model, path, **kw)


@pytest.mark.parametrize("io", ["engine", "simple"])
def test_direct_and_dcp_paths_load_the_same_bytes(checkpoint, monkeypatch, io):
    path, want = checkpoint
    monkeypatch.setenv("SDADAPT_IO", io)
    model, rep = _load(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    monkeypatch.setattr(transaction, "direct_targets", lambda sd: False)  # every part through dcp.load
    dcp_model, dcp_rep = _load(path)
    assert "torch.distributed.checkpoint" in sys.modules
    for k, v in dcp_model.state_dict().items():
        assert torch.equal(v, want[k]), k
    counts = ("keys_loaded", "items_read", "bytes_read", "local_bytes")
    assert [getattr(rep, c) for c in counts] == [getattr(dcp_rep, c) for c in counts]
    assert rep.items_read == len(want) and rep.bytes_read == rep.local_bytes


def test_local_jobs_refuse_a_shape_the_plan_does_not_have(checkpoint):
    path, want = checkpoint
    _, plan = sdadapt.plan_load(TinyTransformer().to(torch.bfloat16), path)
    key = next(iter(want))
    with pytest.raises(ValueError, match=f"Size mismatch .* for {key}"):
        direct.local_jobs(plan, {key: torch.zeros(1, 1, 1)})
