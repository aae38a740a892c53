"""The cycle collector is paused for the length of a load (sdadapt._base.gc) and turned back on after
it, also when the load fails; pauses nest."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import save_file

import sdadapt
from sdadapt._base.gc import gc_paused
from sdadapt._transaction import steps as _steps


def test_pauses_nest_and_restore_the_collector_even_on_errors():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off and leaves it off
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


def test_load_plans_and_reads_with_the_collector_paused(tmp_path, monkeypatch):
    seen: list[bool] = []
    real = _steps.build_plan

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(_steps, "build_plan", spy)
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.randn(3, 4), "bias": torch.randn(3)}, str(path))
    sdadapt.load(model, str(path))
    assert seen == [False] and gc.isenabled()
    save_file({"weight": torch.randn(3, 4)}, str(path))  # bias missing: a plan error
    with pytest.raises(sdadapt.errors.PlanError, match="bias"):
        sdadapt.load(model, str(path))
    assert seen == [False, False] and gc.isenabled()
