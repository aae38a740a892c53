"""The test launcher's own promises (tests/support/dist_helper.py, tests/support/load_clock.py):

- its clock charges a group only for time it could have used: processes kept waiting for a CPU
  are not charged, processes asleep (a hang) are charged at wall speed;
- a hang fails naming each hung rank's stage, with its threads' Python stacks;
- a rank that fails while another keeps running ends the launch, the failure first, the rank
  still running named as hung at its stage;
- a rank that aborts after its result leaves the launch green and is written down for the repeat
  series (tests/support/aborts.py); a launch removes the folders of launchers that are gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from support import aborts, dist_helper
from support.dist_helper import WorkerError, run_distributed, stage
from support.load_clock import WorkClock, descendants

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"


def _clock_over(procs: list[subprocess.Popen[bytes]]) -> tuple[float, float]:
    """(the work clock's reading, wall seconds) until ``procs`` end."""
    clock = WorkClock()
    while any(p.poll() is None for p in procs):
        clock.seconds([p.pid for p in procs])
        time.sleep(0.05)
    return clock.seconds([]), clock.wall


@pytest.mark.skipif(
    not os.path.exists("/proc/self/schedstat"),
    reason="Linux only: the clock subtracts CPU waits read from /proc schedstat; elsewhere it is the wall clock",
)
def test_the_clock_skips_cpu_waits_and_counts_sleep() -> None:
    # three processes that each need 0.6 s of CPU, all on one CPU: each waits for it about 2/3 of the time
    one_cpu = {min(os.sched_getaffinity(0))}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=lambda: os.sched_setaffinity(0, one_cpu)) for _ in range(3)]
    seconds, wall = _clock_over(spinners)
    assert seconds < 0.7 * wall, (seconds, wall)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    assert sleeper.pid in descendants(os.getpid())
    seconds, wall = _clock_over([sleeper])
    assert seconds > 1.4, (seconds, wall)  # the whole sleep, at least (its interpreter's start may wait for a CPU)


def _hang(_: str) -> str:
    if dist.get_rank() == 1:
        stage("case hangs-here")
        time.sleep(600)
    return "done"


def test_a_hang_names_the_rank_its_stage_and_stack() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_hang, 2, "x", timeout=8)
    msg = str(info.value)
    assert "ranks [1] of 2 did not finish within 8 s of the launch's own time (hang)" in msg, msg
    assert "rank 1 at stage 'running test_launcher_dist._hang: case hangs-here'" in msg, msg
    assert "most recent call first" in msg and "in _hang" in msg, msg  # the rank's Python stack
    assert time.monotonic() - t0 < 8 * dist_helper.WALL_FACTOR + 60  # the wall bound, then the stacks and the kill


def _fail_while_one_sleeps() -> None:
    if dist.get_rank() == 0:
        raise ValueError("the first cause")
    stage("sleeping")
    time.sleep(600)


def test_a_failure_ends_the_launch_and_names_the_rank_left_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_helper, "GRACE", 3.0)
    with pytest.raises(WorkerError) as info:
        run_distributed(_fail_while_one_sleeps, 2, timeout=300)
    failures = info.value.failures
    assert [(f.rank, f.type_name) for f in failures] == [(0, "ValueError"), (1, "Hang")], failures
    assert "did not end within 3 s after rank 0 failed" in failures[1].message, failures[1].message
    assert "stage 'running test_launcher_dist._fail_while_one_sleeps: sleeping'" in failures[1].message
    assert str(info.value).index("the first cause") < str(info.value).index("Hang")
    assert 3.0 < info.value.seconds < 300, info.value.seconds  # the launch's own time, the grace included


def _abort_at_teardown() -> int:
    """Rank 1 returns its result, then aborts in ``destroy_process_group`` (as torch 2.13 + gloo
    can at a process's end): the launch passes, the abort is written down."""
    if dist.get_rank() == 1:

        def abort() -> None:
            print(aborts.ABORT, file=sys.stderr, flush=True)
            os.abort()

        dist.destroy_process_group = abort
    return dist.get_rank()


def test_an_abort_after_the_result_passes_and_is_written_down(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "aborts.txt"
    monkeypatch.setenv(aborts.ENV, str(seen))
    assert run_distributed(_abort_at_teardown, 2, timeout=120) == [0, 1]
    (line,) = seen.read_text().splitlines()
    assert line.endswith("test_launcher_dist._abort_at_teardown rank 1 of 2: ended by SIGABRT"), line
    assert line.startswith("tests/dist/test_launcher_dist.py::test_an_abort_after_the_result_passes"), line
    aborts.scan("a page", f"x\n{aborts.ABORT}\n")  # a doc page's output, as test_doc_blocks gives it
    assert seen.read_text().splitlines()[1].endswith(f"a page: 1 x {aborts.ABORT!r}")


def test_a_launch_removes_the_folders_of_launchers_that_are_gone(tmp_path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    folders = {name: tmp_path / f"{dist_helper.PREFIX}{name}" for name in ("dead", "alive", "new", "legacy", "legacy_new")}
    for f in folders.values():
        f.mkdir()
    (folders["dead"] / "launcher").write_text(str(dead))
    (folders["alive"] / "launcher").write_text(str(os.getpid()))
    (folders["new"] / "launcher").write_text(str(dead))
    (folders["legacy"] / "pid.0").write_text(str(dead))  # written before folders named their launcher
    now = time.time()
    for name, age in (("dead", 10), ("alive", 10), ("new", -10), ("legacy", 2 * dist_helper.LEGACY_AGE), ("legacy_new", 10)):
        os.utime(folders[name], (now - age, now - age))
    removed = dist_helper.clean_stale(tmp_path, now)
    assert sorted(p.name for p in removed) == [f"{dist_helper.PREFIX}dead", f"{dist_helper.PREFIX}legacy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{dist_helper.PREFIX}{n}" for n in ("alive", "new", "legacy_new"))
