"""What the engine is asked (jobs) and what its threads do (tasks): one small dataclass per
kind of task, run by :class:`~sdadapt._engine.workers.Worker` according to its type.

They hold tensors, so they get no generated ``__eq__`` or ``__repr__`` (``eq=False, repr=False``):
a tensor's ``==`` is no truth value and its repr no help, and every generated method costs the
module's import an ``exec``; :class:`Where`, the error messages' part, keeps its repr."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._base.regions import Box
from .._recipes.nodes import Compute, Fill, Node, Piece
from ..errors import LoadError


@dataclass(eq=False, repr=False)
class Job:
    """One ReadItem: fill ``dest`` with region ``box`` of target ``key`` made by ``node``."""

    key: str
    node: Node
    box: Box
    dest: torch.Tensor


@dataclass(eq=False)
class Where:
    """What a task is about, for error messages: target key, source key, file(s), region."""

    target: str
    source_key: str | None
    path: str | None
    box: Box

    def error(self, e: Exception) -> LoadError:
        """``e`` as a :class:`LoadError` naming the target key, the source key and the file."""
        if isinstance(e, LoadError):
            return e
        src = f"source key {self.source_key!r} in {self.path}" if self.source_key else f"from {self.path}"
        err = LoadError(f"key {self.target!r} ({src}): reading {list(self.box)} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err


@dataclass(eq=False, repr=False)
class Gather:
    """A computation whose inputs are gathered on the destination's device: staged reads
    deliver their bytes into one device buffer of ``nbytes`` (the device lane makes it on the
    first delivery), each input at its place in ``layout`` (byte offset, dtype, shape, in the
    order of the kernel's arguments), and once all ``pieces`` deliveries have crossed, the lane
    runs ``step.kernel.run(step.dest, *inputs)`` there."""

    step: Compute
    nbytes: int
    layout: list[tuple[int, torch.dtype, tuple[int, ...]]]
    pieces: int = 0
    # the device lane's bookkeeping
    arrived: int = 0
    buffer: torch.Tensor | None = None
    stream: int = 0


@dataclass(eq=False, repr=False)
class Delivery:
    """``staging[offset : offset + nbytes]`` viewed as ``dtype``/``shape`` goes into ``dest``;
    with ``into`` = (gather, at), the bytes go to offset ``at`` of the gather's device buffer
    instead (``dest`` is then the computation's destination: where the buffer lives)."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dest: torch.Tensor
    where: Where
    into: tuple[Gather, int] | None = None


@dataclass(eq=False, repr=False)
class DirectRead:
    """File ``path``'s ``segments`` (offset, nbytes), packed in order, read straight into
    ``dest`` (the contiguous destination's bytes, a uint8 view)."""

    path: str
    segments: list[tuple[int, int]]
    dest: torch.Tensor
    where: Where


@dataclass(eq=False, repr=False)
class GatherRead:
    """A gather's inputs read by kvikio straight into one buffer on the device: ``runs`` holds,
    per input, its file, its (offset, nbytes) runs in order and its offset in the buffer
    (:class:`Gather`'s ``layout``); the kernel runs once every read has ended
    (:class:`~sdadapt._engine.devread.GatherReads`)."""

    gather: Gather
    runs: list[tuple[str, list[tuple[int, int]], int]]
    where: Where


@dataclass(eq=False, repr=False)
class StagedRead:
    """File ``path``'s ``segments`` read into a staging buffer, then copied out by ``deliveries``
    (several when small adjacent reads were coalesced into one)."""

    path: str
    segments: list[tuple[int, int]]
    deliveries: list[Delivery]
    where: Where


@dataclass(eq=False, repr=False)
class SourceRead:
    """A piece read through ``Source.read`` (storage without byte locations, or a strided copy
    out of the source's mapping) and copied into its destination."""

    piece: Piece
    where: Where


@dataclass(eq=False, repr=False)
class ComputeTask:
    """A computation step of a recipe, run against the thread's ``SourceIO``; ``files``: the
    files its leaves are in (opened before any thread sees the task, so that the thread may
    read its inputs with ``preadv``)."""

    step: Compute
    where: Where
    files: tuple[str, ...] = ()


@dataclass(eq=False, repr=False)
class FillTask:
    """A fill step of a recipe."""

    step: Fill
    where: Where


Task = DirectRead | GatherRead | StagedRead | SourceRead | ComputeTask | FillTask


def task_bytes(task: Task) -> int:
    """The destination bytes ``task`` writes (for progress): a gathered input counts in its
    computation, not where it lands."""
    match task:
        case DirectRead():
            dests = [task.dest]
        case GatherRead():
            dests = [task.gather.step.dest]
        case StagedRead():
            dests = [d.dest for d in task.deliveries if d.into is None]
        case SourceRead():
            dests = [task.piece.dest]
        case ComputeTask() | FillTask():
            dests = [task.step.dest]
    return sum(d.numel() * d.element_size() for d in dests)


def task_paths(task: Task) -> tuple[str, ...]:
    """The files a task may read with ``preadv`` (opened before any thread sees the task)."""
    if isinstance(task, (DirectRead, StagedRead)):
        return (task.path,)
    return task.files if isinstance(task, ComputeTask) else ()
