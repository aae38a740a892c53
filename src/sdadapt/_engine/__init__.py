"""The I/O engine behind :class:`~sdadapt._engine.direct.EngineReader` (and its DCP face,
:class:`~sdadapt._engine.reader.AdaptedStorageReader`).

A rank gets its jobs (a target key, a box of it in global coordinates, a destination shard):
DCP's read items, made by :func:`~sdadapt._engine.direct.local_jobs` without ``dcp.load``. The
engine turns all of them into file reads at once and runs those reads on a thread pool:

1. **Steps** (:mod:`sdadapt._recipes.nodes`). Each job's recipe says how its box is produced into the
   destination: pieces ("source tensor ``key``, region ``box``, goes into this view of the
   destination"), fills, and computations. The engine knows no node kinds; it plans pieces
   and runs fills and computations as they are, from what each computation declares: the
   regions it reads (its inputs), how it may be cut in bands, its device kernel. A computation
   with a kernel (a dequantisation) runs on the destination's device when the destination is
   on a GPU: where its declared inputs are stored regions in long runs (an FP8
   shard's weight rows and scale tiles), they are planned as staged reads of a chunk each,
   which the run's device lane (:mod:`.device`) gathers into one buffer on the GPU before it
   runs the kernel there (a *gather*, :meth:`.planner.Planner._gather`); otherwise a thread
   reads the raw inputs into a pinned band buffer, which the lane copies in one piece.
2. **Locating** (:mod:`.planner`). A source declares where a region's bytes are
   (``Source.locate_region``): one contiguous row-major tensor in a file (safetensors always;
   ``torch.save`` zip files when the storages line up with the zip records), or one per stored
   chunk (DCP folders: the raw bytes of each chunk inside its ``torch.save`` record, see
   :mod:`sdadapt.sources._dcp_dir`); the box is cut at the chunk boundaries. A box becomes byte
   spans of that file (:mod:`.geometry`): one span when it covers whole rows (FSDP's dim-0
   shards), one per row otherwise (TP's column shards: rows whose gaps are at most
   ``gap_bytes`` are read in one ``preadv`` call with the gaps between them, never through the
   file's mapping, :func:`.syscalls.read_runs`). Storage without locations is read through
   ``Source.read``.
3. **Tasks** (:mod:`.tasks`). A CPU destination that is contiguous and of the source dtype is
   read *straight into* with ``preadv`` (:mod:`.syscalls`; no copy, no staging), in chunks so
   that several threads share a large tensor. Otherwise the bytes go into a buffer from a
   bounded staging pool (:mod:`.staging`; pinned when the destination is on a GPU), then
   ``copy_`` moves them (on a GPU: queued by the device lane, so the next read overlaps the
   host-to-device copy). Small staged reads that are adjacent in one file
   are **coalesced** into one read.
4. **Threads** (:mod:`.workers`). A pool sized to the machine (:func:`default_threads`),
   started before planning (:mod:`.engine`): each task is queued as soon as it is made, so the
   first bytes are read while later jobs are still being planned. ``preadv`` and ``copy_``
   release the GIL, so threads read in parallel; Python runs per task (a chunk of megabytes),
   never per element. Each thread cycles through ``depth`` staging buffers of its own. Only
   the threads that hold a band buffer run computations (:mod:`.lanes`); the others run the
   plain reads beside them. On a GPU the reading threads make no CUDA calls: one thread of
   the run, the device lane, makes them all (:mod:`.device`), and hands a thread's buffer
   back for refilling once the copy out of it has finished.

Errors name the target key, the source key and the file. Bytes read are counted exactly
(what was copied out of the checkpoint, including any gap a coalesced read spans), and so is
what a cold page cache reads from storage for them (``EngineStats.storage_bytes``: every page
the calls touch once, the gaps of joined reads included; files are opened with read-ahead off).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .._recipes.nodes import Node
    from ..sources import Source
    from .config import EngineConfig, default_threads
    from .device import device_step, device_work, warm_kernels, warm_up
    from .devread import deferred as kvikio_deferred
    from .devread import warm as warm_kvikio
    from .engine import EngineStats, IOEngine, prefetch_pinned
    from .geometry import box_spans
    from .pinned import release_pinned_memory
    from .share import RowShare, exchange_rows, read_and_exchange, replica_parts, round_memory, rounds_memory, row_cut, rows_config
    from .share import read_jobs as row_read_jobs
    from .share import received as row_received
    from .share import rounds as row_rounds
    from .tasks import Job
    from .workers import CountingIO

_NAMES = {
    "EngineConfig": ".config", "default_threads": ".config",
    "device_step": ".device", "device_work": ".device", "warm_kernels": ".device", "warm_up": ".device",
    "kvikio_deferred": ".devread:deferred", "warm_kvikio": ".devread:warm",
    "EngineStats": ".engine", "IOEngine": ".engine", "prefetch_pinned": ".engine",
    "box_spans": ".geometry", "release_pinned_memory": ".pinned", "Job": ".tasks", "CountingIO": ".workers",
    "RowShare": ".share", "exchange_rows": ".share", "read_and_exchange": ".share", "replica_parts": ".share",
    "round_memory": ".share", "rounds_memory": ".share", "row_cut": ".share", "rows_config": ".share",
    "row_read_jobs": ".share:read_jobs", "row_received": ".share:received", "row_rounds": ".share:rounds",
}  # fmt: skip
"""The face's names but :func:`heading`: ``name -> ".module"`` (the same name there) or
``".module:its_name"``, each imported on first use. Importing the package imports none of its
modules, so that a module below the engine's run (:mod:`.pinned`, :mod:`.config`) can be
imported alone, and a plain load never imports :mod:`.share`."""


def heading(
    device: torch.device | None, source: Source, recipes: Mapping[str, Node], cfg: EngineConfig | None, one_rank: bool
) -> contextlib.AbstractContextManager[None]:
    """Around a load's materialising and run: its head start (:func:`.head.heading`) where
    ``cfg.head_bytes`` asks for one; otherwise a context that does nothing, and :mod:`.head` is
    not imported (a plain load never does).

    Args:
        device: the load's destination device (``None``: a CPU load).
        source: the checkpoint it reads.
        recipes: the plan's recipes, target key -> node.
        cfg: the engine's settings (``None``: :meth:`EngineConfig.from_env`).
        one_rank: the load runs on one rank.

    Returns:
        The context manager to run the materialising and the run in.

    Example::

        with heading(device, source, plan.recipes, cfg, world == 1):
            ...  # materialise, then run the engine
    """
    from .config import EngineConfig as Config  # noqa: PLC0415 - the face imports nothing until used

    cfg = cfg or Config.from_env()
    if cfg.head_bytes <= 0:
        return contextlib.nullcontext()
    from .head import heading as around  # noqa: PLC0415 - only where a head start is asked for

    return around(device, source, recipes, cfg, one_rank)


def __getattr__(name: str) -> Any:
    where = _NAMES.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(module, __name__), attr or name)
    globals()[name] = value  # cached: the next access is a plain attribute
    return value

__all__ = [
    "CountingIO",
    "EngineConfig",
    "EngineStats",
    "IOEngine",
    "Job",
    "RowShare",
    "box_spans",
    "default_threads",
    "device_step",
    "device_work",
    "exchange_rows",
    "heading",
    "kvikio_deferred",
    "prefetch_pinned",
    "read_and_exchange",
    "release_pinned_memory",
    "replica_parts",
    "round_memory",
    "rounds_memory",
    "row_cut",
    "row_read_jobs",
    "row_received",
    "row_rounds",
    "rows_config",
    "warm_kernels",
    "warm_kvikio",
    "warm_up",
]
