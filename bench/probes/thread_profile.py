"""Where each engine thread's samples go, from a py-spy profile: for the threads whose name
starts with ``--thread`` (``sdadapt-device``: the device lane; ``sdadapt-io``: the readers;
``MainThread``), the lines that were on top of the stack (self), the functions on the stack
(inclusive) and the last sdadapt frame under each top line, with their share of the thread's
samples.

Record with py-spy (not a dependency of sdadapt; ``pip install py-spy``), one file with only the
samples where a thread was running and one with its waits too (``--idle``); their difference
per line is the time that line waited (for the interpreter lock, a condition, a syscall)::

    py-spy record --threads --nonblocking --rate 500 --format raw -o active.txt -- python your_load.py
    py-spy record --threads --nonblocking --idle --rate 500 --format raw -o all.txt -- python your_load.py
    python bench/thread_profile.py active.txt --thread sdadapt-device --top 30

``--nonblocking`` matters: py-spy otherwise stops the process for every sample (so recorded, and
with ``--native``, an 8B NVFP4 load on the H200 ran about three times slower). The device lane's time split without a profiler is in
``LoadReport.engine_thread_seconds`` (``lane*`` keys).
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterable

_PATH = re.compile(r"\(/\S*/(?:site-packages|src|lib/python3\.\d+)/")


def summarise(lines: Iterable[str], thread: str, top: int = 30) -> str:
    """The report for the threads named ``thread``... out of py-spy ``--format raw`` lines
    (``thread (ID): NAME;frame;frame ... COUNT``, frames outermost first)."""
    own, inclusive, under = collections.Counter[str](), collections.Counter[str](), collections.Counter[str]()
    names: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        name = head.partition(": ")[2]
        n = int(count)
        names[re.sub(r"-\d+$", "", name)] += n
        if not name.startswith(thread):
            continue
        total += n
        frames = [_PATH.sub("(", f) for f in frames] or ["<no Python frame>"]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
        ours = [f for f in frames if "sdadapt/" in f]
        under[f"{ours[-1] if ours else '-'}  ->  {frames[-1]}"] += n

    def table(title: str, c: collections.Counter[str]) -> list[str]:
        return [f"-- {title}", *(f"{k:7d} {100 * k / max(total, 1):5.1f}%  {f}" for f, k in c.most_common(top))]

    out = [f"threads named {thread}*: {total} samples (all threads: {dict(names.most_common(6))})"]
    return "\n".join(out + table("self", own) + table("inclusive", inclusive) + table("last sdadapt frame -> top", under)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy record --format raw output")
    ap.add_argument("--thread", default="sdadapt-device", help="thread name prefix (default: the device lane)")
    ap.add_argument("--top", type=int, default=30, help="rows per table")
    args = ap.parse_args()
    with open(args.profile) as f:
        print(summarise(f, args.thread, args.top), end="")


if __name__ == "__main__":
    main()
