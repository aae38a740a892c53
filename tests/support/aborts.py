"""Teardown aborts seen in passing tests, written where scripts/repeat_tests.py reads them.

torch 2.13 + gloo can abort a process as it ends ("terminate called without an active
exception", shared/DESIGN.md). A rank that aborts after writing its result, or a doc page's
torchrun rank that aborts after its work, can leave a test green: pytest shows a passing test's
output to no one, so a series reading pytest's output alone would count aborts in failing tests
only. Where the environment variable :data:`ENV` names a file, :func:`record` appends one line per
abort seen there:

- tests/support/dist_helper.py: a launched rank that ended by a signal (SIGABRT for an abort), or
  whose log holds :data:`ABORT`;
- tests/project/test_doc_blocks.py: a page whose processes printed :data:`ABORT`.

    SDADAPT_TEST_ABORTS=/tmp/aborts.txt python -m pytest tests/dist   # then: cat /tmp/aborts.txt
"""

from __future__ import annotations

import os

ABORT = "terminate called without an active exception"
ENV = "SDADAPT_TEST_ABORTS"


def _test() -> str:
    """The running test's node id (pytest's ``PYTEST_CURRENT_TEST``, less its phase)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)").rsplit(" (", 1)[0]


def record(what: str) -> None:
    """Append ``<test node id>: <what>`` to the file :data:`ENV` names; nothing where it is unset."""
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{_test()}: {what}\n")


def scan(who: str, text: str) -> None:
    """Record that ``who`` aborted if ``text`` (its output) holds :data:`ABORT`."""
    if ABORT in text:
        record(f"{who}: {text.count(ABORT)} x {ABORT!r}")
