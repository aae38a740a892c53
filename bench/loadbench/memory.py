"""What a load costs a worker process besides time: RSS peaks (anonymous, file-backed and shared
apart) sampled over the load, and the bytes it read through ``read()``."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from .common import GiB


def proc_status() -> dict[str, int]:
    """RssAnon, RssFile, RssShmem, VmHWM and VmRSS of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def rchar() -> int:
    """Bytes this process has read through read()-like calls (/proc/self/io); 0 where unreadable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler:
    """Peaks of RssAnon / RssFile / RssShmem over a region, sampled every ``interval`` s by a
    thread (``0``: no thread, only the region's start and end), and VmHWM (reset at the start
    through /proc/self/clear_refs where the kernel allows)."""

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.start = proc_status()
        self.peak = dict(self.start)
        self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            pass
        self.start = proc_status()
        self.peak = dict(self.start)
        if self.interval > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        for k, v in proc_status().items():
            if v > self.peak.get(k, 0):
                self.peak[k] = v

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._take()

    def result(self) -> dict[str, float]:
        """Extra RSS over the region's start (GiB) and the region's peak RSS."""

        def extra(k: str) -> float:
            return (self.peak.get(k, 0) - self.start.get(k, 0)) / GiB

        return {
            "rss_anon_extra_gib": extra("RssAnon"),
            "rss_file_extra_gib": extra("RssFile"),
            "rss_shmem_extra_gib": extra("RssShmem"),
            "rss_peak_gib": self.peak.get("VmHWM", 0) / GiB if self.hwm_reset else max(self.peak.get("VmRSS", 0), 0) / GiB,
            "rss_start_gib": self.start.get("VmRSS", 0) / GiB,
        }


class GcClock:
    """The cycle collector's runs over a region: each one's generation, start and end (through
    ``gc.callbacks``), for telling a load's own time from a collection that landed in it."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float, float]] = []
        self._started: tuple[int, float] | None = None

    def _note(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = (info["generation"], now)
        elif self._started is not None:
            self.runs.append((self._started[0], self._started[1], now))
            self._started = None

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def summary(self, until: float | None = None) -> dict[str, Any]:
        """Collections per generation and their seconds (the runs that started before ``until``)."""
        runs = [r for r in self.runs if until is None or r[1] < until]
        return {"collections": [sum(1 for g, _, _ in runs if g == gen) for gen in range(3)],
                "seconds": round(sum(e - s for _, s, e in runs), 6),
                "full_seconds": round(sum(e - s for g, s, e in runs if g == 2), 6)}
