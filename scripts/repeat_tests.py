"""Run the distributed and doc-block tests N times in a row and write what each run gave.

A flaky test passes most runs: one green run says little. This runs
``python -m pytest -q <tests>`` ``--runs`` times (default 20: ``tests/dist/`` and
``tests/project/test_doc_blocks.py``), never retrying a failure, and writes a dated report
(``tests/reports/repeat-tests-<machine>-<date>.md`` unless ``--report`` says otherwise): the
command, the machine, the tree, each run's exit status, time, failing tests and whether any
process aborted at teardown (``terminate called without an active exception``): in a passing
test too, since the launcher and the doc-block test write down every rank or page process that
ended by a signal or printed the abort (tests/support/aborts.py), and the report lists them. Add the report's
row to tests/reports/README.md by hand (bench/ holds speed figures; this is the suite's own
record). The report is rewritten after every run, so a series stopped
early (the machine needed back) still says what its runs gave; SIGTERM or Ctrl-C ends the run in
progress, which the report lists as stopped with what it had passed and failed so far. Each run's
whole output (a failure's traceback, the slowest test steps) is kept in ``--logs`` (default
``<tmp>/<report's name>-logs/``).

    python scripts/repeat_tests.py --machine cpu2 [--runs 20] [--report PATH] [TESTS ...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support import aborts  # noqa: E402
from support.load_clock import WorkClock, descendants  # noqa: E402

DEFAULT_TESTS = ["tests/dist", "tests/project/test_doc_blocks.py"]
SLOWEST = 30
"""How many of a run's slowest test steps pytest prints (``--durations``), into its log; the
report lists the last finished run's first ten: what to cut next, since a series pays every
second of a run once per run."""


_STOP = False
"""Set by SIGTERM or SIGINT: the run in progress is ended, reported as stopped with what it had
passed and failed so far, and the series ends."""


def _stop(signum: int, frame: object) -> None:
    global _STOP
    _STOP = True


def _progress(out: str) -> tuple[int, int]:
    """(tests passed, tests failed or errored) so far, from ``pytest -q``'s progress lines."""
    marks = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", out, flags=re.M))
    return marks.count("."), marks.count("F") + marks.count("E")


def one_run(tests: list[str], timeout: float, keep: Path | None = None) -> dict[str, object]:
    """One ``pytest`` run of ``tests``: exit status, seconds, failing node ids, teardown aborts,
    the machine's load average at its start and end, and pytest's one-line reason per failure.
    ``timeout`` counts the run's own time (tests/support/load_clock.py: wall time less the time
    spent waiting for a CPU), so a loaded machine slows a run without ending it."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--durations={SLOWEST}", *tests]
    seen = tempfile.NamedTemporaryFile(prefix="sdadapt-aborts-", suffix=".txt", delete=False)
    seen.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", aborts.ENV: seen.name}
    with tempfile.TemporaryFile() as log:
        # its own session: the run, its fork server and every rank end together if it is stopped
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        clock = WorkClock()
        rc: int | str | None = None
        while rc is None:
            rc = proc.poll()
            if rc is None and (_STOP or clock.seconds([proc.pid, *descendants(proc.pid)]) > timeout):
                rc = "stopped" if _STOP else "timeout"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            time.sleep(0 if rc is not None else 2)
        log.seek(0)
        out = log.read().decode(errors="replace")
    noted = Path(seen.name).read_text(errors="replace").splitlines()
    os.unlink(seen.name)
    if keep is not None:  # the whole output: a failure's traceback, beyond pytest's one line
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(out)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)))
    reasons = sorted(set(re.findall(r"^((?:FAILED|ERROR) \S+ - .*)$", out, flags=re.M)))
    slowest = re.findall(r"^\d+\.\d+s (?:call|setup|teardown) +\S+$", out, flags=re.M)[:10]
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    if rc in ("stopped", "timeout"):
        passed, failing = _progress(out)
        summary = f"{rc} after {passed} passed and {failing} failed (pytest's progress marks)"
    # the processes written down as aborted (passing tests included); a failing test's output
    # holds the text too, so the larger count, not the sum
    return {"rc": rc, "seconds": time.perf_counter() - start, "failed": failed, "summary": summary,
            "aborts": max(len(noted), out.count(aborts.ABORT)), "noted": noted, "slowest": slowest,
            "load": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}", "reasons": reasons}  # fmt: skip


def report(runs: list[dict[str, object]], tests: list[str], machine: str, command: str, asked: int) -> str:
    describe = ["git", "describe", "--always", "--dirty=, with uncommitted changes"]
    tree = subprocess.run(describe, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    green = sum(1 for r in runs if r["rc"] == 0)
    finished = [r for r in runs if r["rc"] != "stopped"]
    rows = [
        f"| {i} | {r['rc']} | {r['seconds']:.0f} | {r['load']} | {r['aborts']} | "
        f"{', '.join(r['failed']) or '-'} | {r['summary'].strip('= ')} |"  # type: ignore[union-attr]
        for i, r in enumerate(runs, 1)
    ]
    # pytest's one-line reason for each failure (cut to 300 characters), by run
    reasons = [f"- run {i}: `{line[:300]}`" for i, r in enumerate(runs, 1) for line in r["reasons"]]  # type: ignore[attr-defined]
    noted = [f"- run {i}: `{line[:300]}`" for i, r in enumerate(runs, 1) for line in r["noted"]]  # type: ignore[attr-defined]
    return "\n".join([
        f"# {green}/{len(finished)} green runs of {' '.join(tests)}",
        "",
        *([f"Stopped after {len(finished)} finished of the {asked} runs asked for"
           + (" (and one stopped by hand partway, listed last: not counted)." if len(finished) < len(runs) else "."), ""]
          if len(finished) < asked else []),
        f"- command: `{command}`",
        f"- machine: {machine} ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {importlib.metadata.version('torch')}, run at nice {os.nice(0)})",
        f"- tree: {tree}",
        "- aborted processes: launched ranks and doc-page processes that ended by a signal or printed "
        f"`{aborts.ABORT}`, in passing tests too (tests/support/aborts.py)",
        f"- date: {datetime.date.today().isoformat()}",
        "",
        "| run | exit | seconds | load average (start-end) | aborted processes | failed | pytest's summary |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(["## Why each failure failed (pytest's one line)", "", *reasons, ""] if reasons else []),
        *(["## Processes that ended by a signal or aborted at teardown (tests/support/aborts.py)", "", *noted, ""]
          if noted else []),
        *(["## The slowest test steps of the last finished run (pytest --durations)", "",
           *[f"- `{line}`" for line in finished[-1]["slowest"]], ""]  # type: ignore[attr-defined]
          if finished and finished[-1].get("slowest") else []),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--machine", required=True, help="the machine's name, as in bench/RESULTS.md (cpu2, cpu16...)")
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds of its own time one run may take")
    parser.add_argument("--logs", type=Path, default=None, help="folder for each run's whole output (default: <tmp>/<report's name>-logs)")
    args = parser.parse_args()
    path = args.report or ROOT / "tests" / "reports" / f"repeat-tests-{args.machine}-{datetime.date.today().isoformat()}.md"
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    runs: list[dict[str, object]] = []
    for i in range(args.runs):
        if _STOP:
            break
        logs = args.logs or Path(tempfile.gettempdir(), f"{path.stem}-logs")
        runs.append(one_run(args.tests, args.timeout, logs / f"run-{i + 1}.txt"))
        print(f"run {i + 1}/{args.runs}: {runs[-1]}", flush=True)
        # rewritten after every run: a series stopped early still leaves the runs it made
        path.write_text(report(runs, args.tests, args.machine, "python " + " ".join(sys.argv), args.runs))
    print(f"wrote {path}")
    sys.exit(0 if all(r["rc"] == 0 for r in runs) else 1)


if __name__ == "__main__":
    main()
