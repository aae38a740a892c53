"""Headers once per job: the first rank reads them, the others receive them in one broadcast.

Opening a checkpoint reads every file's header and the index; on W ranks of a shared filesystem
that is W times every open and every header. :func:`share_headers` has the group's first rank
open the source while recording what it reads (:mod:`sdadapt.sources._headers`) and broadcast
the record, a compact byte string (one broadcast: the same bytes whatever the world size, no
gather); the first rank keeps the source it opened, every other rank opens it from the record,
parsing and validating the bytes exactly as read from disk (:meth:`SharedHeaders.open`): one
header read per file per job, one parse per rank. Each rank still opens the files it reads data
from, and checks the files' size, mtime and inode itself (:mod:`sdadapt.sources._checks`).

A failure cannot hang the group: the first rank broadcasts an empty record when opening fails,
and then every rank opens the source itself and meets the error, which the load's agreed
planning step makes every rank's error (a record that does not decode is read from disk too).
``SDADAPT_HEADERS=every`` turns the broadcast off (every rank reads the headers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._base.distributed import is_distributed
from ..errors import SdadaptError
from ..sources import (
    HeaderRecord,
    Source,
    decode_headers,
    encode_headers,
    open_source,
    recordable,
    recording_headers,
    replaying_headers,
)

log = logging.getLogger(__name__)

ENV = "SDADAPT_HEADERS"


# an internal record: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class SharedHeaders:
    """What :func:`share_headers` gives a rank: the record of the headers the first rank read
    (``None``: this rank reads them itself), and on the first rank the source it opened then."""

    record: HeaderRecord | None = None
    source: Source | None = None

    def open(self, src: str | os.PathLike[str] | Source, subtree: str | None) -> Source:
        """The **open** step of a load: the first rank's source, kept from recording, else ``src``
        opened from the record (or from disk without one); each rank's source is opened once."""
        if self.source is not None:
            source, self.source = self.source, None
            return source
        with replaying_headers(self.record):
            return open_source(src, subtree=subtree)

    def close(self) -> None:
        """Close the first rank's source if no step took it."""
        if self.source is not None:
            self.source.close()
            self.source = None


def share_headers(src: Any, subtree: str | None, group: dist.ProcessGroup | None) -> SharedHeaders:
    """Collective over ``group`` (every rank, at the same point): the record of the headers
    of ``src`` read by the group's first rank, which keeps the source it opened; an empty
    :class:`SharedHeaders` where every rank reads them itself (one process, an open
    :class:`~sdadapt.sources.Source`, a format whose opening reads more than headers and JSON (a
    ``torch.save`` file, a DCP folder: the record would not hold it), ``SDADAPT_HEADERS=every``,
    or a first rank that could not open it)."""
    mode = os.environ.get(ENV, "once")
    if mode not in ("once", "every"):
        from ..errors import UsageError

        raise UsageError(f"{ENV}={mode!r}: use 'once' (one rank reads the headers) or 'every'")
    if not is_distributed() or not recordable(src) or mode == "every" or dist.get_world_size(group) == 1:
        return SharedHeaders()
    payload = b""
    kept: Source | None = None
    if dist.get_rank(group) == 0:
        try:
            with recording_headers() as record:
                kept = open_source(src, subtree=subtree)
            payload = encode_headers(record)
        except Exception as e:  # noqa: BLE001 - every rank opens it itself and meets the error, agreed
            log.debug("reading the headers for the group failed (every rank reads them): %s", e)
    obj: list[Any] = [payload]
    root = dist.get_global_rank(group, 0) if group is not None else 0
    try:
        dist.broadcast_object_list(obj, src=root, group=group)
    except BaseException:
        if kept is not None:
            kept.close()
        raise
    received = obj[0]
    if kept is not None:
        return SharedHeaders(None, kept)  # the first rank's source: nothing to replay
    if not isinstance(received, bytes) or not received:
        return SharedHeaders()
    try:
        return SharedHeaders(decode_headers(received))
    except SdadaptError as e:
        log.warning("%s; reading the headers here instead", e)
        return SharedHeaders()

