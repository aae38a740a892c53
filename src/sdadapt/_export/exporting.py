"""Export a (parallelised) model, or convert a checkpoint, to another layout and format.

Convention: the ``adapter`` given to :func:`export` is the one you *load* with (checkpoint
layout -> model layout, as for :func:`sdadapt.load`); export writes through
``adapter.inverse()``, so ``load(model, export(model, dst, adapter), adapter)`` round-trips.
:func:`convert` (and ``sdadapt convert``) applies its adapter as given: source layout ->
destination layout.

Memory: outputs are pulled one at a time. For a model, each DTensor the current output
needs is gathered whole (``full_tensor()``, on every rank, in the same order) and dropped once
no later output needs it; rank 0 writes. A safetensors export on several ranks gathers nothing
that can be cut: every rank writes the byte ranges of the regions it owns (:mod:`.spread`;
to an object storage URL each file is uploaded by one rank, :mod:`.spread_remote`).
For a checkpoint, each tensor is read from the mapped
source, written, and its pages are handed back to the kernel. Never the whole model at once.

Atomicity: everything is written into ``dst + ".tmp-<id>"`` beside ``dst`` and renamed into
place at the end; an existing ``dst`` is an error unless ``overwrite=True``; on any failure
(a full disk...) the temporary output is removed and ``dst`` is left as it was. Both run the
steps of the load transaction (:mod:`sdadapt._transaction.transaction`): ``export`` plans and agrees on
every rank before anything is written; ``convert`` fingerprints the source's files and
refuses to commit an output read from a file that changed meanwhile.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.distributed import is_distributed, rank_and_world
from .._base.progress import TransferBar
from .._base.regions import Box
from .._base.schema import TensorInfo, slices
from .._plan.adapter import Adapter
from .._plan.intent import intent
from .._plan.registry import checkpoint_format, config_folder, is_shipped
from .._plan.resolve import adapter_or_none
from .._plan.target import model_state_dict, schema_of
from .._plan.titan_names import for_export
from .._recipes.nodes import Node
from .._transaction.args import check_model_and_path, check_not_a_model, renamed_keywords
from .._transaction.materialize import has_meta
from .._transaction.steps import derive_adapter, open_checkpoint
from .._transaction.tidy import call_started, public
from .._transaction.transaction import Transaction
from ..errors import ExportError, RemoteRankError
from ..sources import (
    Source,
    is_url,
    loaded_from,
    tensor_checksums,
    transformers_config,
    write_checksums_data,
)
from .convert_spread import ConvertJob, convert_ranks
from .export_local import local_pieces
from .spread import SpreadJob, write_spread
from .spread_remote import write_spread_remote
from .writers.base import FORMATS
from .writing import CachedIO, ConvertReads, check_destination, plan_outputs, side_files, write_folder

log = logging.getLogger(__name__)

Progress = Callable[[str, int], None]  # (key, bytes) after each tensor is written


class ExportReport(BaseModel):
    """What was written.

    Attributes:
        dst: what was written.
        format: ``"safetensors"``, ``"torch"``, ``"dcp"`` or ``"torch_dist"`` (Megatron-Core's).
        tensors: tensors written.
        bytes: bytes written, by all ranks together.
        rank_bytes: bytes this rank wrote (a safetensors export, or a ``convert`` given a
            process group, on several ranks: about ``bytes / world``; otherwise all of them on
            rank 0, none elsewhere).
        files: the files written.
        skipped_non_tensor: non-tensor entries left out.
        read_back: whether the result was read back and compared (``convert(read_back=True)``).
        seconds: the whole call.

    Example::

        report = sdadapt.export(model, "out/", "llama")
        written = report.files
    """

    dst: str
    format: str
    tensors: int
    bytes: int
    rank_bytes: int = 0
    files: list[str]
    skipped_non_tensor: list[str] = []
    read_back: bool = False  # convert(read_back=True): the output was read back and compared
    seconds: float

    def format_text(self) -> str:
        what = f"{self.tensors} tensors, {self.bytes / 2**20:.1f} MiB"
        return f"wrote {self.dst} ({self.format}: {what}, {len(self.files)} file(s)) in {self.seconds:.2f} s" + (
            "; read back and compared" if self.read_back else ""
        )

    def __str__(self) -> str:  # str(report): the summary, not the fields
        return self.format_text()


# ------------------------------------------------------------------------------ planning
class _ModelStream:
    """``model``'s weights in the checkpoint's layout (through ``adapter.inverse()``), one output
    at a time: :meth:`pull` gathers the DTensors an output needs (``full_tensor()``: a
    collective, so every rank pulls the same keys in the same order) and keeps a gathered
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

        def prepare() -> tuple[dict[str, torch.Tensor], dict[str, Node], Adapter | None]:
            if check is not None:
                check()
            adapter = adapter_or_none(spec, folder, model)  # a shipped name's options: folder, else the model's config
            if has_meta(model):
                raise ExportError("the model has tensors on the meta device; load or initialise it before exporting")
            sd = model_state_dict(model)
            schema = schema_of(sd)  # with placements: an inverse interleave reads the TP degree from them
            named = adapter
            if native_names and adapter is not None:  # a shipped adapter: ours -> the model's own names
                named, sd = for_export(adapter, sd)
                schema = {k: schema[k] for k in sd}
            inverse = named.inverse() if named is not None else None
            return sd, plan_outputs(schema, inverse, what=what)[0], inverse

        # every rank exports the same outputs by the same recipes, or none does
        self.state, self.outputs, _ = txn.prepare(prepare, lambda p: intent(p[2], p[1]))
        self.io = CachedIO(self.outputs, self._fetch, lambda t: None)

    def _fetch(self, key: str) -> torch.Tensor:
        t = self.state[key]
        t = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        return t.cpu()

    def pull(self, key: str) -> torch.Tensor:
        """Output ``key`` (collective when the model holds DTensors); the previous output's
        leaves are dropped first."""
        return self.io.whole(self.outputs[key])

    def close(self) -> None:
        """Drop every gathered tensor still held."""
        self.io.flush()
        self.io.cache.clear()


@overload
def export_iter(
    model: nn.Module, adapter: Adapter | str | None = None, *, process_group: dist.ProcessGroup | None = None,
    local: Literal[False] = False,
) -> Iterator[tuple[str, torch.Tensor]]: ...


@overload
def export_iter(
    model: nn.Module, adapter: Adapter | str | None = None, *, process_group: dist.ProcessGroup | None = None,
    local: Literal[True],
) -> Iterator[tuple[str, torch.Tensor, Box]]: ...


def export_iter(
    model: nn.Module,
    adapter: Adapter | str | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    local: bool = False,
) -> Iterator[Any]:
    """Yield ``(name, tensor)`` for every weight of ``model`` in the checkpoint's layout, one at a
    time, without writing files (to push weights to an inference engine, for instance).

    ``adapter`` is the checkpoint->model adapter you load with (an :class:`Adapter` or a name
    resolved like the CLI's ``--adapter``); its inverse rules are applied. Every rank
    iterates: each tensor is gathered whole (``full_tensor()``) on every rank, so all ranks must
    consume the same sequence to the end (or close the generator on every rank). Memory: the
    tensor last yielded (plus leaves a later output still needs, e.g. the parts of a split); the
    generator drops its own references to an output when the next one is asked for, so a
    consumer that does not keep them holds about one tensor. Tensors are on the CPU. A shipped
    adapter's name takes its options from the checkpoint folder ``model`` was loaded from by
    :func:`sdadapt.load`, else from the model's own config (``model.config``), and reaches the
    names the model holds (torchtitan's current ones: see :func:`sdadapt.torchtitan.torchtitan_names`).

    ``local=True`` gathers nothing: each rank yields ``(name, piece, box)`` for the regions of
    each output it can make from its own shards (``box``: the piece's global ``(start, stop)``
    per dim in the output), and the ranks' pieces cover every output exactly once (of replicas,
    one rank yields; of copies on meshes that do not cover the group, as a 2-D job's parameters
    left out of the TP plan, one mesh's). After one small all-reduce when iterating starts (which
    copies count), ranks need not iterate in step; a consumer that accepts pieces (an engine
    that writes regions, ``sdadapt.refit_plan`` for shard-to-shard moves) gets no whole tensor.
    A piece may be a view of the shard: copy it to keep it.

    Args:
        model: the loaded model (every rank iterates).
        adapter: the checkpoint->model adapter you load with, or a spec string.
        process_group: the group the tensors are gathered over.
        local: yield this rank's pieces with their global boxes instead of whole tensors.

    Yields:
        ``(name, tensor)`` in the checkpoint's layout, whole, on the CPU; with ``local=True``
        ``(name, piece, box)``, on the CPU.

    Example::

        for name, tensor in sdadapt.export_iter(model, "llama"):
            engine.update_weight(name, tensor)
    """
    check_model_and_path("sdadapt.export_iter(model, adapter=None, ...)", model, adapter, path_arg="adapter")
    shipped = is_shipped(adapter)  # our documented layout
    stream = _ModelStream(model, adapter, process_group, "export_iter", native_names=shipped)
    if local:
        stream.close()
        yield from local_pieces(stream.state, stream.outputs, rank_and_world(process_group)[0], process_group)
        return
    try:
        for key in list(stream.outputs):
            yield key, stream.pull(key)
    finally:
        stream.close()


_KEY, _DONE, _ABORT = "key", "done", "abort"


@public
def export(
    model: nn.Module,
    dst: str | os.PathLike[str],
    adapter: Adapter | str | None = None,
    format: str | None = None,  # noqa: A002 - the user-facing name
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = False,
    assets: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> ExportReport:
    """Write ``model``'s weights to ``dst`` through ``adapter.inverse()``; every rank calls it.

    ``adapter`` is the checkpoint->model adapter you load with (see the module docstring; an
    :class:`Adapter` or a name resolved like the CLI's ``--adapter``);
    ``format`` is ``"safetensors"`` (a folder: ``model.safetensors``, or shards of at most
    ``max_shard_size`` plus ``model.safetensors.index.json``), ``"torch"`` (one ``torch.save``
    file of a flat dict), ``"dcp"`` (a DCP folder) or ``"torch_dist"`` (Megatron-Core's); not
    given, the format of the shipped adapter's checkpoints (``"torch_dist"`` for
    ``megatron_gpt``), else ``"safetensors"``. The tensors come from the stream
    :func:`export_iter` iterates, in the order the writer asks for them (rank 0 tells the other
    ranks which key is next); rank 0 writes; the output appears at ``dst`` atomically. On
    several ranks, ``"safetensors"`` to a local or shared folder is written by every rank
    instead: each writes the bytes of the regions of each output it holds, into the same files
    (the ordinary HF layout), and rank 0 writes the index and side files and renames the
    folder into place once every rank succeeded; each rank then writes about ``1/world`` of the
    bytes (``report.rank_bytes``) and no rank gathers a tensor whose recipe can be cut along
    the shards (one that cannot, a rotary permutation of rows split mid-head, is gathered and
    written by one rank). The folder must be on a filesystem every rank sees. To an object
    storage URL each file is uploaded by one rank, which receives the bytes the other ranks
    hold window by window (files cut to about ``1/world`` of the checkpoint; see
    docs/object-storage.md). ``checksums=True`` also writes ``sdadapt.checksums.json`` (beside a
    torch file: ``<file>.sdadapt.checksums.json``), computed from the tensors as they are
    written (to a URL from every rank: by each file's owner, from the bytes it uploads), for
    ``load(..., checksums=True)``.

    A folder (``"safetensors"``, ``"dcp"``) also gets the checkpoint's side files, so that it
    opens in transformers and with ``--adapter NAME``: ``config.json``, tokenizer and generation
    files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``tokenizer.model``, ``generation_config.json`` ...) copied from ``assets``, else from the
    checkpoint folder ``model`` was loaded from by :func:`sdadapt.load`; without either, a
    transformers model's own ``config.json`` (``model.config``) is written. A shipped adapter's
    name takes its options from the same places.

    Args:
        model: the loaded model (every rank calls it).
        dst: the folder (``"safetensors"``, ``"dcp"``) or file (``"torch"``) to write.
        adapter: the checkpoint->model adapter you load with, or a spec string; ``None``: the
            model's own keys.
        format: ``"safetensors"``, ``"torch"``, ``"dcp"`` or ``"torch_dist"`` (Megatron-Core's);
            ``None``: the shipped adapter's checkpoint format, else ``"safetensors"``.
        max_shard_size: the largest safetensors shard (``"5GB"`` or bytes).
        overwrite: replace an existing ``dst``.
        process_group: the group the ranks export over.
        checksums: also write ``sdadapt.checksums.json``.
        assets: a folder whose config, tokenizer and generation files are copied beside the weights.
        progress: a bar of the bytes written (and the tensor count) on rank 0's stderr, drawn
            only on a terminal with sdadapt's logging on; ``False``: never.

    Returns:
        The :class:`~sdadapt.reports.ExportReport`: the files written, keys and bytes.

    Example::

        report = sdadapt.load(model, "path/to/llama", "llama")
        sdadapt.export(model, "out/llama-hf", "llama")  # the HF layout again, with its config
    """
    t0 = call_started()
    check_model_and_path("sdadapt.export(model, dst, adapter=None, format='safetensors', ...)", model, dst, path_arg="dst")
    dst = os.fspath(dst)
    format = format or checkpoint_format(adapter) or "safetensors"  # noqa: A001
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
            check_destination(dst, overwrite)

    stream = _ModelStream(model, adapter, process_group, f"export to {dst}", check, native_names=shipped, folder=folder)
    outputs = stream.outputs
    total = sum(math.prod(n.shape) * n.dtype.itemsize for n in outputs.values())
    if format == "safetensors" and world > 1:  # every rank writes its regions
        bars: list[TransferBar] = []

        def progress_of(mine: int) -> Callable[[int], None]:
            bars.append(TransferBar(mine, "sdadapt.export", tensors=len(outputs), rank=rank, enabled=progress))
            return bars[0].update

        try:
            job = SpreadJob(
                dst, outputs, stream.state, stream.pull, rank=rank, world=world, group=process_group, max_shard_size=max_shard_size,
                overwrite=overwrite, checksums=checksums, finish=lambda tmp: side_files(tmp, folder, config), progress=progress_of,
                after_gather=stream.close,
            )  # fmt: skip
            names, mine = (write_spread_remote if is_url(dst) else write_spread)(job)  # a URL: each file uploaded by one rank
        finally:
            for b in bars:
                b.close()
            stream.close()
        return _reported(dst, format, outputs, total, mine, names, t0, rank)
    src0 = dist.get_global_rank(process_group, 0) if is_distributed() and process_group is not None else 0
    written = [0]
    sums: dict[str, Any] = {}
    bar = TransferBar(total, "sdadapt.export", tensors=len(outputs), rank=rank, enabled=progress)

    def pull(key: str) -> torch.Tensor:
        if world > 1:
            dist.broadcast_object_list([(_KEY, key)], src=src0, group=process_group)
        t = stream.pull(key)
        written[0] += t.numel() * t.element_size()
        bar.update(t.numel() * t.element_size())
        if checksums:  # from the tensor in hand: no read-back (sdadapt.checksums.json, for load(checksums=True))
            sums[key] = tensor_checksums(TensorInfo(tuple(t.shape), t.dtype), lambda box: t[slices(box)])
        return t

    files: list[str] = []
    try:
        if rank == 0:
            try:
                def finish(tmp: str) -> None:
                    side_files(tmp, folder, config)
                    if checksums and is_url(dst):  # uploaded with the rest, before the index
                        write_checksums_data(tmp, sums)

                files = write_folder(dst, format, outputs, pull, max_shard_size=max_shard_size, overwrite=overwrite, check=finish)
                if checksums and not is_url(dst):
                    write_checksums_data(dst, sums)
            except BaseException as e:
                if world > 1:
                    dist.broadcast_object_list([(_ABORT, f"{type(e).__name__}: {e}")], src=src0, group=process_group)
                raise
            if world > 1:
                dist.broadcast_object_list([(_DONE, files)], src=src0, group=process_group)
        else:
            files = _follow(stream, written, process_group, src0, dst)
    finally:
        bar.close()
        stream.close()
    return _reported(dst, format, outputs, total, written[0] if rank == 0 else 0, files, t0, rank)


def _reported(dst: str, fmt: str, outputs: dict[str, Node], total: int, mine: int, files: list[str], t0: float, rank: int) -> ExportReport:
    rep = ExportReport(
        dst=dst, format=fmt, tensors=len(outputs), bytes=total, rank_bytes=mine, files=files, seconds=time.perf_counter() - t0
    )
    log.info("rank %d: %s (%.1f MiB from this rank)", rank, rep.format_text(), mine / 2**20)
    return rep


def _follow(
    stream: _ModelStream, written: list[int], group: dist.ProcessGroup | None, src0: int, dst: str
) -> list[str]:
    """A rank other than 0 of :func:`export`: pull the keys rank 0 names, until it is done."""
    while True:
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=src0, group=group)
        kind, value = msg[0]
        if kind == _KEY:
            t = stream.pull(value)
            written[0] += t.numel() * t.element_size()
            del t
        elif kind == _DONE:
            return list(value)
        else:
            raise RemoteRankError(f"rank 0 failed while writing {dst}, so this rank stops too:\n{value}")


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
    process_group: dist.ProcessGroup | None = None,
) -> ExportReport:
    """Rewrite checkpoint ``src`` as ``dst`` in ``format``, applying ``adapter`` (source layout ->
    destination layout), one tensor at a time in one process (or, given ``process_group``,
    on every rank of it, each writing its share of the files). ``read_back=True`` reads the result
    back (before it is renamed into place) and compares every tensor with the source
    (bit-exact); a difference is an error and leaves nothing at ``dst``. Non-tensor entries are skipped
    (listed in the report). ``adapter`` may be a name, ``file.py:ATTR``, ``module:ATTR`` or
    ``.json`` (resolved like the CLI's ``--adapter``, options read from ``src``'s folder);
    ``src`` may be a Hub id ``hf://org/name[@revision]``. ``on_progress(key, nbytes)`` is called
    after each tensor is written, then after each is read back.

    Args:
        src: the checkpoint path, Hub id or :class:`~sdadapt.sources.Source`.
        dst: the folder (``"safetensors"``, ``"dcp"``) or file (``"torch"``) to write.
        adapter: the source->destination adapter, or a spec string; ``None``: keys unchanged.
        format: ``"safetensors"``, ``"torch"``, ``"dcp"`` or ``"torch_dist"`` (Megatron-Core's).
        max_shard_size: the largest safetensors shard.
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read.
        overwrite: replace an existing ``dst``.
        read_back: read the result back and compare every tensor with the source.
        on_progress: ``on_progress(key, nbytes)`` after each tensor.
        process_group: ``None``: this process converts alone (as a call on one rank of a job).
            A group of several ranks: every rank of it calls ``convert`` with the same
            arguments, and ``"safetensors"`` is written by all of them: the files are cut to
            about ``1/world`` of the bytes and dealt to the ranks, each reads only the source
            tensors of its files and writes them (to a folder every rank sees, or an object
            storage URL), rank 0 the side files and the index last, once every rank succeeded
            (``report.rank_bytes``: this rank's share). Other formats are written by one process.

    Returns:
        The :class:`~sdadapt.reports.ExportReport`.

    Example::

        sdadapt.convert("release/model.pt", "release-st", format="safetensors", read_back=True)
    """
    t0 = time.perf_counter()
    call = "sdadapt.convert(src, dst, adapter=None, ...) for a checkpoint, sdadapt.export(model, dst, ...) for a model"
    check_not_a_model(call, src)
    check_not_a_model(call, dst, path_arg="dst")
    dst = os.fspath(dst)
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if process_group is not None and rank_and_world(process_group)[1] > 1:
        if format != "safetensors":
            raise ExportError(f"convert(..., process_group=...) writes safetensors from every rank; format {format!r} is written "
                              "by one process: call convert without process_group on one rank")  # fmt: skip
        job = ConvertJob(src, dst, adapter, max_shard_size, subtree, overwrite, read_back, on_progress)
        n, total, names, skipped, mine = convert_ranks(job, process_group)
        return ExportReport(dst=dst, format=format, tensors=n, bytes=total, rank_bytes=mine, files=names, skipped_non_tensor=skipped,
                            read_back=read_back, seconds=time.perf_counter() - t0)  # fmt: skip
    check_destination(dst, overwrite)
    source = open_checkpoint(src, subtree)  # **open**, once for the call
    txn = Transaction(None, None, source.path)
    try:
        txn.add_source(source)  # the source's files must not change while they are converted
        adapter = derive_adapter(adapter, source)  # **adapter**: a shipped name's options from the open source
        outputs, skipped = plan_outputs(source.schema, adapter, non_tensor=source.non_tensor, what=f"convert {source.path}")
        if skipped:
            log.warning("convert: %d non-tensor entries are not written: %s", len(skipped), ", ".join(skipped[:8]))
        reads = ConvertReads(source, outputs, txn, dst, read_back, on_progress)

        def check(tmp: str) -> None:
            reads.check(tmp, outputs)
            side_files(tmp, config_folder(source.path), None)

        files = write_folder(dst, format, outputs, reads.whole, max_shard_size=max_shard_size, overwrite=overwrite, check=check)
    finally:
        txn.close()
    return ExportReport(
        dst=dst,
        format=format,
        tensors=len(outputs),
        bytes=reads.bytes,
        rank_bytes=reads.bytes,
        files=files,
        skipped_non_tensor=skipped,
        read_back=read_back,
        seconds=time.perf_counter() - t0,
    )


__all__ = ["ExportError", "ExportReport", "convert", "export", "export_iter"]
