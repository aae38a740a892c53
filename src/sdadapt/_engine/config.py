"""The engine's knobs: thread count, staging memory, read sizes, and their environment variables."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

MiB = 1 << 20


def process_cpus() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``: a launcher's or container's
    pinning counts), else every CPU of the machine (not Linux)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The ranks on this host (``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 when unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def rank_cpus() -> int:
    """This rank's share of the CPUs: :func:`process_cpus` divided by :func:`local_ranks`, at
    least 1, never more than the CPUs the process may use."""
    return max(1, process_cpus() // local_ranks())


def default_threads() -> int:
    """Threads for one rank: ``SDADAPT_IO_THREADS``, else this rank's share of the CPUs
    (:func:`rank_cpus`: the CPUs this process may use divided by the ranks on this host), at
    most 32, so never more threads than cores. From 8 CPUs per rank on, a quarter of them is
    left to the rest of the process (its main thread, NCCL's and CUDA's threads), which the
    reads would otherwise compete with (bench/RESULTS.md measures it)."""
    env = os.environ.get("SDADAPT_IO_THREADS")
    if env:
        return max(1, int(env))
    per_rank = rank_cpus()
    if per_rank >= 8:
        per_rank = per_rank * 3 // 4
    return min(32, per_rank)


@dataclass
class EngineConfig:
    """Knobs of the engine; the defaults suit most machines.

    Every field has a default, and all but three (``coalesce_gap``, ``direct_min_bytes``,
    ``min_span_bytes``) an environment variable that :meth:`from_env` reads; the table of
    variables, defaults and what each one trades is in docs/performance.md ("Engine settings").
    The staging memory of a GPU load is pinned and kept for the next load
    (:func:`sdadapt.release_pinned_memory` frees it); the computing threads and their band
    buffers are described in :mod:`sdadapt._engine.lanes`, the device side in
    :mod:`sdadapt._engine.device`, reads through kvikio in :mod:`sdadapt._engine.devread`.

    Args:
        threads: reading threads per rank.
        staging_bytes: the bound on staging memory of one load on one rank.
        chunk_bytes: the largest single read (``None``: derived from the staging memory).
        coalesce_gap: unwanted bytes a coalesced read may span between two wanted regions
            (counted as read).
        direct_min_bytes: the size from which a CPU destination is read into directly rather
            than through staging.
        min_span_bytes: ``0`` (the default): every located region is read with ``preadv``, a
            column slice's runs too (joined by ``gap_bytes``); a positive value: a region of
            shorter runs is copied out of the source's mapping instead, which faults in whole
            pages (or page-cache folios) of every row it crosses.
        gap_bytes: the largest gap between two runs of one read (a column slice's rows) that is
            read through, into a scratch buffer, so that the runs share one ``preadv`` call;
            runs further apart are read one call each (storage is asked only for their pages).
        readahead: let the kernel read ahead of the engine's reads; off by default, so that
            storage delivers only the pages a rank asks for (``POSIX_FADV_RANDOM``).
        depth: staging buffers each thread cycles through (a read into one overlaps the copies
            out of the others).
        band_bytes: the largest input of one computation, cut into bands of whole blocks (``None``:
            the staging memory shared out over the threads, 4 to 32 MiB).
        band_depth: band buffers per computing thread.
        landing_buffers: band-sized buffers a GPU run keeps on the device.
        warm_kernels: warm a GPU load's kernels up while the model materialises.
        switch_interval: Python's thread switch interval while the engine runs (``None``: leave it).
        plan_switch_interval: the interval while the engine plans (``None``: ``switch_interval``).
        gather_inputs: on a GPU, gather a computation's stored inputs on the device.
        gather_bytes: the largest gathered input (``None``: four chunks).
        kvikio: read GPU pieces that land contiguously in their shard through kvikio (extra
            ``sdadapt[cuda]``): ``None`` where it is installed and starts (else the staged
            path, said once in the log), from a process's second GPU load on (the first
            starts it as it ends), ``True`` always (an error where it cannot), ``False``
            never.
        kvikio_threads: kvikio's thread pool (``None``: this rank's CPUs).
        kvikio_task_bytes: the size kvikio cuts a read into.
        kvikio_bounce_bytes: the size of kvikio's pinned bounce buffers (``None``: kvikio's own).
        kvikio_warm: warm kvikio up while the model is materialised.
        kvikio_gathers: where a run reads through kvikio, have kvikio read the stored inputs of
            gathered computations (dequantisation) into their device buffers too; off by default,
            as measured slower than the staged gathers (docs/performance.md).
        head_bytes: a one-rank GPU load that reads through kvikio has kvikio read up to this
            many bytes of its plain reads into pinned host memory while the model is
            materialised, and copies them to the GPU from there once its run begins
            (:mod:`sdadapt._engine.head`); 0 (the default): none.
        remote_request_bytes: a source at an object storage URL: the size of one ranged request
            (``None``: chosen from the measured latency and rate, docs/object-storage.md).
        remote_concurrency: a source at an object storage URL: the requests in flight, one per
            thread (``None``: chosen from the measured rate).
        share_rows: with ``share_reads``, the ranks holding column slices of the same rows (TP's
            row-parallel weights) split the rows, each reading whole rows once, and exchange
            the slices (:mod:`sdadapt._engine.share`), which cuts a cold rank's storage bytes
            to its share. ``"auto"`` (the default): on for a TP group whose ranks run on more
            than one host (they share no page cache), off for one on a single host (its ranks
            share the page cache, so the host reads each byte from storage once either way,
            and sharing measured no faster there: docs/performance.md); ``True``: always
            (storage read around the page cache); ``False``: never.
        share_round_bytes: the rows a rank reads per round of that exchange (one
            ``all_to_all`` each); the rounds' three buffers (rows read, sent, received), made
            once, take about three times this. The last round's exchange and copies follow the
            last read: smaller rounds shorten that tail, larger ones make fewer collectives.

    Raises:
        ValueError: a field out of range (``depth=0``).

    Example::

        cfg = sdadapt.EngineConfig(threads=8, staging_bytes=512 << 20)
        sdadapt.load(model, "ckpt/", "llama", engine=cfg)
    """

    threads: int = field(default_factory=default_threads)
    staging_bytes: int = 256 * MiB
    chunk_bytes: int | None = None
    coalesce_gap: int = 0
    direct_min_bytes: int = 256 * 1024
    min_span_bytes: int = 0
    gap_bytes: int = 128 * 1024
    readahead: bool = False
    depth: int = 2
    band_bytes: int | None = None
    band_depth: int = 1
    landing_buffers: int = 4
    warm_kernels: bool = True
    switch_interval: float | None = None
    plan_switch_interval: float | None = None
    gather_inputs: bool = True
    gather_bytes: int | None = None
    kvikio: bool | None = None
    kvikio_threads: int | None = None
    kvikio_task_bytes: int = 16 * MiB
    kvikio_bounce_bytes: int | None = None
    kvikio_warm: bool = True
    kvikio_gathers: bool = False
    head_bytes: int = 0
    remote_request_bytes: int | None = None
    remote_concurrency: int | None = None
    share_rows: bool | Literal["auto"] = "auto"
    share_round_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.share_rows not in (True, False, "auto"):
            raise ValueError(f"EngineConfig.share_rows must be True, False or 'auto', got {self.share_rows!r}")
        for name, least, what in _LEAST:
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"EngineConfig.{name} must be {what}, got {value}")

    def kvikio_pool(self) -> int:
        """kvikio's thread pool size: ``kvikio_threads``, or every CPU of this rank
        (:func:`rank_cpus`; its threads wait on reads and copies, not on the interpreter)."""
        return self.kvikio_threads if self.kvikio_threads is not None else rank_cpus()

    def kvikio_settings(self) -> tuple[int, int, int | None]:
        """kvikio's pool size, task size and bounce buffer size, as
        :func:`sdadapt._engine.devread.select` takes them."""
        return self.kvikio_pool(), self.kvikio_task_bytes, self.kvikio_bounce_bytes

    def chunk(self) -> int:
        """The largest single read, in bytes (also the size of one staging buffer)."""
        if self.chunk_bytes is not None:
            return max(4096, self.chunk_bytes)
        return max(MiB, min(32 * MiB, self.staging_bytes // (self.depth * max(1, self.threads))))

    def staging_buffers(self, threads: int) -> int:
        """How many staging buffers a run with ``threads`` threads may hold (each ``chunk()``
        bytes): what ``staging_bytes`` allows, and no more than the threads can cycle through."""
        return max(1, min(self.staging_bytes // self.chunk(), threads * self.depth))

    def band(self) -> int:
        """The largest input of one computation, in bytes: ``band_bytes``, or by default the
        staging memory shared out over the threads (so that every thread computes), 4 to 32 MiB."""
        if self.band_bytes is not None:
            return self.band_bytes
        return max(4 * MiB, min(32 * MiB, self.staging_bytes // max(1, self.threads)))

    def gather_band(self) -> int:
        """The largest input of one gathered computation (its buffer on the device), in bytes:
        ``gather_bytes``, or by default four chunks."""
        return self.gather_bytes if self.gather_bytes is not None else 4 * self.chunk()

    def computing_threads(self, threads: int) -> int:
        """How many of a run's ``threads`` compute: one band buffer each within ``staging_bytes``
        (the band pool holds ``band_depth`` times as many buffers)."""
        return max(1, min(self.staging_bytes // self.band(), threads))

    def band_buffers(self, threads: int) -> int:
        """How many band buffers a run with ``threads`` threads may hold: ``band_depth`` for
        each thread that computes."""
        return self.computing_threads(threads) * self.band_depth

    def band_buffer_bytes(self) -> int:
        """The size of a band buffer: a band's largest input (:meth:`band`) and room for its
        other inputs, the scales: at most a sixteenth of it (MXFP4's byte per 16-byte block),
        each input starting on a multiple of 64 bytes."""
        band = self.band()
        return band + band // 16 + 128

    @classmethod
    def from_env(cls) -> EngineConfig:
        """The defaults, overridden by the ``SDADAPT_IO_*`` environment variables."""
        cfg = cls()
        for var, (name, parse) in ENV.items():
            if os.environ.get(var):
                setattr(cfg, name, parse(os.environ[var]))
        return cfg


_ABOVE_ZERO = math.nextafter(0.0, 1.0)  # the least positive float: "at least this" is "more than 0"
_LEAST: tuple[tuple[str, float, str], ...] = (
    ("gap_bytes", 0, "at least 0"),
    ("min_span_bytes", 0, "at least 0"),
    ("depth", 1, "at least 1 (staging buffers per thread)"),
    ("band_bytes", 1, "positive"),
    ("gather_bytes", 1, "positive"),
    ("band_depth", 1, "at least 1 (band buffers per computing thread)"),
    ("landing_buffers", 1, "at least 1 (band-sized buffers on the GPU)"),
    ("remote_request_bytes", 4096, "at least 4096"),
    ("remote_concurrency", 1, "at least 1"),
    ("share_round_bytes", 4096, "at least 4096"),
    ("kvikio_threads", 1, "at least 1"),
    ("kvikio_task_bytes", 4096, "at least 4096"),
    ("kvikio_bounce_bytes", 4096, "at least 4096"),
    ("head_bytes", 0, "0 or more"),
    ("switch_interval", _ABOVE_ZERO, "positive seconds or None"),
    ("plan_switch_interval", _ABOVE_ZERO, "positive seconds or None"),
)
""":class:`EngineConfig`'s bounded fields: ``(field, the least value, what the error says it must be)``;
``None`` passes where a field takes it."""


def _mib(floor: int) -> Callable[[str], int]:
    return lambda text: max(floor, int(float(text) * MiB))


def _kib(text: str) -> int:
    return max(0, int(float(text) * 1024))


def _count(text: str) -> int:
    return max(1, int(text))


def _flag(text: str) -> bool:
    return text not in ("0", "false", "no")


def _auto_or_flag(text: str) -> bool | str:
    return "auto" if text == "auto" else _flag(text)


def _mib_or_none(text: str) -> int | None:
    mb = float(text)
    return max(4096, int(mb * MiB)) if mb > 0 else None


def _seconds_of_ms(text: str) -> float | None:
    ms = float(text)
    return ms / 1000 if ms > 0 else None


ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "SDADAPT_IO_STAGING_MB": ("staging_bytes", _mib(0)),
    "SDADAPT_IO_CHUNK_MB": ("chunk_bytes", _mib(0)),
    "SDADAPT_IO_DEPTH": ("depth", _count),
    "SDADAPT_IO_BAND_MB": ("band_bytes", _mib(4096)),
    "SDADAPT_IO_BAND_DEPTH": ("band_depth", _count),
    "SDADAPT_IO_LANDING": ("landing_buffers", _count),
    "SDADAPT_IO_WARM": ("warm_kernels", _flag),
    "SDADAPT_IO_GAP_KB": ("gap_bytes", _kib),
    "SDADAPT_IO_READAHEAD": ("readahead", _flag),
    "SDADAPT_IO_GATHER": ("gather_inputs", _flag),
    "SDADAPT_IO_GATHER_MB": ("gather_bytes", _mib(4096)),
    "SDADAPT_IO_KVIKIO": ("kvikio", _flag),
    "SDADAPT_IO_KVIKIO_THREADS": ("kvikio_threads", _count),
    "SDADAPT_IO_KVIKIO_WARM": ("kvikio_warm", _flag),
    "SDADAPT_IO_KVIKIO_GATHERS": ("kvikio_gathers", _flag),
    "SDADAPT_IO_KVIKIO_TASK_MB": ("kvikio_task_bytes", _mib(4096)),
    "SDADAPT_IO_KVIKIO_BOUNCE_MB": ("kvikio_bounce_bytes", _mib_or_none),
    "SDADAPT_IO_HEAD_MB": ("head_bytes", _mib(0)),
    "SDADAPT_IO_REMOTE_REQUEST_MB": ("remote_request_bytes", _mib_or_none),
    "SDADAPT_IO_REMOTE_CONCURRENCY": ("remote_concurrency", _count),
    "SDADAPT_IO_SHARE_ROWS": ("share_rows", _auto_or_flag),
    "SDADAPT_IO_SHARE_ROUND_MB": ("share_round_bytes", _mib(4096)),
    "SDADAPT_IO_SWITCH_MS": ("switch_interval", _seconds_of_ms),
    "SDADAPT_IO_PLAN_SWITCH_MS": ("plan_switch_interval", _seconds_of_ms),
}
"""Each ``SDADAPT_IO_*`` variable :meth:`EngineConfig.from_env` reads: the field it sets and how
its text becomes the value (sizes in MiB, at least 4 KiB where a buffer must hold a page;
counts at least 1; ``0`` / ``false`` / ``no`` turn a switch off, ``auto`` sets ``share_rows`` to
``"auto"``; ``0`` MiB or ms: none)."""

