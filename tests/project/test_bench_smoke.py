"""bench/load_bench.py (the ``bench/loadbench`` package) at a tiny size on 2 gloo ranks: every path
runs in its own fresh process group and loads the right tensors, into a meta model and into a
materialised one, the FP8 twin through sdadapt and through torch's quantized HF reader, every
other quantized twin (each in its tool's layout) through sdadapt against its format's own
reference (no timing asserts: figures live in bench/reports/, indexed by bench/RESULTS.md); a size that
cannot fit is refused before anything is written; the reports cite exactly the raw runs kept in
bench/results/, each is linked from the index and never edited once written."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "load_bench.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@contextlib.contextmanager
def _bench_importable() -> Iterator[None]:
    """The bench's modules (``loadbench``, the probes) importable inside the block."""
    paths = [str(ROOT / "bench"), str(ROOT / "bench" / "probes")]
    sys.path[:0] = paths
    try:
        yield
    finally:
        for p in paths:
            sys.path.remove(p)


@pytest.fixture
def loadbench():
    with _bench_importable():
        import loadbench.checkpoint
        import loadbench.models
        import loadbench.shapes

        yield loadbench


def test_every_path_first_load_in_a_fresh_process_meta_and_materialized(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--nproc", "2", "--backend", "gloo", "--repeat", "1",
         "--paths", "sdadapt,sdadapt-fused,sdadapt-torchsave,sdadapt-fp8,rank0-broadcast,hf-reader,hf-fp8-reader", "--tp-paths", "sdadapt",
         "--materialized-paths", "sdadapt,hf-reader", "--no-references",
         "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--discussion", "materialized", "--discussion-timeout", "4",
         "--timeout", "150", "--fork-ranks"],
        env=_env(), capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    rows = {(r["layout"], r["path"], r["flow"]): r for r in res["rows"]}
    fp8 = ("sdadapt-fp8", "hf-fp8-reader")
    want = [("fsdp", p, "meta") for p in ("sdadapt", "sdadapt-fused", "sdadapt-torchsave", "rank0-broadcast", "hf-reader", *fp8)]
    want += [("tp", "sdadapt", "meta"), ("fsdp", "sdadapt", "materialized"), ("fsdp", "hf-reader", "materialized")]
    for key in want:
        row = rows[key]
        assert row["ok"], (key, row.get("error"))
        # the FP8 twin's paths against the whole-tensor dequantisation of that file, bit for bit
        assert row["check"].startswith("= eager dequant of the FP8 file" if key[1] in fp8 else "= source"), row["check"]
        assert row["first_s"] > 0 and row["wall_s"] == row["first_s"]
        assert row["repeats"] == 1 and len(row["steady_all_s"]) == 1 and row["steady_s"] > 0
        assert len(row["per_rank"]) == 2
        for pr in row["per_rank"]:
            assert pr["wall_s"] > 0 and pr["local_gib"] > 0 and pr["rss_peak_gib"] > 0
            assert pr["steady"]["rss_peak_gib"] > 0
    # every row's first load was the first of its own processes: no process served two rows; each
    # was forked (--fork-ranks) from one that had imported torch's libraries but not sdadapt, which
    # every rank imported itself before its first load
    pids = [r["pid"] for g in res["groups"] if g["job"] for r in g["ranks"] if r is not None]
    assert len(pids) == len(set(pids)) == 2 * len(want)
    assert "torch" in res["forked_from"] and not any(n.startswith("sdadapt") for n in res["forked_from"])
    for g in res["groups"]:
        for r in g["ranks"]:
            if r is not None:
                assert [x["phase"] for x in r["runs"]][:1] == ["first"]
                assert "sdadapt" in r["imported"] and r["sdadapt_preloaded"] == []
    # sdadapt reads its shards' bytes and no more (rename-only: exactly the local shards), in both flows
    for flow in ("meta", "materialized"):
        for pr in rows[("fsdp", "sdadapt", flow)]["per_rank"]:
            assert pr["bytes_read_gib"] == pytest.approx(pr["local_gib"], rel=1e-9)
    # the FP8 twin moves about half the bytes: e4m3 weights and their scale tiles, bf16 embeddings
    for pr in rows[("fsdp", "sdadapt-fp8", "meta")]["per_rank"]:
        assert 0.5 * pr["local_gib"] < pr["bytes_read_gib"] < 0.6 * pr["local_gib"]
    # the discussion's path gives a row whatever happens to it: loaded, failed or hung
    disc = rows[("fsdp", "torchsave-broadcast", "meta")]
    assert disc["ok"] or disc["error"]
    md = Path(f"{out}.md").read_text()
    assert "| sdadapt | fsdp | meta | **" in md and "| hf-reader | fsdp | materialized | **" in md
    assert "fresh process group" in md and "forked for that row alone" in md and "torchsave-broadcast" in md
    # nothing is left behind without --keep
    assert not any((tmp_path / "ckpt").glob("sdadapt-bench-*"))


def test_fork_ranks_refuses_a_variant_that_torch_reads_at_import(loadbench, tmp_path):
    """Forked ranks share the torch their server imported: a variant may not change its settings."""
    import loadbench.cli

    with pytest.raises(loadbench.common.BenchError, match="only SDADAPT_ settings"):
        loadbench.cli.main(["--preset", "tiny", "--nproc", "1", "--backend", "gloo", "--fork-ranks", "--dir", str(tmp_path),
                            "--variant", "a:OMP_NUM_THREADS=2"])
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_materialize_with_values_fills_every_parameter(loadbench):
    import torch

    shape = loadbench.shapes.PRESETS["tiny"]
    model, _ = loadbench.models.build_model(shape, "titan")
    loadbench.models.materialize_with_values(model, torch.device("cpu"), seed=3)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16, name
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.01 < p.float().std().item() < 0.03, name


def test_refuses_a_size_that_cannot_fit(tmp_path, loadbench):
    folder = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "8b", "--layers", "4000", "--nproc", "2", "--backend", "gloo",
         "--dir", str(folder), "--out", str(tmp_path / "res")],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "needs" in proc.stderr and "Nothing was written" in proc.stderr
    assert not folder.exists() or not any(folder.iterdir())
    with pytest.raises(loadbench.common.BenchError, match="RAM"):
        loadbench.checkpoint.check_fits(tmp_path, loadbench.shapes.PRESETS["2g"], ["safetensors"], 2, assume_ram_gib=1.0)
    # issue 12's CPU case: a 1.92 GiB bf16 checkpoint
    assert round(loadbench.shapes.PRESETS["1.9g"].nbytes() / (1 << 30), 2) == 1.92


REPORTS = ROOT / "bench" / "reports"
REPORT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*-[a-z0-9]+-\d{4}-\d{2}-\d{2}\.md")  # <topic>-<machine>-<date>.md


def test_the_reports_cite_exactly_the_kept_runs():
    """Every `bench/results/...` citation in the reports and the index names at least one kept
    file, and every file kept under bench/results/ is cited."""
    results = ROOT / "bench" / "results"
    kept = sorted(str(p.relative_to(ROOT)) for p in results.rglob("*") if p.is_file())
    texts = [p.read_text() for p in [ROOT / "bench" / "RESULTS.md", *sorted(REPORTS.glob("*.md"))]]
    cited = [c for t in texts for c in re.findall(r"`(bench/results/[^`\s]+)`", t)]
    assert cited
    for c in cited:
        assert fnmatch.filter(kept, c), f"a report cites {c}, which matches no file"
    for f in kept:
        assert any(fnmatch.fnmatch(f, c) for c in cited), f"{f} is not cited by any report"


def test_results_md_is_an_index_of_the_reports():
    """bench/RESULTS.md stays short (at most 20,000 characters) and links bench/ARCHIVE.md, where
    its older rows go; every report is named ``<topic>-<machine>-<date>.md`` and linked from one of
    the two, and every link they have leads to a report."""
    index = (ROOT / "bench" / "RESULTS.md").read_text()
    archive = (ROOT / "bench" / "ARCHIVE.md").read_text()
    assert len(index) <= 20_000, len(index)
    assert "](ARCHIVE.md)" in index
    reports = sorted(p.name for p in REPORTS.glob("*"))
    assert reports and all(REPORT_NAME.fullmatch(n) for n in reports), [n for n in reports if not REPORT_NAME.fullmatch(n)]
    links = set(re.findall(r"\]\((?:\./|bench/)?reports/([^)#]+)", index + archive))
    assert links == set(reports), (sorted(links - set(reports)), sorted(set(reports) - links))


def test_docs_link_existing_reports():
    """Docs link figures rather than copy them: every link into bench/reports/ from README.md,
    docs/*.md and SECURITY.md names a report that exists."""
    for doc in [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"bench/reports/([^)\]`\s#]+)", doc.read_text()):
            assert (REPORTS / name).is_file(), f"{doc.name} links bench/reports/{name}, which does not exist"


def test_reports_are_never_edited_once_written():
    """A report is a frozen record of one run (a new run is a new report): every report reads
    exactly as in the commit that added it. An edit that a later commit undid leaves the record as
    written, so the content is compared, not the history of edits. Skipped only outside a git
    checkout (an unpacked sdist has no history); in a checkout git must answer."""
    if not (ROOT / ".git").exists():
        pytest.skip("run outside a git checkout (an unpacked sdist): there is no history of the reports to read")
    git = ["git", "-C", str(ROOT)]
    try:
        log = subprocess.run([*git, "log", "--diff-filter=A", "--format=@%H", "--name-only", "--", "bench/reports/"],
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        added: dict[str, str] = {}  # report -> the newest commit that added it
        commit = ""
        for line in log.splitlines():
            if line.startswith("@"):
                commit = line[1:]
            elif line and line not in added:
                added[line] = commit
        names = [f"bench/reports/{p.name}" for p in sorted(REPORTS.glob("*"))]
        objects = "".join(f"{added.get(n, 'HEAD')}:{n}\n" for n in names)
        first = subprocess.run([*git, "cat-file", "--batch"], input=objects.encode(), capture_output=True,
                               timeout=60, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"git is needed to read the reports' history in this checkout and did not answer: {e}")
    edited, pos = [], 0
    for n in names:
        header_end = first.index(b"\n", pos)
        header = first[pos:header_end].split()
        if header[-1] == b"missing":  # not committed yet: nothing was written before it
            pos = header_end + 1
            continue
        size = int(header[2])
        written = first[header_end + 1 : header_end + 1 + size]
        pos = header_end + 1 + size + 1
        if written != (ROOT / n).read_bytes():
            edited.append(f"{n} (added in {added.get(n, 'no commit yet')[:7]})")
    assert not edited, "reports that differ from what their first commit wrote (write a new report instead):\n" + "\n".join(edited)


def test_a_variant_runs_each_sdadapt_row_again_under_other_settings_and_another_tree(tmp_path):
    """``--variant NAME:SETTINGS``: every sdadapt row runs again in its own fresh processes, with
    the variant's environment (the engine's knobs) and another tree's sdadapt first on the path;
    'x sdadapt' compares within a variant. The other tree is bench/probes/engine_trace.py's overlay,
    which writes each engine run's timeline for its ``summary``."""
    trace = ROOT / "bench" / "probes" / "engine_trace.py"
    made = subprocess.run([sys.executable, str(trace), "overlay", str(ROOT / "src"), str(tmp_path / "tree")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    tree, traces = tmp_path / "tree" / "src", tmp_path / "traces"
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--nproc", "1", "--backend", "gloo", "--repeat", "0",
         "--paths", "sdadapt", "--tp-paths", "", "--materialized-paths", "", "--discussion", "", "--no-references",
         "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--timeout", "150",
         "--variant", f"v:SDADAPT_IO_THREADS=1,SDADAPT_IO_CHUNK_MB=1,src={tree},SDADAPT_TRACE={traces}", "--fork-ranks"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    assert [(r["path"], r["variant"]) for r in res["rows"]] == [("sdadapt", ""), ("sdadapt", "v")]
    assert all(r["ok"] and r["check"].startswith("= source") for r in res["rows"])
    own, varied = (g["ranks"][0] for g in res["groups"])
    assert own["sdadapt_env"] == {} and Path(own["sdadapt_file"]).resolve().is_relative_to((ROOT / "src").resolve())
    assert varied["sdadapt_env"] == {"SDADAPT_IO_CHUNK_MB": "1", "SDADAPT_IO_THREADS": "1", "SDADAPT_TRACE": str(traces)}
    assert Path(varied["sdadapt_file"]).resolve().is_relative_to(tree.resolve())
    assert own["sdadapt_preloaded"] == varied["sdadapt_preloaded"] == []  # forked before any sdadapt was imported
    md = Path(f"{out}.md").read_text()
    assert re.search(r"\| sdadapt @v \| fsdp \| meta \| \*\*[0-9.]+\*\* \| 1\.00 \|", md)  # its own base
    assert f"`v`: SDADAPT_IO_THREADS=1, SDADAPT_IO_CHUNK_MB=1, src={tree.resolve()}, SDADAPT_TRACE={traces}" in md
    assert len(list(traces.glob("trace-*.json"))) == 1  # the variant's one load, traced; the row without it not
    summary = subprocess.run([sys.executable, str(trace), "summary", str(traces)], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert "sdadapt-io-0: +" in summary.stdout and "StagedRead:" in summary.stdout and "GiB read per 50 ms" in summary.stdout


def test_raw_loaders_and_the_loaders_imports_inside_the_first_load(tmp_path):
    """``--raw-paths``: a raw loader's row loads every tensor into a dict, checked against the
    file's bytes; ``--import-in-load``: the workers import only what builds the model, and each
    loader's own imports are timed inside its first load (sdadapt's, with the modules its call
    imported)."""
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--nproc", "1", "--backend", "gloo", "--repeat", "1",
         "--paths", "sdadapt", "--tp-paths", "", "--materialized-paths", "", "--discussion", "", "--no-references",
         "--raw-paths", "safetensors-gpu", "--import-in-load", "--fork-ranks",
         "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--timeout", "150"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    rows = {r["path"]: r for r in res["rows"]}
    assert rows["sdadapt"]["ok"] and rows["sdadapt"]["check"].startswith("= source")
    raw = rows["safetensors-gpu"]
    assert raw["ok"] and raw["layout"] == "raw" and raw["check"] == "= file bytes (21 shards)"  # every tensor of the tiny preset
    assert res["forked_from"] == ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel"]
    for g in res["groups"]:
        assert "sdadapt" not in g["ranks"][0]["imported"]  # nothing of the loaders before timing
        assert g["ranks"][0]["sdadapt_preloaded"] == []
    first = rows["sdadapt"]["per_rank"][0]
    assert first["load_import_s"] > 0 and first["modules_imported_by_call"] is not None
    # the cycle collector's runs inside each first load, and of them those inside sdadapt's imports
    assert len(first["gc"]["collections"]) == 3 and first["import_gc"]["seconds"] <= first["gc"]["seconds"]
    assert raw["per_rank"][0]["gc"] is not None and raw["per_rank"][0]["import_gc"] is None
    assert res["import_in_load"] and "inside its timed first load" in Path(f"{out}.md").read_text()


def test_raw_paths_are_rows_of_their_own_and_unknown_ones_are_refused(loadbench):
    import loadbench.cli

    args = loadbench.cli.parser("").parse_args(["--paths", "sdadapt", "--tp-paths", "", "--materialized-paths", "",
                                                "--discussion", "", "--raw-paths", "instanttensor,safetensors-gpu",
                                                "--variant", "a:X=1"])
    assert [j.tag for j in loadbench.cli._jobs(args, loadbench.cli.variants(args.variant))] == [
        "fsdp-sdadapt", "fsdp-sdadapt@a", "raw-instanttensor", "raw-safetensors-gpu"]
    args = loadbench.cli.parser("").parse_args(["--paths", "", "--tp-paths", "", "--materialized-paths", "", "--discussion", "",
                                                "--raw-paths", "sdadapt"])
    with pytest.raises(loadbench.common.BenchError, match="unknown path"):
        loadbench.cli._jobs(args, {})


def test_rounds_combine_into_one_row_per_job_with_medians(loadbench):
    """``--rounds``: a job's rows of every round become one row: the median first load (each
    round's listed), the median of all rounds' steady repeats; a failed round fails the row."""
    import loadbench.report

    def row(path: str, first: float, steady: list[float], ok: bool = True) -> dict:
        return {"path": path, "layout": "fsdp", "flow": "meta", "variant": "", "ok": ok, "first_s": first,
                "steady_all_s": steady, "steady_s": steady[0], "per_rank": [{"first": first}]}

    rows = [row("sdadapt", 3.0, [1.0]), row("hf-reader", 2.0, [4.0]), row("sdadapt", 1.0, [2.0]),
            row("hf-reader", 9.0, [5.0], ok=False), row("sdadapt", 2.5, [3.0])]
    got = loadbench.report.combine_rounds(rows)
    assert [r["path"] for r in got] == ["sdadapt", "hf-reader"]
    assert got[0]["first_s"] == 2.5 and got[0]["first_all_s"] == [3.0, 1.0, 2.5] and got[0]["per_rank"] == [{"first": 2.5}]
    assert got[0]["steady_s"] == 2.0 and got[0]["steady_all_s"] == [1.0, 2.0, 3.0] and got[0]["rounds"] == 3
    assert got[1]["ok"] is False
    with pytest.raises(loadbench.common.BenchError, match="--rounds"):
        import loadbench.cli

        args = loadbench.cli.parser("").parse_args(["--rounds", "0"])
        loadbench.cli._run_groups(args, [], {}, None, "gloo", {}, {}, [], 0.0)  # type: ignore[arg-type]


def test_run_folder_removed_when_launching_fails(loadbench, tmp_path, monkeypatch):
    """The run's folder of rank configs and logs goes even when launching its groups raises."""
    import tempfile

    import loadbench.cli

    def fail(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(loadbench.cli, "_launch_all", fail)
    args = loadbench.cli.parser("").parse_args([])
    shape = loadbench.shapes.Shape(layers=1, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=32)
    with pytest.raises(RuntimeError, match="launch failed"):
        loadbench.cli._run_groups(args, [], {}, shape, "gloo", {}, {}, [], 0.0)
    assert not list(tmp_path.glob("sdadapt-bench-run-*"))


def test_variants_apply_to_sdadapt_rows_only(loadbench):
    """The other loaders do not read sdadapt's settings: their rows run once."""
    import loadbench.cli

    args = loadbench.cli.parser("").parse_args(["--paths", "sdadapt,hf-reader", "--tp-paths", "sdadapt", "--materialized-paths", "",
                                                "--discussion", "meta", "--variant", "a:X=1", "--variant", "b:Y=2"])
    assert [j.tag for j in loadbench.cli._jobs(args, loadbench.cli.variants(args.variant))] == [
        "fsdp-sdadapt", "fsdp-sdadapt@a", "fsdp-sdadapt@b", "fsdp-hf-reader", "tp-sdadapt", "tp-sdadapt@a", "tp-sdadapt@b",
        "fsdp-torchsave-broadcast-meta"]
    args = loadbench.cli.parser("").parse_args(["--paths", "sdadapt,hf-reader,sdadapt-fp8", "--tp-paths", "", "--materialized-paths", "",
                                                "--discussion", "", "--variant", "a:X=1", "--variant", "b:Y=2", "--by-variant"])
    assert [j.tag for j in loadbench.cli._jobs(args, loadbench.cli.variants(args.variant))] == [
        "fsdp-sdadapt", "fsdp-hf-reader", "fsdp-sdadapt-fp8", "fsdp-sdadapt@a", "fsdp-sdadapt-fp8@a", "fsdp-sdadapt@b",
        "fsdp-sdadapt-fp8@b"]  # --by-variant: a variant's rows back to back


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "NAME:SETTINGS"),
    ("a b:X=1", "NAME:SETTINGS"),
    ("a:", "no settings"),
    ("a:lower=1", "is not ENV=VALUE"),
    ("a:X", "is not ENV=VALUE"),
    ("a:src=/nonexistent", "holds no sdadapt package"),
])
def test_a_bad_variant_is_refused_with_what_to_give(loadbench, spec, message):
    import loadbench.cli

    with pytest.raises(loadbench.common.BenchError, match=message):
        loadbench.cli.variants([spec])
    with pytest.raises(loadbench.common.BenchError, match="new NAME"):
        loadbench.cli.variants(["a:X=1", "a:Y=2"])


@pytest.mark.parametrize("extra", [["--discussion", "meta"], ["--discussion", "", "--variant", "a:X=1"],
                                   ["--discussion", "", "--rounds", "2"]])
def test_one_group_refuses_rows_that_need_processes_of_their_own(loadbench, tmp_path, extra):
    import loadbench.cli

    with pytest.raises(loadbench.common.BenchError, match="--one-group runs neither"):
        loadbench.cli.main(["--preset", "tiny", "--nproc", "1", "--backend", "gloo", "--one-group", "--dir", str(tmp_path), *extra])
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_lane_probe_runs_and_checks_its_bits_on_the_cpu(tmp_path):
    """bench/probes/lane_probe.py with the CPU as its device (no lane: the readers run the kernels): it
    writes its release, loads it once per band size and thread count and repeat, and checks the
    first load's bits against the whole-tensor dequantisation."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probes" / "lane_probe.py"), "--device", "cpu", "--tensors", "2", "--shape", "256,384",
         "--threads", "1,2", "--bands", "0,0.25", "--repeat", "1", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bits equal the whole-tensor dequantisation") == 1
    runs = [line for line in proc.stdout.splitlines() if " run " in line]
    assert len(runs) == 2 * 2 * 2  # bands x threads x (warm-up + 1 repeat)
    assert any(line.startswith("band 0.2 MiB threads  2 run 1:") for line in runs), runs


def test_phase_probe_times_the_steps_of_a_first_and_a_second_load(tmp_path):
    """bench/probes/phase_probe.py on the CPU (gloo, one rank) at the tiny size: it writes the
    checkpoint and its FP8 twin, then per path a fresh process loads twice and reports each
    load's phases and the main thread's time in the wrapped steps. A second call with another
    twin and ``--loads 3`` writes only that twin (the bf16 files stay as they are) and reports a
    third load in the same process."""
    ck = tmp_path / "ck"

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(ROOT / "bench" / "probes" / "phase_probe.py"), "--preset", "tiny", "--dir", str(ck), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
        assert proc.returncode == 0, proc.stderr
        return proc

    proc = probe("--paths", "sdadapt,sdadapt-fp8", "--profile", "5")
    out = proc.stdout
    for path in ("sdadapt", "sdadapt-fp8"):
        for load in ("first", "second"):
            assert re.search(rf"round 0 {path} +{load} +wall [0-9.]+ +plan ", out), out
    steps = re.findall(r"^ +(\S+) +[0-9.]+ s  x[0-9]+$", out, flags=re.M)
    assert steps.count("plan_model") == 4 and steps.count("materialize") == 4, steps  # each load's steps
    assert out.count("Ordered by: cumulative time") == 2  # the first loads' profiles
    bf16 = {p.name: p.stat().st_mtime_ns for p in (ck / "hf").iterdir()}
    proc = probe("--paths", "sdadapt-nvfp4", "--loads", "3")
    for load in ("first", "second", "#3"):
        assert re.search(rf"round 0 sdadapt-nvfp4 +{load} +wall [0-9.]+ +plan ", proc.stdout), proc.stdout
    assert (ck / "hf-nvfp4" / "config.json").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in (ck / "hf").iterdir()} == bf16


def test_first_call_probe_counts_the_imports_inside_a_first_load(tmp_path):
    """bench/probes/first_call_probe.py on the CPU (gloo, world 1) at the tiny size: a child process
    builds and shards the model, then times ``import sdadapt`` + the adapter + the first
    ``sdadapt.load`` and a second load; run under ``-X importtime`` it names the modules
    imported inside that region, among them sdadapt's load machinery (and not torch's DCP: a
    load into a model's tensors runs the engine without ``dcp.load``)."""
    res = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probes" / "first_call_probe.py"), "--preset", "tiny", "--dir", str(tmp_path / "ck"),
         "--runs", "1", "--out", str(res)],
        capture_output=True, text=True, timeout=240, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"\| plain 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", proc.stdout), proc.stdout
    data = json.loads(res.read_text())
    names = {n for _, _, _, n in data["imports"]}
    assert {"sdadapt._transaction.transaction", "sdadapt._engine"} <= names
    assert "torch.distributed.checkpoint" not in names
    assert data["import_s"] > 0 and data["traced"]["bytes"] > 0
    assert "sdadapt._load.loading" in data["traced"]["modules_imported_by_load_call"]


QUANT_TWIN_PATHS = ["sdadapt-fp8ch", "sdadapt-nvfp4", "sdadapt-fp8tensor", "sdadapt-int8ch", "sdadapt-w4a16",
                    "sdadapt-w4a16asym", "sdadapt-mxfp8", "sdadapt-fp8block", "sdadapt-w8a16", "sdadapt-mxfp8e8m0",
                    "sdadapt-fp8static", "sdadapt-nvfp4modelopt", "sdadapt-fp8modelopt"]
REFERENCE_OF = {"sdadapt-fp8static": "float(w) * scale per tensor", "sdadapt-nvfp4modelopt": "the ModelOpt NVFP4 formula",
                "sdadapt-fp8modelopt": "float(w) * scale per tensor"}


def test_every_quantized_twin_loads_and_equals_its_format_reference(tmp_path):
    """Each quantized twin (compressed-tensors FP8 per channel / per tensor / in 128x128 blocks,
    NVFP4, int8, int4 with and without zero points, packed int8, MXFP8 with U8 and F8_E8M0
    exponents; per-tensor ``quant_method: fp8``; ModelOpt NVFP4 and FP8) loads
    through ``sdadapt.dequant_rules`` into the bf16 FSDP2 model on 2 ranks, every shard equal to
    the whole-tensor dequantisation of its file and, for the quantized weights, to the format's
    own reference decompression; each moves fewer bytes than the bf16 shards it fills. The rows
    run in one process group (``--one-group``: 2 processes, not 2 per row, forked from one that
    imported torch: ``--fork-ranks``; a fresh process's first load is
    test_every_path_first_load_in_a_fresh_process_meta_and_materialized's)."""
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--nproc", "2", "--backend", "gloo", "--repeat", "0",
         "--paths", ",".join(QUANT_TWIN_PATHS), "--tp-paths", "", "--materialized-paths", "", "--discussion", "",
         "--no-references", "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--timeout", "150", "--one-group", "--fork-ranks"],
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    assert [r["path"] for r in res["rows"]] == QUANT_TWIN_PATHS
    # one process group ran every row: the same 2 processes, each row its own results
    pids = {(g["tag"], r["pid"]) for g in res["groups"] for r in g["ranks"]}
    assert len({pid for _, pid in pids}) == 2 and len(pids) == 2 * len(QUANT_TWIN_PATHS), pids
    assert res["first_load"].startswith("one process group for every row")
    assert Path(f"{out}.md").read_text().startswith("Not the headline: one process group")
    assert sorted(res["checkpoint"]["formats"]) == sorted(["safetensors"] + [f"safetensors-{p[8:]}" for p in QUANT_TWIN_PATHS])
    for row in res["rows"]:
        assert row["ok"], (row["path"], row.get("error"))
        ref = REFERENCE_OF.get(row["path"], "compressed-tensors' decompression")
        # 2 layers x 7 matrices on each rank, 21 shards each
        assert row["check"] == f"= eager dequant of the quantized file; 14 weights also = {ref} (42 shards)", row["check"]
        for pr in row["per_rank"]:
            assert 0 < pr["bytes_read_gib"] < pr["local_gib"], (row["path"], pr)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Every quantized twin of the tiny preset, written once in this process (on the CPU)."""
    with _bench_importable():
        import loadbench.checkpoint
        import loadbench.models
        import loadbench.twins

        formats = ["safetensors"] + [f"safetensors-{t}" for t in loadbench.twins.TWINS]
        folder = tmp_path_factory.mktemp("twins")
        files = loadbench.checkpoint.write_checkpoint(folder, loadbench.shapes.PRESETS["tiny"], 5.0, formats)
        yield loadbench, files


def _stored(folder: str) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_each_twin_has_its_tools_layout_and_config(twins):
    import torch

    lb, files = twins
    shape = lb.shapes.PRESETS["tiny"]
    down, h, i = "model.layers.1.mlp.down_proj.", shape.hidden, shape.intermediate  # down_proj: [h, i]
    e4m3 = torch.float8_e4m3fn
    layouts = {  # field -> (dtype, shape) of the down projection in each twin
        "fp8tensor": {"weight": (e4m3, [h, i]), "weight_scale": (torch.bfloat16, [1]), "input_scale": (torch.bfloat16, [1])},
        "int8ch": {"weight": (torch.int8, [h, i]), "weight_scale": (torch.bfloat16, [h, 1])},
        "w4a16": {"weight_packed": (torch.int32, [h, i // 8]), "weight_scale": (torch.bfloat16, [h, i // 32]),
                  "weight_shape": (torch.int64, [2])},
        "w4a16asym": {"weight_packed": (torch.int32, [h, i // 8]), "weight_scale": (torch.bfloat16, [h, i // 32]),
                      "weight_zero_point": (torch.int32, [h // 8, i // 32]), "weight_shape": (torch.int64, [2])},
        "mxfp8": {"weight": (e4m3, [h, i]), "weight_scale": (torch.uint8, [h, i // 32])},
        # blocks of 128x128, the tiny matrices' edges in partial blocks
        "fp8block": {"weight": (e4m3, [h, i]), "weight_scale": (torch.bfloat16, [-(-h // 128), -(-i // 128)])},
        "w8a16": {"weight_packed": (torch.int32, [h, i // 4]), "weight_scale": (torch.bfloat16, [h, i // 32]),
                  "weight_shape": (torch.int64, [2])},
        "mxfp8e8m0": {"weight": (e4m3, [h, i]), "weight_scale": (torch.float8_e8m0fnu, [h, i // 32])},
        "fp8static": {"weight": (e4m3, [h, i]), "weight_scale_inv": (torch.float32, []), "input_scale": (torch.float32, [])},
        "nvfp4modelopt": {"weight": (torch.uint8, [h, i // 2]), "weight_scale": (e4m3, [h, i // 16]),
                          "weight_scale_2": (torch.float32, []), "input_scale": (torch.float32, [])},
        "fp8modelopt": {"weight": (e4m3, [h, i]), "weight_scale": (torch.float32, []), "input_scale": (torch.float32, [])},
    }  # fmt: skip
    assert sorted(layouts) == sorted(lb.twins.TWINS)
    for twin, fields in layouts.items():
        folder = files[f"safetensors-{twin}"]
        stored = _stored(folder)
        got = {k.removeprefix(down): (v.dtype, list(v.shape)) for k, v in stored.items() if k.startswith(down)}
        assert got == fields, twin
        for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):  # kept as they were
            assert stored[plain].dtype == torch.bfloat16, (twin, plain)
        cfg = json.loads(Path(folder, "config.json").read_text())
        qc = cfg.get("quantization_config")
        if twin in lb.twins.CT_WRITTEN:
            assert qc["quant_method"] == "compressed-tensors" and qc["format"] == lb.twins.CT_WRITTEN[twin][1]
            assert qc["ignore"] == ["lm_head"] and qc["quantization_status"] == "compressed"
        elif twin == "fp8static":
            assert qc == {"quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]}
        elif twin == "fp8modelopt":
            assert qc == {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
            assert not Path(folder, "hf_quant_config.json").exists()
        else:  # ModelOpt: hf_quant_config.json beside a config without quantization_config
            assert qc is None
            hq = json.loads(Path(folder, "hf_quant_config.json").read_text())["quantization"]
            assert hq == {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    w4 = json.loads(Path(files["safetensors-w4a16asym"], "config.json").read_text())["quantization_config"]
    weights = w4["config_groups"]["group_0"]["weights"]  # the tiny widths (64, 160) take groups of 32, not 128
    assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (4, "group", 32, False)
    w8 = json.loads(Path(files["safetensors-w8a16"], "config.json").read_text())["quantization_config"]
    weights = w8["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["group_size"], weights["symmetric"]) == (8, "int", 32, True)
    block = json.loads(Path(files["safetensors-fp8block"], "config.json").read_text())["quantization_config"]
    weights = block["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["block_structure"], weights["type"]) == ("block", [128, 128], "float")
    mx = json.loads(Path(files["safetensors-mxfp8e8m0"], "config.json").read_text())["quantization_config"]
    assert mx["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.float8_e8m0fnu"
    # the same exponent bytes as the package's MXFP8 twin, stored as F8_E8M0 rather than U8
    u8, e8 = _stored(files["safetensors-mxfp8"]), _stored(files["safetensors-mxfp8e8m0"])
    assert torch.equal(u8[down + "weight_scale"], e8[down + "weight_scale"].view(torch.uint8))
    assert torch.equal(u8[down + "weight"].view(torch.uint8), e8[down + "weight"].view(torch.uint8))
    assert lb.twins.group_for([4096, 14336], 128) == 128 and lb.twins.group_for([64, 160], 128) == 32


def test_each_twin_is_recognised_and_its_reference_uses_every_scale(twins):
    """``sdadapt.dequant_rules(folder)`` alone reads each twin (one rule of its codec, no extra
    rules); a single-process load equals the format's reference, and the reference moves when a
    scale, zero point or second scale is changed (it uses every one of them)."""
    import torch

    import sdadapt

    lb, files = twins
    kinds = {"fp8tensor": ("e4m3", "tensor", None, None), "int8ch": ("int8", "channel", None, None),
             "w4a16": ("int4", "group", None, None), "w4a16asym": ("int4", "group", "_zero_point", None),
             "mxfp8": ("e4m3", "group", None, None), "fp8static": ("e4m3", "tensor", None, None),
             "nvfp4modelopt": ("e2m1", "group", None, "_scale_2"), "fp8block": ("e4m3", "block", None, None),
             "w8a16": ("int8_packed", "group", None, None), "mxfp8e8m0": ("e4m3", "group", None, None),
             "fp8modelopt": ("e4m3", "tensor", None, None)}  # fmt: skip
    shape = lb.shapes.PRESETS["tiny"]
    down = "model.layers.1.mlp.down_proj."
    for twin, kind in kinds.items():
        folder = files[f"safetensors-{twin}"]
        (rule,) = sdadapt.dequant_rules(folder)
        assert (rule.codec, rule.strategy, rule.zero_suffix, rule.global_suffix) == kind, twin
        if twin in ("mxfp8", "mxfp8e8m0"):  # the exponents' stored dtype, from the config and the headers
            assert rule.scale_dtype == ("uint8" if twin == "mxfp8" else "float8_e8m0fnu"), (twin, rule.scale_dtype)
        if twin == "fp8block":
            assert list(rule.block) == [128, 128], rule.block
        model, _ = lb.models.build_model(shape, "titan")
        rep = sdadapt.load(model, folder, lb.shapes.adapter_for("titan", folder))
        # the activation scales that static FP8 and ModelOpt store are dropped on purpose, and said so
        static = twin in ("fp8tensor", "fp8static", "nvfp4modelopt", "fp8modelopt")
        assert (f"{down}input_scale" in rep.report.dropped) == static, (twin, rep.report.dropped)
        ref = lb.twins.FormatReference(folder)
        stored = {k.removeprefix(down): v for k, v in _stored(folder).items() if k.startswith(down) and "input" not in k}
        want = ref.dequantize(stored, torch.bfloat16)
        got = model.state_dict()["layers.1.feed_forward.w2.weight"]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), twin
        for field in ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_scale_2"):
            if field not in stored:
                continue
            bent = dict(stored)
            v = stored[field]
            bent[field] = (v + 1) if v.dtype in (torch.int32, torch.uint8) else (v.float() * 2).to(v.dtype)
            assert not torch.equal(ref.dequantize(bent, torch.bfloat16), want), (twin, field)


def test_the_disk_estimate_knows_every_quantized_twin_and_is_near_what_is_written(twins):
    """``check_fits`` counts each format at about its written size (a quantized twin is smaller
    than the bf16 checkpoint), so a run can keep several twins on a disk that would not hold as
    many bf16 copies; every quantized format the bench reads has an entry."""
    lb, files = twins
    import loadbench.paths

    assert set(loadbench.paths.QUANT_FORMATS.values()) == set(lb.checkpoint.QUANTIZED_BYTES_PER_VALUE)
    shape = lb.shapes.PRESETS["tiny"]
    for fmt, folder in files.items():
        written = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
        estimate = lb.checkpoint.format_nbytes(shape, fmt)
        # the tiny preset's headers are a tenth of its bytes; the estimate counts tensors only
        assert 0.8 * written < estimate <= written, (fmt, estimate, written)
        if fmt != "safetensors":
            assert estimate < 0.65 * lb.checkpoint.format_nbytes(shape, "safetensors"), fmt


def test_refit_host_probe_runs_every_format_path_with_the_kernels_faked():
    """bench/probes/refit_host_probe.py at 2 layers: the fused path taken on the CPU for the
    NVFP4 engine (its global scales and packed codes), a run timed."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probes" / "refit_host_probe.py"), "--quant", "nvfp4", "--repeat", "1", "--layers", "2"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nvfp4: host CPU per run" in out.stdout and "2 layers" in out.stdout, out.stdout


def test_gil_probe_prints_a_row_per_interval_and_sets_the_interval_back():
    """bench/probes/gil_probe.py: one table row per switch interval asked for, each with the calls per
    second alone and beside a Python loop (positive), and the interval set back afterwards."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probes" / "gil_probe.py"), "--intervals", "5,1", "--seconds", "0.05"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| [0-9.]+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["5", "1"], proc.stdout
    for r in rows:
        idle, busy, speed = (float(c) for c in r.strip("|").split("|")[1:])
        assert idle > 0 and busy > 0 and speed > 0
    with _bench_importable():
        import gil_probe
    before = sys.getswitchinterval()
    row = gil_probe.measure(0.002, 0.02)
    assert sys.getswitchinterval() == before and row["interval_ms"] == 2.0


def test_first_kernel_probe_times_each_op_twice_on_the_cpu():
    """bench/probes/first_kernel_probe.py runs on the CPU too: two timed calls of every op (the e2m1
    table it times is checked against the published values in ``test_quant``)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probes" / "first_kernel_probe.py"), "--device", "cpu", "--rows", "64", "--cols", "64"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    timed = [line for line in proc.stdout.splitlines() if ": call " in line]
    assert len(timed) == 2 * 10 and timed[-1].startswith("NVFP4 dequantize_into: call 2 ")


def test_gpu_timeline_overlay_profiles_the_first_two_engine_runs_and_summarises_them(tmp_path):
    """bench/probes/gpu_timeline.py: the overlay's sdadapt writes one profile per engine run, for the
    first two runs of a process only, each with its ``ENGINE_RUN`` span; ``summary`` reads them
    (on the CPU: no GPU work)."""
    tool = ROOT / "bench" / "probes" / "gpu_timeline.py"
    made = subprocess.run([sys.executable, str(tool), "overlay", str(ROOT / "src"), str(tmp_path / "tree")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    script = (
        "import torch, sdadapt\n"
        "from safetensors.torch import save_file\n"
        f"save_file({{'weight': torch.ones(4, 4), 'bias': torch.ones(4)}}, {str(tmp_path / 'model.safetensors')!r})\n"
        "for _ in range(3):\n"
        "    m = torch.nn.Linear(4, 4)\n"
        f"    sdadapt.load(m, {str(tmp_path)!r})\n"
        "    assert torch.equal(m.weight, torch.ones(4, 4))\n"
    )
    env = dict(_env(), PYTHONPATH=str(tmp_path / "tree" / "src"), SDADAPT_GPU_TIMELINE=str(tmp_path / "tl"))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "tl").iterdir()) == ["0.json", "1.json"]
    out = subprocess.run([sys.executable, str(tool), "summary", str(tmp_path / "tl")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("== timeline-") == 2 and "GPU work: none" in out.stdout and "GPU busy 0.000 s" in out.stdout


def test_thread_profile_summarises_a_py_spy_profile_per_thread(tmp_path):
    """bench/probes/thread_profile.py: of a py-spy raw profile, only the threads named as asked count;
    each table gives the samples and their share, paths shortened to the package's."""
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (11): sdadapt-device;Thread.run (threading.py:1010);DeviceLane._run (/x/site-packages/sdadapt/_engine/device.py:310);"
        "DeviceLane._gathered (/x/site-packages/sdadapt/_engine/device.py:459) 30\n"
        "thread (11): sdadapt-device;Thread.run (threading.py:1010);DeviceLane._run (/x/site-packages/sdadapt/_engine/device.py:310);"
        "dequantize_into (/x/src/sdadapt/_recipes/quant_scaled.py:168);"
        "Tensor.to (/usr/lib/python3.12/site-packages/torch/_tensor.py:9) 10\n"
        "thread (12): sdadapt-io-3;Worker._loop (/x/src/sdadapt/_engine/workers.py:187) 50\n"
        "thread (13): MainThread 5\n"
    )
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "probes" / "thread_profile.py"), str(raw), "--top", "5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("threads named sdadapt-device*: 40 samples") and "'sdadapt-io': 50" in lines[0]
    assert "     30  75.0%  DeviceLane._gathered (sdadapt/_engine/device.py:459)" in lines
    assert "     40 100.0%  DeviceLane._run (sdadapt/_engine/device.py:310)" in lines
    assert "     10  25.0%  dequantize_into (sdadapt/_recipes/quant_scaled.py:168)  ->  Tensor.to (torch/_tensor.py:9)" in lines
