"""The command line of ``bench/load_bench.py`` and the run as a whole: write the checkpoint once,
start a fresh process group per job, then one for the references, and write PREFIX.json and
PREFIX.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .checkpoint import check_fits, drop_caches, stamp, warm_cache, write_checkpoint
from .common import BenchError, GiB
from .forkserver import ForkServer
from .launch import MALLOC_MODES, launch_group, server_env
from .paths import (
    ALL_PATHS,
    DISCUSSION_PATHS,
    LIBRARIES,
    MATERIALIZED_PATHS,
    QUANT_FORMATS,
    RAW_PATHS,
    TP_PATHS,
    USER_LIBRARIES,
    Job,
)
from .report import combine_rounds, machine, markdown, summarize
from .shapes import PRESETS, Shape

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
ENTRY = BENCH / "load_bench.py"


def parser(description: str) -> argparse.ArgumentParser:
    """The options of ``bench/load_bench.py``."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="2g")
    for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, help=f"override the preset's {f}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-gb", type=float, default=5.0, help="HF shard size (GB), like save_pretrained's max_shard_size")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default=None, help="gloo (CPU) or nccl (GPU); default: nccl when CUDA is available")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (and reuse one written with the same settings)")
    ap.add_argument("--paths", default=",".join(ALL_PATHS),
                    help="comma list of FSDP paths, model on meta; the quantized twins' paths are "
                         f"{', '.join(p for p in QUANT_FORMATS if p.startswith('sdadapt'))} and hf-fp8-reader")
    ap.add_argument("--tp-paths", default=",".join(TP_PATHS), help="comma list of TP paths ('' for none)")
    ap.add_argument("--hsdp-paths", default="", help="comma list of paths on an HSDP mesh of replicas only, "
                    "e.g. sdadapt,sdadapt-shared (share_reads=True),hf-reader ('' for none)")
    ap.add_argument("--materialized-paths", default=",".join(MATERIALIZED_PATHS),
                    help="comma list of FSDP paths loaded into a materialised model (to_empty + values) ('' for none)")
    ap.add_argument("--raw-paths", default="", help="comma list of raw loaders (every tensor to the rank's device as a dict, "
                    "no model): instanttensor (buffered I/O), instanttensor-mmap, instanttensor-direct, safetensors-gpu, kvikio "
                    "('' for none)")
    ap.add_argument("--import-in-load", action="store_true",
                    help="import only what a job needs to build and shard its model before timing: each loader's own "
                         "imports (sdadapt and what it needs, InstantTensor, safetensors, DCP) are part of its first load")
    ap.add_argument("--collect-after-build", action="store_true",
                    help="gc.collect() after each model is built, before its load is timed (every row, every loader): "
                         "a first load without the full collection a model build leaves due (not what a user's first "
                         "load sees; labelled in the output)")
    ap.add_argument("--discussion", default="materialized,meta", help="torchsave-broadcast variants to run ('' for none)")
    ap.add_argument("--discussion-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=3000.0, help="timeout of each path's process group (s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed steady-state loads after the first load (default 3)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every row this many times, round-robin (every row's fresh process group once per round, "
                         "in row order): a row's first load is the median of its rounds' first loads and its steady "
                         "figure the median of all its rounds' repeats, so that rows compared are measured interleaved "
                         "rather than minutes apart on a machine whose load moves (e.g. --rounds 5 --repeat 1)")
    ap.add_argument("--malloc", choices=sorted(MALLOC_MODES), default="default",
                    help="glibc memory reuse between loads in the workers (see MALLOC_MODES); default: glibc's own")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed loads between the first load and the steady-state repeats (default 0)")
    ap.add_argument("--assume-ram-gib", type=float, default=None,
                    help="RAM to plan with (machines whose memory grows on demand report too little)")
    ap.add_argument("--no-references", action="store_true")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load (root only)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact checks (tuning runs only)")
    ap.add_argument("--rss-interval-ms", type=float, default=3.0,
                    help="how often a thread samples RSS during a load (0: no sampling thread; peaks from VmHWM "
                         "and the end of the load only), to see what the sampling costs the load")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:SETTINGS",
                    help="also run every sdadapt job under other settings, in its own fresh process group right after "
                         "the job's own: SETTINGS is a comma list of ENV=VALUE (e.g. SDADAPT_IO_BAND_DEPTH=2) and "
                         "src=FOLDER (a folder holding another sdadapt package, e.g. another commit's src/ from "
                         "`git archive`, put first on the workers' path); rows are named PATH @NAME, and 'x sdadapt' "
                         "compares within a variant (repeatable)")
    ap.add_argument("--by-variant", action="store_true",
                    help="run the rows variant by variant: each variant's sdadapt rows back to back (the other "
                         "loaders' rows with the rows without a variant, first), so that 'x sdadapt' compares loads run "
                         "one after the other rather than minutes apart")
    ap.add_argument("--one-group", action="store_true",
                    help="run every row in one process group, one after the other (no variants, rounds or discussion): "
                         "only the first row's first load is its processes' first, so the figures are not the "
                         "headline's; for checking many paths at the cost of one process start (the test suite)")
    ap.add_argument("--fork-ranks", action="store_true",
                    help="fork every rank from one process that imported torch's libraries once (not sdadapt: each rank "
                         "imports it, and its first load is still its process's first): a group costs forks, not "
                         "interpreters; the environment torch reads at import is that process's, so --variant may set "
                         "only SDADAPT_ settings and src= (for checking many rows on a small machine: the test suite)")
    ap.add_argument("--out", default=str(BENCH / "out" / "load_bench"), help="output prefix: writes PREFIX.json and PREFIX.md")
    return ap


def _split(s: str) -> list[str]:
    return [p for p in s.split(",") if p]


_VARIANT_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--variant`` values as ``{name: {"src": folder?, ENV: value, ...}}``, checked."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or not _VARIANT_NAME.fullmatch(name) or name in out:
            raise BenchError(f"--variant {spec!r}: give NAME:SETTINGS with a new NAME of letters, digits, '_', '-', '.'")
        settings: dict[str, str] = {}
        for item in _split(rest):
            key, eq, value = item.partition("=")
            if not eq or not (key == "src" or _ENV_NAME.fullmatch(key)):
                raise BenchError(f"--variant {spec!r}: {item!r} is not ENV=VALUE or src=FOLDER")
            settings[key] = value
        if not settings:
            raise BenchError(f"--variant {spec!r}: no settings after {name}:")
        if "src" in settings:
            src = Path(settings["src"]).resolve()
            if not (src / "sdadapt" / "__init__.py").is_file():
                raise BenchError(f"--variant {spec!r}: {src} holds no sdadapt package (give the folder that holds sdadapt/)")
            settings["src"] = str(src)
        out[name] = settings
    return out


def _jobs(args: argparse.Namespace, the_variants: dict[str, dict[str, str]]) -> list[Job]:
    """The rows to run: each path of each layout, and each sdadapt row again per variant."""
    jobs = [Job("fsdp", p) for p in _split(args.paths)]
    jobs += [Job("tp", p) for p in _split(args.tp_paths)]
    jobs += [Job("hsdp", p) for p in _split(args.hsdp_paths)]
    jobs += [Job("fsdp", p, "materialized") for p in _split(args.materialized_paths)]
    jobs += [Job("raw", p, "none") for p in _split(getattr(args, "raw_paths", ""))]
    for v in _split(args.discussion):
        if v not in DISCUSSION_PATHS:
            raise BenchError(f"--discussion takes {', '.join(DISCUSSION_PATHS)}, not {v!r}")
        jobs.append(Job("fsdp", DISCUSSION_PATHS[v]))
    known = set(ALL_PATHS) | {"sdadapt-shared"} | set(DISCUSSION_PATHS.values())
    unknown = sorted({j.path for j in jobs if j.layout != "raw"} - known)
    unknown += sorted({j.path for j in jobs if j.layout == "raw"} - set(RAW_PATHS))
    if unknown:
        raise BenchError(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    names = list(the_variants)
    if getattr(args, "by_variant", False):
        return [replace(j, variant=v) for v in ["", *names] for j in jobs if not v or j.path.startswith("sdadapt")]
    return [replace(j, variant=v) for j in jobs for v in ["", *(names if j.path.startswith("sdadapt") else [])]]


def _formats(jobs: list[Job]) -> list[str]:
    paths = {j.path for j in jobs}
    formats = ["safetensors"]
    if "sdadapt-torchsave" in paths or paths & set(DISCUSSION_PATHS.values()):
        formats.append("torch.save")
    if paths & {"sdadapt-dcp", "dcp-native"}:
        formats.append("dcp")
    formats += sorted({QUANT_FORMATS[p] for p in paths if p in QUANT_FORMATS})
    return formats


def _refs_text(groups: list[dict[str, Any]], warm: float, cold: bool) -> dict[str, str]:
    refs: dict[str, str] = {}
    ranks = next((g["ranks"] for g in groups if g["tag"] == "references"), None)
    if ranks and all(r is not None and r.get("refs") for r in ranks):
        threads = ranks[0]["refs"].get("page_cache_read_threads")
        refs["page-cache read (GiB/s per rank, all ranks at once)"] = \
            "/".join(f"{r['refs']['page_cache_read_gibps']:.1f}" for r in ranks) + f" with {threads} threads each"
        if ranks[0]["refs"].get("pinned_pipeline_gibps"):
            refs["pread into pinned buffers + host-to-GPU copy, overlapped (GiB/s per rank, all at once)"] = \
                "/".join(f"{r['refs']['pinned_pipeline_gibps']:.1f}" for r in ranks) + f" with {threads} threads each"
        if ranks[0]["refs"].get("pinned_h2d_gibps"):
            refs["pinned host-to-GPU (GiB/s per rank, all at once)"] = "/".join(f"{r['refs']['pinned_h2d_gibps']:.1f}" for r in ranks)
    if not cold:
        refs["first read of all files after writing (8 threads)"] = f"{warm:.1f} GiB/s"
    return refs


def main(argv: list[str] | None = None, description: str = "") -> int:
    """Run the benchmark (or, with ``--worker``, one worker process); returns the exit status."""
    args = parser(description).parse_args(argv)
    if args.worker:
        from .worker import main as worker_main

        worker_main(args.worker)
        return 0

    import torch

    shape = PRESETS[args.preset]
    shape = Shape(**{**asdict(shape), **{k: v for k, v in vars(args).items() if k in asdict(shape) and v is not None}})
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.nproc:
        raise BenchError(f"--backend nccl needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    if str(ROOT / "src") not in sys.path:  # the workers get it on PYTHONPATH; this process checks imports
        sys.path.insert(0, str(ROOT / "src"))
    the_variants = variants(args.variant)
    jobs = _jobs(args, the_variants)
    if args.one_group and (args.variant or args.rounds > 1 or any(j.path in DISCUSSION_PATHS.values() for j in jobs)):
        raise BenchError("--one-group runs neither --variant, --rounds nor --discussion rows (they need processes of their own)")
    if args.fork_ranks and any(k != "src" and not k.startswith("SDADAPT_") for v in the_variants.values() for k in v):
        raise BenchError("--fork-ranks: a --variant may set only SDADAPT_ settings and src= (the ranks' torch was "
                         "imported by the process they are forked from)")
    if any(j.path == "sdadapt-dcp" for j in jobs):
        try:
            import sdadapt.sources._dcp_dir  # noqa: F401
        except ImportError:
            print("sdadapt-dcp: the DCP source (sdadapt.sources._dcp_dir) is not available here; skipped", file=sys.stderr)
            jobs = [j for j in jobs if j.path != "sdadapt-dcp"]
    formats = _formats(jobs)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    folder = base / f"sdadapt-bench-{stamp(shape, args.shard_gb, formats)}"
    reuse = args.keep and (folder / "DONE").exists()
    facts = {} if reuse else check_fits(base, shape, formats, args.nproc, args.assume_ram_gib)
    created = False
    try:
        t0 = time.perf_counter()
        if reuse:
            files = json.loads((folder / "DONE").read_text())
            print(f"reusing {folder}", file=sys.stderr)
        else:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            created = True
            files = write_checkpoint(folder, shape, args.shard_gb, formats)
            (folder / "DONE").write_text(json.dumps(files))
            os.sync()  # no write-back of the new files during the timed loads
        write_s = time.perf_counter() - t0
        if args.cold:
            drop_caches()  # refuses here, before any worker starts, where it is not allowed
            warm = 0.0
        else:
            warm = warm_cache(list(files.values()))
        print(f"checkpoint {shape.nbytes() / GiB:.2f} GiB x {len(files)} formats ready in {write_s:.1f} s; "
              f"cache warmed at {warm:.1f} GiB/s", file=sys.stderr)
        result = _run_groups(args, jobs, the_variants, shape, backend, files, facts, formats, warm)
        if args.one_group:
            result["first_load"] = ONE_GROUP
        out_prefix = Path(args.out)
        out_prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out_prefix}.json").write_text(json.dumps(result, indent=1, default=str))
        md = markdown(result)
        if args.one_group:  # the paragraph below speaks of fresh process groups: these figures are not those
            md = f"Not the headline: {ONE_GROUP}.\n\n{md}"
        Path(f"{out_prefix}.md").write_text(md)
        print(md)
        rows = result["rows"]
        return 0 if all(r.get("ok") for r in rows if r["path"] not in DISCUSSION_PATHS.values()) else 1
    finally:
        if (created or reuse) and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


ONE_GROUP = "one process group for every row (--one-group): only the first row's first load is the first load of its processes"


def _one_group(args: argparse.Namespace, jobs: list[Job], common: dict[str, Any], work: Path,
               pythonpath: list[str], server: ForkServer | None) -> list[dict[str, Any]]:
    """``--one-group``: every job run by the same ranks, one after the other; one group's
    record per job (its ranks' results, the shared launch's exit codes, seconds and log)."""
    cfgs = [{**common, "job": asdict(job), "out": str(work / job.tag), "repeat": args.repeat, "warmup": args.warmup}
            for job in jobs]
    for cfg in cfgs:
        Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
    timeout = args.timeout * max(1, len(jobs))
    g = launch_group({**common, "job": None, "chain": cfgs, "out": str(work / "one-group")}, args.nproc, timeout,
                     "one-group", ENTRY, pythonpath, server=server)
    print(f"one group of {len(jobs)} rows done in {g['seconds']:.1f} s" + (" (hung, killed)" if g["hung"] else ""),
          file=sys.stderr)
    groups = []
    for cfg, job in zip(cfgs, jobs, strict=True):
        files = [Path(cfg["out"], f"rank{r}.json") for r in range(args.nproc)]
        ranks = [json.loads(f.read_text()) if f.exists() else None for f in files]
        groups.append({**g, "tag": job.tag, "ranks": ranks, "job": asdict(job), "timeout": timeout})
    return groups


def _run_groups(args: argparse.Namespace, jobs: list[Job], the_variants: dict[str, dict[str, str]], shape: Shape,
                backend: str, files: dict[str, str], facts: dict[str, float], formats: list[str], warm: float) -> dict[str, Any]:
    """One fresh process group per job (per round), then one for the references; the result as a dict."""
    if args.rounds < 1:
        raise BenchError("--rounds takes 1 or more")
    work = Path(tempfile.mkdtemp(prefix="sdadapt-bench-run-"))
    common = {"shape": asdict(shape), "backend": backend, "files": files, "cold": args.cold,
              "verify": not args.no_verify, "malloc": args.malloc, "rss_interval": args.rss_interval_ms / 1000,
              "import_in_load": args.import_in_load, "collect_after_build": args.collect_after_build}
    pythonpath = [str(ROOT / "src")]
    the_machine = machine()  # the load average before the workers start
    preload = [n for n in (USER_LIBRARIES if args.import_in_load else LIBRARIES) if n != "sdadapt"]
    try:  # the groups' results are read back into memory: their folders go, even on an error
        with ForkServer(preload, server_env(args.malloc)) if args.fork_ranks else contextlib.nullcontext() as server:
            groups = _launch_all(args, jobs, the_variants, common, work, pythonpath, server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = combine_rounds(summarize(groups))
    loads = [run["load_avg"] for g in groups for r in g["ranks"] if r for run in r["runs"] if "load_avg" in run]
    first_load = "one fresh process group per row; the row's first load is the first load of its processes"
    if args.fork_ranks:
        first_load += f" (ranks forked from one process that had imported {', '.join(preload)}; not sdadapt: --fork-ranks)"
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": the_machine,
        "load_avg_during": [min(loads), max(loads)] if loads else None,
        "shape": asdict(shape),
        "checkpoint": {"gib": shape.nbytes() / GiB, "formats": formats, "shard_gb": args.shard_gb, **facts},
        "nproc": args.nproc,
        "backend": backend,
        "libraries": USER_LIBRARIES if args.import_in_load else LIBRARIES,
        "import_in_load": args.import_in_load,
        "collect_after_build": args.collect_after_build,
        "first_load": first_load,
        "forked_from": preload if args.fork_ranks else None,
        "repeat": args.repeat,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "malloc": args.malloc,
        "rss_interval_ms": args.rss_interval_ms,
        "variants": the_variants,
        "cache": "cold (dropped before every load)" if args.cold else "warm",
        "refs": _refs_text(groups, warm, args.cold),
        "rows": rows,
        "groups": groups,
    }


def _launch_all(args: argparse.Namespace, jobs: list[Job], the_variants: dict[str, dict[str, str]], common: dict[str, Any],
                work: Path, pythonpath: list[str], server: ForkServer | None) -> list[dict[str, Any]]:
    """Every job's group (per round), then the references' (forked from ``server`` where given)."""
    groups = _one_group(args, jobs, common, work, pythonpath, server) if args.one_group else []
    for rnd, job in ((r, j) for r in range(args.rounds) for j in ([] if args.one_group else jobs)):
        discussion = job.path in DISCUSSION_PATHS.values()
        timeout = args.discussion_timeout if discussion else args.timeout
        out = work / (job.tag if args.rounds == 1 else f"{job.tag}-round{rnd}")
        cfg = {**common, "job": asdict(job), "out": str(out), "repeat": 0 if discussion else args.repeat,
               "warmup": 0 if discussion else args.warmup}
        if discussion:
            cfg.update(pg_timeout=int(timeout) + 60, dump_after=max(1.0, timeout * 0.6))
        settings = dict(the_variants.get(job.variant, {}))
        src = settings.pop("src", None)
        g = launch_group(cfg, args.nproc, timeout, job.tag, ENTRY, [src] if src else pythonpath, settings, server)
        g.update(job=asdict(job), timeout=timeout, round=rnd)
        groups.append(g)
        which = f"{job.tag}" + (f" round {rnd + 1}/{args.rounds}" if args.rounds > 1 else "")
        print(f"{which}: group done in {g['seconds']:.1f} s" + (" (hung, killed)" if g["hung"] else ""), file=sys.stderr)
    if not args.no_references and not args.cold:
        cfg = {**common, "job": None, "references": True, "out": str(work / "references")}
        g = launch_group(cfg, args.nproc, args.timeout, "references", ENTRY, pythonpath, server=server)
        g.update(job=None, timeout=args.timeout)
        groups.append(g)
    return groups
