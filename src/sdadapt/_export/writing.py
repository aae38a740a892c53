"""Writing a checkpoint as one step that either completes or leaves nothing: the outputs an
adapter makes from a schema (:func:`plan_outputs`), a temporary folder beside the destination
renamed into place at the end (:func:`write_folder`), and the pages of what was written handed
back to the kernel (:class:`PageReleaser`). Used by export, convert and shrink."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._base.regions import Box, full_box
from .._base.schema import TensorInfo, slices
from .._plan.adapter import Adapter
from .._recipes.nodes import Node
from .._transaction.transaction import Transaction
from ..errors import ExportError, SdadaptError, SourceError
from ..rules import PlanContext
from ..sources import Source, check_writable, copy_side_files, is_url, open_source, upload, write_config
from .writers import make_writer

log = logging.getLogger(__name__)


def plan_outputs(
    schema: dict[str, TensorInfo], adapter: Adapter | None, *, non_tensor: list[str] | None = None, what: str = "export"
) -> tuple[dict[str, Node], list[str]]:
    """Apply ``adapter`` to ``schema`` with no target: every key it yields is an output.
    Returns ``(outputs in write order, non-tensor keys left over)``."""
    adapter = adapter or Adapter([], name="identity")
    ctx = PlanContext(schema, non_tensor or [], None, adapter.rules, adapter.stage_of)
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    ctx.check_ambiguity()
    if ctx.issues:
        rows = "\n".join(f"  #{it.index} {it.rule}: {it.key or ''}: {it.message}" for it in ctx.issues[:20])
        raise ExportError(f"{what}: adapter {adapter.name!r} does not apply cleanly:\n{rows}")
    unused = [f"#{i} {r.label()}" for i, r in enumerate(adapter.rules) if ctx.matches[i] == 0]
    if unused:
        log.warning("%s: rules that matched nothing: %s", what, ", ".join(unused))
    order = {k: i for i, k in enumerate(schema)}
    outputs = sorted(ctx.env.items(), key=lambda kv: min((order.get(leaf, 0) for leaf in kv[1].leaves()), default=0))
    return dict(outputs), sorted(ctx.non_tensor)


def _entries(outputs: dict[str, Node]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}


# ------------------------------------------------------------------------------ reading
class CachedIO:
    """Whole leaves, fetched once and kept until no later output needs them.

    Outputs are computed with ``node.read(full box)``, the lazy path: a plain leaf comes back
    as the fetched tensor itself (for a mapped source, a view of the file: no copy), a concat
    allocates only its result. Leaves no later output needs are released when the next output
    is asked for (the writer has written the previous one by then) or at :meth:`flush`."""

    def __init__(self, outputs: dict[str, Node], fetch: Callable[[str], torch.Tensor], release: Callable[[torch.Tensor], None]):
        self.uses = Counter(leaf for n in outputs.values() for leaf in set(n.leaves()))
        self.fetch = fetch
        self.release = release
        self.cache: dict[str, torch.Tensor] = {}
        self.pending: list[torch.Tensor] = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = self.fetch(key)
        return t[slices(box)]

    def whole(self, node: Node) -> torch.Tensor:
        """All of ``node``'s output (the leaves the previous output alone used released first)."""
        self.flush()
        out = node.read(full_box(tuple(node.shape)), self)
        for leaf in set(node.leaves()):
            self.uses[leaf] -= 1
            if self.uses[leaf] <= 0 and leaf in self.cache:
                self.pending.append(self.cache.pop(leaf))
        return out

    def flush(self) -> None:
        while self.pending:
            self.release(self.pending.pop())


_MADV_DONTNEED = 4


class PageReleaser:
    """Hands the pages of mapped source files back to the kernel once a tensor is used, so the
    process's RSS does not grow with every tensor read from an ``mmap`` (Linux; elsewhere a
    no-op). Only ranges inside a mapping of one of ``files`` are touched."""

    def __init__(self, files: list[str]):
        self.files = {os.path.realpath(f) for f in files}
        self.ranges: list[tuple[int, int]] = []
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.libc = None
        if sys.platform.startswith("linux"):
            try:
                self.libc = ctypes.CDLL(None, use_errno=True)
                self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                self.libc = None

    def _refresh(self) -> None:
        self.ranges = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and os.path.realpath(parts[5].strip()) in self.files:
                        a, b = (int(x, 16) for x in parts[0].split("-"))
                        self.ranges.append((a, b))
        except OSError:
            pass

    def __call__(self, t: torch.Tensor) -> None:
        if self.libc is None or not self.files or t.device.type != "cpu" or t.numel() == 0:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        a = (start + self.page - 1) // self.page * self.page
        b = end // self.page * self.page
        if b <= a:
            return
        for attempt in range(2):
            if any(lo <= a and b <= hi for lo, hi in self.ranges):
                self.libc.madvise(a, b - a, _MADV_DONTNEED)
                return
            if attempt == 0:
                self._refresh()


def read_back_compare(
    tmp: str, dst: str, outputs: dict[str, Node], source: Source, release: PageReleaser, progress: Callable[[str, int], None] | None
) -> None:
    """Read the output ``tmp`` (a folder, a file or a URL) back and compare every tensor of
    ``outputs`` with ``source`` through its recipe, bit for bit; a difference is an ExportError."""
    result = open_source(tmp)
    try:
        release_out = PageReleaser(result.files())
        missing = sorted(set(outputs) - set(result.schema))
        extra = sorted(set(result.schema) - set(outputs))
        if missing or extra:
            raise ExportError(f"reading {dst} back: missing {missing[:8]}, unexpected {extra[:8]}")
        io = CachedIO(outputs, lambda k: source.read(k, full_box(source.schema[k].shape)), release)
        for key, node in outputs.items():
            want = io.whole(node)
            got = result.read(key, full_box(result.schema[key].shape))
            same = got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape) and torch.equal(got, want)
            nbytes = got.numel() * got.element_size()
            release_out(got)
            io.flush()
            if not same:
                raise ExportError(f"reading {dst} back: key {key!r} differs from the source; the output is wrong")
            if progress is not None:
                progress(key, nbytes)
            del want, got
    finally:
        result.close()


class ConvertReads:
    """What one convert reads of the open ``source`` for ``outputs`` (all of them, or one rank's):
    their leaves fetched whole once (from object storage in one concurrent batch), their pages
    handed back after use. :meth:`whole` gives an output (``on_progress(key, bytes)`` after each,
    ``bytes`` counts them); :meth:`check` compares a written file with the source
    (``read_back``), then checks that the source's files (``txn``'s) did not change."""

    def __init__(self, source: Source, outputs: dict[str, Node], txn: Transaction, dst: str, read_back: bool,
                 on_progress: Callable[[str, int], None] | None):  # fmt: skip
        if source.remote_url() is not None and outputs:
            source.prefetch([(k, None) for k in sorted({leaf for n in outputs.values() for leaf in n.leaves()})])
        self.source, self.outputs, self.txn, self.dst, self.read_back, self.on_progress = source, outputs, txn, dst, read_back, on_progress
        self.release = PageReleaser(source.files())
        self.io = CachedIO(outputs, lambda k: source.read(k, full_box(source.schema[k].shape)), self.release)
        self.bytes = 0

    def whole(self, key: str) -> torch.Tensor:
        t = self.io.whole(self.outputs[key])
        n = t.numel() * t.element_size()
        self.bytes += n
        if self.on_progress is not None:
            self.on_progress(key, n)
        return t

    def check(self, path: str, outputs: dict[str, Node]) -> None:
        """``outputs``, written at ``path`` (a folder, a file or a URL), read back and compared."""
        self.io.flush()
        if self.read_back:
            read_back_compare(path, self.dst, outputs, self.source, self.release, self.on_progress)
        self.txn.files_unchanged("while it was being converted")


def side_files(tmp: str, folder: str | None, config: dict[str, Any] | None) -> None:
    """Into the folder being written (not a single file): ``folder``'s side files (config,
    tokenizer, generation), or ``config`` as ``config.json``."""
    if not os.path.isdir(tmp):
        return
    if folder is not None:
        copy_side_files(folder, tmp)
    elif config is not None:
        write_config(tmp, config)
    else:
        log.warning("%s gets no config.json: pass assets='checkpoint folder' to copy its config and tokenizer files", tmp)


# ------------------------------------------------------------------------------ output
def check_destination(dst: str, overwrite: bool) -> None:
    if is_url(dst):
        try:
            check_writable(dst, overwrite)
        except SourceError as e:
            raise ExportError(str(e)) from None
        return
    if os.path.lexists(dst) and not overwrite:
        raise ExportError(f"{dst} exists; pass overwrite=True (--overwrite) or choose another destination")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise ExportError(f"{dst}: the folder {parent} does not exist")


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def temp_path(dst: str) -> str:
    """The temporary folder (or file) beside ``dst`` that a write goes into before it is renamed into place."""
    return f"{dst.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"


def shared_temp(dst: str, group: dist.ProcessGroup | None) -> str:
    """Collective: the temporary folder beside ``dst`` every rank of ``group`` writes into (rank 0's name)."""
    tmp = [temp_path(dst)]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return tmp[0]


def unseen(folder: str, dst: str, what: str) -> ExportError | None:
    """The error of a rank that cannot see ``folder``, made by rank 0 for ``dst``; ``None`` where it can."""
    if os.path.isdir(folder):
        return None
    return ExportError(f"{folder}, made by rank 0 for {dst}, is not visible on this rank: {what} every rank to one shared "
                       "filesystem, or to an object store (s3://...)")  # fmt: skip


def commit(tmp: str, dst: str, overwrite: bool) -> None:
    old = None
    if os.path.lexists(dst):
        if not overwrite:
            raise ExportError(f"{dst} appeared while writing; the output is left at {tmp}")
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
        remove(old)


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(n for n in os.listdir(path))
    return [os.path.basename(path)]


def _root_cause(e: BaseException) -> BaseException:
    """DCP wraps failures in ``CheckpointException.failures`` ({rank: (exception, traceback)})."""
    for v in getattr(e, "failures", {}).values():
        inner = v[0] if isinstance(v, tuple) and v else v
        if isinstance(inner, BaseException):
            return inner
    return e


def describe_failure(dst: str, e: BaseException) -> str:
    e = _root_cause(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"writing {dst} failed: the disk is full ({e}); nothing was left at {dst}"
    return f"writing {dst} failed ({type(e).__name__}: {e}); nothing was left at {dst}"


def write_folder(
    dst: str,
    fmt: str,
    outputs: dict[str, Node],
    pull: Callable[[str], torch.Tensor],
    *,
    max_shard_size: int | str,
    overwrite: bool,
    check: Callable[[str], None] | None = None,
) -> list[str]:
    """Write into a temporary path beside ``dst``, run ``check(tmp)``, then rename. Returns the
    files written. An object storage URL is written into a local temporary folder first, then
    uploaded, its index or metadata last (:func:`~sdadapt.sources._object_store.upload`)."""
    if is_url(dst):
        staging = tempfile.mkdtemp(prefix="sdadapt-upload-")
        try:
            local = os.path.join(staging, dst.rstrip("/").rsplit("/", 1)[-1])
            try:
                files = write_folder(local, fmt, outputs, pull, max_shard_size=max_shard_size, overwrite=False, check=check)
            except ExportError as e:
                if not str(e).startswith(f"writing {local} failed"):  # a check, not the writing
                    raise
                raise ExportError(
                    f"writing {dst} failed in the local copy it is uploaded from ({e}); set TMPDIR to a folder with room for the "
                    f"whole checkpoint; nothing was uploaded, and what {dst} held before is as it was"
                ) from None
            try:
                upload(local, dst, overwrite=overwrite)
            except SourceError as e:
                raise ExportError(str(e)) from None
            return files
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tmp = temp_path(dst)
    writer = make_writer(fmt, tmp, max_shard_size)
    try:
        writer.write(_entries(outputs), pull)
        if check is not None:
            check(tmp)
        files = _files(tmp) if os.path.isdir(tmp) else [os.path.basename(dst)]
        commit(tmp, dst, overwrite)
    except SdadaptError:
        remove(tmp)
        raise
    except BaseException as e:  # noqa: BLE001 - a CheckpointException (BaseException) too
        remove(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExportError(describe_failure(dst, e)) from e
    return files


# ------------------------------------------------------------------------------ export
