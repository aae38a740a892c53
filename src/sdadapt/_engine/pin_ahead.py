"""Pinning a process's first GPU staging slab while ``sdadapt.load``'s modules are imported.

A process's first GPU load reads through pinned staging memory (:mod:`.staging`), one slab of
about ``EngineConfig.staging_bytes`` that takes tens of milliseconds to pin (:mod:`.pinned`).
The load asks for it as it starts (:func:`.engine.prefetch_pinned`), but plans and materialises
the model in less time than that, so its first reads would wait for it. Its imports take longer:
the first lookup of ``sdadapt.load`` imports :mod:`sdadapt._load` and everything below it, which
calls :func:`pin_staging_ahead` before importing the rest. That starts pinning, on the slab
cache's background thread, the slab a load with the environment's settings asks for
(``EngineConfig.from_env()``, :meth:`.staging.StagingPool.run_slab_bytes`); the load's own
prefetch then finds it pinned or on its way and asks for nothing more, and its staging pool takes
it (the smallest kept slab large enough: also a run with fewer threads than the settings').

The thread spends its time in calls that let go of the interpreter lock (``mmap``, ``madvise``
through ctypes, torch's ``zero_``, ``cudaHostRegister``), so it pins while the main thread imports.

It pins only in a process that has initialised CUDA already, for the current device, and only
where that device has its CUDA context: it never initialises CUDA or makes a context (a process
that has not used CUDA imports nothing more and pins nothing). Memory registered with CUDA's
default flags is portable on 64-bit systems (unified addressing), so a load to another device
of the process copies out of the slab as well. ``SDADAPT_IO_PIN_AHEAD=0`` turns it
off. The slab is kept like any other (:func:`~sdadapt.release_pinned_memory` frees it), also when
the process's loads turn out to go to the CPU or ask for more staging (``engine=``).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pinned import SlabCache

log = logging.getLogger(__name__)

ENV_VAR = "SDADAPT_IO_PIN_AHEAD"


def pin_staging_ahead(slabs: SlabCache | None = None) -> int:
    """Start pinning the staging slab of a GPU load with the environment's settings, in the
    background, where this process has initialised CUDA (see the module's docstring).

    Args:
        slabs: the cache to pin it into (``None``: :data:`~sdadapt._engine.pinned.SLABS`, the
            one staging pools take their slabs from).

    Returns:
        The bytes asked for; 0 where nothing was started (CUDA not initialised, the current
        device without a context, ``SDADAPT_IO_PIN_AHEAD=0``, or settings that do not parse, which
        the load then reports itself).

    Example::

        import sdadapt._engine.pin_ahead as ahead

        asked = ahead.pin_staging_ahead()  # 0 in a process that has not initialised CUDA
    """
    torch: Any = sys.modules.get("torch")  # not imported: CUDA cannot be initialised, and nothing is imported here
    if torch is None or not torch.cuda.is_initialized():
        return 0
    from . import config  # noqa: PLC0415 - only in a process that uses CUDA

    if not config.env_switch(ENV_VAR, True):
        return 0
    try:
        index = torch.cuda.current_device()
        if not _has_context(torch, index):
            return 0
        from .pinned import SLABS  # noqa: PLC0415
        from .staging import StagingPool  # noqa: PLC0415

        cfg = config.EngineConfig.from_env()
        nbytes = StagingPool.run_slab_bytes(cfg, cfg.threads)
        (slabs if slabs is not None else SLABS).prefetch(nbytes, torch.device("cuda", index))
    except Exception as e:  # noqa: BLE001 - a head start only: the load pins (and reports) for itself
        log.debug("not pinning staging memory ahead of the first load: %s", e)
        return 0
    log.debug("pinning %d bytes of staging memory for cuda:%d ahead of the first load", nbytes, index)
    return nbytes


def _has_context(torch: Any, index: int) -> bool:
    """Whether device ``index`` has its primary CUDA context (registering memory there makes
    none); ``False`` where torch cannot tell."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(has(index)) if has is not None else False
