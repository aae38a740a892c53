"""Which thread takes which task: two queues, computations that use a band buffer and the rest.

Only the threads that hold a band buffer (as many as the band pool has buffers, see
:class:`~sdadapt._engine.config.EngineConfig`) take computations; they take the other tasks too
once no computation is waiting. The other threads take only the other tasks. So no thread ever
waits for a band buffer holding a task that another thread could run, and the plain reads of
a load that also dequantises (a release's bf16 embeddings next to its FP8 layers) run beside
the computations instead of after them.
"""

from __future__ import annotations

import threading
from collections import deque

from .tasks import ComputeTask, Task


def uses_band(task: Task) -> bool:
    """The task is a computation whose inputs are read into a band buffer (see
    :meth:`~sdadapt._engine.workers.Worker._compute`)."""
    return isinstance(task, ComputeTask) and task.step.on_device


class TaskQueues:
    """The tasks of one run, queued as the planner makes them, until :meth:`close`."""

    def __init__(self) -> None:
        lock = threading.Lock()
        self._computing = threading.Condition(lock)  # threads that may take either queue wait here
        self._plain = threading.Condition(lock)  # threads that take only plain tasks wait here
        self._queues: tuple[deque[Task], deque[Task]] = (deque(), deque())  # (band, plain)
        self._waiting = [0, 0]  # threads waiting on (_computing, _plain)
        self._closed = False

    def put(self, task: Task) -> None:
        """Queue ``task`` and wake one thread that can run it."""
        band = uses_band(task)
        with self._computing:
            self._queues[0 if band else 1].append(task)
            if not band and self._waiting[1]:
                self._plain.notify()
            elif self._waiting[0]:
                self._computing.notify()

    def get(self, computes: bool) -> Task | None:
        """The next task a thread may run (``computes``: it holds a band buffer, and takes
        computations first), waiting for one; ``None`` once the queues are closed and empty."""
        band, plain = self._queues
        cond = self._computing if computes else self._plain
        with cond:
            while True:
                if computes and band:
                    return band.popleft()
                if plain:
                    return plain.popleft()
                if self._closed:
                    return None
                self._waiting[0 if computes else 1] += 1
                cond.wait()
                self._waiting[0 if computes else 1] -= 1

    def close(self) -> None:
        """No more tasks: threads finish what is queued, then :meth:`get` returns ``None``."""
        with self._computing:
            self._closed = True
            self._computing.notify_all()
            self._plain.notify_all()
