"""A planned refit's runs: :class:`Refit` moves the bytes :func:`sdadapt.refit_plan` scheduled,
and says what it did in a :class:`RefitReport` (see :mod:`sdadapt._refit.refit`)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel

from .._base.regions import Box, box_shape
from .._recipes.nodes import Compute, Fill, Node, Step
from ..errors import RefitError
from .refit_cut import CutBlocks, CutPlan
from .refit_schedule import Request, Transfer, round_bytes, rounds_of
from .refit_send import LocalShards, Region, SendFn, send_regions

log = logging.getLogger(__name__)


class RefitReport(BaseModel):
    """What one :meth:`Refit.run` did on this rank.

    Attributes:
        rank: this rank in the refit's group.
        updated: the engine tensors of this rank written by the run.
        unchanged: those left as they were (delta mode: made only from unchanged trainer tensors).
        bytes_sent: bytes this rank sent to other ranks.
        bytes_received: bytes it received from other ranks.
        bytes_local: bytes copied from its own trainer shards into its own engine shards.
        rounds: rounds of the run (every rank runs the same number).
        buffer_bytes: the bytes of the round buffers this rank held (at most ``bucket_bytes``).
        staged_bytes: the most bytes held at once for computations' inputs (0 for recipes that
            only move and cast data).
        seconds: the run's wall time.

    Example::

        refit = sdadapt.refit_plan(trainer, engine, adapter)
        report = refit.run()
        moved = report.bytes_received + report.bytes_local  # this rank's engine bytes
    """

    rank: int
    updated: list[str]
    unchanged: list[str] = []
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    rounds: int = 0
    buffer_bytes: int = 0
    staged_bytes: int = 0
    seconds: float = 0.0

    def format_text(self) -> str:
        return (
            f"rank {self.rank}: refit {len(self.updated)} engine tensors ({len(self.unchanged)} unchanged), "
            f"sent {_size(self.bytes_sent)}, received {_size(self.bytes_received)}, local {_size(self.bytes_local)} "
            f"in {self.rounds} rounds, {self.seconds:.3f} s"
        )

    def __str__(self) -> str:
        return self.format_text()


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class _Staged:
    """A source serving the staged inputs of computations (on ``device``: the computations'
    regions are assembled there, not on the host)."""

    def __init__(self, staged: dict[tuple[str, Box], torch.Tensor], target: str, device: torch.device):
        self.staged = staged
        self.target = target
        self.device = device

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self.staged.get((key, box))
        if t is None:
            raise RefitError(f"engine tensor {self.target!r}: its recipe read region {list(box)} of {key!r}, which was not sent")
        return t


@dataclass
class _Mine:
    """This engine rank's side: each engine tensor's steps, and where each request lands."""

    steps: dict[str, list[Step]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    dest: dict[int, torch.Tensor] = field(default_factory=dict)  # request -> view of the engine tensor (pieces)
    inputs: dict[str, list[int]] = field(default_factory=dict)  # engine key -> requests its computations read
    by_target: dict[str, list[int]] = field(default_factory=dict)  # engine key -> all its requests
    where: dict[str, torch.device] = field(default_factory=dict)  # engine key -> its tensor's device
    users: dict[int, list[str]] = field(default_factory=dict)  # a computation's input -> the engine keys reading it
    shared: dict[tuple[frozenset[str], str, Box], int] = field(default_factory=dict)  # (leaves, key, box) -> request
    cut: CutPlan = field(default_factory=CutPlan)  # FP8 blocks cut by the trainer's shards (refit_cut)


@dataclass
class _Run:
    """One run's progress on this rank."""

    rep: RefitReport
    remaining: dict[int, int] = field(default_factory=dict)  # request -> transfers still to land
    open: dict[str, int] = field(default_factory=dict)  # engine key -> requests still incomplete
    ready: list[str] = field(default_factory=list)  # engine keys whose bytes are all in
    done: set[str] = field(default_factory=set)
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    readers: dict[int, int] = field(default_factory=dict)  # staged input -> computations still to read it
    staged_now: int = 0


def _version(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s version counters: a DTensor's own (its in-place ops) and its local tensor's (in-place
    changes made through ``to_local()``, as optimizers over local shards make them), which move
    independently."""
    local = getattr(t, "_local_tensor", None)
    return (t._version,) if local is None else (t._version, local._version)


def _scales_memo() -> contextlib.AbstractContextManager[None]:
    """An FP8 weight's scales taken from its codes' pass (``quant_fused.scales_memo``), where a
    recipe quantizes: only then is that module imported."""
    fused = sys.modules.get("sdadapt._recipes.quant_fused")
    return fused.scales_memo() if fused is not None else contextlib.nullcontext()


def _offset(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


class Refit:
    """A refit planned by :func:`sdadapt.refit_plan`: :meth:`run` (or calling it) moves the
    trainer's current weights into the engine's tensors. Every rank of the group calls it at the
    same point; the plan is reused, a run only moves bytes.

    Attributes:
        recipes: engine key -> the recipe that makes it from the trainer's tensors.
        bucket_bytes: a rank's buffers for the transfers (two rounds of half of it each).
        delta: whether a run skips engine tensors made only from unchanged trainer tensors.

    Example::

        refit = sdadapt.refit_plan(trainer_model, engine_params, adapter, bucket_bytes=64 << 20)
        for batch in data:
            train_step(batch)
            refit()  # the engine now serves the new weights
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
        recipes: dict[str, Node],
        send: SendFn | None,
        sending: list[Region] | None,
        bucket_bytes: int,
        delta: bool,
        timeout: float,
        mine: _Mine,
        trainer: dict[str, torch.Tensor],
        versioned: dict[str, torch.Tensor],
        trainer_box: dict[str, Box],
        source_dtype: dict[str, torch.dtype],
        transfers: list[Transfer],
        device: torch.device,
        cut: CutBlocks | None = None,
    ):
        self.rank, self.world, self.group = rank, world, group
        self.recipes, self.bucket_bytes, self.delta, self.timeout = recipes, bucket_bytes, delta, timeout
        self.send, self.sending = send, sending or []
        self.mine = mine
        self.trainer = trainer  # key -> this rank's local shard
        self.versioned = versioned  # key -> the tensor whose version counter delta mode reads
        self.trainer_box = trainer_box
        self.source_keys = sorted(source_dtype)
        self.source_dtype = source_dtype
        self.transfers = transfers  # every rank's: every rank packs the same rounds
        self.local = [t for t in transfers if t.src == rank and t.dst == rank]
        # per local transfer, made at its first run and reused (the plan's tensors stay the same):
        # its steps (a region computed straight into its engine view) or (its engine view, its
        # trainer view) for a plain copy; None where it lands elsewhere (a computation's input)
        self._local_made: dict[int, list[Step] | tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._local_bytes = [t.nbytes for t in self.local]
        self._globals: dict[str, list[Node]] | None = None  # engine key -> the NVFP4 global scales its recipe reads
        self.device = device
        self.cut = cut
        self._rounds: dict[frozenset[str], list[list[Transfer]]] = {}
        self._versions: dict[str, tuple[int, ...]] = {}

    # ----- one run
    def __call__(self) -> RefitReport:
        """The same as :meth:`run`."""
        return self.run()

    def run(self) -> RefitReport:
        """Move the trainer's current weights into the engine's tensors (every rank calls it).

        Returns:
            This rank's :class:`RefitReport`.

        Raises:
            RefitError: on every rank, when a rank failed, left or timed out; its ``updated`` /
                ``not_updated`` say which of this rank's engine tensors were written. In delta
                mode the next run sends again everything this one was to send.

        Example::

            report = refit.run()
        """
        t0 = time.perf_counter()
        seen: dict[str, tuple[int, ...]] = {}  # delta mode: the versions this run sends, kept once it succeeded
        st = _Run(RefitReport(rank=self.rank, updated=[]))
        mine = {r.key for r in self.sending} if self.send is not None else set(self.mine.steps)
        todo, active = sorted(mine), set(self.recipes)  # until delta mode's agreement says what changed
        error: BaseException | None = None
        try:  # every collective of the run, the version agreement included, under its timeout and handling
            if self.delta:
                active = self._changed_targets(seen)
                todo = sorted(k for k in mine if k in active)
            with torch.no_grad(), _scales_memo():
                if self.send is not None:
                    io = LocalShards(self.trainer, self.trainer_box, self._trainer_device())
                    regions = [r for r in self.sending if r.key in active]
                    st.rep.bytes_sent, st.rep.rounds, st.rep.buffer_bytes = send_regions(
                        regions, self.recipes, io, self.send, self.bucket_bytes, st.done
                    )
                else:
                    self._move(st, todo, active)
        except BaseException as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        try:
            failed = self._any_failed(error is not None) if self.world > 1 else error is not None
        except Exception as e:  # noqa: BLE001 - a rank that left breaks the group's collectives, one that hangs times out
            failed, error = True, error or e
        if failed:
            not_done = sorted(set(todo) - st.done)
            why = f"{type(error).__name__}: {error}" if error is not None else "another rank failed"
            raise RefitError(
                f"refit failed on rank {self.rank}: {why}. Of this rank's engine tensors, {len(st.done)} were "
                f"updated and {len(not_done)} were not ({', '.join(not_done[:8])}{' ...' if len(not_done) > 8 else ''}); "
                "run the refit again once every rank is back",
                updated=sorted(st.done),
                not_updated=not_done,
            ) from error
        self._versions.update(seen)  # a failed run keeps the old ones: running again resends what it did not
        rep = st.rep
        rep.updated = sorted(st.done)
        rep.unchanged = sorted(k for k in mine if k not in active)
        rep.seconds = time.perf_counter() - t0
        log.info("%s", rep.format_text())
        return rep

    def _move(self, st: _Run, todo: list[str], active: set[str]) -> None:
        """Copy this rank's own regions, then move the rest in rounds, two buffers in flight."""
        rounds = self._rounds_for(active)
        st.rep.rounds = len(rounds)
        if self.cut is not None and self.cut.any(active):  # every rank: the agreed scales of cut FP8 blocks
            self.cut.agree(active, LocalShards(self.trainer, self.trainer_box, self._trainer_device()), self.world)
            self.cut.write(self.mine.cut)
        self._start(st, todo, active)
        size = max((self._load(r) for r in rounds), default=0)
        io = LocalShards(self.trainer, self.trainer_box, self._trainer_device())
        self._prepare_global_scales(active, io)
        for i, t in enumerate(self.local):
            if t.target in active:
                st.rep.bytes_local += self._local_bytes[i]
                self._land_local(i, t, st, io)
                if st.ready:
                    self._finish_ready(st)  # a computation runs once its inputs are in: staged inputs go
        self._finish_ready(st)
        # two buffers of at most half the bucket: a round is packed while the one before is in flight
        buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(min(2, len(rounds)))] if size else []
        st.rep.buffer_bytes = size * len(buffers)
        before: tuple[list[Any], list[tuple[Transfer, torch.Tensor]]] | None = None
        for i, r in enumerate(rounds):
            posted = self._post(r, buffers[i % 2] if buffers else None, st)
            if before is not None:
                self._complete(*before, st)
            before = posted
        if before is not None:
            self._complete(*before, st)
        del buffers
        if len(st.done) != len(todo):
            raise RefitError(f"engine tensors {sorted(set(todo) - st.done)[:8]} did not get all their bytes")

    def _prepare_global_scales(self, active: set[str], io: LocalShards) -> None:
        """NVFP4's global scales of the regions this rank computes, made before any is used, with
        one wait for the device in all (``quant_scaled_nodes.prepare_global_scales``); only where
        a recipe quantizes to a scaled format (that module is then imported)."""
        nodes_mod = sys.modules.get("sdadapt._recipes.quant_scaled_nodes")
        if nodes_mod is None:
            return
        if self._globals is None:
            self._globals = {}
            for t in self.transfers:
                if t.src == self.rank and t.computed and t.band < 0 and t.target not in self._globals:
                    found, stack = [], [self.recipes[t.target]]
                    while stack:
                        n = stack.pop()
                        if isinstance(n, nodes_mod.GlobalScaleOf):
                            found.append(n)
                        else:
                            stack.extend(n.children())
                    self._globals[t.target] = found
        if not any(self._globals.values()):
            return
        nodes = list({id(n): n for k in sorted(active) for n in self._globals.get(k, [])}.values())
        if nodes:
            nodes_mod.prepare_global_scales(nodes, io)

    def _trainer_device(self) -> torch.device:
        return next((t.device for t in self.trainer.values()), torch.device("cpu"))

    def _any_failed(self, failed: bool) -> bool:
        """Whether any rank failed this run (every rank calls it); waits at most ``timeout``."""
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        return bool(int(flag.item()))

    def _start(self, st: _Run, todo: list[str], active: set[str]) -> None:
        """Fill the constant regions; count, per request and per engine tensor, what is awaited."""
        for t in self.transfers:
            if t.dst == self.rank and t.target in active:
                st.remaining[t.request] = st.remaining.get(t.request, 0) + 1
        for k in todo:
            for s in self.mine.steps[k]:
                if isinstance(s, Fill):
                    s.dest.fill_(s.value)
            st.open[k] = sum(1 for i in self.mine.by_target.get(k, []) if st.remaining.get(i))
            for i in self.mine.inputs.get(k, []):
                st.readers[i] = st.readers.get(i, 0) + 1
            if st.open[k] == 0:
                st.ready.append(k)

    # ----- delta mode
    def _changed_targets(self, seen: dict[str, tuple[int, ...]]) -> set[str]:
        """Engine keys made from a trainer tensor whose version counter moved since the last
        successful run; ``seen`` receives the changed tensors' new versions."""
        flags = torch.zeros(len(self.source_keys), dtype=torch.int32, device=self.device)
        for i, k in enumerate(self.source_keys):
            t = self.versioned.get(k)
            if t is not None:
                v = _version(t)
                if self._versions.get(k) != v:
                    flags[i] = 1
                    seen[k] = v
            elif k not in self._versions:  # not held here: the first run sends it
                seen[k] = ()
                flags[i] = 1
        if self.world > 1:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            assert work is not None
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        changed = {k for k, f in zip(self.source_keys, flags.tolist(), strict=True) if f}
        return {k for k, node in self.recipes.items() if changed.intersection(node.leaves()) or not node.leaves()}

    def _rounds_for(self, active: set[str]) -> list[list[Transfer]]:
        key = frozenset(active)
        if key not in self._rounds:
            if len(self._rounds) > 8:
                self._rounds.clear()
            self._rounds[key] = rounds_of([t for t in self.transfers if t.target in active], round_bytes(self.bucket_bytes), self.world)
        return self._rounds[key]

    def _load(self, r: list[Transfer]) -> int:
        return sum(t.padded for t in r if self.rank in (t.src, t.dst))

    # ----- moving bytes
    def _source_view(self, t: Transfer) -> torch.Tensor:
        if t.band >= 0:  # part of a cut FP8 block, quantized here with the block's agreed scale
            assert self.cut is not None
            return self.cut.codes(t.dst, t.band, t.box, LocalShards(self.trainer, self.trainer_box, self._trainer_device()))
        if t.computed:  # the engine tensor's region, computed here from this rank's shards
            return self.recipes[t.target].read(t.box, LocalShards(self.trainer, self.trainer_box, self._trainer_device()))
        local, box = self.trainer[t.key], self.trainer_box[t.key]
        return local[_offset(t.box, box)]

    def _land_local(self, i: int, t: Transfer, st: _Run, io: LocalShards) -> None:
        """Local transfer ``i`` (``t``, from this rank to itself); a computed region whose request
        lands in the engine tensor is computed straight into it (no copy of the result)."""
        if i not in self._local_made:
            self._local_made[i] = self._made_local(t)
        made = self._local_made[i]
        if made is None:
            self._land(t, self._source_view(t), st)
            return
        if isinstance(made, tuple):
            made[0].copy_(made[1])
        else:
            for step in made:
                step.run(io)
        self._landed(t, st)

    def _made_local(self, t: Transfer) -> list[Step] | tuple[torch.Tensor, torch.Tensor] | None:
        """What :meth:`_land_local` runs for ``t``, every run: see ``_local_made``."""
        if t.band >= 0:
            return None
        dest = self.mine.dest.get(t.request)
        if dest is None:
            return None
        view = dest[_offset(t.box, self.mine.requests[t.request].box)]
        if t.computed:
            return self.recipes[t.target].steps(t.box, view)
        return view, self.trainer[t.key][_offset(t.box, self.trainer_box[t.key])]

    def _land(self, t: Transfer, data: torch.Tensor, st: _Run) -> None:
        """Put transfer ``t``'s data where its request goes."""
        req = self.mine.requests[t.request]
        dest = self.mine.dest.get(t.request)
        if dest is None:  # an input of a computation: staged until the computation runs
            dest = st.staged.get(t.request)
            if dest is None:
                where = self.mine.where[req.target]  # computations run where their engine tensor lives
                dest = st.staged[t.request] = torch.empty(box_shape(req.box), dtype=self.source_dtype[req.key], device=where)
                st.staged_now += dest.numel() * dest.element_size()
                st.rep.staged_bytes = max(st.rep.staged_bytes, st.staged_now)
        dest[_offset(t.box, req.box)].copy_(data)
        self._landed(t, st)

    def _landed(self, t: Transfer, st: _Run) -> None:
        """Count transfer ``t`` in: a request whose transfers are all in readies its users."""
        st.remaining[t.request] -= 1
        if st.remaining[t.request] == 0:
            for k in self.mine.users.get(t.request, [t.target]):
                st.open[k] -= 1
                if st.open[k] == 0:
                    st.ready.append(k)

    def _finish_ready(self, st: _Run) -> None:
        """Run the computations of every engine tensor whose bytes are all in; it is then done."""
        mine = self.mine
        while st.ready:
            k = st.ready.pop()
            computes = [s for s in mine.steps[k] if isinstance(s, Compute)]
            if computes:
                io = _Staged({(mine.requests[i].key, mine.requests[i].box): st.staged[i] for i in mine.inputs[k]}, k, mine.where[k])
                for s in computes:
                    s.run(io)
                for i in mine.inputs[k]:
                    st.readers[i] -= 1
                    if st.readers[i] == 0:
                        t = st.staged.pop(i)
                        st.staged_now -= t.numel() * t.element_size()
            st.done.add(k)

    def _post(self, r: list[Transfer], buffer: torch.Tensor | None,
              st: _Run) -> tuple[list[Any], list[tuple[Transfer, torch.Tensor]]]:  # fmt: skip
        """Pack this rank's sends of round ``r`` into ``buffer`` and post them with its receives;
        returns the pending works and where each received transfer lies in the buffer."""
        me = self.rank
        sends = sorted((t for t in r if t.src == me), key=lambda t: t.dst)
        recvs = sorted((t for t in r if t.dst == me), key=lambda t: t.src)
        if not sends and not recvs:
            return [], []
        assert buffer is not None
        offset = 0
        ops: list[dist.P2POp] = []
        placed: list[tuple[Transfer, torch.Tensor]] = []
        for group_of, peer_of, is_send in ((sends, "dst", True), (recvs, "src", False)):
            i = 0
            while i < len(group_of):
                peer = getattr(group_of[i], peer_of)
                start = offset
                while i < len(group_of) and getattr(group_of[i], peer_of) == peer:
                    t = group_of[i]
                    view = buffer[offset : offset + t.nbytes].view(getattr(torch, t.wire)).view(box_shape(t.box))
                    if is_send:
                        view.copy_(self._source_view(t))
                        st.rep.bytes_sent += t.nbytes
                    else:
                        placed.append((t, view))
                        st.rep.bytes_received += t.nbytes
                    offset += t.padded
                    i += 1
                op = dist.isend if is_send else dist.irecv
                ops.append(dist.P2POp(op, buffer[start:offset], self._global(peer), self.group))
        return list(dist.batch_isend_irecv(ops)), placed

    def _complete(self, works: list[Any], placed: list[tuple[Transfer, torch.Tensor]], st: _Run) -> None:
        """Wait for a round's works, land what it received, run what became ready."""
        for w in works:
            if not w.wait(timeout=datetime.timedelta(seconds=self.timeout)):
                raise RefitError(f"a transfer did not finish within timeout={self.timeout} s")
        for t, view in placed:
            self._land(t, view, st)
        self._finish_ready(st)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


__all__ = ["Refit", "RefitReport"]
