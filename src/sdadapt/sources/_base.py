"""The :class:`Source` protocol (a schema read from headers, region reads, byte locations) and
what the source formats share: :func:`member_path` (a file named by a checkpoint, kept inside
its folder), :func:`read_json_file` and the Hub id test :func:`is_hub_id`. The schema records a
source's schema is made of (:class:`~sdadapt._base.schema.TensorInfo`, ``TensorLocation``,
``dtype_name`` ...) live in :mod:`sdadapt._base.schema`.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._base.regions import Box, full_box
from .._base.schema import TensorInfo, TensorLocation
from ..errors import SourceError
from ._json import read_json

HUB_PREFIX = "hf://"
"""What a Hugging Face Hub id starts with (``hf://org/name[@revision]``); :mod:`._hub`, imported
only to resolve one, turns it into a local folder."""


def is_hub_id(text: object) -> bool:
    """``text`` is a string starting with ``hf://``."""
    return isinstance(text, str) and text.startswith(HUB_PREFIX)


SCHEMES = {"s3": "s3", "gs": "gcs"}
"""Object storage URL scheme -> the extra that installs its client (``pip install 'sdadapt[s3]'``);
:mod:`._object_store`, imported only for a URL, reads them."""


def is_url(text: object) -> bool:
    """``text`` is a string starting with ``s3://`` or ``gs://``."""
    return isinstance(text, str) and text.split("://", 1)[0] in SCHEMES and "://" in text


def read_json_file(path: str, limit: int, what: str) -> Any:
    """The JSON value in the file ``path`` (a checksums file...), refused before it is parsed
    when it is larger than ``limit`` bytes, not UTF-8 or nested too deep: see
    :func:`sdadapt.sources._json.read_json`, whose :class:`SourceError` names ``what`` and the file."""
    return read_json(path, None, what=what, limit=limit)


HeaderRanges = Callable[[str, int], Iterator[list[tuple[int, int]]]]
"""A format's header reads for object storage: called with a file's local mirror path and its
size, it yields the byte ranges ``(start, stop)`` that opening the file reads next; when it
resumes they are in the mirror, so it may read them to find the next ranges."""


@dataclass(frozen=True, eq=False)
class Format:
    """What one checkpoint format is, declared once by its module (``FORMAT``) and collected in
    :data:`sdadapt.sources._formats.FORMATS`: every open path, suffix list, object storage
    header fetch and header record derives from these entries.

    Attributes:
        name: the format's short name (``"safetensors"``).
        suffixes: the endings of its weight files (``(".safetensors",)``).
        claims: ``claims(path)``: whether the existing local ``path`` (a file or folder) is a
            checkpoint of this format (as DCP's ``validate_checkpoint_id`` answers); a file is
            judged by its name, a folder by the files it holds.
        open: ``open(path, subtree)``: the :class:`Source` of a path it claims.
        header_ranges: what opening one of its files reads, for object storage (see
            :data:`HeaderRanges`); ``None``: nothing before a tensor is read (its files hold
            only data).
        recordable: whether opening it reads only bytes from its files' starts and JSON, so
            that one rank's reads can be recorded and broadcast (:mod:`._headers`).
        folder_file: the file whose presence marks a folder of this format
            (``model.safetensors``), which a Hub source fetches.
        members: for a ``folder_file`` that lists other files (an index), the file names it
            lists, as ``members(folder_file_path)``.
        any_file: whether it claims any other non-empty file (the last entry: ``torch.save``).
        config: ``config(path)``: the ``config.json`` fields a file of this format carries in its
            own metadata (GGUF), or ``None``; ``None`` for formats whose config is a side file.
    """

    name: str
    suffixes: tuple[str, ...]
    claims: Callable[[str], bool]
    open: Callable[[str, str | None], Source]
    header_ranges: HeaderRanges | None = None
    recordable: bool = False
    folder_file: str | None = None
    members: Callable[[str], list[str]] | None = None
    any_file: bool = False
    config: Callable[[str], dict[str, Any] | None] | None = None


def claims_by_name(folder_file: str, suffix: str) -> Callable[[str], bool]:
    """:attr:`Format.claims` of a format whose folders hold ``folder_file`` and whose files end
    with ``suffix``."""

    def claims(path: str) -> bool:
        return os.path.isfile(os.path.join(path, folder_file)) if os.path.isdir(path) else path.endswith(suffix)

    return claims


def flat_only(path: str, subtree: str | None) -> str:
    """``path``, unless a ``subtree`` was asked of a format whose keys are flat."""
    if subtree:
        raise SourceError(
            f"subtree={subtree!r} applies to torch.save files and DCP folders; safetensors keys are "
            f"flat. Select keys with a strip_prefix({subtree + '.'!r}) rule instead",
            path=path,
        )
    return path


def nonempty(path: str) -> str:
    """``path``, unless the file is empty (a :class:`SourceError`)."""
    if os.path.getsize(path) == 0:
        raise SourceError("empty file", path=path)
    return path


class Source(abc.ABC):
    """A checkpoint opened for lazy reading.

    ``schema`` maps each tensor key to its :class:`TensorInfo` (read from headers only);
    ``non_tensor`` lists keys whose values are not tensors (ints, strings...).
    ``read(key, box)`` returns that region; it may be a view of mapped file memory, so
    copy it before the source is closed.

    Beyond ``read``, a source declares what it can do by overriding these methods (the
    defaults say "nothing more"); nobody probes a source for other attributes, and a source
    that wraps another delegates each of them explicitly:

    - :meth:`locate`: the file and byte offset of a tensor stored contiguously;
    - :meth:`locate_region`: the same for storage in chunks (by default the whole tensor, from
      :meth:`locate`);
    - :meth:`files`: every file it reads, for integrity checks (fingerprints);
    - :meth:`file_of`: the file that holds a key, for messages;
    - :meth:`stored_key`: the name the checkpoint itself gives a key (checksums are keyed by it).

    Attributes:
        path: the checkpoint's path.
        schema: ``key -> TensorInfo`` of every tensor.
        non_tensor: keys whose values are not tensors.

    Example::

        with sdadapt.sources.open_source("ckpt/model.safetensors") as src:
            info = src.schema["embed.weight"]
            first_rows = src.read("embed.weight", ((0, 2), (0, info.shape[1]))).clone()
    """

    path: str
    schema: dict[str, TensorInfo]
    non_tensor: list[str]

    @abc.abstractmethod
    def read(self, key: str, box: Box) -> torch.Tensor: ...

    def file_of(self, key: str) -> str:
        """The file that holds ``key`` (for error messages)."""
        return self.path

    def files(self) -> list[str]:
        """Every file the source reads tensor data or headers from (index and metadata files
        included), for fingerprints. Default: ``path`` when it is a file."""
        return [self.path] if os.path.isfile(self.path) else []

    def stored_key(self, key: str) -> str:
        """The name the checkpoint itself gives ``key`` (a DCP subtree adds its prefix)."""
        return key

    def locate(self, key: str) -> TensorLocation | None:
        """Where ``key``'s bytes are, if the source can prove they lie contiguously (row-major)
        in one file: the I/O engine then reads them with ``preadv``. ``None`` (the default):
        read through :meth:`read`."""
        return None

    def locate_region(self, key: str, box: Box) -> list[tuple[Box, TensorLocation]] | None:
        """The stored tensors that hold region ``box`` of ``key``: (its box in ``key``'s global
        coordinates, where its bytes are), one per stored chunk the box intersects; ``None``
        when they cannot all be located (read through :meth:`read`). Default: the whole
        tensor, from :meth:`locate`."""
        loc = self.locate(key)
        return None if loc is None else [(full_box(loc.shape), loc)]

    def region_bytes(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        """The byte ranges ``(file, start, stop)`` that :meth:`read` of region ``box`` reads, for a
        source whose tensors are not stored as plain values (quantized blocks): what an object
        storage source fetches first. ``None`` (the default): those of :meth:`locate_region`."""
        return None

    def remote_url(self) -> str | None:
        """The object storage URL the source was opened from (its bytes are fetched on
        demand: see :meth:`prefetch`); ``None`` (the default) for local files."""
        return None

    def prefetch(self, regions: Sequence[tuple[str, Box | None]], *, engine: bool = False) -> tuple[int, int]:
        """Make the bytes of these ``(key, box)`` regions (``None``: the whole tensor) ready to
        read, in one batch, before a load reads them by their locations. Sources whose bytes are
        local need nothing (the default); one opened from an object storage URL fetches them
        (concurrent ranged requests) into the local file its locations name.

        Args:
            regions: the ``(key, box)`` regions a load will read.
            engine: the I/O engine reads the located regions itself (an object storage source
                then fetches only what locating them and ``read`` need, and probes the rest).

        Returns:
            The bytes fetched and the requests made by this call.
        """
        return 0, 0

    @property
    def kind(self) -> str:
        return type(self).__name__

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{self.kind}({self.path!r}, {len(self.schema)} tensors)"


def member_path(folder: str, name: object, *, what: str, path: str, key: str | None = None, subdirs: bool = True) -> str:
    """``folder/name``, if ``name`` is a plain relative name that stays inside ``folder``: no
    ``..``, no absolute path, no NUL byte, no symlink leading out (and no ``/`` at all unless
    ``subdirs``); in a Hub cache snapshot, links into the repository's ``blobs`` are its files.
    Otherwise a SourceError: ``what`` says who named it ("index names shard")."""
    plain = isinstance(name, str) and bool(name) and "\x00" not in name and not os.path.isabs(name)
    if plain:
        parts = name.replace("\\", "/").split("/")  # type: ignore[union-attr]
        plain = ".." not in parts and "." not in parts and (subdirs or len(parts) == 1)
    if not plain:
        raise SourceError(
            f"{what} {name!r}, which is not a plain file name inside the folder; refusing to read "
            "outside the checkpoint folder",
            path=path,
            key=key,
        )
    full = os.path.join(folder, name)  # type: ignore[arg-type]
    real, real_folder = os.path.realpath(full), os.path.realpath(folder)
    if not _inside(real, real_folder) and not _inside(real, _hub_blobs(real_folder)):
        raise SourceError(
            f"{what} {name!r}, which resolves to {real} outside the checkpoint folder (a symlink?); "
            "refusing to read it",
            path=path,
            key=key,
        )
    return full


def _inside(path: str, folder: str | None) -> bool:
    return folder is not None and os.path.commonpath([path, folder]) == folder


def _hub_blobs(folder: str) -> str | None:
    """The ``blobs`` folder a Hugging Face Hub cache snapshot (``models--org--name/snapshots/<rev>``)
    links its files into, or ``None`` for any other folder."""
    snapshots = os.path.dirname(folder)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or "--" not in os.path.basename(repo):
        return None
    return os.path.join(repo, "blobs")
