"""Checkpoints at object storage URLs as sources: the headers fetched when opened, tensor bytes
fetched for the regions asked for (see :mod:`._object_store` for the mirror and the fetching).

:func:`remote_root` turns a URL into its local mirror (one :class:`Remote` per URL and process,
checked against a fresh listing each time: a changed object gives a new mirror), after fetching
what the local source classes read when they open a checkpoint: whole side files (``*.json``,
DCP ``.metadata``, tokenizers...), each safetensors file's 8-byte length and header, a
``torch.save`` file's zip directory, local record headers and pickle. :func:`attach` turns the
local source opened on a mirror into a remote one (same class, so every caller that knows the
local class keeps working) whose ``read``, ``read_object`` and DCP chunk locating fetch their
bytes first, and whose :meth:`RemoteReads.prefetch` fetches a whole plan's regions in one
concurrent batch before the I/O engine reads them from the mirror.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._base.regions import Box, full_box
from ..errors import SdadaptError
from ._base import Source
from ._formats import format_of_name
from ._object_store import Remote

if TYPE_CHECKING:
    from ._fetching import Fetching, ObjectFile

_MAX_RUNS = 4096  # a region cut into more runs than this is fetched as the span covering them

_remotes: dict[tuple[str, str], Remote] = {}
_by_root: dict[str, Remote] = {}
_lock = threading.Lock()


def remote_root(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The local path standing for ``url`` (its mirror folder, or the mirror file of the one
    object it names), its headers fetched. Raises SourceError naming the URL."""
    # the same URL through another endpoint or other credentials is another mirror (in memory only)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "SDADAPT_REMOTE_")))
    ident = (url.rstrip("/"), repr((sorted((storage_options or {}).items()), env)))
    with _lock:
        old = _remotes.get(ident)
    fresh = Remote(url, storage_options, old.settings if old is not None else None)
    if old is not None and old.objects == fresh.objects:
        fresh.close()
        return old.local_root
    try:
        _fetch_headers(fresh)
    except BaseException:
        fresh.close()
        raise
    with _lock:
        _remotes[ident] = fresh
        _by_root[os.path.realpath(fresh.root)] = fresh
    return fresh.local_root


def remote_of(path: str) -> Remote | None:
    """The :class:`Remote` whose mirror holds the local ``path``, if any."""
    real = os.path.realpath(path)
    with _lock:
        for root, remote in _by_root.items():
            if real == root or real.startswith(root + os.sep):
                return remote
    return None


def object_file(path: str) -> ObjectFile | None:
    """The object a mirror file stands for, read by the engine straight into memory
    (:meth:`ObjectFile.read_into`); ``None`` for a local file."""
    remote = remote_of(path)
    name = remote.name_of(path) if remote is not None else None
    if remote is None or name is None:
        return None
    from ._fetching import ObjectFile  # noqa: PLC0415 - object storage loads only

    return ObjectFile(remote, name)


def fetching_for(
    source: Source, share: int, request_bytes: int | None = None, concurrency: int | None = None
) -> Fetching | None:
    """How the engine fetches ``share`` bytes of ``source`` (:func:`._fetching.choose`, from what
    its first requests measured; ``request_bytes`` / ``concurrency`` replace the choice);
    ``None`` for a source of local files."""
    if source.remote_url() is None:
        return None
    from ._fetching import choose, measured  # noqa: PLC0415 - object storage loads only

    remote = remote_of(source.path)
    latency, rate = measured(remote) if remote is not None else (None, None)
    chosen = choose(latency, rate, share)
    if request_bytes is None and concurrency is None:
        return chosen
    return dataclasses.replace(chosen, request_bytes=request_bytes or chosen.request_bytes, concurrency=concurrency or chosen.concurrency)


def fetch_all(path: str) -> None:
    """Fetch every object of the mirror holding ``path`` whole (for readers other than sdadapt's
    own, such as ``from_pretrained``, which would see zeros where nothing was fetched)."""
    remote = remote_of(path)
    if remote is not None:
        remote.fetch_whole(remote.objects)


def fetch_dcp_entries(folder: str, names: list[str]) -> None:
    """Fetch the stored items of the DCP entries ``names`` (and everything under ``name.``) of a
    mirrored DCP folder, for DCP's own ``FileSystemReader`` (extra state of ``load_state``)."""
    remote = remote_of(folder)
    if remote is None:
        return
    from ._dcp_dir import read_dcp_metadata  # noqa: PLC0415 - DCP folders only

    md = read_dcp_metadata(folder)
    ranges = []
    for index, info in md.storage_data.items():
        if any(index.fqn == n or index.fqn.startswith(n + ".") for n in names):
            ranges.append((info.relative_path, info.offset, info.offset + info.length))
    remote.fetch(ranges)


def _fetch_headers(remote: Remote) -> None:
    """Fetch what opening the checkpoint reads (see the module docstring): each file's header
    ranges as its format declares them (:data:`sdadapt.sources._formats.FORMATS`), all files'
    steps in lockstep so that every step is one concurrent batch; files no format claims (JSON,
    DCP ``.metadata``, tokenizers...) whole."""
    names = sorted(remote.objects)
    sizes = {n: remote.objects[n][0] for n in names}
    batch: list[tuple[str, int, int]] = []
    steps: list[tuple[str, Iterator[list[tuple[int, int]]]]] = []
    for n in names:
        fmt = format_of_name(n, single=remote.single == n)
        if fmt is None:
            batch.append((n, 0, sizes[n]))
        elif fmt.header_ranges is not None:
            steps.append((n, fmt.header_ranges(remote.local(n), sizes[n])))
    while steps or batch:
        going = []
        for n, step in steps:
            ranges = next(step, None)
            if ranges is not None:
                batch += [(n, a, b) for a, b in ranges]
                going.append((n, step))
        remote.fetch(batch)
        steps, batch = going, []


def box_runs(shape: tuple[int, ...], itemsize: int, box: Box) -> list[tuple[int, int]]:
    """Region ``box`` of a row-major tensor of ``shape`` as (byte offset, nbytes) runs, in
    order; more than ``_MAX_RUNS`` runs become the one span that covers them."""
    if any(b <= a for a, b in box):
        return []
    d = len(shape)
    inner = itemsize
    while d > 0 and box[d - 1] == (0, shape[d - 1]):  # trailing whole dims are contiguous
        d -= 1
        inner *= shape[d]
    if d == 0:
        return [(0, inner)]
    run = (box[d - 1][1] - box[d - 1][0]) * inner
    strides = [0] * d
    acc = inner * shape[d - 1]
    for i in range(d - 2, -1, -1):
        strides[i] = acc
        acc *= shape[i]
    outer = box[: d - 1]
    count = math.prod(b - a for a, b in outer)
    base = box[d - 1][0] * inner
    if count > _MAX_RUNS:
        first = base + sum(a * s for (a, _), s in zip(outer, strides, strict=False))
        last = base + sum((b - 1) * s for (_, b), s in zip(outer, strides, strict=False)) + run
        return [(first, last - first)]
    starts = [base]
    for (a, b), s in zip(outer, strides, strict=False):
        starts = [p + i * s for p in starts for i in range(a, b)]
    return [(p, run) for p in sorted(starts)]


_ZIP_END = 8192  # of a DCP item (a small torch.save zip): its pickle and first local header, its directory


def _zip_ends(items: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The first and last ``_ZIP_END`` bytes of each DCP item: what locating its tensor's raw
    bytes reads (``torch.save`` writes ``data.pkl`` and the storage record's header first, the
    small records and the zip directory last); an item whose bytes then cannot be located is
    fetched whole by :meth:`RemoteReads._ranges`."""
    out = []
    for name, start, stop in items:
        out += [(name, start, min(stop, start + _ZIP_END)), (name, max(start, stop - _ZIP_END), stop)]
    return out


class RemoteReads:
    """What a source opened on a mirror adds (mixed into its own class by :func:`attach`)."""

    __slots__ = ()  # the same layout as the class it is mixed into (``__class__`` is swapped)
    remote: Remote

    def prefetch(self, regions: Sequence[tuple[str, Box | None]], *, engine: bool = False) -> tuple[int, int]:
        """Fetch the bytes of every ``(key, box)`` region (``None``: the whole tensor) in one
        concurrent batch (see :meth:`Remote.fetch`). ``engine``: the regions the I/O engine
        reads by their locations are left to it (it fetches them straight into memory:
        :mod:`._fetching`); they are only checked against the objects' sizes and probed (the
        first bytes of each object, timed and kept: :meth:`Remote.probe`)."""
        src: Any = self
        remote = self.remote
        before = remote.fetched_bytes, remote.requests
        boxes = [(k, b if b is not None else full_box(src.schema[k].shape)) for k, b in regions if k in src.schema]
        ends: list[tuple[str, int, int]] = []
        for key, box in boxes:  # a DCP folder: every chunk's zip records in one batch first
            ends += _zip_ends(self._item_ranges(key, box) or [])
        remote.fetch(ends)
        mirrored: list[tuple[str, int, int]] = []
        direct: list[tuple[str, int, int]] = []
        for key, box in boxes:
            ranges, located = self._ranges(key, box)
            (direct if engine and located else mirrored).extend(ranges)
        remote.fetch(mirrored)
        if direct:
            from ._fetching import PROBE  # noqa: PLC0415 - object storage loads only

            remote.check_ranges(direct)
            remote.probe(direct, PROBE)
        return remote.fetched_bytes - before[0], remote.requests - before[1]

    def _ranges(self, key: str, box: Box) -> tuple[list[tuple[str, int, int]], bool]:
        """The object ranges region ``box`` of ``key`` reads, and whether they are its located
        bytes (which the engine reads by location) rather than what ``Source.read`` reads."""
        src: Any = self
        remote = self.remote
        items = self._item_ranges(key, box)
        if items is not None:
            remote.fetch(_zip_ends(items))  # a DCP chunk is located by reading its own zip records
        own = src.region_bytes(key, box)
        if own is not None:
            return [(name, a, b) for path, a, b in own if (name := remote.name_of(path)) is not None], False
        located = src._located_region(key, box)
        if located is None:
            if items is not None:
                return items, False
            name = remote.name_of(src.file_of(key))
            return ([(name, 0, remote.objects[name][0])] if name is not None else []), False
        out = []
        for chunk_box, loc in located:
            name = remote.name_of(loc.path)
            if name is None:
                continue
            local = tuple((max(a, o) - o, min(b, e) - o) for (a, b), (o, e) in zip(box, chunk_box, strict=True))
            out += [(name, loc.offset + s, loc.offset + s + n) for s, n in box_runs(loc.shape, loc.dtype.itemsize, local)]
        return out, True

    def _item_ranges(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        """For a DCP folder: the byte ranges of the stored items (chunks) that hold ``box``."""
        src: Any = self
        if not hasattr(src, "_intersecting") or key not in getattr(src, "_entries", {}):
            return None
        from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: PLC0415 - DCP folders only

        out = []
        for idx, _ in src._intersecting(key, box):
            md = src._entries[key]
            info = src.metadata.storage_data.get(MetadataIndex(src._prefix + key, md.chunks[idx].offsets, idx))
            if info is not None:
                out.append((info.relative_path, info.offset, info.offset + info.length))
        return out


def attach(source: Source, path: str) -> Source:
    """``source`` (opened on ``path``) as a remote source when ``path`` lies in a mirror."""
    remote = remote_of(path)
    if remote is None or isinstance(source, RemoteReads):
        return source
    source.__class__ = _remote_class(type(source))
    source.remote = remote  # type: ignore[attr-defined]
    return source


_classes: dict[type, type] = {}


def _remote_class(cls: type) -> type:
    """``cls`` with :class:`RemoteReads` mixed in: the reads that go through the source (not
    through byte locations) fetch their bytes first."""
    made = _classes.get(cls)
    if made is not None:
        return made
    base: Any = cls

    def read(self: Any, key: str, box: Box) -> torch.Tensor:
        self.prefetch([(key, box)])
        return base.read(self, key, box)

    def locate_region(self: Any, key: str, box: Box) -> Any:
        items = self._item_ranges(key, box)
        if items:
            self.remote.fetch(_zip_ends(items))
        return base.locate_region(self, key, box)

    def located_region(self: Any, key: str, box: Box) -> Any:
        return base.locate_region(self, key, box)

    def read_object(self: Any, key: str) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: PLC0415 - DCP folders only

        info = self.metadata.storage_data.get(MetadataIndex(self._prefix + key))
        if info is not None:
            self.remote.fetch([(info.relative_path, info.offset, info.offset + info.length)])
        return base.read_object(self, key)

    def kind(self: Any) -> str:
        return cls.__name__

    def repr_(self: Any) -> str:
        return f"{cls.__name__}({self.remote.url!r}, {len(self.schema)} tensors)"

    def remote_url(self: Any) -> str:
        return str(self.remote.url)

    body: dict[str, Any] = {
        "prefetch": RemoteReads.prefetch,  # before the local class's default, which does nothing
        "remote_url": remote_url,
        "read": read,
        "locate_region": locate_region,
        "_located_region": located_region,
        "kind": property(kind),
        "__repr__": repr_,
        "__module__": __name__,
        "__slots__": (),
    }
    if hasattr(cls, "read_object"):
        body["read_object"] = read_object
    made = _classes[cls] = type(f"Remote{cls.__name__}", (cls, RemoteReads), body)
    return made


def in_urls(error: SdadaptError) -> SdadaptError:
    """``error`` with every mirror path in its message (and ``path``) written as its URL."""
    with _lock:
        remotes = list(_by_root.values())
    text = str(error)
    for remote in remotes:
        if remote.root in text:
            text = text.replace(remote.local_root, remote.url).replace(remote.root, remote.url)
    if text == str(error):
        return error
    new = copy.copy(error)
    new.args = (text,)
    path = getattr(error, "path", None)
    owner = remote_of(path) if isinstance(path, str) else None
    if owner is not None and isinstance(path, str):
        new.path = owner.url_of(path)  # type: ignore[attr-defined]
    return new


__all__ = [
    "attach", "box_runs", "fetch_all", "fetch_dcp_entries", "fetching_for", "in_urls", "object_file", "remote_of", "remote_root",
]  # fmt: skip
