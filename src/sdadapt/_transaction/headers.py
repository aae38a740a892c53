"""Headers once per job: the first rank reads them, the others receive them in one broadcast.

Opening a checkpoint reads every file's header and the index; on W ranks of a shared filesystem
that is W times every open and every header. :func:`share_headers` has the group's first rank
open the source while recording what it reads (:mod:`sdadapt.sources._headers`) and broadcast
the record, a compact byte string (one broadcast: the same bytes whatever the world size, no
gather); every rank, the first included, then opens the source from the record, parsing and
validating the bytes exactly as read from disk. Each rank still opens the files it reads data
from, and checks the files' size, mtime and inode itself (:mod:`sdadapt.sources._integrity`).

A failure cannot hang the group: the first rank broadcasts an empty record when opening fails,
and then every rank opens the source itself and meets the error, which the load's agreed
planning step makes every rank's error (a record that does not decode is read from disk too).
``SDADAPT_HEADERS=every`` turns the broadcast off (every rank reads the headers).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from .._base.distributed import is_distributed
from ..errors import SdadaptError
from ..sources import HeaderRecord, Source, decode_headers, encode_headers, open_source, recording_headers

log = logging.getLogger(__name__)

ENV = "SDADAPT_HEADERS"


def share_headers(src: Any, subtree: str | None, group: dist.ProcessGroup | None) -> HeaderRecord | None:
    """Collective over ``group`` (every rank, at the same point): the record of the headers
    of ``src`` read by the group's first rank, or ``None`` where every rank reads them itself
    (one process, an open :class:`~sdadapt.sources.Source`, a format whose opening reads more
    than headers and JSON (a ``torch.save`` file, a DCP folder: the record would not hold it),
    ``SDADAPT_HEADERS=every``, or a first rank that could not open it)."""
    mode = os.environ.get(ENV, "once")
    if mode not in ("once", "every"):
        from ..errors import UsageError

        raise UsageError(f"{ENV}={mode!r}: use 'once' (one rank reads the headers) or 'every'")
    if not is_distributed() or not _recordable(src) or mode == "every" or dist.get_world_size(group) == 1:
        return None
    payload = b""
    if dist.get_rank(group) == 0:
        try:
            with recording_headers() as record:
                open_source(src, subtree=subtree).close()
            payload = encode_headers(record)
        except Exception as e:  # noqa: BLE001 - every rank opens it itself and meets the error, agreed
            log.debug("reading the headers for the group failed (every rank reads them): %s", e)
    obj: list[Any] = [payload]
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(obj, src=root, group=group)
    received = obj[0]
    if not isinstance(received, bytes) or not received:
        return None
    try:
        return decode_headers(received)
    except SdadaptError as e:
        log.warning("%s; reading the headers here instead", e)
        return None


def _recordable(src: Any) -> bool:
    """Whether opening ``src`` reads only what a record holds: safetensors headers and JSON."""
    if isinstance(src, Source) or not isinstance(src, (str, os.PathLike)):
        return False
    p = os.fspath(src)
    if os.path.isdir(p):
        return os.path.isfile(os.path.join(p, "model.safetensors.index.json")) or os.path.isfile(os.path.join(p, "model.safetensors"))
    return p.endswith((".safetensors", ".index.json"))

