"""Progress bars for long work (``convert``, ``shrink``, Hub downloads): tqdm on stderr, shown
only on a terminal with logging on, so that logs, pipes and CI output stay clean."""

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
