"""Refit: the training model's shards -> an inference engine's shards, every training step.

:func:`refit_plan` is called once on every rank of a process group; it returns a :class:`Refit`
whose :meth:`Refit.run` moves the bytes, as often as wanted. A rank may hold trainer shards,
engine shards or both (colocated). The engine's tensors are the target of an ordinary plan (the
adapter maps the trainer's keys onto the engine's), and each engine rank asks, through its
tensors' recipes, only for the regions of trainer tensors its own shards are made of. Those
regions go from the ranks that hold them (``refit_schedule``): pieces straight into views of the
engine tensors, computations' inputs staged until the computation runs on the receiving rank.
A cast to a narrower dtype happens on the sending side (the same bits, fewer bytes), and so does
a computation whose result is smaller than what it reads (a re-quantization) wherever one
trainer rank holds all it reads: the engine region is cut (in halves along its leading dims,
never inside what one value reads, such as an FP8 block) into parts that one rank can make, the
rest computed on the receiving rank from its inputs, but for FP8 blocks (FP8 weights of one
scale, NVFP4 weights) cut by the trainer's shards: their holders agree on each block's largest
magnitude and quantize their own rows (``refit_cut``), so such an engine receives its own bytes only. Nothing is gathered whole unless
an engine rank holds it whole.

Transport: point-to-point sends and receives of the group's backend (gloo on the CPU, NCCL on
GPUs), in rounds; a rank packs one round while the one before is in flight, each in a buffer of
at most half of ``bucket_bytes`` (allocated for the run and released after it). Delta mode reads the
trainer tensors' version counters (``tensor._version``: every in-place change, an optimizer's
step included, bumps it) and moves only the engine tensors made from a changed one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.agreement import agree_on
from .._base.distributed import agree, collective_device, gather_agreed, gather_objects, is_distributed, rank_and_world
from .._base.regions import Box, box_shape, dtensor_box, full_box
from .._base.schema import TensorInfo, dtype_name
from .._export import plan_outputs, reads_of
from .._plan.adapter import Adapter, with_dtype
from .._plan.intent import intent, no_intent
from .._plan.plan import build_plan
from .._plan.registry import EngineLayout
from .._plan.target import model_state_dict, schema_of
from .._recipes.nodes import Compute, Node, Piece, Step
from .._transaction.options import Options
from ..errors import RefitError, SdadaptError
from .refit_cut import CutBlocks, applies, can_cut, plan_cut, whole_weight
from .refit_run import Refit, _Mine
from .refit_schedule import Held, Request, maker, round_bytes, transfers_of, volume
from .refit_send import Region, SendFn, plan_regions

log = logging.getLogger(__name__)
P = ParamSpec("P")


# ------------------------------------------------------------------------------ what a rank holds
def _placed(t: torch.Tensor, what: str, key: str) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """A tensor's global shape, the box this rank holds and its local tensor."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), full_box(tuple(t.shape)), t.detach()
    box = dtensor_box(t)
    if box is None:
        raise RefitError(
            f"{what} tensor {key!r} has placements {t.placements}; refit reads shards placed with Shard and Replicate, "
            "and FSDP over a TP-sharded dim (_StridedShard) as torchtitan's 2-D layout places it; redistribute it"
        )
    return tuple(t.shape), box, t._local_tensor.detach()


def _tensors(obj: nn.Module | Mapping[str, torch.Tensor] | None, engine: bool) -> dict[str, torch.Tensor]:
    if obj is None:
        return {}
    if isinstance(obj, nn.Module):
        return dict(obj.named_parameters()) if engine else model_state_dict(obj)
    if isinstance(obj, Mapping):
        return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    raise RefitError(f"expected a model, a dict of tensors or None; got {type(obj).__name__}")


# ------------------------------------------------------------------------------ planning
def _collectives_failing(plan: Callable[P, Refit]) -> Callable[P, Refit]:
    """``plan`` with the backend's error (a rank left, or broke the group, while the ranks
    planned) raised as a :class:`RefitError` naming this rank."""

    @functools.wraps(plan)
    def planned(*args: P.args, **kwargs: P.kwargs) -> Refit:
        try:
            return plan(*args, **kwargs)
        except RuntimeError as e:
            rank = rank_and_world(kwargs.get("process_group"))[0]  # type: ignore[arg-type]
            raise RefitError(f"planning the refit failed on rank {rank}: a collective failed ({type(e).__name__}: {e}); "
                             "nothing was written; plan again once every rank is back") from e  # fmt: skip

    return planned


@_collectives_failing
def refit_plan(
    trainer: nn.Module | Mapping[str, torch.Tensor] | None,
    engine: nn.Module | Mapping[str, torch.Tensor] | None,
    adapter: Adapter | None = None,
    *,
    engine_layout: EngineLayout | None = None,
    process_group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 256 << 20,
    delta: bool = False,
    timeout: float = 600.0,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    send: SendFn | None = None,
) -> Refit:
    """Plan moving a training model's shards into an inference engine's shards; every rank of
    ``process_group`` calls it (the planning is collective), then calls the result's
    :meth:`Refit.run` after each training step.

    ``send``: the engine is not in the group (disaggregated over its own channel). Then
    ``engine`` describes the engine's whole tensors (shapes and dtypes: tensors on the ``meta``
    device will do, or ``None`` for the adapter's outputs as they come), and each trainer rank
    makes the regions of them it can make from the shards it owns (of replicas, one rank) and
    calls ``send([(engine key, global box, piece), ...])`` with buckets of at most
    ``bucket_bytes``; the pieces are views of a buffer reused once ``send`` returns. The ranks'
    regions cover every engine tensor once; the receiver cuts its own shards from them.

    ``trainer``: this rank's part of the training model (a model whose parameters are DTensors,
    as FSDP2 / TP / 2-D leave them, or a state dict), ``None`` on a rank that holds no trainer
    shards (an engine-only rank). ``engine``: this rank's engine tensors (a model, e.g. a vLLM
    worker's model, whose ``named_parameters()`` are written; or a dict of tensors), ``None`` on a
    trainer-only rank. A rank may hold both (colocated). ``adapter`` maps the trainer's keys onto
    the engine's (``None``: the same keys and layouts), as for :func:`sdadapt.load` with the
    trainer's state dict as the checkpoint, then each tensor is cast to the engine's dtype: e.g. a family's adapter inverted (trainer -> HF)
    followed by ``sdadapt.adapters.vllm_llama.build(...)`` (HF -> vLLM). An engine DTensor says
    where its shard lies; a plain engine tensor is whole, unless ``engine_layout(key, tensor)``
    gives its global shape and box (``sdadapt.adapters.vllm_llama.layout(tp, rank)``).

    Each engine rank receives exactly the regions its shards are made of, from the ranks that
    hold them; narrowing casts happen before sending; a computed recipe whose result is smaller
    than its inputs (a re-quantization) runs on the trainer rank holding its inputs where one
    does, else on the receiving rank. No rank gathers a whole tensor unless its engine shard
    needs all of it.

    Args:
        trainer: this rank's training model or state dict (DTensors or plain tensors), or ``None``.
        engine: this rank's engine model or tensors (written in place), or ``None``.
        adapter: the trainer -> engine adapter; ``None``: keys and layouts as they are.
        engine_layout: ``(key, tensor) -> (global shape, box)`` for plain engine tensors that are
            shards.
        process_group: the group of every trainer and engine rank (default: the world).
        bucket_bytes: the most memory one rank's transfers take: two buffers of half of it, one
            round (its sends and receives) packed while the other moves.
        delta: a run moves only the engine tensors made from a trainer tensor changed in place
            since the previous run (version counters: a DTensor's and its local shard's).
        timeout: seconds a run waits for any one transfer before failing on every rank, and
            seconds planning waits for every rank to arrive.
        allow_missing: engine key patterns the trainer need not provide (left as they are).
        allow_unexpected: adapted trainer key patterns the engine need not hold (not sent).
        send: ``send(bucket)`` for an engine outside the group: ``bucket`` lists ``(engine
            key, global box, piece)``; ``engine`` then gives the whole tensors' shapes and dtypes.

    Returns:
        The :class:`Refit`; call it (or its ``run()``) to move the weights.

    Example::

        refit = sdadapt.refit_plan(trainer, engine, adapter)
        refit()  # after every training step, on every rank
        # an engine outside the group: every trainer rank sends the regions it makes
        sdadapt.refit_plan(trainer, whole_engine_on_meta, adapter, send=push_to_engine)()
    """
    options = Options(name="the trainer", allow_missing=tuple(allow_missing or ()), allow_unexpected=tuple(allow_unexpected or ()))
    group = process_group
    rank, world = rank_and_world(group)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 32:
        raise RefitError(f"bucket_bytes={bucket_bytes!r} must be an int of at least 32")
    if send is not None and (not callable(send) or engine_layout is not None):
        raise RefitError("send= takes a function send(bucket), and the engine's whole tensors (no engine_layout=)")
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    try:
        trainer_t = _tensors(trainer, engine=False)
        engine_t = _tensors(engine, engine=True)
        held_t: dict[str, Held] = {}
        local_t: dict[str, torch.Tensor] = {}
        box_t: dict[str, Box] = {}
        described = schema_of(trainer_t)  # placements and mesh: an inverse interleave reads its TP degree there
        for k, t in trainer_t.items():
            shape, box, local = _placed(t, "trainer", k)
            info = described[k]
            held_t[k], local_t[k], box_t[k] = Held(shape, dtype_name(t.dtype), box, info.placements, info.mesh), local, box
        held_e: dict[str, Held] = {}
        local_e: dict[str, torch.Tensor] = {}
        for k, t in engine_t.items():
            if send is not None:  # the engine's whole tensors, described: none is held here
                held_e[k] = Held(tuple(t.shape), dtype_name(t.dtype), full_box(tuple(t.shape)))
                continue
            if isinstance(t, DTensor) or engine_layout is None:
                shape, box, local = _placed(t, "engine", k)
            else:
                shape, given = engine_layout(k, t)
                box = tuple((int(a), int(b)) for a, b in given)
                shape, local = tuple(shape), t.detach()
                if box_shape(box) != tuple(local.shape):
                    raise RefitError(f"engine tensor {k!r}: its layout gives box {list(box)} but it holds {list(local.shape)}")
            held_e[k], local_e[k] = Held(shape, dtype_name(t.dtype), box), local
        # of copies on meshes that do not cover the group (a 2-D job's parameter left out of the TP
        # plan, a plain tensor on every rank), the copy whose mesh has the lowest rank counts (send=)
        me = dist.get_rank() if is_distributed() else 0
        first = {k: int(t.device_mesh.mesh.min()) if isinstance(t, DTensor) else me for k, t in trainer_t.items()}
        meta = {"trainer": held_t, "engine": held_e, "first": first}
    except SdadaptError as e:
        error = e
    # the planning's first collective waits at most ``timeout`` for a rank that stalls before it
    agree(error, group, RefitError, timeout=timeout)
    metas = gather_objects(meta, group)
    trainer_all = [m["trainer"] for m in metas]
    recipes: dict[str, Node] = {}
    error = None
    try:  # planned on every rank from the same schemas: a failure on one rank, or another plan, stops all
        source = _schema(trainer_all, "trainer")
        target = _schema([m["engine"] for m in metas], "engine")
        if send is not None and not target:  # no engine described: the adapter's outputs as they come
            recipes, _ = plan_outputs(source, adapter, what="refit")
        else:
            plan = build_plan(source, target, with_dtype(adapter, "model"), allow_missing=list(options.allow_missing),
                              allow_unexpected=list(options.allow_unexpected), source_name="trainer", target_name="engine")  # fmt: skip
            if not plan.report.ok:
                raise RefitError("the trainer's tensors, through the adapter, do not line up with the engine's:\n" + plan.report.format())
            recipes = plan.recipes
    except Exception as e:  # noqa: BLE001 - every failure must be agreed, whatever its type
        error = e if isinstance(e, RefitError) else RefitError(f"planning failed: {type(e).__name__}: {e}")
    parts = no_intent() if error is not None else intent(adapter, recipes, delta=delta, bucket_bytes=bucket_bytes)
    agree_on(parts, error, group, what="refit", mismatch=RefitError, remote=RefitError)
    dtypes = {k: v.dtype for k, v in source.items()}
    sending: list[Region] | None = None
    mine = _Mine()
    error = None
    try:
        if send is not None:  # no engine tensor is held here: the regions this rank sends
            leaves = {leaf for n in recipes.values() for leaf in n.leaves()}
            counted = {k for k, f in meta["first"].items() if k in leaves and f == min(m["first"].get(k, f) for m in metas)}
            sending = plan_regions({k: t for k, t in trainer_t.items() if k in counted}, dtypes, recipes, rank, bucket_bytes)
        for k in sorted(local_e):
            if k not in recipes:
                continue
            node, dest = recipes[k], local_e[k]
            ebox = meta["engine"][k].box
            steps = node.steps(ebox, dest)
            made = _made_by_senders(node, ebox, steps, trainer_all, dtypes, rank)
            # the parts no one trainer rank can make: FP8 blocks quantized by their holders on
            # agreed scales (refit_cut), anything else computed here from its inputs
            cut = [part for part, src in made if src < 0 and can_cut(node, part, trainer_all, dtypes, rank)]
            if made:
                steps = [s for part, src in made if src < 0 and part not in cut for s in node.steps(part, dest[_within(part, ebox)])]
            mine.steps[k] = steps
            mine.where[k] = dest.device
            _requests(k, node, steps, source, dtypes, mine)

            def add(req: Request, view: torch.Tensor, k: str = k) -> None:
                i = len(mine.requests)
                mine.requests.append(dataclasses.replace(req, index=i))
                mine.dest[i] = view
                mine.by_target[k].append(i)

            for part, src in made:
                if src >= 0:
                    add(Request(k, k, part, dtype_name(node.dtype), -1, src), dest[_within(part, ebox)])
            for part in cut:
                plan_cut(k, node, part, dest[_within(part, ebox)], trainer_all, dtypes, rank, mine.cut, add)
    except SdadaptError as e:
        error = e
    # one exchange: every rank's requests and cut bands, or the first rank's failure on every rank
    gathered = gather_agreed((mine.requests, mine.cut.bands), error, group, RefitError)
    requests = [r for r, _ in gathered]
    transfers = transfers_of(trainer_all, requests, round_bytes(bucket_bytes), bucket_bytes)
    device = collective_device(group) if is_distributed() else torch.device("cpu")
    bands = [b for _, b in gathered]
    cut_blocks = CutBlocks(bands, recipes, group, rank, device, timeout) if any(bands) else None
    refit = Refit(
        rank=rank, world=world, group=group, recipes=recipes, send=send, sending=sending, bucket_bytes=bucket_bytes, delta=delta,
        timeout=timeout, mine=mine, trainer=local_t, versioned=trainer_t, trainer_box=box_t,
        source_dtype={k: v.dtype for k, v in source.items()}, transfers=transfers, device=device, cut=cut_blocks,
    )  # fmt: skip
    log.info("refit planned on rank %d: %d engine tensors here, %d transfers", rank, len(mine.steps), len(transfers))
    return refit


def _schema(per_rank: list[dict[str, Held]], what: str) -> dict[str, TensorInfo]:
    """Every key's global shape and dtype; ranks that disagree are an error (the same on all)."""
    out: dict[str, TensorInfo] = {}
    for r, held in enumerate(per_rank):
        for k, h in sorted(held.items()):
            info = TensorInfo(h.shape, getattr(torch, h.dtype), h.placements, h.mesh)
            if k in out and (out[k].shape, out[k].dtype) != (info.shape, info.dtype):
                raise RefitError(
                    f"{what} tensor {k!r} is {list(h.shape)} {h.dtype} on rank {r} but "
                    f"{list(out[k].shape)} {dtype_name(out[k].dtype)} on another rank; every rank must hold the same tensor"
                )
            out[k] = info
    return out


def _within(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def _made_by_senders(
    node: Node, box: Box, steps: list[Step], trainer: list[dict[str, Held]], dtypes: dict[str, torch.dtype], dst: int
) -> list[tuple[Box, int]]:
    """For a computed engine region whose result is smaller than what it reads (a re-quantization):
    its parts, each with the trainer rank that holds everything the part reads and computes it
    there (``-1``: no one rank does: an FP8 weight's part is quantized by its holders on agreed
    scales, ``refit_cut``; another's is computed here from its inputs). Cut in halves
    along its longest leading dim while that narrows what the halves read (an FP8 block cut by
    the trainer's shards stays whole). ``[]``: computed here, from its inputs."""
    if not any(isinstance(s, Compute) for s in steps):
        return []

    def nbytes(reads: list[tuple[str, Box]]) -> int:
        return sum(volume(b) * dtypes[k].itemsize for k, b in reads)

    reads = reads_of(node, box, dtypes)
    if volume(box) * node.dtype.itemsize >= nbytes(reads):
        return []
    if len(box) < 2 or whole_weight(node):  # a per-tensor value: made where the whole tensor is, if one rank holds it, else agreed
        src = maker(trainer, reads, dst)
        return [(box, src)] if src >= 0 or applies(node) else []
    out: list[tuple[Box, int]] = []

    def halves(part: Box, d: int) -> list[Box]:
        a, b = part[d]
        return [part[:d] + (h,) + part[d + 1 :] for h in ((a, (a + b) // 2), ((a + b) // 2, b))]

    def split(part: Box, reads: list[tuple[str, Box]], depth: int) -> None:
        src = maker(trainer, reads, dst)
        if src >= 0 or depth > 24:
            out.append((part, src))
            return
        # of the leading dims, the one whose halves some rank makes whole, else the longest that
        # still narrows what each half reads (inside one FP8 block a half reads all of it)
        dims = sorted((d for d in range(len(part) - 1) if part[d][1] - part[d][0] > 1), key=lambda d: part[d][0] - part[d][1])
        best: tuple[list[Box], list[list[tuple[str, Box]]]] | None = None
        for d in dims:
            hs = halves(part, d)
            got = [reads_of(node, h, dtypes) for h in hs]
            if any(set(g) == set(reads) for g in got):
                continue
            if all(maker(trainer, g, dst) >= 0 for g in got):
                best = (hs, got)
                break
            best = best or (hs, got)
        if best is None:
            out.append((part, -1))
            return
        for h, g in zip(*best, strict=True):
            split(h, g, depth + 1)

    split(box, reads, 0)
    return out if any(src >= 0 for _, src in out) or applies(node) else []


def _requests(k: str, node: Node, steps: list[Step], source: dict[str, TensorInfo], dtypes: dict[str, torch.dtype], mine: _Mine) -> None:
    """The regions of trainer tensors engine tensor ``k``'s steps need."""
    first = len(mine.requests)
    asked: list[tuple[str, Box]] = []
    for s in steps:
        if isinstance(s, Piece):
            src, dst = source[s.key].dtype, s.dest.dtype
            wire = dst if dst.itemsize < src.itemsize else src
            i = len(mine.requests)
            mine.requests.append(Request(k, s.key, s.box, dtype_name(wire), i))
            mine.dest[i] = s.dest
        elif isinstance(s, Compute):
            asked += [a for a in reads_of(s.node, s.box, dtypes) if a not in asked]
    mine.by_target[k] = list(range(first, len(mine.requests)))
    leaves = frozenset(node.leaves())
    for key, box in asked:
        # engine tensors made from the same trainer tensors (an FP8 weight and its scales) share
        # the regions both read: one transfer, staged once
        i = mine.shared.get((leaves, key, box), -1)
        if i < 0:
            i = mine.shared[(leaves, key, box)] = len(mine.requests)
            mine.requests.append(Request(k, key, box, dtype_name(source[key].dtype), i))
        mine.users.setdefault(i, []).append(k)
        mine.inputs.setdefault(k, []).append(i)
        mine.by_target[k].append(i)


__all__ = ["refit_plan"]
