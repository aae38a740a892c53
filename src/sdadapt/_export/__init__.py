"""Floor 7, export: ``sdadapt.export()`` / ``export_iter()`` a model and ``sdadapt.convert()`` a
checkpoint; the output folder written as one step by the streaming writers, and the regions of
each output a rank makes from the shards it owns (also used by refit)."""

from .export_local import first_copies, owned_shard, reads_of, regions
from .exporting import ExportReport, convert, export, export_iter
from .writers import FORMATS
from .writing import CachedIO, PageReleaser, check_destination, plan_outputs, write_folder

__all__ = [
    "FORMATS",
    "CachedIO",
    "ExportReport",
    "PageReleaser",
    "check_destination",
    "convert",
    "export",
    "export_iter",
    "first_copies",
    "owned_shard",
    "plan_outputs",
    "reads_of",
    "regions",
    "write_folder",
]
