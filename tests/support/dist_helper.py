"""Run a function on N real processes (gloo on CPU), with a timeout so a hang fails fast.

    results = run_distributed(my_cases, world_size=4, some_arg)

``fn`` must be a module-level function of an importable module (a test module is fine: tests/
and its layer folders are put on the workers' path). Each worker initialises the default process group
(gloo; the ranks meet in a file of the launch's temporary folder), calls ``fn(*args,
**kwargs)`` and returns its value; the caller gets the list of values by rank. If any rank
raises, :class:`WorkerError` carries every rank's traceback (the ranks that failed on their
own first); if any rank does not finish within ``timeout`` s, all are killed and the call
fails naming the ranks that hung. Process start costs seconds on 2 cores: let one launched
group run many cases and return a dict of results.
"""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = TESTS_DIR.parent / "src"


@dataclass
class RankFailure:
    rank: int
    type_name: str
    message: str
    traceback: str
    mro: list[str]


# what a rank reports when another rank's process ended while it waited on it in a collective
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _first_cause(f: RankFailure) -> int:
    """Sort key: a rank that crashed, then one that raised on its own, before the ranks that only
    saw a peer go away (they are its consequence, and a long report is cut from its end)."""
    if f.type_name == "Crash":
        return 0
    return 2 if any(s in f.message for s in _PEER_GONE) else 1


class WorkerError(AssertionError):
    def __init__(self, failures: list[RankFailure], logs: str):
        self.failures = failures
        ordered = sorted(failures, key=_first_cause)
        text = "\n".join(f"--- rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in ordered)
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}\n--- worker output (tail) ---\n{logs}")


def run_distributed(fn: Any, world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    job = tempfile.mkdtemp(prefix="sdadapt-dist-")
    try:
        return _run_job(job, fn, world_size, args, kwargs, timeout)
    finally:
        shutil.rmtree(job, ignore_errors=True)  # the ranks' logs are in the error raised, if any


def _run_job(job: str, fn: Any, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> list[Any]:
    with open(os.path.join(job, "job.pkl"), "wb") as f:
        pickle.dump((fn.__module__, fn.__qualname__, args, kwargs), f)
    env = dict(os.environ)
    # tests/ for support, and every layer's folder: fn, or a function among the arguments, may
    # live in a test module, imported by its file's name (unique across the folders)
    folders = sorted(str(d) for d in TESTS_DIR.iterdir() if d.is_dir() and d.name not in ("support", "__pycache__"))
    where = [str(TESTS_DIR), *folders, str(SRC_DIR)]
    env.update(
        WORLD_SIZE=str(world_size),
        SDADAPT_TEST_TIMEOUT=str(timeout),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([*where, env.get("PYTHONPATH", "")]),
    )
    logs = [os.path.join(job, f"log.{rank}") for rank in range(world_size)]
    if os.environ.get("SDADAPT_TEST_FRESH_PROCESSES") == "1" or not _forkable_main():
        hung, codes = _run_fresh(job, world_size, env, logs, timeout)
    else:
        hung, codes = _run_forked(job, world_size, env, where, logs, timeout)
    tail = ""
    for rank in range(world_size):
        log = Path(job, f"log.{rank}")
        text = log.read_text(errors="replace") if log.exists() else ""
        if text.strip():
            tail += f"[rank {rank}] " + text[-3000:] + "\n"
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s (hang)\n{tail}")
    results: list[Any] = []
    failures: list[RankFailure] = []
    for rank in range(world_size):
        path = Path(job, f"result.{rank}.pkl")
        if not path.exists():
            failures.append(RankFailure(rank, "Crash", f"exit code {codes[rank]}, no result", "", []))
            results.append(None)
            continue
        status, value = pickle.loads(path.read_bytes())
        if status == "ok":
            results.append(value)
        else:
            failures.append(RankFailure(rank, *value))
            results.append(None)
    if failures:
        raise WorkerError(failures, tail)
    return results


def _run_fresh(job: str, world_size: int, env: dict[str, str], logs: list[str], timeout: float) -> tuple[list[int], list[Any]]:
    """Each rank a fresh interpreter (``python -m support.dist_helper``); (the ranks that hung,
    every rank's exit code)."""
    procs = []
    for rank in range(world_size):
        with open(logs[rank], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "support.dist_helper", job, str(rank)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(TESTS_DIR),
                )
            )
    deadline = time.monotonic() + timeout
    hung = []
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
    if hung:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    return hung, [p.returncode for p in procs]


PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint"]
"""What the fork server imports once; every rank is forked from it with these imported and
nothing else: sdadapt, the test modules and every other import happen in the rank, fresh."""
_FORK_SERVER: Any = None


def _forkable_main() -> bool:
    """Whether the ranks may come from the fork server: this process was started as ``python -m
    NAME`` (``python -m pytest``), so that a rank imports NAME as multiprocessing's main module.
    A script run by its path (compat_cases.py in its small venv, a bench) would run its top level
    again in every rank: those launch fresh interpreters."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return bool(getattr(spec, "name", None))


def _fork_context() -> Any:
    """The multiprocessing fork server of this process, started once with :data:`PRELOAD`
    imported under ``OMP_NUM_THREADS=1`` (the ranks' setting: OpenMP reads it when torch loads)."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        import multiprocessing
        import multiprocessing.forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _FORK_SERVER = ctx
    return _FORK_SERVER


def _run_forked(
    job: str, world_size: int, env: dict[str, str], where: list[str], logs: list[str], timeout: float
) -> tuple[list[int], list[Any]]:
    """Each rank forked from the fork server (torch already imported: a launch costs a fork, not
    an interpreter and torch's import per rank); (the ranks that hung, every rank's exit code)."""
    ctx = _fork_context()
    procs = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        p = ctx.Process(target=_forked_rank, args=(job, rank, rank_env, where, logs[rank]))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    hung = []
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            hung.append(rank)
    if hung:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
    codes = [p.exitcode for p in procs]
    for p in procs:
        p.close()
    return hung, codes


def _forked_rank(job: str, rank: int, env: dict[str, str], where: list[str], log: str) -> None:
    """A rank in a process forked from the fork server: its output to its log, the launch's
    environment, path and working folder, then :func:`_worker`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = where
    os.chdir(TESTS_DIR)
    _worker(job, rank)


def _worker(job: str, rank: int) -> None:
    import datetime
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a native crash leaves its Python stack in the rank's log

    module, qualname, args, kwargs = pickle.loads(Path(job, "job.pkl").read_bytes())
    world = int(os.environ["WORLD_SIZE"])
    out: tuple[str, Any]
    try:
        # the ranks meet in a file of the job's own folder: a TCP store's port, picked free by
        # the parent, could be taken by another socket before rank 0 binds it
        dist.init_process_group(
            "gloo",
            init_method=f"file://{Path(job, 'rendezvous')}",
            rank=rank,
            world_size=world,
            # no shorter than the parent's hang timeout: on a loaded machine a rank can wait long
            # for a slow peer, and its own timeout would end it and fail every other rank
            timeout=datetime.timedelta(seconds=float(os.environ.get("SDADAPT_TEST_TIMEOUT", "180"))),
        )
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        out = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out = ("error", (type(e).__name__, str(e), traceback.format_exc(), [c.__name__ for c in type(e).__mro__]))
    try:
        data = pickle.dumps(out)
    except Exception as e:  # noqa: BLE001
        data = pickle.dumps(("error", ("PickleError", f"result not picklable: {e}", "", [])))
    Path(job, f"result.{rank}.pkl.tmp").write_bytes(data)
    os.replace(Path(job, f"result.{rank}.pkl.tmp"), Path(job, f"result.{rank}.pkl"))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # avoids gloo's abort at interpreter exit (see shared/DESIGN.md)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))


def outcome(fn: Any) -> tuple[str, str, float]:
    """Run one case inside a rank: (the error's class name or ``"ok"``, its whole message, the
    seconds it took), so that one launched group can run many failing cases in a row."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the case's outcome is what it raised
        return type(e).__name__, getattr(e, "full_message", str(e)), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def shard_of(v: Any, want: Any) -> tuple[Any, Any]:
    """``(v's local shard, the same region of the full tensor want)``; a plain ``v``: both whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(v, DTensor):
        return v, want
    shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return v.to_local(), want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
