"""The table of checkpoint formats: one :class:`~sdadapt.sources._base.Format` entry per format,
declared by the format's own module (``FORMAT``), in the order paths are tried.

Everything that depends on what formats exist derives from :data:`FORMATS`: opening a local path
(:func:`open_local`), the files an object storage URL's opening fetches (:func:`format_of_name`
and each entry's ``header_ranges``), the files a Hub source fetches (``folder_file`` and
``members``), whether one rank's header reads can be broadcast (:func:`recordable`), and the
suffix lists (:data:`WEIGHT_SUFFIXES`, :data:`FILE_SUFFIXES`). A new format is one module that
declares its ``FORMAT``, one row here, one test and one row in docs/sources.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ..errors import SourceError
from . import _hf_sharded, _safetensors_file
from ._base import Format, Source


def _dcp_claims(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, ".metadata")) or any(n.endswith(".distcp") for n in os.listdir(path))
    )


def _dcp_open(path: str, subtree: str | None) -> Source:
    from ._dcp_dir import DCPSource  # noqa: PLC0415 - it imports torch.distributed.checkpoint: only for DCP folders

    return DCPSource(path, subtree=subtree)


_DCP = Format("dcp", (".distcp",), _dcp_claims, _dcp_open)
"""A DCP folder (``.metadata`` and ``*.distcp`` files). Declared here rather than in
:mod:`._dcp_dir`, which imports ``torch.distributed.checkpoint`` and is imported only to open
one; opening it reads ``.metadata`` whole (a side file) and its data files only when located."""

def _gguf_open(path: str, subtree: str | None) -> Source:
    from ._gguf_file import FORMAT  # noqa: PLC0415 - the GGUF reader, imported only to open a .gguf file

    return FORMAT.open(path, subtree)


def _gguf_header_ranges(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    from ._gguf_file import header_ranges  # noqa: PLC0415 - as _gguf_open

    return header_ranges(path, size)


def _gguf_config(path: str) -> dict[str, Any] | None:
    from ._gguf_file import config_of  # noqa: PLC0415 - as _gguf_open

    return config_of(path)


_GGUF = Format(
    "gguf", (".gguf",), lambda path: path.endswith(".gguf"), _gguf_open, _gguf_header_ranges, recordable=True, config=_gguf_config
)
"""A ``.gguf`` file (llama.cpp's format): :data:`sdadapt.sources._gguf_file.FORMAT`, whose module
(the GGUF header parser and reader) is imported only to open, fetch or read the config of one;
``tests/sources/test_gguf.py`` checks that the two declarations agree."""

def _torch_save_open(path: str, subtree: str | None) -> Source:
    from ._torch_save import FORMAT  # noqa: PLC0415 - the torch.save reader, imported only to open one

    return FORMAT.open(path, subtree)


def _torch_save_header_ranges(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    from ._torch_save import header_ranges  # noqa: PLC0415 - as _torch_save_open

    return header_ranges(path, size)


_TORCH_SAVE = Format(
    "torch_save", (".bin", ".pt", ".pth", ".ckpt"), os.path.isfile, _torch_save_open, _torch_save_header_ranges, any_file=True
)
"""A ``torch.save`` zip file, any file no other format claims: :data:`sdadapt.sources._torch_save.FORMAT`,
whose module (the zip directory and pickle reader) is imported only to open or fetch one;
``tests/sources/test_formats.py`` checks that the two declarations agree."""

FORMATS: tuple[Format, ...] = (
    _hf_sharded.FORMAT,
    _safetensors_file.FORMAT,
    _DCP,
    _GGUF,
    _TORCH_SAVE,  # any other file: last
)
"""Every format sdadapt reads, in the order a path is tried."""

FOREIGN_SUFFIXES = (".h5", ".msgpack", ".onnx")
"""Weight files of formats sdadapt does not read (TensorFlow, Flax, ONNX): never side files."""

WEIGHT_SUFFIXES: tuple[str, ...] = tuple(s for f in FORMATS for s in f.suffixes if s != ".index.json") + FOREIGN_SUFFIXES
"""Endings of weight files: never copied as side files (the writer makes the weights)."""

FILE_SUFFIXES: tuple[str, ...] = tuple(s for f in FORMATS for s in f.suffixes) + (".json", ".py")
"""Endings of file names (checkpoints, indexes, code) that mark a path, not a Hub id or a module."""


def format_of(path: str) -> Format | None:
    """The format that claims the existing local ``path`` (a file or folder), if any."""
    is_dir = os.path.isdir(path)
    for fmt in FORMATS:
        if fmt.any_file and is_dir:
            continue
        if fmt.claims(path):
            return fmt
    return None


def open_local(path: str, subtree: str | None) -> Source | None:
    """The source of the existing local ``path`` through the format that claims it; ``None`` when
    none does (a folder holding no checkpoint)."""
    fmt = format_of(path)
    return None if fmt is None else fmt.open(path, subtree)


def format_of_name(name: str, *, single: bool = False) -> Format | None:
    """The format of a file by its name alone (an object storage object, before it is fetched);
    ``single``: the URL names this one object, so an unknown ending is the last entry's (a
    ``torch.save`` file), as a local file would be."""
    for fmt in FORMATS:
        if name.endswith(fmt.suffixes):
            return fmt
    if single and not name.endswith(".json"):
        return next((f for f in FORMATS if f.any_file), None)
    return None


def recordable(src: Any) -> bool:
    """Whether opening ``src`` (a path; a folder judged by its files, a file or URL by its name)
    reads only what a header record holds, so that one rank may read and broadcast it."""
    if isinstance(src, Source) or not isinstance(src, (str, os.PathLike)):
        return False
    p = os.fspath(src)
    fmt = format_of(p) if os.path.isdir(p) else format_of_name(p)
    return fmt is not None and fmt.recordable


def hub_files(folder_has: Any) -> tuple[str, list[str]] | None:
    """For a Hub snapshot: ``folder_has(name) -> path or None`` answers whether a marker file was
    fetched; returns (the marker, the files it lists) of the first format whose marker with
    members is there, else ``None`` (then :data:`HUB_SINGLE` is fetched)."""
    for fmt in FORMATS:
        if fmt.folder_file is not None and fmt.members is not None:
            path = folder_has(fmt.folder_file)
            if path is not None:
                return fmt.folder_file, fmt.members(path)
    return None


HUB_MARKERS: tuple[str, ...] = tuple(f.folder_file for f in FORMATS if f.folder_file is not None and f.members is not None)
"""Marker files that list a checkpoint's files (indexes): what a Hub source fetches first."""

HUB_SINGLE: str = next(f.folder_file for f in FORMATS if f.folder_file is not None and f.members is None)
"""The single weight file a Hub source fetches when no index is there."""



def embedded_config(source: Any) -> dict[str, Any] | None:
    """The ``config.json`` fields a checkpoint file carries in its own metadata (a GGUF file's
    ``general.architecture``, head counts...), for a checkpoint with no ``config.json`` beside it;
    ``None`` for other formats, folders, or a file whose header does not open."""
    path = getattr(source, "path", source)
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return None
    fmt = format_of(os.fspath(path))
    if fmt is None or fmt.config is None:
        return None
    try:
        return fmt.config(os.fspath(path))
    except SourceError:
        return None  # opening it says what is wrong
