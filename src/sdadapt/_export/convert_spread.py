"""``convert(..., process_group=group)``: every rank of ``group`` converts the same checkpoint and
writes its own share of the safetensors files, to a folder every rank sees or to an object
storage URL; the index and side files come last, from rank 0, once every file is written.

A checkpoint has no shards to split by: each output is read whole from the source. So the unit
a rank owns is a file: the files are cut to about ``total / world`` bytes (never above
``max_shard_size``, not below :data:`.spread_remote.MIN_FILE_BYTES`) and dealt largest first to
the least loaded rank (:func:`.spread_remote.owners`); each rank reads only the source tensors
its files need and writes those files whole, front to back (a local file with ``write``, an
object through one multipart upload). No bytes move between ranks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._base.agreement import agree_on
from .._base.distributed import agree, rank_and_world
from .._base.schema import TensorInfo
from .._base.tensor_bytes import tensor_bytes
from .._plan.adapter import Adapter
from .._plan.registry import config_folder
from .._recipes.nodes import Node
from .._transaction.steps import derive_adapter, open_checkpoint
from .._transaction.transaction import Transaction
from ..errors import ExportError, SdadaptError
from ..sources import ObjectWriter, Source, Uploader, is_url
from .spread_remote import BUCKET_BYTES, MIN_FILE_BYTES, RELEASE_WAIT_S, commit_index, owners, side_files_and_index, watched
from .writers import parse_size
from .writers.base import check_pulled, write_bytes
from .writers.safetensors_writer import FileLayout, check_dtypes, plan_files
from .writing import (
    ConvertReads,
    check_destination,
    commit,
    describe_failure,
    plan_outputs,
    remove,
    shared_temp,
    side_files,
    temp_path,
    unseen,
)

log = logging.getLogger(__name__)


def plan_convert(outputs: dict[str, Node], max_shard_size: int | str, world: int) -> tuple[list[FileLayout], list[int]]:
    """The files (cut to about ``1/world`` of the bytes) and the rank writing each."""
    entries = {k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}
    check_dtypes(entries)
    total = sum(i.nbytes for i in entries.values())
    files = plan_files(entries, min(parse_size(max_shard_size), max(-(-total // world), MIN_FILE_BYTES)))
    return files, owners(files, torch.zeros(world, len(files), dtype=torch.int64))


def convert_spread(
    dst: str,
    outputs: dict[str, Node],
    files: list[FileLayout],
    owner: list[int],
    whole: Callable[[str], torch.Tensor],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    overwrite: bool,
    check: Callable[[str], None],
    finish: Callable[[str], None],
) -> tuple[list[str], int]:
    """Collective: write this rank's ``files`` (``whole(key)`` gives an output's tensor), then
    ``check(path or URL of each)`` (the read back), then rank 0 the side files (``finish``) and
    the index. Returns the names written and the tensor bytes this rank wrote."""
    mine = [f for f, o in zip(files, owner, strict=True) if o == rank]
    mine_bytes = sum(f.size - len(f.header) for f in mine)
    remote = is_url(dst)
    error: SdadaptError | None = None
    up: Uploader | None = None
    old: list[str] = []
    folder = temp_path(dst) if remote else shared_temp(dst, group)
    try:
        try:
            if remote:
                up = Uploader(dst)
                if rank == 0:
                    old = up.retire(overwrite)
            elif rank == 0:
                os.makedirs(folder)
        except SdadaptError as e:
            error = e if isinstance(e, ExportError) else ExportError(str(e))
        except OSError as e:
            error = ExportError(describe_failure(dst, e))
        agree(error, group)
        agree(None if remote else unseen(folder, dst, "convert"), group)
        for f in mine:
            try:
                if up is not None:
                    _upload(up, f, outputs, whole)
                    check(f"{up.url}/{f.name}")
                else:
                    _write(os.path.join(folder, f.name), f, outputs, whole)
                    check(os.path.join(folder, f.name))
            except SdadaptError as e:
                error = e if isinstance(e, ExportError) else ExportError(str(e))
            except OSError as e:
                error = ExportError(describe_failure(dst, e) + f" (rank {rank}, file {f.name})")
            if error is not None:
                break
        agree(error, group)  # every file is written: the index may go in
        names = [f.name for f in files]
        if rank == 0:
            try:
                if up is not None:
                    names += commit_index(up, files, outputs, finish)
                    up.sweep(old, {up.dest(n) for n in names})
                else:
                    names = side_files_and_index(folder, files, outputs, finish)
                    commit(folder, dst, overwrite)
            except SdadaptError as e:
                error = e if isinstance(e, ExportError) else ExportError(str(e))
            except OSError as e:
                error = ExportError(describe_failure(dst, e))
        agree(error, group)
    except BaseException:
        if up is not None:
            up.undo()
        elif rank == 0:
            remove(folder)
        raise
    log.info("rank %d: wrote %d of %d file(s) of %s (%.1f MiB)", rank, len(mine), len(files), dst, mine_bytes / 2**20)
    return sorted(set(names)), mine_bytes


def _write(path: str, f: FileLayout, outputs: dict[str, Node], whole: Callable[[str], torch.Tensor]) -> None:
    with open(path, "wb") as out:
        write_bytes(out, f.header)
        for key in f.starts:
            t = _pulled(key, outputs, whole)
            write_bytes(out, tensor_bytes(t))
            del t
        out.flush()
        os.fsync(out.fileno())


def _upload(up: Uploader, f: FileLayout, outputs: dict[str, Node], whole: Callable[[str], torch.Tensor]) -> None:
    """File ``f`` through one multipart upload. obstore refers to each tensor given until its
    parts are uploaded and does not make ``write`` wait for them: a tensor is read only once the
    ones before that it still holds are under :data:`.spread_remote.BUCKET_BYTES`, so a rank
    holds about one bucket of its files, not the file."""
    writer = ObjectWriter(up, f.name, size=f.size)
    writer.write(f.header)
    held = _Held()
    for key in f.starts:
        held.wait_below(BUCKET_BYTES)
        t = _pulled(key, outputs, whole).contiguous()
        n = t.numel() * t.element_size()
        held.add(n)
        writer.write(watched(t, lambda n=n: held.add(-n)))  # type: ignore[misc]
        del t
    writer.finish()


class _Held:
    """Bytes the upload still refers to, released from obstore's threads (a view collected)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.changed = threading.Condition()

    def add(self, n: int) -> None:
        with self.changed:
            self.bytes += n
            self.changed.notify_all()

    def wait_below(self, limit: int) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.bytes < limit, RELEASE_WAIT_S):
                log.debug("the upload still holds %d bytes after %d s; reading on", self.bytes, RELEASE_WAIT_S)


def _pulled(key: str, outputs: dict[str, Node], whole: Callable[[str], torch.Tensor]) -> torch.Tensor:
    t = whole(key)
    node = outputs[key]
    check_pulled(key, t, TensorInfo(tuple(node.shape), node.dtype))
    return t




@dataclass(frozen=True)
class ConvertJob:
    """What one :func:`sdadapt.convert` call asked for, built once there: its arguments of the
    same names (``dst`` as a string)."""

    src: str | os.PathLike[str] | Source
    dst: str
    adapter: Adapter | str | None
    max_shard_size: int | str
    subtree: str | None
    overwrite: bool
    read_back: bool
    on_progress: Callable[[str, int], None] | None


def convert_ranks(job: ConvertJob, group: dist.ProcessGroup) -> tuple[int, int, list[str], list[str], int]:
    """Collective over ``group``: :func:`sdadapt.convert` with every rank writing its files.
    Opening and planning run on every rank and are agreed (the same files planned everywhere);
    each rank reads only the source tensors its files need. Returns ``(tensors, bytes in all,
    names written, non-tensor keys skipped, bytes this rank wrote)``."""
    rank, world = rank_and_world(group)
    dst = job.dst
    error: SdadaptError | None = None
    source: Source | None = None
    planned: tuple[dict[str, Node], list[str], list[FileLayout], list[int]] | None = None
    try:
        if rank == 0:
            check_destination(dst, job.overwrite)
        source = open_checkpoint(job.src, job.subtree)
        outputs, skipped = plan_outputs(source.schema, derive_adapter(job.adapter, source), non_tensor=source.non_tensor,
                                        what=f"convert {source.path}")  # fmt: skip
        planned = (outputs, skipped, *plan_convert(outputs, job.max_shard_size, world))
    except SdadaptError as e:
        error = e
    layout = [] if planned is None else [(f.name, f.size, list(f.starts)) for f in planned[2]]
    try:
        agree_on({"files": layout}, error, group, what=f"convert to {dst}")
    except BaseException:
        if source is not None:
            source.close()
        raise
    assert source is not None and planned is not None
    outputs, skipped, files, owner = planned
    txn = Transaction(None, None, source.path)
    try:
        txn.add_source(source)  # the source's files must not change while they are converted
        mine = {k: outputs[k] for f, o in zip(files, owner, strict=True) if o == rank for k in f.starts}
        reads = ConvertReads(source, mine, txn, dst, job.read_back, job.on_progress)

        def check(path: str) -> None:  # one of this rank's files
            reads.check(path, {k: outputs[k] for k in next(f for f in files if path.endswith("/" + f.name)).starts})

        names, written = convert_spread(dst, outputs, files, owner, reads.whole, rank=rank, group=group, overwrite=job.overwrite,
                                        check=check, finish=lambda tmp: side_files(tmp, config_folder(source.path), None))  # fmt: skip
    finally:
        txn.close()
    total = sum(f.size - len(f.header) for f in files)
    return len(outputs), total, names, skipped, written


__all__ = ["ConvertJob", "convert_ranks", "convert_spread", "plan_convert"]
