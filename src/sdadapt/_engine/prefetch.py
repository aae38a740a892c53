"""Before a load reads: the source regions its jobs need, handed to ``Source.prefetch`` in one
batch (a source opened from an object storage URL fetches what the engine does not fetch
itself, and probes the rest; a local source does nothing)."""

from __future__ import annotations

from collections.abc import Sequence

from .._base.regions import Box
from .._recipes.nodes import Compute, Piece
from ..sources import Source
from .tasks import Job


def regions_of(jobs: Sequence[Job]) -> list[tuple[str, Box | None]]:
    """``(source key, box)`` of every region the jobs' steps read: each piece's region, each
    computation's declared input regions; ``None`` (the whole tensor) for the source tensors
    of an input that is not one stored region, or of a computation that declares none."""
    out: list[tuple[str, Box | None]] = []
    for job in jobs:
        for step in job.node.steps(job.box, job.dest):
            if isinstance(step, Piece):
                out.append((step.key, step.box))
            elif isinstance(step, Compute):
                if not step.inputs:
                    out += [(k, None) for k in step.node.leaves()]
                for inp in step.inputs:
                    if inp.read is not None:
                        out.append((inp.read.key, inp.read.box))
                    else:
                        out += [(k, None) for k in inp.node.leaves()]
    return out


def prefetch(source: Source, jobs: Sequence[Job], engine: bool = False) -> tuple[int, int]:
    """Fetch what ``jobs`` read, if ``source`` fetches at all (``engine``: the engine reads them,
    fetching the located regions itself); (bytes, requests) fetched."""
    if source.remote_url() is None:
        return 0, 0
    return source.prefetch(regions_of(jobs), engine=engine)
