"""Export a (parallelised) model, or convert a checkpoint, to another layout and format.

Convention: the ``adapter`` given to :func:`export` is the one you *load* with (checkpoint
layout -> model layout, as for :func:`sdadapt.load`); export writes through
``adapter.inverse()``, so ``load(model, export(model, dst, adapter), adapter)`` round-trips.
:func:`convert` (and ``sdadapt convert``) applies its adapter as given: source layout ->
destination layout.

Memory: outputs are produced one at a time. For a model, each DTensor the current output
needs is gathered whole (``full_tensor()``, on every rank, in the same order) and dropped once
no later output needs it; rank 0 writes. For a checkpoint, each tensor is read from the mapped
source, written, and its pages are handed back to the kernel. Never the whole model at once.

Atomicity: everything is written into ``dst + ".tmp-<id>"`` beside ``dst`` and renamed into
place at the end; an existing ``dst`` is an error unless ``overwrite=True``; on any failure
(a full disk...) the temporary output is removed and ``dst`` is left as it was. Both run the
steps of the load transaction (:mod:`sdadapt._transaction.transaction`): ``export`` plans and agrees on
every rank before anything is written; ``convert`` fingerprints the source's files and
refuses to commit an output read from a file that changed meanwhile.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.distributed import is_distributed, rank_and_world
from .._base.regions import Box, full_box
from .._plan.adapter import Adapter
from .._plan.registry import config_folder, is_shipped
from .._plan.resolve import adapter_or_none
from .._plan.target import model_state_dict
from .._plan.titan_names import for_export
from .._recipes.nodes import Node
from ..errors import ExportError, RemoteRankError, SdadaptError
from ..rules._base import PlanContext
from ..sources import Source, open_source
from ..sources._assets import copy_side_files, loaded_from, transformers_config, write_config
from ..sources._base import TensorInfo, slices
from . import integrity
from .args import check_model_and_path, check_not_a_model, renamed_keywords
from .materialize import has_meta
from .transaction import Transaction
from .writers import make_writer
from .writers.base import FORMATS

log = logging.getLogger(__name__)

Progress = Callable[[str, int], None]  # (key, bytes) after each tensor is written


class ExportReport(BaseModel):
    """What was written."""

    dst: str
    format: str
    tensors: int
    bytes: int
    files: list[str]
    skipped_non_tensor: list[str] = []
    read_back: bool = False  # convert(read_back=True): the output was read back and compared
    seconds: float

    def format_text(self) -> str:
        what = f"{self.tensors} tensors, {self.bytes / 2**20:.1f} MiB"
        return f"wrote {self.dst} ({self.format}: {what}, {len(self.files)} file(s)) in {self.seconds:.2f} s" + (
            "; read back and compared" if self.read_back else ""
        )

    def __str__(self) -> str:  # print(report): the summary, not the fields
        return self.format_text()


# ------------------------------------------------------------------------------ planning
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
class _CachedIO:
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

    def produce(self, node: Node) -> torch.Tensor:
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


# ------------------------------------------------------------------------------ output
def _check_dst(dst: str, overwrite: bool) -> None:
    if os.path.lexists(dst) and not overwrite:
        raise ExportError(f"{dst} exists; pass overwrite=True (--overwrite) or choose another destination")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise ExportError(f"{dst}: the folder {parent} does not exist")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(tmp: str, dst: str, overwrite: bool) -> None:
    old = None
    if os.path.lexists(dst):
        if not overwrite:
            raise ExportError(f"{dst} appeared while writing; the output is left at {tmp}")
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
        _remove(old)


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


def _describe_failure(dst: str, e: BaseException) -> str:
    e = _root_cause(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"writing {dst} failed: the disk is full ({e}); nothing was left at {dst}"
    return f"writing {dst} failed ({type(e).__name__}: {e}); nothing was left at {dst}"


def _write(
    dst: str,
    fmt: str,
    outputs: dict[str, Node],
    produce: Callable[[str], torch.Tensor],
    *,
    max_shard_size: int | str,
    overwrite: bool,
    check: Callable[[str], None] | None = None,
) -> list[str]:
    """Write into a temporary path beside ``dst``, run ``check(tmp)``, then rename. Returns the
    files written."""
    tmp = f"{dst.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"
    writer = make_writer(fmt, tmp, max_shard_size)
    try:
        writer.write(_entries(outputs), produce)
        if check is not None:
            check(tmp)
        files = _files(tmp) if os.path.isdir(tmp) else [os.path.basename(dst)]
        _commit(tmp, dst, overwrite)
    except SdadaptError:
        _remove(tmp)
        raise
    except BaseException as e:  # noqa: BLE001 - a CheckpointException (BaseException) too
        _remove(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExportError(_describe_failure(dst, e)) from e
    return files


# ------------------------------------------------------------------------------ export
class _ModelStream:
    """``model``'s weights in the checkpoint's layout (through ``adapter.inverse()``), one output
    at a time: :meth:`produce` gathers the DTensors an output needs (``full_tensor()``: a
    collective, so every rank produces the same keys in the same order) and keeps a gathered
    leaf only while a later output still needs it. Planning runs as the first step of a load
    transaction: an error on any rank (and ``check``'s, run first) is every rank's error."""

    def __init__(
        self,
        model: nn.Module,
        spec: Adapter | str | None,
        process_group: dist.ProcessGroup | None,
        what: str,
        check: Callable[[], None] | None = None,
        native_names: bool = False,
        folder: str | None = None,
    ):
        txn = Transaction(None, process_group, what)

        def prepare() -> tuple[dict[str, torch.Tensor], dict[str, Node]]:
            if check is not None:
                check()
            adapter = adapter_or_none(spec, folder, model)  # a shipped name's options: folder, else the model's config
            if has_meta(model):
                raise ExportError("the model has tensors on the meta device; load or initialise it before exporting")
            sd = model_state_dict(model)
            schema = {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in sd.items()}
            named = adapter
            if native_names and adapter is not None:  # a shipped adapter: ours -> the model's own names
                named, sd = for_export(adapter, sd)
                schema = {k: schema[k] for k in sd}
            inverse = named.inverse() if named is not None else None
            return sd, plan_outputs(schema, inverse, what=what)[0]

        self.state, self.outputs = txn.prepare(prepare)
        self.io = _CachedIO(self.outputs, self._fetch, lambda t: None)

    def _fetch(self, key: str) -> torch.Tensor:
        t = self.state[key]
        t = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        return t.cpu()

    def produce(self, key: str) -> torch.Tensor:
        """Output ``key`` (collective when the model holds DTensors); the previous output's
        leaves are dropped first."""
        return self.io.produce(self.outputs[key])

    def close(self) -> None:
        """Drop every gathered tensor still held."""
        self.io.flush()
        self.io.cache.clear()


def export_iter(
    model: nn.Module,
    adapter: Adapter | str | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of ``model`` in the checkpoint's layout, one at a
    time, without writing files (to push weights to an inference engine, for instance).

    ``adapter`` is the checkpoint->model adapter you load with (an :class:`Adapter` or a name
    resolved as by :func:`sdadapt.resolve_adapter`); its inverse rules are applied. Every rank
    iterates: each tensor is gathered whole (``full_tensor()``) on every rank, so all ranks must
    consume the same sequence to the end (or close the generator on every rank). Memory: the
    tensor last yielded (plus leaves a later output still needs, e.g. the parts of a split); the
    generator drops its own references to an output when the next one is asked for, so a
    consumer that does not keep them holds about one tensor. Tensors are on the CPU. A shipped
    adapter's name takes its options from the checkpoint folder ``model`` was loaded from by
    :func:`sdadapt.load`, else from the model's own config (``model.config``), and reaches the
    names the model holds (torchtitan's current ones: see :func:`sdadapt.torchtitan.torchtitan_names`)."""
    check_model_and_path("sdadapt.export_iter(model, adapter=None, ...)", model, adapter, path_arg="adapter")
    shipped = is_shipped(adapter)  # our documented layout
    stream = _ModelStream(model, adapter, process_group, "export_iter", native_names=shipped)
    try:
        for key in list(stream.outputs):
            yield key, stream.produce(key)
    finally:
        stream.close()


_KEY, _DONE, _ABORT = "key", "done", "abort"


def export(
    model: nn.Module,
    dst: str | os.PathLike[str],
    adapter: Adapter | str | None = None,
    format: str = "safetensors",  # noqa: A002 - the user-facing name
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = False,
    assets: str | os.PathLike[str] | None = None,
) -> ExportReport:
    """Write ``model``'s weights to ``dst`` through ``adapter.inverse()``; every rank calls it.

    ``adapter`` is the checkpoint->model adapter you load with (see the module docstring; an
    :class:`Adapter` or a name resolved as by :func:`sdadapt.resolve_adapter`);
    ``format`` is ``"safetensors"`` (a folder: ``model.safetensors``, or shards of at most
    ``max_shard_size`` plus ``model.safetensors.index.json``), ``"torch"`` (one ``torch.save``
    file of a flat dict) or ``"dcp"`` (a DCP folder). The tensors come from the stream
    :func:`export_iter` iterates, in the order the writer asks for them (rank 0 tells the other
    ranks which key is next); rank 0 writes; the output appears at ``dst`` atomically.
    ``checksums=True`` also writes ``sdadapt.checksums.json`` (beside a torch file:
    ``<file>.sdadapt.checksums.json``), computed from the tensors as they are written, for
    ``load(..., checksums=True)``.

    A folder (``"safetensors"``, ``"dcp"``) also gets the checkpoint's side files, so that it
    opens in transformers and with ``--adapter NAME``: ``config.json``, tokenizer and generation
    files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``tokenizer.model``, ``generation_config.json`` ...) copied from ``assets``, else from the
    checkpoint folder ``model`` was loaded from by :func:`sdadapt.load`; without either, a
    transformers model's own ``config.json`` (``model.config``) is written. A shipped adapter's
    name takes its options from the same places.
    """
    t0 = time.perf_counter()
    check_model_and_path("sdadapt.export(model, dst, adapter=None, format='safetensors', ...)", model, dst, path_arg="dst")
    dst = os.fspath(dst)
    folder = os.fspath(assets) if assets is not None else loaded_from(model)
    shipped = is_shipped(adapter)  # our documented layout
    config = transformers_config(model) if folder is None else None
    rank, world = rank_and_world(process_group)

    def check() -> None:
        if folder is not None and not os.path.isdir(folder):
            raise ExportError(f"assets={folder!r} is not a folder; give the checkpoint folder whose config and tokenizer files to copy")
        if format not in FORMATS:
            raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
        if rank == 0:
            _check_dst(dst, overwrite)

    stream = _ModelStream(model, adapter, process_group, f"export to {dst}", check, native_names=shipped, folder=folder)
    outputs = stream.outputs
    src0 = dist.get_global_rank(process_group, 0) if is_distributed() and process_group is not None else 0
    written = [0]
    sums: dict[str, Any] = {}

    def produce(key: str) -> torch.Tensor:
        if world > 1:
            dist.broadcast_object_list([(_KEY, key)], src=src0, group=process_group)
        t = stream.produce(key)
        written[0] += t.numel() * t.element_size()
        if checksums:  # from the tensor in hand: no read-back (sdadapt.checksums.json, for load(checksums=True))
            sums[key] = integrity.tensor_checksums(TensorInfo(tuple(t.shape), t.dtype), lambda box: t[slices(box)])
        return t

    files: list[str] = []
    try:
        if rank == 0:
            try:
                files = _write(dst, format, outputs, produce, max_shard_size=max_shard_size, overwrite=overwrite,
                               check=lambda tmp: _side_files(tmp, folder, config))  # fmt: skip
                if checksums:
                    integrity.write_checksums_data(dst, sums)
            except BaseException as e:
                if world > 1:
                    dist.broadcast_object_list([(_ABORT, f"{type(e).__name__}: {e}")], src=src0, group=process_group)
                raise
            if world > 1:
                dist.broadcast_object_list([(_DONE, files)], src=src0, group=process_group)
        else:
            files = _follow(stream, written, process_group, src0, dst)
    finally:
        stream.close()
    rep = ExportReport(
        dst=dst,
        format=format,
        tensors=len(outputs),
        bytes=written[0],
        files=files,
        seconds=time.perf_counter() - t0,
    )
    log.info("rank %d: %s", rank, rep.format_text())
    return rep


def _follow(
    stream: _ModelStream, written: list[int], group: dist.ProcessGroup | None, src0: int, dst: str
) -> list[str]:
    """A rank other than 0 of :func:`export`: produce the keys rank 0 names, until it is done."""
    while True:
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=src0, group=group)
        kind, value = msg[0]
        if kind == _KEY:
            t = stream.produce(value)
            written[0] += t.numel() * t.element_size()
            del t
        elif kind == _DONE:
            return list(value)
        else:
            raise RemoteRankError(f"rank 0 failed while writing {dst}, so this rank stops too:\n{value}")


def _side_files(tmp: str, folder: str | None, config: dict[str, Any] | None) -> None:
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


# ------------------------------------------------------------------------------ convert
@renamed_keywords(
    "sdadapt.convert",
    {
        "verify": ("read_back", "read the output back and compare every tensor; sdadapt.verify compares a model's outputs"),
        "progress": ("on_progress", "a function called (key, nbytes) after each tensor; progress= is a bool, as shrink takes it"),
    },
)
def convert(
    src: str | os.PathLike[str] | Source,
    dst: str | os.PathLike[str],
    adapter: Adapter | str | None = None,
    format: str = "safetensors",  # noqa: A002
    *,
    max_shard_size: int | str = "5GB",
    subtree: str | None = None,
    overwrite: bool = False,
    read_back: bool = False,
    on_progress: Progress | None = None,
) -> ExportReport:
    """Rewrite checkpoint ``src`` as ``dst`` in ``format``, applying ``adapter`` (source layout ->
    destination layout), one tensor at a time in one process. ``read_back=True`` reads the result
    back (before it is renamed into place) and compares every tensor with the source
    (bit-exact); a difference is an error and leaves nothing at ``dst``. Non-tensor entries are skipped
    (listed in the report). ``adapter`` may be a name, ``file.py:ATTR``, ``module:ATTR`` or
    ``.json`` (resolved by :func:`sdadapt.resolve_adapter`, options read from ``src``'s folder);
    ``src`` may be a Hub id ``hf://org/name[@revision]``. ``on_progress(key, nbytes)`` is called
    after each tensor is written, then after each is read back."""
    t0 = time.perf_counter()
    call = "sdadapt.convert(src, dst, adapter=None, ...) for a checkpoint, sdadapt.export(model, dst, ...) for a model"
    check_not_a_model(call, src)
    check_not_a_model(call, dst, path_arg="dst")
    dst = os.fspath(dst)
    adapter = adapter_or_none(adapter, src)
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    _check_dst(dst, overwrite)
    source = open_source(src, subtree=subtree)
    txn = Transaction(None, None, source.path)
    try:
        txn.add_source(source)  # the source's files must not change while they are converted
        outputs, skipped = plan_outputs(source.schema, adapter, non_tensor=source.non_tensor, what=f"convert {source.path}")
        if skipped:
            log.warning("convert: %d non-tensor entries are not written: %s", len(skipped), ", ".join(skipped[:8]))
        release = PageReleaser(source.files())
        io = _CachedIO(outputs, lambda k: source.read(k, full_box(source.schema[k].shape)), release)
        written = [0]

        def produce(key: str) -> torch.Tensor:
            t = io.produce(outputs[key])
            n = t.numel() * t.element_size()
            written[0] += n
            if on_progress is not None:
                on_progress(key, n)
            return t

        def check(tmp: str) -> None:
            io.flush()
            if read_back:
                _read_back(tmp, dst, outputs, source, release, on_progress)
            txn.files_unchanged("while it was being converted")
            _side_files(tmp, config_folder(source.path), None)

        files = _write(dst, format, outputs, produce, max_shard_size=max_shard_size, overwrite=overwrite, check=check)
    finally:
        txn.close()
    return ExportReport(
        dst=dst,
        format=format,
        tensors=len(outputs),
        bytes=written[0],
        files=files,
        skipped_non_tensor=skipped,
        read_back=read_back,
        seconds=time.perf_counter() - t0,
    )


def _read_back(tmp: str, dst: str, outputs: dict[str, Node], source: Source, release: PageReleaser, progress: Progress | None) -> None:
    result = open_source(tmp)
    try:
        release_out = PageReleaser(result.files())
        missing = sorted(set(outputs) - set(result.schema))
        extra = sorted(set(result.schema) - set(outputs))
        if missing or extra:
            raise ExportError(f"reading {dst} back: missing {missing[:8]}, unexpected {extra[:8]}")
        io = _CachedIO(outputs, lambda k: source.read(k, full_box(source.schema[k].shape)), release)
        for key, node in outputs.items():
            want = io.produce(node)
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


__all__ = ["ExportError", "ExportReport", "PageReleaser", "convert", "export", "export_iter", "plan_outputs"]
