"""A clock for the suite's timeouts that a loaded machine does not run down.

A launched group of ranks (or a doc page's runner and the processes it starts) gets a timeout so
that a hang fails instead of blocking the suite. Measured on the wall clock, that timeout also
fails a group that is only slow: on 2 cores shared with other work, a rank can wait minutes for a
CPU. :class:`WorkClock` counts wall time less the time the processes spent runnable but waiting for
a CPU (Linux's ``/proc/<pid>/task/<tid>/schedstat``, second field), so that

- a group that works, however slowly the machine serves it, is charged only for what it would
  have taken had it had the CPUs (at each step, the wait of the most delayed process: the ranks
  wait on the slowest one);
- a group that hangs (every process asleep: a collective no peer joins, a rank stalled in a
  sleep) has no CPU to wait for, so its clock runs at wall speed and the hang is caught after the
  same timeout as on an idle machine.

Where ``schedstat`` is missing (another OS), the clock is the wall clock.

    clock = WorkClock()
    while ...:
        if clock.seconds(pids) > timeout: ...  # call it every fraction of a second
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any


def cpu_wait_seconds(pid: int) -> float | None:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a CPU (threads
    that ended are not counted); None where the process or ``schedstat`` is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    seen = False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if seen else None


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, their children and so on (from ``/proc/*/stat``'s parent ids)."""
    parent: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # the name, in parentheses, may hold spaces
        if len(fields) > 1:
            parent[int(name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        children = [c for c, pp in parent.items() if pp == p]
        found += children
        todo += children
    return found


class WorkClock:
    """Seconds since creation, less the time the watched processes were held up waiting for a CPU.

    Each call of :meth:`seconds` adds the wall time since the last call, less the largest CPU
    wait any one watched process gathered meanwhile (never less than zero)."""

    def __init__(self) -> None:
        self.start = self._last = time.monotonic()
        self._elapsed = 0.0
        self._waits: dict[int, float] = {}

    @property
    def wall(self) -> float:
        """Wall seconds since creation."""
        return time.monotonic() - self.start

    def seconds(self, pids: list[int]) -> float:
        """The clock's reading, with ``pids`` the processes to account for since the last call."""
        now = time.monotonic()
        step = now - self._last
        self._last = now
        held = 0.0
        for pid in pids:
            wait = cpu_wait_seconds(pid)
            if wait is None:
                continue
            # a process first seen now started since the last call: all its wait is this step's
            held = max(held, wait - self._waits.get(pid, 0.0))
            self._waits[pid] = wait
        self._elapsed += max(0.0, step - held)
        return self._elapsed

    @property
    def held(self) -> float:
        """Wall seconds not counted: the time spent waiting for a CPU."""
        return self.wall - self._elapsed


def watch(pid: int, poll: Callable[[], int | None], timeout: float) -> WorkClock | None:
    """Wait for process ``pid`` (``poll()``: its exit status, None while it runs) on a
    :class:`WorkClock` of it and every process it starts; past ``timeout`` kill them all and
    return the clock (a hang), else None."""
    clock = WorkClock()
    while poll() is None:
        tree = [pid, *descendants(pid)]
        if clock.seconds(tree) > timeout:
            for p in reversed(tree):
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            return clock
        time.sleep(0.5)  # reading every process's parent costs a little CPU: not too often
    return None


def hang_message(what: str, clock: WorkClock, timeout: float, stdout: str, stderr: str) -> str:
    """What a timed-out run says: how long it ran, how much of it waiting for a CPU, its output's end."""
    return (
        f"{what} did not finish within {timeout:.0f} s of its own time (hang): {clock.wall:.0f} s wall, "
        f"of which {clock.held:.0f} s waiting for a CPU; load average {os.getloadavg()[0]:.1f}\n"
        f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-4000:]}"
    )


def run(argv: list[str], *, timeout: float, capture: bool = True, **popen: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, ...)`` whose ``timeout`` is counted on a :class:`WorkClock` of the
    process and every process it starts (a launcher's ranks included). On timeout the whole tree
    is killed and an ``AssertionError`` says how long it ran, how much of it waiting for a CPU,
    and the end of its output (``capture``: stdout and stderr are returned, as text)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = {"stdout": out, "stderr": err} if capture else {}
        proc = subprocess.Popen(argv, **streams, **popen)
        hung = watch(proc.pid, proc.poll, timeout)
        proc.wait()
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        if hung:
            raise AssertionError(hang_message(shlex.join(argv), hung, timeout, *texts))
        return subprocess.CompletedProcess(argv, proc.returncode, texts[0] if capture else None, texts[1] if capture else None)
