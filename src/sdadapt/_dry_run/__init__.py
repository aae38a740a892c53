"""Floor 7, the dry run: ``sdadapt.dry_run()``, every rank of a mesh of any size planned on one
process, with what each rank would read."""

from .dryrun import DryRunRank, DryRunReport, dry_run

__all__ = ["DryRunRank", "DryRunReport", "dry_run"]
