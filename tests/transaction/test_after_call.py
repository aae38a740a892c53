"""Work a public call queues for after it returns (sdadapt._base.later): a process's first GPU
load queues kvikio's start there, so that its thread does not compete with the load's last steps
for the GIL. It starts once the outermost public call ends (also by an error), or as the next
engine run begins; a failure to start is logged, never raised."""

from __future__ import annotations

import logging

import pytest
import torch
from support.checkpoints import write_safetensors

from sdadapt._base import later
from sdadapt._engine import EngineConfig, IOEngine, Job
from sdadapt._recipes import nodes as N
from sdadapt._transaction.tidy import public
from sdadapt.errors import UsageError
from sdadapt.sources import open_source


@pytest.fixture(autouse=True)
def _empty_queue():
    later.drop()
    yield
    later.drop()


def test_queued_work_starts_once_the_outermost_public_call_returns_or_fails(caplog):
    ran: list[str] = []

    @public
    def inner() -> None:
        later.queue(lambda: ran.append("inner's"))
        assert ran == []

    @public
    def outer(fail: bool) -> int:
        later.queue(lambda: ran.append("outer's"))
        inner()
        assert ran == [] and later.queued() == 2  # a nested call's end starts nothing
        if fail:
            raise UsageError("bad")
        return 7

    assert outer(False) == 7
    assert ran == ["outer's", "inner's"] and later.queued() == 0
    ran.clear()
    with pytest.raises(UsageError):
        outer(True)
    assert ran == ["outer's", "inner's"]

    def broken() -> None:
        raise RuntimeError("no kvikio today")

    ran.clear()
    with caplog.at_level(logging.DEBUG, logger="sdadapt._base.later"):
        mark = later.enter()
        later.queue(broken)
        later.queue(lambda: ran.append("after the broken one"))
        later.leave(mark)  # never raises; the rest still runs
    assert ran == ["after the broken one"] and "no kvikio today" in caplog.text


def test_an_engine_run_starts_what_an_earlier_run_queued_before_reading(tmp_path):
    path = write_safetensors(tmp_path / "m.safetensors", {"w": torch.arange(6, dtype=torch.float32)})
    seen: list[int] = []
    mark = later.enter()  # inside a public call: queued until it ends, or the next engine run
    later.queue(lambda: seen.append(later.queued()))
    assert later.queued() == 1 and seen == []
    dest = torch.zeros(6)
    with open_source(path) as src:
        IOEngine(src, EngineConfig(threads=1)).run([Job("w", N.Leaf("w", (6,), torch.float32), ((0, 6),), dest)])
    assert seen == [0] and later.queued() == 0
    later.leave(mark)
    assert seen == [0]  # run once
    assert torch.equal(dest, torch.arange(6, dtype=torch.float32))


def test_outside_a_public_call_queued_work_starts_at_once():
    """An engine run under ``dcp.load`` (the torchtitan bridge's reader) is in no public call:
    what it queues starts as it is queued, as before."""
    ran: list[int] = []
    later.queue(lambda: ran.append(1))
    assert ran == [1] and later.queued() == 0
