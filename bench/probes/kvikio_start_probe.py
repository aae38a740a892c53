"""Probe: where a process's first kvikio read spends its time, and whether the page cache can be dropped.

Run on a GPU machine with kvikio installed, over a checkpoint folder of safetensors files
(e.g. the 8B one ``bench/load_bench.py --preset 8b --dir /tmp/ck --keep`` leaves)::

    python3 bench/probes/kvikio_start_probe.py start --folder /tmp/ck/sdadapt-bench-*/hf --bounce-mb 16,4,1
    python3 bench/probes/kvikio_start_probe.py cold --folder ...      # root: drop_caches, fadvise, O_DIRECT

``start``: one fresh process per bounce buffer size (and one without the warm-up read), each
importing torch and making every tensor's device buffer first (untimed), then timing:
kvikio's import, sizing its pool, its compat-mode check, opening the files, one read per pool
thread (kvikio pins its bounce buffers on first use), then three reads of every tensor
(``CuFile.pread`` into its own device buffer, all queued at once). Also the modules kvikio's
import spends its time in (``-X importtime``). ``cold``: whether writing
``/proc/sys/vm/drop_caches`` or ``posix_fadvise(DONTNEED)`` empties the page cache of the files
(``kvikio.get_page_cache_info`` before and after), then the first file read cold and warm,
with kvikio's plain reads and with its ``O_DIRECT`` reads (``auto_direct_io_read``).
Prints one JSON line per measurement. Nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

GiB = 1 << 30


def _tensors(folder: str) -> list[tuple[str, int, int]]:
    """(file, offset, nbytes) of every tensor of the safetensors files in ``folder``."""
    out = []
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = json.loads(fh.read(n))
        base = 8 + n
        for k, v in head.items():
            if k != "__metadata__":
                a, b = v["data_offsets"]
                out.append((f, base + a, b - a))
    return out


def _read_all(kvikio, handles, bufs, items) -> float:
    t = time.perf_counter()
    futs = [(handles[f].pread(bufs[i], n, off), n) for i, (f, off, n) in enumerate(items)]
    for fut, n in futs:
        assert fut.get() == n
    return time.perf_counter() - t


def start(args: argparse.Namespace) -> None:
    if args.child:
        return _start_child(args)
    for bounce in [float(b) for b in args.bounce_mb.split(",")]:
        for warm in ([1, 0] if bounce == float(args.bounce_mb.split(",")[0]) else [1]):
            cmd = [sys.executable, __file__, "start", "--folder", args.folder, "--threads", str(args.threads),
                   "--bounce-mb", str(bounce), "--warm", str(warm), "--child"]
            subprocess.run(cmd, check=False, timeout=120)
    imp = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch; import kvikio, kvikio.defaults"],
                         capture_output=True, text=True, timeout=120)
    lines = imp.stderr.splitlines()
    after = next((i for i, ln in enumerate(lines) if ln.rstrip().endswith("| torch")), 0)
    rows = []
    for ln in lines[after + 1:]:
        parts = ln.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    print(json.dumps({"probe": "kvikio import, cumulative us (self us)", "top": [f"{c} ({s}) {m}" for c, s, m in rows[:14]]}))


def _start_child(args: argparse.Namespace) -> None:
    import torch

    items = _tensors(args.folder)
    dev = torch.device("cuda", 0)
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for _, _, n in items]
    torch.cuda.synchronize()
    facts: dict[str, object] = {"probe": "start", "bounce_mb": args.bounce_mb, "warm": args.warm, "threads": args.threads,
                                "tensors": len(items), "gib": round(sum(n for *_, n in items) / GiB, 3)}
    t = time.perf_counter()
    import kvikio
    import kvikio.defaults as d

    facts["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    d.set("num_threads", args.threads)
    d.set("task_size", 16 << 20)
    bounce = int(float(args.bounce_mb) * (1 << 20))
    d.set("bounce_buffer_size", bounce)
    facts["set_s"] = time.perf_counter() - t
    t = time.perf_counter()
    facts["compat_preferred"] = bool(d.is_compat_mode_preferred())
    facts["compat_check_s"] = time.perf_counter() - t
    t = time.perf_counter()
    handles = {f: kvikio.CuFile(f, "r") for f in sorted({f for f, _, _ in items})}
    facts["open_s"] = time.perf_counter() - t
    if args.warm:
        scratch = torch.empty(args.threads * bounce, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        f0 = items[0][0]
        t = time.perf_counter()
        futs = [handles[f0].pread(scratch[i * bounce:(i + 1) * bounce], bounce, 0) for i in range(args.threads)]
        for fut in futs:
            fut.get()
        facts["warm_s"] = time.perf_counter() - t
        t = time.perf_counter()
        futs = [handles[f0].pread(scratch[i * bounce:(i + 1) * bounce], bounce, 0) for i in range(args.threads)]
        for fut in futs:
            fut.get()
        facts["warm_again_s"] = time.perf_counter() - t
        del scratch
    facts["reads_s"] = [round(_read_all(kvikio, handles, bufs, items), 4) for _ in range(3)]
    facts["gibps"] = [round(float(facts["gib"]) / s, 1) for s in facts["reads_s"]]  # type: ignore[union-attr]
    for h in handles.values():
        h.close()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in facts.items()}), flush=True)


def _cached(kvikio, files: list[str]) -> float:
    got = tot = 0
    for f in files:
        c, n = kvikio.get_page_cache_info(f)
        got, tot = got + c, tot + n
    return got / max(1, tot)


def _warm(files: list[str]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def cold(args: argparse.Namespace) -> None:
    import kvikio
    import kvikio.defaults as d
    import torch

    files = sorted(glob.glob(os.path.join(args.folder, "*.safetensors")))
    d.set("num_threads", args.threads)
    d.set("task_size", 16 << 20)
    out: dict[str, object] = {"probe": "cold", "files": len(files), "uid": os.getuid()}
    out["cached_before"] = round(_cached(kvikio, files), 3)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        out["drop_caches"] = "written"
    except OSError as e:
        out["drop_caches"] = f"refused: {e}"
    out["cached_after_drop_caches"] = round(_cached(kvikio, files), 3)
    _warm(files[:1])
    out["cached_first_after_warming"] = round(_cached(kvikio, files[:1]), 3)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    out["cached_after_fadvise"] = round(_cached(kvikio, files), 3)
    try:
        fd = os.open(files[0], os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
        out["o_direct_open"] = "ok"
    except OSError as e:
        out["o_direct_open"] = f"refused: {e}"
    print(json.dumps(out), flush=True)
    # the first file, read by kvikio into the GPU: cold (after dropping) and warm, plain and O_DIRECT
    f0 = files[0]
    size = os.path.getsize(f0)
    buf = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def drop() -> None:
        fd = os.open(f0, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
        except OSError:
            pass

    for direct in (False, True):
        d.set("auto_direct_io_read", direct)
        for state in ("cold", "warm", "cold"):
            if state == "cold":
                drop()
            before = _cached(kvikio, [f0])
            h = kvikio.CuFile(f0, "r")
            t = time.perf_counter()
            n = h.pread(buf, size, 0).get()
            s = time.perf_counter() - t
            h.close()
            print(json.dumps({"probe": "read first file", "o_direct": direct, "cache": state, "cached_before": round(before, 3),
                              "gib": round(n / GiB, 3), "s": round(s, 3), "gibps": round(n / GiB / s, 2)}), flush=True)
    _warm(files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["start", "cold"])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--bounce-mb", default="16,4,1")
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    (start if args.what == "start" else cold)(args)


if __name__ == "__main__":
    main()
