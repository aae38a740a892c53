"""Floor 7, loading: ``sdadapt.load()`` and ``sdadapt.plan_load()``, a checkpoint of any format
adapted into a (meta, parallelised) model as one transaction.

Importing it first starts pinning a GPU load's staging memory where the process has initialised
CUDA (:mod:`sdadapt._engine.pin_ahead`), so that the pinning runs beside the imports of
:mod:`.loading` and everything below it, which a process's first load waits for."""

from .._engine.pin_ahead import pin_staging_ahead

pin_staging_ahead()

from .loading import LoadReport, load, plan_load  # noqa: E402 - after the pinning has started

__all__ = ["LoadReport", "load", "plan_load"]
