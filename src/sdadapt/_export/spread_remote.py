"""``export(..., format="safetensors")`` to an object storage URL from every rank: each file is
uploaded by one rank, which receives the bytes of it the other ranks hold, window by window;
the index and side files come last, from rank 0, once every file is complete.

Why files, not byte ranges: an object has one writer. S3's multipart upload would let several
processes upload parts of one object, but every part except the last must be >= 5 MiB, the
ranks' byte ranges interleave far finer than that (a column shard is one run per row), and the
client (obstore) hands out no upload of one process to another. So the layout of
:mod:`.spread` is kept (the ordinary HF folder: whole tensors, each in one file), the files are
cut to about ``total / world`` bytes each (never above ``max_shard_size``) and dealt to the
ranks (largest first, to the least loaded; a tie to the rank holding most of the file), and
each owner streams its files front to back through one multipart upload each
(:class:`~sdadapt.sources.ObjectWriter`, parts of 8 MiB). The bytes travel in rounds: in
round ``r`` each owner takes window ``r`` of its files (:data:`WINDOW_BYTES`, a whole number of
parts), every rank sends it the runs of its own regions that fall inside (one ``all_to_all`` of
counts, one of offsets, one of bytes), and the owner hands the bytes received, in file order, to
its upload without copying them; before the next round it waits for that window's parts to be
uploaded, which releases them. A round whose bytes to send exceed :data:`SEND_BYTES` on some rank
(a rank holding most of several owners' next windows) is sent in steps of at most that many
bytes per rank, each received behind the one before in the window. So a rank holds its own
shards, at most :data:`SEND_BYTES` it sends and one window it receives (:data:`BUCKET_BYTES` in
all): never a tensor it does not own. Outputs computed across shards are gathered as
:mod:`.spread` gathers them and kept only by the owner of their file.

Faults: a rank that fails (an upload refused, a read) says so in the next round's counts, every
rank stops after that round, and every rank raises; the uploads left unfinished leave no object,
the files a rank completed are deleted again, and the index is never written. A destination
that held a checkpoint (``overwrite=True``) lost its index and ``.metadata`` first, so it never
looks complete with a mix of old and new files.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._base.distributed import agree, collective_device, gather_objects
from .._base.regions import Box, full_box
from .._base.schema import TensorInfo
from .._base.tensor_bytes import tensor_bytes
from .._recipes.nodes import Node
from ..errors import ExportError, SdadaptError
from ..sources import INDEX_NAME, ObjectWriter, StreamedChecksums, Uploader, write_checksums_data
from .export_local import _Reads
from .spread import SpreadJob, byte_runs, plan_spread
from .writers import parse_size
from .writers.safetensors_writer import FileLayout, index_json

log = logging.getLogger(__name__)

BUCKET_BYTES = 32 << 20
"""What a rank's exchange holds beyond its shards: half for the bytes it sends at once, half
for the window of a file it receives (the next round's bytes are packed while the window's parts
upload)."""
WINDOW_BYTES = BUCKET_BYTES // 2
"""Bytes of one file an owner receives per round (rounded up to whole parts: :func:`windows`)."""
SEND_BYTES = BUCKET_BYTES // 2
"""The most bytes a rank sends in one exchange (its send buffer): a round with more is sent in
steps (:func:`steps_of`)."""
MIN_FILE_BYTES = 64 << 20
"""Files are cut to ``total / world`` bytes, but not below this (small files: one rank)."""


def owners(files: list[FileLayout], held: torch.Tensor) -> list[int]:
    """The rank uploading each file: largest first, to the least loaded rank; a tie to the rank
    that holds most of the file (``held[rank, file]``: its bytes there)."""
    world = held.shape[0]
    load = [0] * world
    out = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        r = min(range(world), key=lambda r: (load[r], -int(held[r, i]), r))
        out[i] = r
        load[r] += files[i].size
    return out


@dataclass
class _Mine:
    """This rank's bytes of one file in file order: ``(offset, length, piece, offset in the
    piece's bytes)``, consumed window by window."""

    runs: list[tuple[int, int, int, int]] = field(default_factory=list)
    at: int = 0

    def take(self, a: int, b: int) -> list[tuple[int, int, int, int, bool]]:
        """The runs (clipped) inside ``[a, b)``, each with whether it is used up."""
        out = []
        while self.at < len(self.runs):
            off, n, p, po = self.runs[self.at]
            if off >= b:
                break
            lo, hi = max(off, a), min(off + n, b)
            out.append((lo, hi - lo, p, po + lo - off, off + n <= b))
            if off + n > b:
                break
            self.at += 1
        return out


class _Pieces:
    """The regions this rank writes, made when first needed and dropped when used up."""

    def __init__(self, make: list[Callable[[], torch.Tensor]], uses: list[int]):
        self.make, self.uses = make, uses
        self.made: dict[int, memoryview] = {}
        self.held: dict[int, torch.Tensor] = {}

    def data(self, p: int) -> memoryview:
        if p not in self.made:
            t = self.make[p]()
            self.held[p] = t
            self.made[p] = tensor_bytes(t)
        return self.made[p]

    def done(self, p: int) -> None:
        self.uses[p] -= 1
        if self.uses[p] <= 0:
            self.made.pop(p, None)
            self.held.pop(p, None)
            self.make[p] = _gone


def _gone() -> torch.Tensor:
    raise AssertionError("a region was asked for after its last run was sent")


def write_spread_remote(job: SpreadJob) -> tuple[list[str], int]:
    """Collective: write the HF folder at URL ``job.dst`` from every rank (see the module
    docstring); ``finish(folder)`` (rank 0) puts the side files into a local folder uploaded
    with the index. With ``job.checksums`` each owner computes its files' block checksums from
    the bytes it uploads, and rank 0 writes ``sdadapt.checksums.json`` beside the side files.
    Returns the names written and the tensor bytes this rank uploaded."""
    dst, outputs, rank, world, group = job.dst, job.outputs, job.rank, job.world, job.group
    total = sum(math.prod(n.shape) * n.dtype.itemsize for n in outputs.values())
    size = min(parse_size(job.max_shard_size), max(-(-total // world), MIN_FILE_BYTES))
    error: SdadaptError | None = None
    plan = None
    shards: dict[str, tuple[Box, torch.Tensor]] = {}
    up: Uploader | None = None
    old: list[str] = []
    try:
        plan, shards = plan_spread(job.state, outputs, size, rank, group)
        up = Uploader(dst)
        if rank == 0:
            old = up.retire(job.overwrite)  # the old index goes first: the old folder stops looking complete
    except SdadaptError as e:
        error = ExportError(str(e)) if not isinstance(e, ExportError) else e
    agree(error, group)
    assert plan is not None and up is not None
    dev = collective_device(group)
    which = {f.name: i for i, f in enumerate(plan.files)}
    # this rank's runs of each file, from its regions
    make: list[Callable[[], torch.Tensor]] = []
    uses: list[int] = []
    mine = [_Mine() for _ in plan.files]
    io = _Reads({k: t.dtype for k, (_, t) in shards.items()}, shards)

    def add(key: str, box: Box, fn: Callable[[], torch.Tensor]) -> None:
        name, base = plan.start[key]
        node, p, pos = outputs[key], len(make), 0
        make.append(fn)
        uses.append(0)
        for off, n in byte_runs(tuple(node.shape), node.dtype.itemsize, box):
            mine[which[name]].runs.append((base + off, n, p, pos))
            uses[p] += 1
            pos += n

    for key, boxes in plan.mine.items():
        for box in boxes:
            add(key, box, lambda key=key, box=box: outputs[key].read(box, io))  # type: ignore[misc]
    held = torch.zeros(world, len(plan.files), dtype=torch.int64, device=dev)
    for i, m in enumerate(mine):
        held[rank, i] = sum(n for _, n, _, _ in m.runs)
    dist.all_reduce(held, group=group)
    owner = owners(plan.files, held.cpu())
    for key in plan.gathered:  # collective, in the same order on every rank
        t = job.pull(key)
        if owner[which[plan.start[key][0]]] == rank:
            add(key, full_box(tuple(t.shape)), lambda t=t: t)  # type: ignore[misc]
        del t
    job.after_gather()
    for m in mine:
        m.runs.sort()
    pieces = _Pieces(make, uses)
    my_files = [i for i, o in enumerate(owner) if o == rank]
    mine_bytes = sum(plan.files[i].size - len(plan.files[i].header) for i in my_files)
    on_written = job.progress(mine_bytes)
    sums: dict[str, dict] | None = {} if job.checksums else None
    try:
        sent = _rounds(plan.files, owner, mine, pieces, up, rank, world, group, dev, on_written, outputs, sums)
        if isinstance(sent, SdadaptError):
            error = sent
        agree(error, group)  # every file is complete: the index may go in
        every = {k: v for part in gather_objects(sums, group) for k, v in part.items()} if sums is not None else None
        names = [f.name for f in plan.files]
        if rank == 0:

            def finish(tmp: str) -> None:
                job.finish(tmp)
                if every is not None:  # uploaded with the side files, before the index
                    write_checksums_data(tmp, every)

            try:
                names += commit_index(up, plan.files, outputs, finish)
                up.sweep(old, {up.dest(n) for n in names})
            except SdadaptError as e:
                error = e if isinstance(e, ExportError) else ExportError(str(e))
        agree(error, group)
    except BaseException:
        up.undo()
        raise
    log.info("rank %d: uploaded %d of %d file(s) of %s, sent %.1f MiB to their owners", rank, len(my_files), len(plan.files),
             dst, (sent if isinstance(sent, int) else 0) / 2**20)  # fmt: skip
    return sorted(names), mine_bytes


def side_files_and_index(folder: str, files: list[FileLayout], outputs: dict[str, Node], finish: Callable[[str], None]) -> list[str]:
    """Into ``folder``: the side files (``finish``), then the index of a folder of several
    files. Returns the names the folder holds."""
    finish(folder)
    if len(files) > 1:
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            f.write(index_json({k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}, files))
    return sorted(os.listdir(folder))


def commit_index(up: Uploader, files: list[FileLayout], outputs: dict[str, Node], finish: Callable[[str], None]) -> list[str]:
    """Rank 0, after every file is complete: the side files, then the index. Returns their names."""
    folder = tempfile.mkdtemp(prefix="sdadapt-upload-")
    try:
        names = side_files_and_index(folder, files, outputs, finish)
        up.put([(os.path.join(folder, n), up.dest(n)) for n in names])  # the index last
        return names
    except OSError as e:
        raise ExportError(f"writing {up.url} failed preparing its index and side files ({e}); no index was written") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def windows(f: FileLayout) -> list[tuple[int, int]]:
    """File ``f``'s windows ``(start, stop)``: :data:`WINDOW_BYTES` rounded up to a whole number
    of its upload's parts, so that each window's parts are full and go out before the next."""
    part = ObjectWriter.part_size(f.size)
    step = -(-WINDOW_BYTES // part) * part
    return [(a, min(a + step, f.size)) for a in range(0, f.size, step)]


def _rounds(
    files: list[FileLayout], owner: list[int], mine: list[_Mine], pieces: _Pieces, up: Uploader, rank: int, world: int,
    group: dist.ProcessGroup | None, dev: torch.device, on_written: Callable[[int], None], outputs: dict[str, Node],
    sums: dict[str, dict] | None,
) -> int | SdadaptError:  # fmt: skip
    """Every round: each owner's next window, from every rank's runs, handed to its upload
    without a copy (the received bytes themselves go out). One buffer holds what this rank
    sends (at most :data:`SEND_BYTES`: a round with more goes in steps) and one what it
    receives, both reused round after round: the receiving one once the upload has let go of
    the window before (every view of it released, its parts uploaded), so a rank holds one
    bucket beyond its shards. ``sums`` (when given) gets the block checksums of this rank's
    files, from the bytes uploaded. Returns the bytes this rank sent to other ranks, or the
    error that stopped it (every rank stops in the round after any rank failed)."""
    items: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for i, f in enumerate(files):
        items[owner[i]] += [(i, a, b) for a, b in windows(f)]
    error: SdadaptError | None = None
    writer: ObjectWriter | None = None
    summed: StreamedChecksums | None = None
    sent = 0
    send = torch.empty(min(SEND_BYTES, sum(n for m in mine for _, n, _, _ in m.runs)), dtype=torch.uint8)
    landing = torch.empty(max((b - a for _, a, b in items[rank]), default=0), dtype=torch.uint8)
    released: threading.Event | None = None  # set once the upload let go of the last window
    for r in range(max(len(x) for x in items)):
        runs: list[list[int]] = [[] for _ in range(world)]
        data: list[list[memoryview]] = [[] for _ in range(world)]
        try:
            for o in range(world):
                if error is None and r < len(items[o]):
                    i, a, b = items[o][r]
                    for lo, n, p, po, used_up in mine[i].take(a, b):
                        runs[o] += [lo - a, n]
                        data[o].append(pieces.data(p)[po : po + n])
                        if used_up:
                            pieces.done(p)
        except SdadaptError as e:
            error = ExportError(f"writing {up.url} failed on rank {rank}: {e}")
        sizes = [sum(x[1::2]) for x in runs]
        starts = [sum(sizes[:o]) for o in range(world)]
        counts = torch.tensor([[len(runs[o]), sizes[o], error is not None, starts[o], sum(sizes)] for o in range(world)],
                              dtype=torch.int64)  # fmt: skip
        got = _exchange(counts.reshape(-1), [5] * world, [5] * world, group, dev)
        got = got.reshape(world, 5)
        if int(got[:, 2].max()) or error is not None:
            break
        flat_runs = torch.tensor([x for o in range(world) for x in runs[o]], dtype=torch.int64)
        in_runs = _exchange(flat_runs, [len(x) for x in runs], got[:, 0].tolist(), group, dev)
        parts = [d for o in range(world) for d in data[o]]
        del data
        theirs = list(zip(got[:, 3].tolist(), got[:, 1].tolist(), strict=True))  # each sender's bytes for this rank
        bases = [sum(n for _, n in theirs[:s_]) for s_ in range(world)]  # where they start in the window's runs
        segs: list[tuple[int, int, int]] = []  # (position in the senders' bytes, in the window received, length)
        done = 0
        for k, (lo, hi) in enumerate(steps_of(int(got[:, 4].max()), SEND_BYTES)):
            _packed(parts, send, lo, hi)
            if k == 0:
                if released is not None and not released.wait(RELEASE_WAIT_S):
                    log.debug("rank %d: the upload still holds the last window after %d s; receiving into a new buffer",
                              rank, RELEASE_WAIT_S)  # fmt: skip
                    landing = torch.empty_like(landing)  # the old one is freed once the upload lets go of it
                released = None
            out_n = [_clip(at, n, lo, hi) for at, n in zip(starts, sizes, strict=True)]
            in_n = [_clip(at, n, lo, hi) for at, n in theirs]
            _exchange(send[: sum(out_n)], out_n, in_n, group, dev, landing[done:])
            for s_, (at, _n) in enumerate(theirs):
                if in_n[s_]:
                    segs.append((bases[s_] + max(lo, at) - at, done + sum(in_n[:s_]), in_n[s_]))
            done += sum(in_n)
        del parts
        segs.sort()
        sent += sum(n for o, n in enumerate(sizes) if o != rank)
        if r >= len(items[rank]):
            continue
        i, a, b = items[rank][r]
        try:
            if a == 0:
                writer = ObjectWriter(up, files[i].name, size=files[i].size)
                if sums is not None:
                    infos = {k: TensorInfo(tuple(outputs[k].shape), outputs[k].dtype) for k in files[i].starts}
                    summed = StreamedChecksums(infos, files[i].starts)
            assert writer is not None
            released = _upload(writer, files[i], a, b, in_runs.tolist(), landing[:done], summed, segs)
            on_written(max(0, b - max(a, len(files[i].header))))  # tensor bytes, not the header's
            if b == files[i].size:
                writer.finish()
                writer = None
                if summed is not None and sums is not None:
                    sums.update(summed.done())
        except SdadaptError as e:
            error = _failed(e, rank, files[i].name, up)
    return error if error is not None else sent


def steps_of(total: int, cap: int) -> list[tuple[int, int]]:
    """The steps ``[lo, hi)`` of a round in which the rank sending most sends ``total`` bytes, at
    most ``cap`` each (one step where nobody sends: the owners still take their windows)."""
    return [(lo, min(lo + cap, total)) for lo in range(0, total, cap)] or [(0, 0)]


def _clip(at: int, n: int, lo: int, hi: int) -> int:
    """How many of the bytes ``[at, at + n)`` lie inside ``[lo, hi)``."""
    return max(0, min(at + n, hi) - max(at, lo))


RELEASE_WAIT_S = 120
"""How long a round waits for the upload to let go of the window before (its parts uploaded)
before it receives into a new buffer instead (only memory is at stake, never the bytes)."""


class _Watch:
    """Calls ``done`` when collected: kept in the one object every view of a window refers to."""

    def __init__(self, done: Callable[[], None]):
        self.done = done

    def __del__(self) -> None:
        self.done()


def watched(data: torch.Tensor, released: Callable[[], None]) -> memoryview:
    """A byte view of ``data`` (a contiguous CPU tensor) after whose last view (and every slice of
    it) is released, ``released()`` is called: how a caller learns that obstore, which refers to
    what it is given until the part is uploaded, has let go of it. An empty ``data`` is released
    at once."""
    flat = data.reshape(-1)
    if not flat.numel():
        released()
        return memoryview(b"")
    mem = (ctypes.c_ubyte * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
    vars(mem)["owner"] = flat  # from_address holds no reference to the memory it maps
    vars(mem)["watch"] = _Watch(released)  # collected with the array, once no view refers to it
    return memoryview(mem).cast("B")


def _upload(writer: ObjectWriter, f: FileLayout, a: int, b: int, runs: list[int], data: torch.Tensor,
            summed: StreamedChecksums | None = None, segs: list[tuple[int, int, int]] | None = None) -> threading.Event:  # fmt: skip
    """Hand window ``[a, b)`` of ``f`` (``data``: the runs received, placed by ``segs`` as
    :func:`_in_file_order` reads them) to ``writer``, viewed, not copied (and to ``summed``, in
    file order). Returns an event set once every view of ``data`` is released: obstore holds its
    views until their parts are uploaded, and none outlives this call here."""
    released = threading.Event()
    pos = a
    for view in _in_file_order(f, a, b, runs, watched(data, released.set), segs):
        if summed is not None:
            summed.feed(pos, view)
            pos += len(view)
        writer.write(view)  # obstore refers to the view until its part is uploaded
    return released


def _failed(e: SdadaptError, rank: int, name: str, up: Uploader) -> ExportError:
    return ExportError(f"{e} (rank {rank} uploads {name.rsplit('/', 1)[-1]}); nothing that looks complete was left at {up.url}: "
                       "check the destination and write again")  # fmt: skip


def _packed(parts: list[memoryview], buf: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
    """Bytes ``[lo, hi)`` of ``parts`` laid one after the other, copied once to the start of
    ``buf``: a round's bytes are never held twice."""
    view, at, pos = tensor_bytes(buf), 0, 0  # a writable view of buf's memory
    hi = sum(len(d) for d in parts) if hi is None else hi
    for d in parts:
        a, b = max(lo, at), min(hi, at + len(d))
        if a < b:
            view[pos : pos + b - a] = d[a - at : b - at]
            pos += b - a
        at += len(d)
        if at >= hi:
            break


def _exchange(t: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None, dev: torch.device,
              into: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``all_to_all_single`` of ``t``; received into the start of ``into`` where given (on the host)."""
    n = sum(recv)
    out = into[:n] if into is not None and dev.type == "cpu" else torch.empty(n, dtype=t.dtype, device=dev)
    dist.all_to_all_single(out, t.to(dev), recv, send, group=group)
    if into is not None and dev.type != "cpu":
        into[:n].copy_(out)
        return into[:n]
    return out.cpu()


def _in_file_order(f: FileLayout, a: int, b: int, runs: list[int], data: memoryview,
                   segs: list[tuple[int, int, int]] | None = None) -> list[memoryview]:  # fmt: skip
    """Window ``[a, b)`` of file ``f`` as views, in file order, of the header and of the runs
    received (``runs``: offset in the window and length of each, in rank order, each rank's in
    file order; ``segs``: where those runs' bytes, laid one after the other, lie in ``data``,
    as sorted ``(position in the runs' bytes, position in data, length)``, by default all in
    order); every byte must be covered exactly once."""
    parts: list[tuple[int, memoryview]] = []
    if a < len(f.header):
        parts.append((0, memoryview(f.header)[a : min(b, len(f.header))]))
    segs = [(0, 0, len(data))] if segs is None else segs
    firsts = [x[0] for x in segs]
    pos = 0
    for j in range(0, len(runs), 2):
        off, n = runs[j], runs[j + 1]
        k = bisect.bisect_right(firsts, pos) - 1
        at, left = pos, n
        while left > 0 and 0 <= k < len(segs):  # a run cut between two steps is two views
            s0, d0, m = segs[k]
            take = min(left, s0 + m - at)
            parts.append((off + at - pos, data[d0 + at - s0 : d0 + at - s0 + take]))
            at, left, k = at + take, left - take, k + 1
        pos += n
    parts.sort(key=lambda x: x[0])
    at = 0
    for off, view in parts:
        if off != at:
            break
        at += len(view)
    if at != b - a:
        raise ExportError(f"{f.name}: the ranks' regions leave bytes {a + at}-{b} of {a}-{b} uncovered or twice covered "
                          "(a bug; please report it)")  # fmt: skip
    return [view for _, view in parts]


__all__ = [
    "BUCKET_BYTES", "MIN_FILE_BYTES", "SEND_BYTES", "WINDOW_BYTES", "commit_index", "owners", "side_files_and_index", "steps_of", "windows",
    "watched", "write_spread_remote",
]  # fmt: skip
