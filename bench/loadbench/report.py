"""From the ranks' raw results to one row per job (first load, steady repeats, memory, check)
and a markdown table."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

from .common import GiB, meminfo

_MEMORY_KEYS = ("rss_anon_extra_gib", "rss_file_extra_gib", "rss_shmem_extra_gib", "rss_peak_gib", "gpu_extra_gib")


def _failure(g: dict[str, Any]) -> str:
    done = [r for r in g["ranks"] if r is not None]
    if g["hung"]:
        return f"hang: no result within {g['timeout']:.0f} s, killed"
    fatal = "; ".join(r["fatal"].splitlines()[0] for r in done if "fatal" in r)
    return fatal or f"crash (exit codes {g['rc']})"


def _memory(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Peak of each memory figure over ``runs`` (None where not measured, e.g. GPU on CPU runs)."""
    out: dict[str, float | None] = {}
    for k in _MEMORY_KEYS:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = max(vals) if vals else None
    return out


def summarize(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job: ``first_s`` (slowest rank's first load in its fresh process group; also
    ``wall_s``), ``steady_s`` (median over the steady repeats of the slowest rank), per-rank
    figures of the first load with the steady repeats' memory peaks beside them."""
    rows = []
    for g in groups:
        job = g.get("job")
        if not job:
            continue
        row: dict[str, Any] = {"path": job["path"], "layout": job["layout"], "flow": job["flow"], "variant": job.get("variant", "")}
        by_rank = [(r or {}).get("runs", []) for r in g["ranks"]]
        found = [next((x for x in runs if x["phase"] == "first"), None) for runs in by_rank]
        firsts = [f for f in found if f is not None]
        if len(firsts) < len(found):
            rows.append({**row, "ok": False, "error": _failure(g)})
            continue
        if not all(f["ok"] for f in firsts):
            errs = [f.get("error") for f in firsts if not f["ok"] and f.get("error")]
            rows.append({**row, "ok": False, "error": errs[0] if errs else "another rank failed"})
            continue
        steadies = [[x for x in runs if x["phase"] == "steady"] for runs in by_rank]
        reps = min(len(s) for s in steadies)
        bad = [s[i] for s in steadies for i in range(reps) if not s[i]["ok"]]
        if bad:
            row["steady_error"] = bad[0].get("error", "another rank failed")
            reps = 0
        walls = [max(s[i]["wall"] for s in steadies) for i in range(reps)]
        row.update(ok=True, first_s=max(f["wall"] for f in firsts), steady_s=statistics.median(walls) if walls else None,
                   steady_all_s=walls, repeats=reps)
        row["wall_s"] = row["first_s"]
        row["per_rank"] = []
        for rk, (f, s) in enumerate(zip(firsts, steadies, strict=True)):
            pr: dict[str, Any] = {
                "rank": rk,
                "wall_s": f["wall"],
                "steady_wall_s": statistics.median(y["wall"] for y in s[:reps]) if reps else None,
                "bytes_read_gib": f["bytes_read"] / GiB if "bytes_read" in f else None,
                "rchar_gib": f.get("rchar_gib"),
                "local_gib": f["local_bytes"] / GiB,
                "import_s": (g["ranks"][rk] or {}).get("import_s"),
                "load_import_s": f.get("import_s"),  # the loader's own imports inside the timed first load
                "load_import_cpu_s": f.get("import_cpu_s"),
                "gc": f.get("gc"),  # the cycle collector's runs inside the timed first load
                "import_gc": f.get("import_gc"),  # of which inside sdadapt's imports
                "modules_imported_by_call": f.get("modules_imported_by_call"),
                "raw_backend": f.get("backend"),
                "raw_io": f.get("io"),
                **_memory([f]),
                "steady": _memory(s[:reps]) if reps else None,
            }
            pr["gibps"] = pr["local_gib"] / pr["wall_s"]
            if f.get("phases"):
                pr["phases"] = f["phases"]
            steady_phases = [y["phases"] for y in s[:reps] if y.get("phases")]
            if steady_phases and len(steady_phases) == reps:  # each phase's median over the steady loads
                pr["steady_phases"] = {n: statistics.median(p.get(n, 0.0) for p in steady_phases) for n in steady_phases[0]}
            row["per_rank"].append(pr)
        row["check"] = f"{firsts[0].get('check', '?')} ({sum(f.get('checked', 0) for f in firsts)} shards)"
        rows.append(row)
    return rows


def combine_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job out of the rows of its rounds (``--rounds``), in first-seen order:
    ``first_s`` the median of the rounds' first loads (``first_all_s`` each of them, in round
    order), ``steady_s`` the median of every round's steady repeats (``steady_all_s``); the
    per-rank figures of the round whose first load is nearest that median. A job that failed
    in any round is that round's failed row."""
    by_job: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        by_job.setdefault((r["path"], r["layout"], r["flow"], r.get("variant", "")), []).append(r)
    out = []
    for same in by_job.values():
        failed = [r for r in same if not r.get("ok")]
        if failed or len(same) == 1:
            out.append(failed[0] if failed else {**same[0], "first_all_s": [same[0]["first_s"]]})
            continue
        firsts = [r["first_s"] for r in same]
        mid = statistics.median(firsts)
        rep = min(same, key=lambda r: abs(r["first_s"] - mid))
        walls = [w for r in same for w in r["steady_all_s"]]
        errors = [r["steady_error"] for r in same if r.get("steady_error")]
        row = {**rep, "first_s": mid, "wall_s": mid, "first_all_s": firsts, "steady_all_s": walls,
               "steady_s": statistics.median(walls) if walls and not errors else None,
               "repeats": len(walls) if not errors else 0, "rounds": len(same)}
        if errors:
            row["steady_error"] = errors[0]
        out.append(row)
    return out


def _name(row: dict[str, Any]) -> str:
    """A row's path, with its variant's name where it ran under one."""
    return row["path"] + (f" @{row['variant']}" if row.get("variant") else "")


def _span(vals: list[float | None], fmt: str = "{:.2f}") -> str:
    """``lo-hi`` over the ranks (one figure when they agree); ``-`` when none was measured."""
    vs = [v for v in vals if v is not None]
    if not vs:
        return "-"
    lo, hi = fmt.format(min(vs)), fmt.format(max(vs))
    return lo if lo == hi else f"{lo}-{hi}"


def _modules(pr: list[dict[str, Any]]) -> str:
    """`` (N)``: the modules sdadapt's load call itself imported (first rank), where counted; then
    the seconds the cycle collector ran inside the first load, and how many of its runs were full."""
    n = pr[0].get("modules_imported_by_call")
    out = f" ({n})" if n is not None else ""
    gc = pr[0].get("gc")
    if gc and gc.get("seconds"):  # the cycle collector's runs inside the first load (first rank)
        out += f"; GC {gc['seconds']:.3f} s, {gc['collections'][2]} full"
    return out


def how_line(result: dict[str, Any]) -> str:
    """How the figures were taken, in one paragraph (printed above the table)."""
    rounds = result.get("rounds", 1)
    forked = result.get("forked_from")
    started = (f"{result['nproc']} processes forked for that row alone from one process that had imported "
               f"{', '.join(forked)} once (--fork-ranks; each rank imported the rest itself, sdadapt among them)"
               if forked else f"{result['nproc']} new Python processes started for that row alone")
    return (f"Each row ran in its own fresh process group: {started}, "
            f"which imported {', '.join(result['libraries'])} before anything was timed"
            + (" (each loader's own imports, sdadapt and what it needs among them, are inside its timed first load: "
               "column `imports s`)" if result.get("import_in_load") else "")
            + ", built and parallelised the "
            "model (untimed; `materialized`: `to_empty` + values in every parameter, untimed)"
            + (", **then ran `gc.collect()` (--collect-after-build: the first load no longer meets a full collection the "
               "model build left due, as a user's would; not the headline's setting)**" if result.get("collect_after_build") else "")
            + ", then timed the first load "
            f"of the process (**first load**, the headline); then {result.get('warmup', 0)} untimed warm-up load(s) and "
            f"{result['repeat']} timed steady-state load(s) in the same processes, each into a newly prepared model. "
            + (f"The rows ran {rounds} times round-robin (each row's group once per round, in row order): first load = "
               f"median of the rounds' first loads, steady = median of all rounds' repeats (both listed). " if rounds > 1 else "")
            + "Wall = slowest rank. Extra RSS / GPU memory = peak over the load's start, per rank.")


def markdown(result: dict[str, Any]) -> str:
    """The run as markdown: what was measured and how, the references, the table, sdadapt's split."""
    rows = result["rows"]
    m, sh = result["machine"], result["shape"]
    lines = [
        f"Checkpoint: {result['checkpoint']['gib']:.2f} GiB {sh['dtype']} ({sh['layers']} layers, hidden {sh['hidden']}, "
        f"vocab {sh['vocab']}); {result['nproc']} ranks, {result['backend']}; {m['torch']} on {m['host']} ({m['cpus']} CPUs"
        + (f", {m['gpus']}" if m.get("gpus") else "") + f"; load average {m.get('load_avg', '?')} at the start"
        + (", {:.1f}-{:.1f} after the loads".format(*result["load_avg_during"]) if result.get("load_avg_during") else "") + "); "
        f"{result.get('cache', 'warm')} page cache"
        + (f"; worker memory: {result['malloc']} (see MALLOC_MODES)." if result.get("malloc", "default") != "default" else "."),
        how_line(result),
    ]
    if result.get("refs"):
        lines.append("References measured in the same run: " + "; ".join(f"{k} {v}" for k, v in result["refs"].items()) + ".")
    hdr = ("| path | layout | model before load | first load s | x sdadapt | steady s, median | steady repeats s | "
           "GiB/s per rank (first) | bytes read / rank GiB | extra RSS anon / file per rank GiB, first load | "
           "extra RSS anon per rank GiB, steady | peak RSS rank 0 GiB | extra GPU GiB per rank | check | "
           "imports in the first load s (modules the load call imported; GC: the collector inside the first load) |")
    lines += ["", hdr, "|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|"]
    if result.get("variants"):
        defs = [f"`{name}`: " + ", ".join(f"{k}={v}" for k, v in settings.items()) for name, settings in result["variants"].items()]
        lines.append("Variants (rows `PATH @NAME`, each in its own fresh process group after the row without it; "
                     "'x sdadapt' compares within a variant): " + "; ".join(defs) + ".")
    base = {(r["layout"], r["flow"], r.get("variant", "")): r["first_s"] for r in rows if r.get("ok") and r["path"] == "sdadapt"}
    for r in rows:
        if not r.get("ok"):
            err = str(r.get("error", ""))[:160].replace("|", "/").replace("\n", " ")
            lines.append(f"| {_name(r)} | {r['layout']} | {r['flow']} | FAILED | | | | | | | | | | {err} | |")
            continue
        pr = r["per_rank"]
        b = _span([p["bytes_read_gib"] if p["bytes_read_gib"] is not None else p["rchar_gib"] for p in pr])
        if pr[0]["bytes_read_gib"] is None:
            b += " (read())"
        key = (r["layout"], r["flow"], r.get("variant", ""))
        rel = f"{r['first_s'] / base[key]:.2f}" if key in base else "-"
        steady = f"{r['steady_s']:.3f}" if r["steady_s"] is not None else r.get("steady_error", "-")[:60].replace("|", "/")
        reps = " ".join(f"{w:.3f}" for w in r["steady_all_s"])
        if len(r.get("first_all_s", [])) > 1:
            reps += " (first loads: " + " ".join(f"{w:.3f}" for w in r["first_all_s"]) + ")"
        st_anon = _span([(p["steady"] or {}).get("rss_anon_extra_gib") for p in pr])
        lines.append(
            f"| {_name(r)} | {r['layout']} | {r['flow']} | **{r['first_s']:.3f}** | {rel} | {steady} | {reps} | "
            f"{_span([p['gibps'] for p in pr])} | {b} | "
            f"{_span([p['rss_anon_extra_gib'] for p in pr])} / {_span([p['rss_file_extra_gib'] for p in pr])} | {st_anon} | "
            f"{pr[0]['rss_peak_gib']:.2f} | {_span([p['gpu_extra_gib'] for p in pr])} | {r.get('check', '')} | "
            f"{_span([p.get('load_import_s') for p in pr], '{:.3f}')}{_modules(pr)} |"
        )
    split = [r for r in rows if r.get("ok") and r["per_rank"][0].get("phases")]
    if split:
        names = list(split[0]["per_rank"][0]["phases"])
        lines += ["", "sdadapt's own split of the first load (`LoadReport.phase_seconds`, seconds, slowest rank; `dcp_load` "
                  "contains `engine`, the engine's planning and reading, which overlap; `threads_*`: "
                  "`LoadReport.engine_thread_seconds`, summed over the engine's threads: busy running tasks, of which "
                  "read and wait for buffers):", "",
                  "| path | layout | model before load | " + " | ".join(names) + " |", "|" + "|".join(["---"] * (len(names) + 3)) + "|"]
        for r in split:
            vals = [max(p["phases"].get(n, 0.0) for p in r["per_rank"]) for n in names]
            lines.append(f"| {_name(r)} | {r['layout']} | {r['flow']} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    steady = [r for r in split if all(p.get("steady_phases") for p in r["per_rank"])]
    if steady:
        names = list(steady[0]["per_rank"][0]["steady_phases"])
        lines += ["", "The same split of the steady loads: each phase's median over a rank's steady loads, slowest rank:", "",
                  "| path | layout | model before load | " + " | ".join(names) + " |", "|" + "|".join(["---"] * (len(names) + 3)) + "|"]
        for r in steady:
            vals = [max(p["steady_phases"].get(n, 0.0) for p in r["per_rank"]) for n in names]
            lines.append(f"| {_name(r)} | {r['layout']} | {r['flow']} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def machine() -> dict[str, Any]:
    """Host, CPUs, RAM, torch version, GPUs and the load average now."""
    import torch

    m = {"host": platform.node(), "cpus": len(os.sched_getaffinity(0)), "torch": f"torch {torch.__version__}",
         "ram_gib": round(meminfo().get("MemTotal", 0) / GiB, 1), "load_avg": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        m["gpus"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return m
