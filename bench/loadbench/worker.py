"""One worker process: one rank of a fresh process group started for one job (or for the
references). It imports the libraries, initialises the process group, then loads: the first
load of the process (the headline figure), ``warmup`` untimed loads, ``repeat`` timed
steady-state loads. Each load gets its own model, prepared untimed. Results go to
``<out>/rank<N>.json`` after every load, so that a killed group still leaves what it did."""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoint import drop_caches
from .common import GiB
from .memory import RssSampler, rchar
from .paths import (
    FP8_PATHS,
    QUANT_FORMATS,
    RAW_PATHS,
    Job,
    import_libraries,
    local_of,
    model_sd,
    prepare,
    timed_load,
    verify_against_source,
    verify_raw,
)
from .references import measure_references
from .shapes import Shape


def main(config_path: str) -> None:
    """Run the worker described by the JSON file ``config_path``; ends the process."""
    cfg = json.loads(Path(config_path).read_text())
    chain = cfg.get("chain") or [cfg]  # --one-group: every job's config, run one after the other
    preloaded = sorted(n for n in sys.modules if n == "sdadapt" or n.startswith("sdadapt."))  # none: a fresh process
    t_start = time.perf_counter()
    imported: list[str] = []
    for c in chain:
        imported += [n for n in import_libraries(bool(cfg.get("import_in_load")), (c.get("job") or {}).get("path", ""))
                     if n not in imported]
    import_s = time.perf_counter() - t_start
    import torch
    import torch.distributed as dist

    backend = cfg["backend"]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if cfg.get("dump_after"):  # a hang leaves its stacks in the log
        import faulthandler

        faulthandler.dump_traceback_later(cfg["dump_after"], exit=False)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.get("pg_timeout", 600)),
                            device_id=dev if backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = importlib.util.find_spec("sdadapt")  # where it is, without importing it (see --import-in-load)

    for c in chain:
        out: dict[str, Any] = {"rank": rank, "world": world, "pid": os.getpid(), "imported": imported,
                               "sdadapt_preloaded": preloaded,
                               "import_s": import_s, "runs": [], "refs": {}, "sdadapt_file": spec.origin if spec else None,
                               "sdadapt_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SDADAPT_")}}
        try:
            if c.get("job"):
                _run_job(c, Job(**c["job"]), Shape(**c["shape"]), dev, rank, out)
            if c.get("references"):
                out["refs"] = measure_references(c["files"], dev, rank, world)
        except BaseException as e:  # noqa: BLE001 - reported in the results
            import traceback

            out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        _save(c, rank, out)
        if "fatal" in out:
            break  # the ranks may no longer agree on where they are: the later jobs get no results
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # torch 2.13 + gloo can abort at interpreter exit after destroy_process_group


def _save(cfg: dict[str, Any], rank: int, out: dict[str, Any]) -> None:
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))


def _run_job(cfg: dict[str, Any], job: Job, shape: Shape, dev: Any, rank: int, out: dict[str, Any]) -> None:
    """The first load, the untimed warm-ups, the steady repeats; stops at the first load that
    failed on any rank (the ranks agree on it, so none waits for another)."""
    import torch
    import torch.distributed as dist

    loads = [("first", 0)] + [("warmup", i) for i in range(int(cfg.get("warmup", 0)))]
    loads += [("steady", i) for i in range(int(cfg.get("repeat", 0)))]
    for phase, i in loads:
        run = _measure_one(cfg, job, shape, dev, phase)
        run["repeat"] = i
        if phase != "warmup":
            out["runs"].append(run)
            _save(cfg, rank, out)  # partial results survive a kill
        flag = torch.tensor([0 if run["ok"] else 1], device=dev)
        dist.all_reduce(flag)
        if flag.item():
            if run["ok"]:
                run["note"] = "another rank failed"
            return


def _measure_one(cfg: dict[str, Any], job: Job, shape: Shape, dev: Any, phase: str) -> dict[str, Any]:
    """Prepare the model (untimed), then time one load and sample its memory; the first load is
    checked bit-exactly against the source afterwards (untimed)."""
    import torch
    import torch.distributed as dist

    run: dict[str, Any] = {"path": job.path, "layout": job.layout, "flow": job.flow, "phase": phase}
    model = None
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    try:
        model = prepare(job, shape, dev)
        if cfg.get("collect_after_build"):
            gc.collect()  # --collect-after-build: the collection the build left due, run before the timing
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
        gpu0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        if cfg.get("cold"):
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                drop_caches()
            dist.barrier()
        rchar0 = rchar()
        with RssSampler(cfg.get("rss_interval", 0.003)) as sampler:
            facts = timed_load(model, job, cfg["files"], dev)
        loaded = facts.pop("_loaded", None)
        if loaded is not None:
            model = loaded  # a raw loader's dict of tensors
        run.update(facts)
        run.update(sampler.result())
        run["load_avg"] = os.getloadavg()[0]
        run["rchar_gib"] = (rchar() - rchar0) / GiB
        if dev.type == "cuda":
            now = torch.cuda.memory_allocated(dev)
            run["gpu_extra_gib"] = (torch.cuda.max_memory_allocated(dev) - now) / GiB
            run["gpu_model_gib"] = now / GiB
            run["gpu_grown_gib"] = (now - gpu0) / GiB
        sd = model if isinstance(model, dict) else model_sd(model)
        run["local_bytes"] = run.get("local_bytes") or sum(
            local_of(t)[0].numel() * local_of(t)[0].element_size() for t in sd.values()
        )
        del sd
        if phase == "first" and cfg.get("verify", True) and job.path in RAW_PATHS:
            run["checked"], run["check"] = verify_raw(model, cfg["files"]["safetensors"]), "= file bytes"
        elif phase == "first" and cfg.get("verify", True):
            run["checked"], also = verify_against_source(model, job.path, cfg["files"], dev)
            run["check"] = ("= eager dequant of the FP8 file" if job.path in FP8_PATHS else
                            "= eager dequant of the quantized file" if job.path in QUANT_FORMATS else "= source")
            run["check"] += f"; {also}" if also else ""
        elif phase == "first":
            run["checked"], run["check"] = 0, "not checked (--no-verify)"
        run["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failing path is a result
        import traceback

        run["ok"] = False
        run["error"] = f"{type(e).__name__}: {e}"[:2000]
        run["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
    finally:
        model = None  # free this load's model before the next one is built
        gc.collect()
    return run
