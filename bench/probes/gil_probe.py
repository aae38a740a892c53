"""Probe: how fast the engine's other threads run while its main thread plans, per switch interval.

    python bench/gil_probe.py                         # the interpreter's 5 ms and shorter ones
    python bench/gil_probe.py --intervals 5,1,0.2 --seconds 0.5

The engine plans on the load's main thread while its readers and its device lane already run
(:mod:`sdadapt._engine.engine`). Planning is pure Python: it holds the interpreter lock until
the interpreter asks it to let go, which a waiting thread requests only after the switch
interval (``sys.setswitchinterval``, 5 ms by default). The device lane takes the lock back after
every device call, and a reader after every ``preadv``. This measures that contention without a
GPU: one thread makes small torch calls (each lets go of the lock and takes it back, as a
device call does) while the main thread runs a pure-Python loop, for each interval; printed are
the calls per second, alone and while the main thread loops, and how fast the loop ran beside
them against alone. What it does not say is what a load gains: that is for ``load_bench`` with
``SDADAPT_IO_SWITCH_MS`` (``EngineConfig.switch_interval``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def _calls(stop: threading.Event, out: list[int]) -> None:
    """Small torch calls until ``stop`` (each releases and retakes the interpreter lock)."""
    t = torch.zeros(16)
    n = 0
    while not stop.is_set():
        t.add_(1)
        n += 1
    out.append(n)


def _python(seconds: float) -> int:
    """A pure-Python loop for ``seconds``; returns its rounds."""
    end = time.perf_counter() + seconds
    rounds = x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i
        rounds += 1
    return rounds


def measure(interval: float, seconds: float) -> dict[str, float]:
    """Calls per second of the calling thread alone and beside a looping main thread, and the
    loop's speed beside it relative to alone, under switch ``interval`` (seconds)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        row: dict[str, float] = {"interval_ms": interval * 1e3}
        alone = _python(seconds)
        for busy in (False, True):
            stop, out = threading.Event(), []
            th = threading.Thread(target=_calls, args=(stop, out))
            th.start()
            if busy:
                row["loop_speed"] = _python(seconds) / max(1, alone)
            else:
                time.sleep(seconds)
            stop.set()
            th.join()
            row["calls_busy" if busy else "calls_idle"] = out[0] / seconds
        return row
    finally:
        sys.setswitchinterval(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", default="5,1,0.2,0.05", help="switch intervals to try, in ms")
    ap.add_argument("--seconds", type=float, default=0.2, help="how long each measurement runs")
    args = ap.parse_args()
    print("| switch interval ms | torch calls/s, main thread idle | torch calls/s, main thread in Python "
          "| the Python loop's speed beside them |")
    print("|---|---|---|---|")
    for ms in (float(v) for v in args.intervals.split(",")):
        r = measure(ms / 1e3, args.seconds)
        print(f"| {r['interval_ms']:g} | {r['calls_idle']:.0f} | {r['calls_busy']:.0f} | {r['loop_speed']:.2f} |")


if __name__ == "__main__":
    main()
