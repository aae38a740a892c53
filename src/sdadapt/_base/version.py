"""The package version, one place (``sdadapt.__version__``, and the metadata of saved states)."""

VERSION = "0.1.0"
