"""The package version, one place (``sdadapt.__version__``, and the metadata of saved states),
and the installed version of another distribution (:func:`version_of`: every load agrees on
transformers' version across ranks; ``sdadapt.env()`` reports the rest)."""

from __future__ import annotations

VERSION = "0.1.0"


def version_of(dist: str) -> str | None:
    """The installed version of distribution ``dist``, ``None`` if it is not installed. Taken from
    the ``Version:`` line among the first lines of its metadata file, where
    ``importlib.metadata.version`` runs the email parser over the whole file, a long description
    included (every load agrees on transformers' version)."""
    from importlib import metadata  # noqa: PLC0415 - not at ``import sdadapt``, which imports this module

    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return None
    for line in (found.read_text("METADATA") or found.read_text("PKG-INFO") or "").splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        if line.startswith("Version:"):
            return line[len("Version:") :].strip()
    return found.version
