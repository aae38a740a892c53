"""Object bytes fetched straight into memory: the hot path of a load from object storage.

The I/O engine reads a region it can locate in a mirror file (:mod:`._object_store`) with
:meth:`ObjectFile.read_into` instead of ``preadv``: ranged GETs whose bodies are copied into the
memory the engine hands over (its staging buffer, pinned on a GPU, or the destination itself),
never into the mirror file. Runs of one read less than ``gap`` bytes apart share one request.

How large the requests are and how many are in flight is chosen from what the first requests
measured (:func:`measured`, :func:`choose`): every request so far (the headers fetched when the
checkpoint was opened, and the probes made before a load writes: the first bytes of each object a
rank reads, :meth:`Remote.probe`) gives the latency ``L``, the median time to an answer's first
byte; the bodies of at least :data:`SMALL` bytes give one stream's rate ``B``. Then

- request size ``R = 4 * L * B`` rounded up to a power of two, 1 to 64 MiB: the latency is then
  at most a fifth of a request's time;
- requests in flight ``C = GOAL / B`` rounded up, 4 to 64: enough streams for :data:`GOAL`
  bytes per second at the measured rate;
- a rank whose share is less than ``C * R`` takes smaller requests so that every stream has
  work (``R`` at most ``share / C`` rounded down to a power of two, at least 1 MiB), and no
  more streams than requests (``C`` at most ``share / R``).

Without measurements (a rank reading less than :data:`SMALL` bytes from each object) the
defaults are 8 MiB and 16. ``EngineConfig.remote_request_bytes`` / ``remote_concurrency``
(``SDADAPT_IO_REMOTE_REQUEST_MB`` / ``SDADAPT_IO_REMOTE_CONCURRENCY``) replace either choice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._object_store import Remote

MiB = 1 << 20
SMALL = 64 << 10
"""Bodies of at least this many bytes measure a stream's rate."""
GOAL = 4 << 30
"""The rate (bytes per second) the number of requests in flight is chosen for."""
PROBE = 1 << 20
"""The largest probe (the first bytes a rank reads from an object, kept for the engine)."""
DEFAULT_REQUEST = 8 * MiB
DEFAULT_CONCURRENCY = 16


@dataclass(frozen=True)
class Fetching:
    """How a load fetches from object storage (:func:`choose`): the size of one request, how
    many are in flight, and the measurements they came from (``None``: not measured)."""

    request_bytes: int
    concurrency: int
    latency: float | None = None
    stream_rate: float | None = None


def choose(latency: float | None, stream_rate: float | None, share: int) -> Fetching:
    """The request size and the requests in flight for a rank fetching ``share`` bytes, given the
    measured latency (seconds) and one stream's rate (bytes per second); see the module docstring."""
    if latency is None or stream_rate is None:
        request, streams = DEFAULT_REQUEST, DEFAULT_CONCURRENCY
    else:
        request = min(64 * MiB, max(MiB, _pow2(4 * latency * stream_rate, up=True)))
        streams = min(64, max(4, math.ceil(GOAL / stream_rate)))
    if share <= 0:
        return Fetching(request, 1, latency, stream_rate)
    request = max(MiB, min(request, _pow2(share / streams, up=False)))  # every stream has work
    return Fetching(request, max(1, min(streams, math.ceil(share / request))), latency, stream_rate)


def _pow2(x: float, up: bool) -> int:
    """The power of two at or above (``up``) or at or below ``x`` (at least 1)."""
    if x <= 1:
        return 1
    e = math.log2(x)
    return 1 << int(math.ceil(e) if up else math.floor(e))


def measured(remote: Remote) -> tuple[float | None, float | None]:
    """(latency, one stream's rate) from the requests ``remote`` timed so far: the median time
    to an answer's first byte, and the bytes of the bodies of at least :data:`SMALL` bytes over
    the time they took."""
    times = remote.timings
    latency = statistics.median(t for _, t, _ in times) if times else None
    large = [(n, body) for n, _, body in times if n >= SMALL]
    seconds = sum(body for _, body in large)
    return latency, (sum(n for n, _ in large) / seconds if large and seconds > 0 else None)


class ObjectFile:
    """One object of a :class:`Remote` read by the engine: ranges fetched into memory."""

    def __init__(self, remote: Remote, name: str):
        self.remote = remote
        self.name = name

    def read_into(self, segments: Sequence[tuple[int, int]], mem: torch.Tensor, pos: int, gap: int) -> tuple[int, int]:
        """Fetch ``segments`` (offset, nbytes) of the object packed one after the other into the
        uint8 CPU tensor ``mem`` from byte ``pos`` on; segments at most ``gap`` bytes apart share
        one request, bytes a probe fetched are taken from it. Returns (requests, bytes fetched).
        Raises SourceError naming the object's URL."""
        requests = fetched = 0
        at = pos
        i = 0
        while i < len(segments):
            j = i + 1
            while j < len(segments) and segments[j][0] - (segments[j - 1][0] + segments[j - 1][1]) <= gap:
                j += 1
            start, stop = segments[i][0], segments[j - 1][0] + segments[j - 1][1]
            blocks, made, got = self._span(start, stop)
            requests += made
            fetched += got
            for off, n in segments[i:j]:
                _copy_out(blocks, off, n, mem, at)
                at += n
            i = j
        return requests, fetched

    def _span(self, start: int, stop: int) -> tuple[list[tuple[int, int, Any]], int, int]:
        """Bytes ``[start, stop)`` as blocks (start, stop, data): what a probe kept, the rest
        fetched (one request per uncovered part)."""
        kept = self.remote.kept_blocks(self.name, start, stop)
        blocks = list(kept)
        pos = start
        requests = fetched = 0
        for a, b, _ in [*sorted(kept, key=lambda k: k[0]), (stop, stop, None)]:
            if a > pos:
                blocks.append((pos, a, self.remote.get_range(self.name, pos, a)))
                requests += 1
                fetched += a - pos
            pos = max(pos, b)
        return blocks, requests, fetched


def _copy_out(blocks: list[tuple[int, int, Any]], off: int, n: int, mem: torch.Tensor, at: int) -> None:
    """Object bytes ``[off, off + n)`` from ``blocks`` into ``mem[at : at + n]``."""
    end = off + n
    for a, b, data in blocks:
        lo, hi = max(a, off), min(b, end)
        if hi > lo:
            src = torch.frombuffer(data, dtype=torch.uint8, count=hi - lo, offset=lo - a)
            mem[at + lo - off : at + hi - off].copy_(src)


def _quiet_frombuffer() -> None:
    """torch warns once per process that a read-only buffer (a response body) makes a tensor
    that could write to it; the engine only reads from it: that one warning is used up here."""
    import warnings  # noqa: PLC0415 - once

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_quiet_frombuffer()
