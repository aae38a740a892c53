"""Units, the benchmark's own error and the /proc readers that several modules use."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


class BenchError(Exception):
    """The benchmark cannot run as asked (size does not fit, bad option...)."""


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out
