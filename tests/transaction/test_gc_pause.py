"""The cycle collector is paused for the length of a load (sdadapt._base.gc) and turned back on after
it, also when the load fails; pauses nest."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

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


def test_a_public_name_imports_its_modules_with_the_collector_paused():
    """The first use of a public name imports its modules (``sdadapt._base.lazy``) with no
    collection inside, even where the collector's thresholds would run many; the collector is on
    again afterwards, and one the caller turned off stays off."""
    child = textwrap.dedent(
        """
        import gc, json, sys
        import sdadapt

        runs = []

        def importing():  # the load's module is being imported (its body or the modules it imports)
            module = sys.modules.get("sdadapt._load.loading")
            return module is not None and getattr(module.__spec__, "_initializing", False)

        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" and importing() else None)
        gc.disable()
        rename = sdadapt.rename  # the rules and pydantic, imported while the caller has the collector off
        off_after = not gc.isenabled()
        gc.enable()
        gc.set_threshold(100)  # unpaused, importing the engine would run collections of every generation
        before = "sdadapt._engine.engine" in sys.modules
        load = sdadapt.load
        print(json.dumps({"runs": runs, "on": gc.isenabled(), "off_after": off_after, "before": before,
                          "imported": "sdadapt._engine.engine" in sys.modules, "rename": rename.__name__}))
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"runs": [], "on": True, "off_after": True, "before": False, "imported": True, "rename": "rename"}, result
