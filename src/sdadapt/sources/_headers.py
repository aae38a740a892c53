"""Headers read once: the bytes a source's opening reads from its files, recorded and replayed.

Opening a checkpoint reads its headers: each safetensors file's header, the index, a config.
On W ranks of a shared filesystem that is W times every file opened and every header read. One
rank can instead open the source while :func:`recording`: every header and JSON file it reads
is kept as the bytes read (and the file's size); :func:`encode` packs them into one compact
byte string to broadcast. The other ranks open the same source while :func:`replaying` the
record: the readers (:func:`sdadapt.sources._safetensors_file.read_header`,
:func:`sdadapt.sources._json.read_bytes`) take a recorded file's bytes instead of opening it,
and parse and validate them exactly as bytes read from disk. A file not in the record (another
path, another format) is read from disk as always.
"""

from __future__ import annotations

import contextlib
import contextvars
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import SourceError

_MAGIC = b"SDADAPT-HEADERS-1\n"


@dataclass
class HeaderRecord:
    """Path -> (the bytes read from the file's start, the file's size), in the order read."""

    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The header bytes the record holds (what a rank reading them itself reads)."""
        return sum(len(data) for data, _ in self.files.values())


# an internal record: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class _Active:
    record: HeaderRecord
    replay: bool


_active: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("sdadapt_headers", default=None)


@contextlib.contextmanager
def recording() -> Iterator[HeaderRecord]:
    """Inside the block, every header and JSON file the sources read is added to the record."""
    record = HeaderRecord()
    token = _active.set(_Active(record, replay=False))
    try:
        yield record
    finally:
        _active.reset(token)


@contextlib.contextmanager
def replaying(record: HeaderRecord | None) -> Iterator[None]:
    """Inside the block, the sources take the recorded files' bytes instead of reading them
    (``None``: everything is read from disk)."""
    if record is None:
        yield
        return
    token = _active.set(_Active(record, replay=True))
    try:
        yield
    finally:
        _active.reset(token)


def recorded(path: str) -> tuple[bytes, int] | None:
    """The recorded bytes and size of ``path`` while replaying, else ``None`` (read it)."""
    act = _active.get()
    return act.record.files.get(path) if act is not None and act.replay else None


def note(path: str, data: bytes, size: int) -> None:
    """Record that opening a source read ``data`` from the start of ``path`` (``size`` bytes long)."""
    act = _active.get()
    if act is not None and not act.replay:
        act.record.files[path] = (data, size)


def encode(record: HeaderRecord) -> bytes:
    """The record as one byte string: a magic line, then per file its path, size and bytes."""
    out = [_MAGIC, struct.pack("<Q", len(record.files))]
    for path, (data, size) in record.files.items():
        raw = path.encode("utf-8", "surrogateescape")
        out += [struct.pack("<QQQ", len(raw), size, len(data)), raw, data]
    return b"".join(out)


def decode(payload: bytes) -> HeaderRecord:
    """:func:`encode`'s output back as a record; a malformed payload is a :class:`SourceError`."""
    if not payload.startswith(_MAGIC):
        raise SourceError("the headers received from the first rank are not sdadapt's record", path="(broadcast)")
    pos = len(_MAGIC)
    try:
        (count,) = struct.unpack_from("<Q", payload, pos)
        pos += 8
        record = HeaderRecord()
        for _ in range(count):
            n_path, size, n_data = struct.unpack_from("<QQQ", payload, pos)
            pos += 24
            if pos + n_path + n_data > len(payload) or n_data > size:
                raise ValueError("an entry runs past the end")
            path = payload[pos : pos + n_path].decode("utf-8", "surrogateescape")
            pos += n_path
            record.files[path] = (payload[pos : pos + n_data], size)
            pos += n_data
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"the headers received from the first rank are truncated or corrupt ({e})", path="(broadcast)") from None
    if pos != len(payload):
        raise SourceError("the headers received from the first rank have trailing bytes", path="(broadcast)")
    return record
