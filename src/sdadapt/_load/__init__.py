"""Floor 7, loading: ``sdadapt.load()`` and ``sdadapt.plan_load()``, a checkpoint of any format
adapted into a (meta, parallelised) model as one transaction."""

from .loading import LoadReport, load, plan_load

__all__ = ["LoadReport", "load", "plan_load"]
