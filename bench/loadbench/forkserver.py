"""``--fork-ranks``: one process imports torch's libraries once; every rank of every group is
forked from it, so that a group costs forks rather than ``nproc`` interpreters each importing
torch (seconds of CPU apiece on a small machine: the test suite's case). A forked rank is still
new for everything the server did not import: sdadapt (never preloaded) and the job's own
modules are imported in the rank, and its first load is the first load of its process. The
environment read when torch loads (``OMP_NUM_THREADS``, glibc's ``MALLOC_*``) is the server's.

The server talks JSON lines on its stdin / stdout: ``{"start": {argv, env, path, log}}`` forks a
rank (reply ``{"pid": N}``); ``{"poll": N}`` reaps it if it ended (reply ``{"rc": code or
null}``, a signal as ``-signum`` like :class:`subprocess.Popen`). Each rank leads a session of
its own (``os.killpg(pid, ...)`` stops it) and writes to its log; the server ends at end of input."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_SERVER = r"""
import importlib, json, os, runpy, sys, traceback
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps({"ready": sorted(m for m in sys.modules if m == "sdadapt" or m.startswith("sdadapt."))}), flush=True)
done = {}
for line in sys.stdin:
    req = json.loads(line)
    if "poll" in req:
        pid = req["poll"]
        if pid not in done:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done[pid] = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": done.get(pid)}), flush=True)
        continue
    job = req["start"]
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = list(job["argv"])
        sys.path[:1] = [os.path.dirname(os.path.abspath(sys.argv[0]))] + job["path"]
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
"""


class ForkServer:
    """A process that imported ``preload`` (never sdadapt) under ``env``; :meth:`start` forks a
    rank from it. Use as a context manager: the server ends on leaving it."""

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        if any(n == "sdadapt" or n.startswith("sdadapt.") for n in preload):
            raise ValueError("the fork server never preloads sdadapt: each rank imports it fresh")
        self.preload = list(preload)
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(self.preload)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._reply()["ready"]
        if ready:  # one of the preloaded libraries imports sdadapt: the ranks would not import it fresh
            self.close()
            raise ValueError(f"preloading {self.preload} imported {ready}")

    def _reply(self) -> dict[str, Any]:
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line:
            raise RuntimeError(f"the fork server ended (exit code {self._proc.wait()}); its stderr went to this process's")
        return json.loads(line)

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def start(self, argv: list[str], env: dict[str, str], path: list[str], log: str) -> int:
        """Fork a rank running the script ``argv[0]`` with ``argv[1:]``, environment ``env``,
        ``path`` first on ``sys.path`` (as ``PYTHONPATH`` would), output appended to ``log``;
        returns its pid, which is also its process group's."""
        return int(self._ask({"start": {"argv": argv, "env": env, "path": path, "log": log}})["pid"])

    def poll(self, pid: int) -> int | None:
        """The rank's exit code once it ended (``-signum`` if a signal ended it), else None."""
        rc = self._ask({"poll": pid})["rc"]
        return None if rc is None else int(rc)

    def close(self) -> None:
        """End the server (the ranks it forked are not its to stop: their launch kills them)."""
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
