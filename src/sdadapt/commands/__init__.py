"""Subcommands of the ``sdadapt`` CLI, one module each (see :mod:`sdadapt.cli`)."""
