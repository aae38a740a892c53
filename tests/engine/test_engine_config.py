"""``engine=EngineConfig(...)``: the settings a load's I/O engine runs with, per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sdadapt
from sdadapt._engine import direct


@pytest.fixture
def seen(monkeypatch):
    """The configs the I/O engine was built with during the test."""
    configs: list[object] = []
    real = direct.IOEngine

    def spy(source, config=None, **kw):
        configs.append(config)
        return real(source, config, **kw)

    monkeypatch.setattr(direct, "IOEngine", spy)
    return configs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_load_runs_the_engine_with_the_given_config(tmp_path, seen):
    src = _model()
    torch.save(src.state_dict(), tmp_path / "ck.pt")
    cfg = sdadapt.EngineConfig(threads=1, staging_bytes=1 << 20, chunk_bytes=4096, coalesce_gap=0)
    model = _model().apply(lambda m: [nn.init.zeros_(p) for p in m.parameters(recurse=False)])
    report = sdadapt.load(model, tmp_path / "ck.pt", engine=cfg)
    assert seen == [cfg]
    assert report.keys_loaded == 4
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_load_without_a_config_reads_the_environment(tmp_path, seen, monkeypatch):
    torch.save(_model().state_dict(), tmp_path / "ck.pt")
    monkeypatch.setenv("SDADAPT_IO_THREADS", "1")
    sdadapt.load(_model(), tmp_path / "ck.pt")
    assert seen == [None]  # the engine builds EngineConfig.from_env() itself


def test_load_state_runs_the_engine_with_the_given_config(tmp_path, seen):
    src = _model()
    sdadapt.save_state(src, str(tmp_path / "s"))
    cfg = sdadapt.EngineConfig(threads=2, staging_bytes=2 << 20)
    model = _model().apply(lambda m: [nn.init.zeros_(p) for p in m.parameters(recurse=False)])
    sdadapt.load_state(model, str(tmp_path / "s"), engine=cfg)
    assert seen == [cfg]
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_a_bad_config_fails_when_built():
    with pytest.raises(ValueError, match="depth must be at least 1"):
        sdadapt.EngineConfig(depth=0)


def test_every_variable_of_the_table_sets_its_field(monkeypatch):
    """``EngineConfig.from_env`` reads one table (``config.ENV``): each variable sets a field of
    ``EngineConfig``, parsed as the table says; docs/performance.md names every variable."""
    import dataclasses
    from pathlib import Path

    from sdadapt import EngineConfig
    from sdadapt._engine import config

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {name for name, _ in config.ENV.values()} <= fields
    values = {"SDADAPT_IO_STAGING_MB": "64", "SDADAPT_IO_DEPTH": "0", "SDADAPT_IO_WARM": "no", "SDADAPT_IO_GATHER_MB": "0.001",
              "SDADAPT_IO_KVIKIO_BOUNCE_MB": "0", "SDADAPT_IO_SWITCH_MS": "2", "SDADAPT_IO_PLAN_SWITCH_MS": "0"}  # fmt: skip
    for var, text in values.items():
        monkeypatch.setenv(var, text)
    cfg = EngineConfig.from_env()
    assert (cfg.staging_bytes, cfg.depth, cfg.warm_kernels, cfg.gather_bytes) == (64 << 20, 1, False, 4096)
    assert (cfg.kvikio_bounce_bytes, cfg.switch_interval, cfg.plan_switch_interval) == (None, 0.002, None)
    docs = "".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "docs").glob("*.md"))
    assert [var for var in config.ENV if var not in docs] == []


def test_share_rows_is_auto_by_default_and_takes_three_values(monkeypatch):
    from sdadapt._engine.direct import rows_mode

    assert sdadapt.EngineConfig().share_rows == "auto"
    for text, want in (("auto", "auto"), ("1", True), ("0", False)):
        monkeypatch.setenv("SDADAPT_IO_SHARE_ROWS", text)
        assert sdadapt.EngineConfig.from_env().share_rows == want
    with pytest.raises(ValueError, match="share_rows must be True, False or 'auto'"):
        sdadapt.EngineConfig(share_rows="yes")  # type: ignore[arg-type]
    # (rows_gap, ask each TP group): auto is off on one host without asking, else each group asks
    assert rows_mode("auto", True, 7) == (None, False) and rows_mode("auto", False, 7) == (7, True)
    assert rows_mode("auto", None, 7) == (7, True) and rows_mode(True, True, 7) == (7, False)
    assert rows_mode(False, False, 7) == (None, False)
