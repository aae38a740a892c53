"""Where a TP group's time goes when it shares rows (``share_rows``): a per-rank timeline.

    python bench/probes/row_share_trace.py --dir CKPT --mesh tp=8 [--mode shared|group] [--events]

Starts the mesh's first TP group as in ``bench/cold_read_bench.py``'s ``shared`` mode (one
process per rank, cold, gloo), with the engine's runs (``read``), the agreements (``agree``:
``any_rank``), the exchanges (``pack`` and ``unpack``: the copies into and out of a round's
buffers; ``a2a``: posting ``all_to_all_single``; ``wait``: waiting for it) and gloo's other
collectives timed in each process; prints each rank's events (seconds from its
start) and, per rank, the sums per kind and the rest. The engine's runs and the rounds run on two
threads at once (``read`` sums both), so the sums may exceed the rank's time. For diagnosis:
the wrappers add a list append per call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

EVENTS: list[tuple[str, float, float]] = []
T0 = time.perf_counter()


def _timed(owner: object, name: str, label: str) -> None:
    f = getattr(owner, name, None)
    if f is None:  # a tree without it (an older engine): not timed
        return

    def g(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            out = f(*a, **k)
        finally:
            EVENTS.append((label, t - T0, time.perf_counter() - T0))
        if label == "a2a" and out is not None:
            return _Work(out)
        return out

    setattr(owner, name, g)


class _Work:
    def __init__(self, work: object):
        self.work = work

    def wait(self) -> object:
        t = time.perf_counter()
        try:
            return self.work.wait()  # type: ignore[attr-defined]
        finally:
            EVENTS.append(("wait", t - T0, time.perf_counter() - T0))


def patch() -> None:
    import torch.distributed as dist

    from sdadapt._engine import direct, engine, share

    _timed(engine.IOEngine, "run", "read")
    _timed(share, "_pack", "pack")
    _timed(share, "_unpack", "unpack")
    _timed(share, "any_rank", "agree")
    _timed(dist, "all_to_all_single", "a2a")
    _timed(dist, "all_reduce", "all_reduce")
    _timed(dist, "broadcast", "broadcast")
    del direct


def member(args: argparse.Namespace) -> None:
    patch()
    import cold_read_bench as B

    global T0
    T0 = time.perf_counter()
    # an older bench's member() shares rows only (no ``mode``)
    out = B.member(args.dir, args.mesh, args.rank, args.port, False, *([args.mode] if args.mode != "shared" else []))
    sums: dict[str, float] = {}
    for label, a, b in EVENTS:
        sums[label] = sums.get(label, 0.0) + b - a
    print(json.dumps({"rank": args.rank, "seconds": out["seconds"], "rounds": out["rounds"], "sums": sums,
                      "events": [(lb, round(a, 3), round(b, 3)) for lb, a, b in EVENTS]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--mesh", default="tp=8")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--mode", default="shared", choices=["shared", "group"])
    ap.add_argument("--events", action="store_true", help="print every event, not only the sums")
    args = ap.parse_args()
    if args.rank is not None:
        member(args)
        return
    import cold_read_bench as B

    from sdadapt._plan.layout import Mesh

    tp = Mesh.parse(args.mesh).size_of("tp")
    B.drop(args.dir)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--dir", str(args.dir), "--mesh", args.mesh, "--rank", str(r),
                               "--port", str(args.port), "--mode", args.mode], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LOCAL_WORLD_SIZE": str(tp)}) for r in range(tp)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    print(f"group wall {time.perf_counter() - t0:.2f} s")
    for o in outs:
        r = json.loads(o.strip().splitlines()[-1])
        s = r["sums"]
        rest = r["seconds"] - sum(v for k, v in s.items() if k in ("read", "agree", "wait", "a2a", "pack", "unpack"))
        print(f"rank {r['rank']}: {r['seconds']:.2f} s, {r['rounds']} rounds; "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s.items())) + f", rest {rest:.2f}")
        if args.events:
            print("   ", " ".join(f"{lb}[{a:.2f}-{b:.2f}]" for lb, a, b in r["events"]))


if __name__ == "__main__":
    main()
