"""The engine's knobs: thread count, staging memory, read sizes, and their environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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

    ``staging_bytes`` bounds the staging memory of one load on one rank (pinned when loading to
    a GPU, and kept pinned for the next load: :func:`sdadapt.release_pinned_memory` frees it);
    ``depth`` is how many staging buffers each thread cycles through (a read into one overlaps
    the host-to-device copies out of the others); ``chunk_bytes`` is the largest single read
    (default: staging / (depth x threads), 1 to 32 MiB); ``coalesce_gap`` is how many
    unwanted bytes a coalesced read may span between two wanted regions (counted as read);
    ``direct_min_bytes`` is the size from which a CPU destination is read into directly rather
    than through staging (and coalescing); a region made of several runs shorter than
    ``min_span_bytes`` each (a column slice) is copied out of the source's mapping in one
    strided copy instead of one read per run. ``band_bytes`` is the largest input of one
    computation (a dequantisation is cut into bands of whole blocks of about that size): each
    thread that computes reads its bands into one buffer of that size, from a second pool bounded
    by ``staging_bytes`` too (allocated only by loads that compute; its bound is also how many
    threads compute, the others running the load's plain reads meanwhile, see
    :mod:`sdadapt._engine.lanes`). By default (``None``) it is the staging memory shared out
    over the threads, 4 to 32 MiB, so that every thread computes (:meth:`band`).
    ``band_depth`` is how many band buffers a computing thread may cycle through (the pool holds
    that many times more; above 1, reading a band overlaps the copy of the last one to the GPU;
    1, the default, until measured otherwise). ``landing_buffers`` is how many band-sized
    buffers a GPU run keeps on the device for the copies of computations' inputs (a ring: a
    copy into one waits, on the GPU, for the kernel that last read it; see
    :mod:`sdadapt._engine.device`). ``warm_kernels``: a load whose recipes compute on a GPU
    runs each kind of kernel once on a tiny input while it materialises the model
    (:func:`sdadapt._engine.device.warm_kernels`). ``switch_interval`` is Python's thread
    switch interval while the engine's threads run (``sys.setswitchinterval``, set back
    afterwards): how long a thread back from a read may wait for the interpreter lock before
    it asks for it; ``None``, the default, leaves the interpreter's own (5 ms) until a
    shorter one is measured to help (bench/RESULTS.md). ``plan_switch_interval`` is the
    interval while the engine plans (the threads read meanwhile, and each of them waits for the
    lock that the planning thread holds, ``LoadReport.phase_seconds["engine_first_task"]``
    shows how long the first task took); ``None``, the default, leaves ``switch_interval``.
    ``gather_inputs``: on a GPU, a computation whose inputs lie in the files as they are stored
    (an FP8 weight's rows and their scales) has them read like a plain load's bytes, in staged
    reads of ``chunk()`` bytes from the shared staging pool, gathered in a buffer on the device,
    and computed there once all have crossed (:mod:`sdadapt._engine.device`); it is cut into
    bands of ``gather_bytes`` (default four chunks: fewer, larger kernels than band buffers
    allow), the size of that device buffer, of which each thread fills about one at a time.
    ``False``: every computation reads its inputs into a band buffer and crosses in one copy.
    ``kvikio``: on a GPU, read the pieces whose bytes land contiguously in their destination
    shard straight into it through kvikio (the extra ``sdadapt[cuda]``;
    :mod:`sdadapt._engine.devread`): ``None``, the default, where kvikio is installed and
    starts (else the staged path, said once in the log), ``True`` always (an error where it
    cannot), ``False`` never; ``kvikio_threads`` is its pool's size (``None``: every CPU of
    this rank, :func:`rank_cpus`), ``kvikio_task_bytes`` the size it cuts reads into and
    ``kvikio_bounce_bytes`` the size of its pinned bounce buffers, one per pool thread, which a
    process's first load pins (``None``, the default: kvikio's own, ``KVIKIO_BOUNCE_BUFFER_SIZE``
    or 16 MiB; smaller ones pin sooner, shortening a first load, and cost each read more
    copies); ``kvikio_warm``: a process's first load starts kvikio's threads and bounce buffers
    with one small read per thread while it materialises the model
    (:func:`sdadapt._engine.devread.warm`). Where a run reads through kvikio, the inputs of its
    gathered computations are read by kvikio too, into device buffers of which at most twice
    ``staging_bytes`` are out at once.
    Environment: ``SDADAPT_IO_THREADS``, ``SDADAPT_IO_STAGING_MB``, ``SDADAPT_IO_CHUNK_MB``,
    ``SDADAPT_IO_DEPTH``, ``SDADAPT_IO_BAND_MB``, ``SDADAPT_IO_BAND_DEPTH``,
    ``SDADAPT_IO_LANDING``, ``SDADAPT_IO_WARM`` (``0``: no warm-up), ``SDADAPT_IO_SWITCH_MS``
    (``0``: leave the interval as it is), ``SDADAPT_IO_PLAN_SWITCH_MS`` (likewise, while the
    engine plans), ``SDADAPT_IO_GATHER`` (``0``: no gathering), ``SDADAPT_IO_GATHER_MB``, ``SDADAPT_IO_KVIKIO``
    (``0`` / ``1``), ``SDADAPT_IO_KVIKIO_THREADS``, ``SDADAPT_IO_KVIKIO_TASK_MB``, ``SDADAPT_IO_KVIKIO_BOUNCE_MB`` (``0``: kvikio's own),
    ``SDADAPT_IO_KVIKIO_WARM``.

    Args:
        threads: reading threads per rank.
        staging_bytes: the bound on staging memory of one load on one rank.
        chunk_bytes: the largest single read (``None``: derived from the staging memory).
        coalesce_gap: unwanted bytes a coalesced read may span.
        direct_min_bytes: the size from which a CPU destination is read into directly.
        min_span_bytes: the run length below which a region is copied out in one strided copy.
        depth: staging buffers each thread cycles through.
        band_bytes: the largest input of one computation (``None``: derived).
        band_depth: band buffers per computing thread.
        landing_buffers: band-sized buffers a GPU run keeps on the device.
        warm_kernels: warm a GPU load's kernels up while the model materialises.
        switch_interval: Python's thread switch interval while the engine runs (``None``: leave it).
        plan_switch_interval: the interval while the engine plans (``None``: ``switch_interval``).
        gather_inputs: on a GPU, gather a computation's stored inputs on the device.
        gather_bytes: the largest gathered input (``None``: four chunks).
        kvikio: read contiguous GPU pieces through kvikio (``None``: where it is installed).
        kvikio_threads: kvikio's thread pool (``None``: this rank's CPUs).
        kvikio_task_bytes: the size kvikio cuts a read into.
        kvikio_bounce_bytes: the size of kvikio's pinned bounce buffers (``None``: kvikio's own).
        kvikio_warm: warm kvikio up while the model is materialised.

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
    min_span_bytes: int = 64 * 1024
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

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"EngineConfig.depth must be at least 1 (staging buffers per thread), got {self.depth}")
        if self.band_bytes is not None and self.band_bytes < 1:
            raise ValueError(f"EngineConfig.band_bytes must be positive, got {self.band_bytes}")
        if self.gather_bytes is not None and self.gather_bytes < 1:
            raise ValueError(f"EngineConfig.gather_bytes must be positive, got {self.gather_bytes}")
        if self.band_depth < 1:
            raise ValueError(f"EngineConfig.band_depth must be at least 1 (band buffers per computing thread), got {self.band_depth}")
        if self.landing_buffers < 1:
            raise ValueError(f"EngineConfig.landing_buffers must be at least 1 (band-sized buffers on the GPU), got {self.landing_buffers}")
        if self.kvikio_threads is not None and self.kvikio_threads < 1:
            raise ValueError(f"EngineConfig.kvikio_threads must be at least 1, got {self.kvikio_threads}")
        if self.kvikio_task_bytes < 4096:
            raise ValueError(f"EngineConfig.kvikio_task_bytes must be at least 4096, got {self.kvikio_task_bytes}")
        if self.kvikio_bounce_bytes is not None and self.kvikio_bounce_bytes < 4096:
            raise ValueError(f"EngineConfig.kvikio_bounce_bytes must be at least 4096, got {self.kvikio_bounce_bytes}")
        for name in ("switch_interval", "plan_switch_interval"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive seconds or None, got {value}")

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
        if os.environ.get("SDADAPT_IO_STAGING_MB"):
            cfg.staging_bytes = int(float(os.environ["SDADAPT_IO_STAGING_MB"]) * MiB)
        if os.environ.get("SDADAPT_IO_CHUNK_MB"):
            cfg.chunk_bytes = int(float(os.environ["SDADAPT_IO_CHUNK_MB"]) * MiB)
        if os.environ.get("SDADAPT_IO_DEPTH"):
            cfg.depth = max(1, int(os.environ["SDADAPT_IO_DEPTH"]))
        if os.environ.get("SDADAPT_IO_BAND_MB"):
            cfg.band_bytes = max(4096, int(float(os.environ["SDADAPT_IO_BAND_MB"]) * MiB))
        if os.environ.get("SDADAPT_IO_BAND_DEPTH"):
            cfg.band_depth = max(1, int(os.environ["SDADAPT_IO_BAND_DEPTH"]))
        if os.environ.get("SDADAPT_IO_LANDING"):
            cfg.landing_buffers = max(1, int(os.environ["SDADAPT_IO_LANDING"]))
        if os.environ.get("SDADAPT_IO_WARM"):
            cfg.warm_kernels = os.environ["SDADAPT_IO_WARM"] not in ("0", "false", "no")
        if os.environ.get("SDADAPT_IO_GATHER"):
            cfg.gather_inputs = os.environ["SDADAPT_IO_GATHER"] not in ("0", "false", "no")
        if os.environ.get("SDADAPT_IO_GATHER_MB"):
            cfg.gather_bytes = max(4096, int(float(os.environ["SDADAPT_IO_GATHER_MB"]) * MiB))
        if os.environ.get("SDADAPT_IO_KVIKIO"):
            cfg.kvikio = os.environ["SDADAPT_IO_KVIKIO"] not in ("0", "false", "no")
        if os.environ.get("SDADAPT_IO_KVIKIO_THREADS"):
            cfg.kvikio_threads = max(1, int(os.environ["SDADAPT_IO_KVIKIO_THREADS"]))
        if os.environ.get("SDADAPT_IO_KVIKIO_WARM"):
            cfg.kvikio_warm = os.environ["SDADAPT_IO_KVIKIO_WARM"] not in ("0", "false", "no")
        if os.environ.get("SDADAPT_IO_KVIKIO_TASK_MB"):
            cfg.kvikio_task_bytes = max(4096, int(float(os.environ["SDADAPT_IO_KVIKIO_TASK_MB"]) * MiB))
        if os.environ.get("SDADAPT_IO_KVIKIO_BOUNCE_MB"):
            mb = float(os.environ["SDADAPT_IO_KVIKIO_BOUNCE_MB"])
            cfg.kvikio_bounce_bytes = max(4096, int(mb * MiB)) if mb > 0 else None
        for var, name in (("SDADAPT_IO_SWITCH_MS", "switch_interval"), ("SDADAPT_IO_PLAN_SWITCH_MS", "plan_switch_interval")):
            if os.environ.get(var):
                ms = float(os.environ[var])
                setattr(cfg, name, ms / 1000 if ms > 0 else None)
        return cfg
