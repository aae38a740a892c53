"""bench/load_bench.py at a tiny size on 2 gloo ranks: every path runs and loads the right
tensors (no timing asserts: figures live in bench/RESULTS.md), and a size that cannot fit is
refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "load_bench.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_every_path_loads_the_same_tensors(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--nproc", "2", "--backend", "gloo", "--repeat", "1",
         "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--discussion", "materialized", "--discussion-timeout", "10",
         "--timeout", "150"],
        env=_env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    rows = {(r["layout"], r["path"]): r for r in res["rows"]}
    want = [("fsdp", p) for p in ("sdadapt", "sdadapt-fused", "sdadapt-torchsave", "rank0-broadcast", "hf-reader", "dcp-native")]
    want += [("tp", "sdadapt"), ("tp", "hf-reader")]
    for key in want:
        row = rows[key]
        assert row["ok"], (key, row.get("error"))
        assert row["check"].startswith("= source") or row["check"].startswith("= sdadapt"), row["check"]
        assert len(row["per_rank"]) == 2
        for pr in row["per_rank"]:
            assert pr["wall_s"] > 0 and pr["local_gib"] > 0
            assert pr["rss_peak_gib"] > 0
    # sdadapt reads its shards' bytes and no more (rename-only: exactly the local shards)
    for pr in rows[("fsdp", "sdadapt")]["per_rank"]:
        assert pr["bytes_read_gib"] == pytest.approx(pr["local_gib"], rel=1e-9)
    # the discussion's path gives a row whatever happens to it: loaded, failed or hung
    disc = rows[("fsdp", "torchsave-broadcast")]
    assert disc["ok"] or "hang" in disc["error"] or disc["error"]
    md = Path(f"{out}.md").read_text()
    assert "| sdadapt | fsdp |" in md and "| hf-reader | tp |" in md and "torchsave-broadcast" in md
    # nothing is left behind without --keep
    assert not any((tmp_path / "ckpt").glob("sdadapt-bench-*"))


def test_refuses_a_size_that_cannot_fit(tmp_path):
    folder = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "8b", "--layers", "4000", "--nproc", "2", "--backend", "gloo",
         "--dir", str(folder), "--out", str(tmp_path / "res")],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "needs" in proc.stderr and "Nothing was written" in proc.stderr
    assert not folder.exists() or not any(folder.iterdir())
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import load_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(load_bench.BenchError, match="RAM"):
        load_bench.check_fits(tmp_path, load_bench.PRESETS["2g"], ["safetensors"], 2, assume_ram_gib=1.0)
