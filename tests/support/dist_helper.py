"""Run a function on N real processes (gloo on CPU), with a timeout so a hang fails fast.

    results = run_distributed(my_cases, world_size=4, some_arg)

``fn`` must be a module-level function of an importable module (a test module is fine: tests/
and its layer folders are put on the workers' path). Each worker initialises the default process group
(gloo; the ranks meet in a file of the launch's temporary folder), calls ``fn(*args,
**kwargs)`` and returns its value; the caller gets the list of values by rank. If any rank
raises, :class:`WorkerError` carries every rank's traceback (the ranks that failed on their
own first). Process start costs seconds on 2 cores: let one launched group run many cases and
return a dict of results.

``timeout`` is counted on a :class:`~support.load_clock.WorkClock`: wall time less the time the
ranks waited for a CPU, so a loaded machine makes a launch slower, never a failure, while a hang
(every rank asleep) still fails after ``timeout`` s. A rank that hangs is named with its stage
(where the launcher, or ``fn`` through :func:`stage`, last said it was) and the Python stack of
each of its threads; once one rank has failed, the others get :data:`GRACE` s to end.

A rank that ends by a signal or aborts at teardown after its result is written leaves the launch
green; it is written down for scripts/repeat_tests.py (tests/support/aborts.py). Each launch's
folder names its launcher's process; a launch removes the folders of launchers that are gone
(a run killed by SIGKILL leaves its folder).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import aborts, load_clock
from support.load_clock import WorkClock

TESTS_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = TESTS_DIR.parent / "src"


@dataclass
class RankFailure:
    rank: int
    type_name: str
    message: str
    traceback: str
    mro: list[str]


GRACE = 60.0
"""Seconds (of the work clock) the other ranks get to end once one rank has failed: they fail at
once when the failed rank's sockets close, or hang in a collective it never joins."""
WALL_FACTOR = 30
"""A launch ends after ``WALL_FACTOR * timeout`` wall seconds whatever the work clock says: the
bound for a rank that spins forever while the machine keeps it waiting for a CPU."""

# what a rank reports when another rank's process ended while it waited on it in a collective
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _first_cause(f: RankFailure) -> int:
    """Sort key: a rank that crashed, then one that raised on its own, before the ranks that only
    saw a peer go away (they are its consequence, and a long report is cut from its end)."""
    if f.type_name == "Crash":
        return 0
    if f.type_name == "Hang":
        return 3
    return 2 if any(s in f.message for s in _PEER_GONE) else 1


class WorkerError(AssertionError):
    def __init__(self, failures: list[RankFailure], logs: str, seconds: float = 0.0):
        self.failures = failures
        self.seconds = seconds  # the launch's own time (support.load_clock), for "fails within N s" bounds
        ordered = sorted(failures, key=_first_cause)
        text = "\n".join(f"--- rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in ordered)
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}\n--- worker output (tail) ---\n{logs}")


PREFIX = "sdadapt-dist-"
LEGACY_AGE = 3600.0
"""Seconds after which a launch folder that names no launcher (written before folders named
one) is stale, once none of the ranks it names is alive."""
_CLEANED = False


def run_distributed(fn: Any, world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    global _CLEANED
    job = tempfile.mkdtemp(prefix=PREFIX)
    Path(job, "launcher").write_text(str(os.getpid()))
    if not _CLEANED:  # once per process: the folders left before it started
        _CLEANED = True
        clean_stale(Path(job).parent, os.stat(job).st_mtime)
    try:
        return _run_job(job, fn, world_size, args, kwargs, timeout)
    finally:
        shutil.rmtree(job, ignore_errors=True)  # the ranks' logs are in the error raised, if any


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def clean_stale(where: Path, before: float) -> list[Path]:
    """Remove the launch folders in ``where`` last changed before ``before`` (a time) whose
    launcher process is gone (a folder that names none: whose ranks are all gone, and older than
    :data:`LEGACY_AGE`); return them. Another user's folders, or one in use, are left."""
    removed = []
    for folder in where.glob(f"{PREFIX}*"):
        try:
            changed = folder.stat().st_mtime
            owner = Path(folder, "launcher")
            if owner.exists():
                stale = changed < before and not _alive(int(owner.read_text() or 0))
            else:
                ranks = [int(p.read_text() or 0) for p in folder.glob("pid.*")]
                stale = changed < before - LEGACY_AGE and not any(_alive(r) for r in ranks)
        except (OSError, ValueError):
            continue  # removed meanwhile, or not ours to read
        if stale and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _note_aborts(fn: Any, job: str, codes: list[Any], hung: list[int]) -> None:
    """Write down (tests/support/aborts.py) each rank that ended by a signal or with the teardown
    abort's text in its log, other than the ranks ended as hung. An exit status alone is not one:
    tests end ranks with ``os._exit(9)`` to play a crash."""
    for rank, code in enumerate(codes):
        if rank in hung:
            continue
        who = f"{fn.__module__}.{fn.__qualname__} rank {rank} of {len(codes)}"
        if code is not None and code < 0:
            aborts.record(f"{who}: ended by {signal.Signals(-code).name}")
        else:
            log = Path(job, f"log.{rank}")
            aborts.scan(who, log.read_text(errors="replace") if log.exists() else "")


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
        # the ranks' own collective timeout: never shorter than the launch may last, so that a
        # rank waiting for a slow peer never gives up first and fails the others
        SDADAPT_TEST_TIMEOUT=str(WALL_FACTOR * timeout),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([*where, env.get("PYTHONPATH", "")]),
    )
    logs = [os.path.join(job, f"log.{rank}") for rank in range(world_size)]
    if os.environ.get("SDADAPT_TEST_FRESH_PROCESSES") == "1" or not _forkable_main():
        ranks = _start_fresh(job, world_size, env, logs)
    else:
        ranks = _start_forked(job, world_size, env, where, logs)
    hung, codes, why, seconds = _supervise(job, ranks, timeout)
    _note_aborts(fn, job, codes, hung)
    tail = _log_tails(job, world_size)
    if hung and all(c is not None and not _failed(job, r) for r, c in enumerate(codes) if r not in hung):
        raise AssertionError(f"ranks {hung} of {world_size} {why}\n{_stages(job, hung)}\n{tail}")
    results: list[Any] = []
    failures: list[RankFailure] = []
    for rank in range(world_size):
        path = Path(job, f"result.{rank}.pkl")
        if rank in hung:
            results.append(None)
            continue
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
    for rank in hung:  # still running once another rank had failed
        stack = _stages(job, [rank])
        failures.append(RankFailure(rank, "Hang", f"{why}; {stack.strip()}", "", []))
    if failures:
        raise WorkerError(failures, tail, seconds)
    return results


def _log_tails(job: str, world_size: int) -> str:
    tail = ""
    for rank in range(world_size):
        log = Path(job, f"log.{rank}")
        text = log.read_text(errors="replace") if log.exists() else ""
        if text.strip():
            tail += f"[rank {rank}] " + text[-4000:] + "\n"
    return tail


def _stages(job: str, ranks: list[int]) -> str:
    """Where each of ``ranks`` last said it was (:func:`stage`), one line each."""
    lines = []
    for rank in ranks:
        path = Path(job, f"stage.{rank}")
        try:
            said, at = path.read_text(errors="replace"), path.stat().st_mtime
            lines.append(f"rank {rank} at stage {said!r} since {time.time() - at:.0f} s")
        except OSError:
            lines.append(f"rank {rank} before its first stage (not yet started)")
    return "\n".join(lines)


@dataclass
class _Rank:
    """A started rank: its process id and how to poll (the exit code, None while it runs) and end it."""

    pid: int
    poll: Any
    kill: Any
    reap: Any


def _failed(job: str, rank: int) -> bool:
    """Whether an ended rank failed: no result, or an error as its result."""
    path = Path(job, f"result.{rank}.pkl")
    return not path.exists() or pickle.loads(path.read_bytes())[0] != "ok"


def _supervise(job: str, ranks: list[_Rank], timeout: float) -> tuple[list[int], list[Any], str, float]:
    """Wait for every rank; (the ranks that hung, every rank's exit code, why they were ended, the
    launch's own time).

    A rank hangs when the work clock passes ``timeout`` (or ``WALL_FACTOR * timeout`` wall
    seconds pass), or :data:`GRACE` seconds after another rank failed. A hung rank is asked for
    its threads' Python stacks (faulthandler, into its log), then killed with the rest."""
    clock = WorkClock()
    failed_at: float | None = None
    first_failed = -1
    judged: set[int] = set()  # the ended ranks whose result was read
    now, read_at = 0.0, 0.0
    while True:
        codes = [r.poll() for r in ranks]
        alive = [i for i, c in enumerate(codes) if c is None]
        if not alive:
            return [], codes, "", clock.seconds([])
        if time.monotonic() - read_at >= 1.0:  # every rank thread's schedstat: read once a second
            now, read_at = clock.seconds([ranks[i].pid for i in alive]), time.monotonic()
        for i in [i for i, c in enumerate(codes) if c is not None and i not in judged]:
            judged.add(i)
            if failed_at is None and _failed(job, i):
                failed_at, first_failed = now, i
        if failed_at is not None and now > failed_at + GRACE:
            why = f"did not end within {GRACE:.0f} s after rank {first_failed} failed"
            break
        if now > timeout or clock.wall > WALL_FACTOR * timeout:
            why = (
                f"did not finish within {timeout:.0f} s of the launch's own time (hang): {clock.wall:.0f} s wall, "
                f"of which {clock.held:.0f} s waiting for a CPU; load average {os.getloadavg()[0]:.1f}"
            )
            break
        time.sleep(0.1)
    _dump_stacks(job, [ranks[i] for i in alive], alive)
    for r in ranks:
        r.kill()
    for r in ranks:
        r.reap()
    return alive, [r.poll() for r in ranks], why, clock.seconds([])


def _dump_stacks(job: str, ranks: list[_Rank], numbers: list[int]) -> None:
    """Ask each rank for its threads' Python stacks (its faulthandler writes them to its log) and
    give them a few seconds to arrive."""
    sizes = {}
    for r, n in zip(ranks, numbers, strict=True):
        log = Path(job, f"log.{n}")
        sizes[n] = log.stat().st_size if log.exists() else 0
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except OSError:
            continue
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        grown = [n for n in numbers if Path(job, f"log.{n}").exists() and Path(job, f"log.{n}").stat().st_size > sizes[n]]
        if len(grown) == len(numbers):
            time.sleep(0.5)  # the rest of the dump
            return
        time.sleep(0.2)


def _start_fresh(job: str, world_size: int, env: dict[str, str], logs: list[str]) -> list[_Rank]:
    """Each rank a fresh interpreter (``python -m support.dist_helper``)."""
    ranks = []
    for rank in range(world_size):
        with open(logs[rank], "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "support.dist_helper", job, str(rank)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(TESTS_DIR),
            )
        ranks.append(_Rank(p.pid, p.poll, p.kill, p.wait))
    return ranks


PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "transformers.modeling_utils", "support.rank_preload",
]  # fmt: skip
"""What the fork server imports once (``support.rank_preload``: every sdadapt module); each rank
is forked from it with these imported, the test modules and everything else imported in the rank.
A library may read its environment once, at import (huggingface_hub's ``HF_HUB_OFFLINE`` and
``HF_HUB_CACHE``): the server is started again whenever this process's environment differs from
the one it was started with (:func:`_env_key`), so a rank sees what a fresh interpreter would."""
_FORK_SERVER: Any = None
_FORK_ENV: frozenset[tuple[str, str]] = frozenset()


UNREAD_AT_IMPORT = ("PYTEST_", "SDADAPT_", "AWS_")
"""Prefixes of the environment variables no module of :data:`PRELOAD` reads at import: pytest's
(``PYTEST_CURRENT_TEST`` changes with every test), sdadapt's (read when called) and the object
stores' (read by sdadapt when called, and by obstore, which is not preloaded)."""


def _env_key() -> frozenset[tuple[str, str]]:
    """This process's environment, less the variables of :data:`UNREAD_AT_IMPORT`. (Tested by
    tests/dist/test_corpus_doors.py: its ranks read the Hub offline only if the server started
    again after it set ``HF_HUB_OFFLINE``.)"""
    return frozenset((k, v) for k, v in os.environ.items() if not k.startswith(UNREAD_AT_IMPORT))


def _forkable_main() -> bool:
    """Whether the ranks may come from the fork server: this process was started as ``python -m
    NAME`` (``python -m pytest``), so that a rank imports NAME as multiprocessing's main module.
    A script run by its path (compat_cases.py in its small venv, a bench) would run its top level
    again in every rank: those launch fresh interpreters."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return bool(getattr(spec, "name", None))


def _fork_context() -> Any:
    """The multiprocessing fork server of this process, started with :data:`PRELOAD` imported
    under ``OMP_NUM_THREADS=1`` (the ranks' setting: OpenMP reads it when torch loads) and this
    process's environment; started again where that environment has changed since."""
    global _FORK_SERVER, _FORK_ENV
    import multiprocessing
    import multiprocessing.forkserver

    if _FORK_SERVER is not None and _env_key() != _FORK_ENV:
        server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - the only way to start it anew
        # ended, not asked to end: it waits for every process holding its pipe, and a process a
        # page or rank left behind may hold it (no launch is in flight here)
        with contextlib.suppress(OSError, TypeError):
            os.kill(server._forkserver_pid, signal.SIGKILL)  # noqa: SLF001
        server._stop()  # noqa: SLF001
        _FORK_SERVER = None
    if _FORK_SERVER is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _FORK_ENV = _env_key()
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


def _start_forked(job: str, world_size: int, env: dict[str, str], where: list[str], logs: list[str]) -> list[_Rank]:
    """Each rank forked from the fork server (torch already imported: a launch costs a fork, not
    an interpreter and torch's import per rank)."""
    ctx = _fork_context()
    ranks = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        p = ctx.Process(target=_forked_rank, args=(job, rank, rank_env, where, logs[rank]))
        p.start()
        ranks.append(_Rank(p.pid, lambda p=p: p.exitcode, p.kill, p.join))
    return ranks


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


def forkable() -> bool:
    """Whether :func:`run_forked` may fork from the server (under ``python -m pytest``, and not
    asked for fresh processes by ``SDADAPT_TEST_FRESH_PROCESSES=1``)."""
    return os.environ.get("SDADAPT_TEST_FRESH_PROCESSES") != "1" and _forkable_main()


def run_forked(fn: Any, *args: Any, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``fn(*args)`` in one process forked from the fork server (torch, transformers and sdadapt
    imported once), as a fresh ``python`` would run it with ``env`` in ``cwd`` (``PYTHONPATH``
    first on its path; ``PYTHONFAULTHANDLER`` set: faulthandler on). Its exit status (1 where
    ``fn`` raised, with the traceback on stderr) and output, as :func:`support.load_clock.run`
    gives them, with the same timeout on the process's and its children's own time."""
    out, err = Path(cwd, ".forked.stdout"), Path(cwd, ".forked.stderr")
    p = _fork_context().Process(target=_forked_call, args=(fn, args, env, cwd, str(out), str(err)))
    p.start()
    hung = load_clock.watch(p.pid, lambda: p.exitcode, timeout)
    p.join()
    texts = [f.read_text(errors="replace") if f.exists() else "" for f in (out, err)]
    for f in (out, err):
        f.unlink(missing_ok=True)
    name = f"{fn.__module__}.{fn.__qualname__}{args!r}"
    if hung:
        raise AssertionError(load_clock.hang_message(name, hung, timeout, *texts))
    return subprocess.CompletedProcess([name], p.exitcode, *texts)


def _drop_mirrors() -> None:
    """Remove the object storage mirror folders this process made: leaving through ``os._exit``
    skips the exit handler that would (sdadapt.sources._mirrors), and the sweep of a later
    mirror comes only if one is made."""
    mirrors = sys.modules.get("sdadapt.sources._mirrors")
    if mirrors is not None:
        mirrors._remove_mirrors()


def _forked_call(fn: Any, args: tuple[Any, ...], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.chdir(cwd)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    code = 0
    try:
        fn(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed, as an interpreter would, and the status says it
        traceback.print_exc()
        code = 1
    finally:
        _drop_mirrors()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_STAGE_FILE: Path | None = None
_JOB = ""
_RUNNING = ""


def _say(what: str) -> None:
    if _STAGE_FILE is not None:
        _STAGE_FILE.write_text(what)


def stage(what: str) -> None:
    """Inside a launched rank: say where ``fn`` is (a case's name...), so that a hang names it
    (``running <fn>: <what>``). Outside a launch: nothing."""
    _say(f"{_RUNNING}: {what}")


def _worker(job: str, rank: int) -> None:
    import datetime
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a native crash leaves its Python stack in the rank's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's request, for a hang
    global _STAGE_FILE, _JOB
    _STAGE_FILE, _JOB = Path(job, f"stage.{rank}"), job
    Path(job, f"pid.{rank}").write_text(str(os.getpid()))  # for group_seconds()
    _say("init_process_group (the ranks meet)")

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
        _say(f"importing {module}")
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        global _RUNNING
        _RUNNING = f"running {module}.{qualname}"
        _say(_RUNNING)
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
        _say("destroy_process_group")
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _drop_mirrors()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # a fast end: no interpreter finalization (src/sdadapt/_base/teardown.py: the abort it risked)


if __name__ == "__main__":
    from support import dist_helper  # the module fn's stage() calls reach, not this __main__ copy

    dist_helper._worker(sys.argv[1], int(sys.argv[2]))


def group_seconds() -> Any:
    """A stopwatch, started now, of the launched group's own time: a function giving the wall
    seconds since, less the longest time any one rank waited for a CPU meanwhile
    (:class:`~support.load_clock.WorkClock` over every rank's process). A bound such as "every
    rank fails within 30 s" then holds on a loaded machine and still catches a rank that waits
    out a timeout. Outside a launch: this process alone."""
    pids = [int(p.read_text()) for p in Path(_JOB).glob("pid.*")] if _JOB else [os.getpid()]
    clock = WorkClock()
    clock.seconds(pids)
    return lambda: clock.seconds(pids)


def outcome(fn: Any) -> tuple[str, str, float]:
    """Run one case inside a rank: (the error's class name or ``"ok"``, its whole message, the
    seconds it took on :func:`group_seconds`' clock), so that one launched group can run many
    failing cases in a row."""
    took = group_seconds()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the case's outcome is what it raised
        return type(e).__name__, getattr(e, "full_message", str(e)), took()
    return "ok", "", took()


def shard_of(v: Any, want: Any) -> tuple[Any, Any]:
    """``(v's local shard, the same region of the full tensor want)``; a plain ``v``: both whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(v, DTensor):
        return v, want
    shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return v.to_local(), want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
