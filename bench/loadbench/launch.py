"""Start one fresh process group (``nproc`` new Python processes, one per rank, rendezvous over
TCP on this host; or ``nproc`` processes forked from a :class:`~loadbench.forkserver.ForkServer`),
wait for it with a timeout, and collect what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import GiB, MiB
from .forkserver import ForkServer

# glibc settings for the worker processes. Whether a load writes into fresh pages (one page
# fault per 4 KiB on first write, which costs more than reading from the page cache) or into
# memory an earlier load freed depends otherwise on glibc's dynamic mmap/trim thresholds.
# "fresh": every tensor of 128 KiB or more is its own mapping, returned on free: every load
# writes into fresh pages, as a job's first load does. "reuse": memory is kept and reused
# (tensors over 32 MiB still get fresh pages).
MALLOC_MODES: dict[str, dict[str, str]] = {
    "default": {},
    "fresh": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    "reuse": {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB), "MALLOC_TRIM_THRESHOLD_": str(64 * GiB)},
}

# after one rank dies, how long the others get to notice before they are killed
_GRACE_S = 15.0


class _Rank:
    """A started rank: its pid (and process group), and how to ask whether it ended."""

    def __init__(self, pid: int, poll: Callable[[], int | None]) -> None:
        self.pid, self._poll = pid, poll
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._poll()
        return self.returncode


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(malloc: str) -> dict[str, str]:
    """The environment torch and glibc read at a worker's start (a fork server's, for its ranks)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MALLOC_MODES[malloc])
    return env


def launch_group(cfg: dict[str, Any], nproc: int, timeout: float, tag: str, entry: Path, pythonpath: list[str],
                 extra_env: dict[str, str] | None = None, server: ForkServer | None = None) -> dict[str, Any]:
    """Run ``entry --worker <config>`` as ``nproc`` fresh ranks of one process group (``pythonpath``
    first on their path, ``extra_env`` set; forked from ``server`` where given); kill the group
    after ``timeout`` s (a hang is a result). Returns the tag, exit codes, whether it hung, its
    seconds, each rank's results (None where a rank wrote none) and the log's tail."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    env = server_env(cfg.get("malloc", "default"))
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")])
    env.update(extra_env or {})
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    log_path = out / "log.txt"
    start = time.perf_counter()
    procs: list[_Rank] = []
    hung = False
    with open(log_path, "wb") as log:
        for r in range(nproc):
            argv, rank_env = [str(entry), "--worker", str(cfg_path)], {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            if server is not None:
                pid = server.start(argv, rank_env, pythonpath, str(log_path))
                procs.append(_Rank(pid, lambda pid=pid, server=server: server.poll(pid)))
            else:
                p = subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
                procs.append(_Rank(p.pid, lambda p=p: p.poll()))
        deadline = start + timeout
        first_failure: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.perf_counter()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + _GRACE_S):
                hung = now > deadline
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                for p in procs:
                    while p.poll() is None:
                        time.sleep(0.01)
                break
            time.sleep(0.05)
    ranks = []
    for r in range(nproc):
        rank_file = out / f"rank{r}.json"
        ranks.append(json.loads(rank_file.read_text()) if rank_file.exists() else None)
    return {"tag": tag, "rc": [p.returncode for p in procs], "hung": hung, "seconds": time.perf_counter() - start,
            "ranks": ranks, "log_tail": log_path.read_text(errors="replace")[-4000:]}
