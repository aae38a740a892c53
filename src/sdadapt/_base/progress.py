"""Progress bars for long work (``load``, ``load_state``, ``export``, ``convert``, ``shrink``, Hub
downloads): tqdm on stderr, shown only on a terminal with logging on (and, for the operations
every rank runs, on rank 0 only), so that logs, pipes and CI output stay clean."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("sdadapt")


def show_progress(enabled: bool | None = None) -> bool:
    """Whether to draw a bar: ``enabled=False`` never; ``None``/``True`` only when stderr is a
    terminal and sdadapt's warnings are not silenced (``logging.disable``)."""
    return enabled is not False and sys.stderr.isatty() and log.isEnabledFor(logging.WARNING)


def progress_bar(total: int, desc: str, *, enabled: bool | None = None, unit: str = "B") -> Any:
    """A tqdm bar of ``total`` units (bytes by default, shown as KiB/MiB/...) on stderr; a
    disabled bar (its ``update`` does nothing) when :func:`show_progress` says no."""
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        desc=desc,
        disable=not show_progress(enabled),
        leave=False,
        file=sys.stderr,
    )


class TransferBar:
    """A bar of ``total`` bytes for one operation on one rank, updated from any thread (the I/O
    engine's threads call :meth:`update` with each finished task's bytes); ``tensors`` is said in
    its description. Drawn only on rank 0 (``rank``) and where :func:`show_progress` says yes,
    so other ranks and logs stay quiet; a context manager that removes the bar when done."""

    def __init__(self, total: int, desc: str, *, tensors: int, rank: int = 0, enabled: bool | None = None):
        import threading

        self.on = rank == 0 and show_progress(enabled)
        self._lock = threading.Lock()
        self._bar = progress_bar(total, f"{desc}: {tensors} tensors", enabled=enabled) if self.on else None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> TransferBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
