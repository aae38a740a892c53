"""sdadapt as a backend of vLLM's weight-transfer API: refit a trainer into a live vLLM engine.

vLLM moves a trainer's weights into a running engine through its weight-transfer calls
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``: on ``LLM``, on the server's HTTP routes, or any
``VLLMWeightSyncClient``), each served by a backend registered in its
``WeightTransferEngineFactory``. This module adds the backend ``"sdadapt"``:

- engine side: registered by :func:`register`, which vLLM calls in each of its processes (the
  ``vllm.general_plugins`` entry point of this package); start the engine with
  ``weight_transfer_config={"backend": "sdadapt"}``. Each worker lays its raw parameters (vLLM's
  names and per-rank shapes, before post-processing) out in shared memory, and on each update
  loads them through vLLM's layerwise reload, so its own post-processing (CPU repacking, FP8,
  MoE layouts) runs as after a checkpoint load;
- trainer side: :func:`connect`, on every trainer rank, plans once (:func:`sdadapt.refit_plan`
  from the trainer's shards, through the adapter, into each engine rank's staged shards; a
  mismatch is a :class:`~sdadapt.errors.RefitError` on every rank before anything moves); each
  call of the returned :class:`VllmRefit` moves bytes only, over the trainer's process group
  (gloo on the CPU, NCCL on GPUs) into the mapped staging, then rank 0 drives the engine's update.

Engine rank ``j`` of ``tp`` is written by trainer rank ``j % world`` (a rank hosts ``ceil(tp /
world)`` engine ranks at most): each receives exactly its shards' regions from the trainer ranks
holding them. The engine must run on the trainer's host (the staging is shared memory): the
colocated layout of verl, slime and OpenRLHF's hybrid engine, or a separate engine on the same
node. ``delta=True`` sends only the engine tensors made from trainer tensors changed in place,
and the engine reloads only the layers holding them. Nothing here imports vLLM: this module is
safe to import without it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ._base.distributed import agree, gather_objects, is_distributed, rank_and_world
from ._plan.adapter import Adapter
from ._plan.plan import KeyPatterns, key_patterns
from ._refit import Refit, RefitReport, refit_plan
from ._refit.vllm_staging import read as read_staging
from ._refit.vllm_worker import BACKEND
from .errors import RefitError

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, the package runs on 3.10

log = logging.getLogger(__name__)

LayoutFn = Callable[[int, int], Callable[[str, torch.Tensor], tuple[tuple[int, ...], Any]]]
"""``layout(tp, rank)``: a vLLM layout module's ``layout`` (``vllm_llama.layout``)."""


def register() -> None:
    """Register the ``"sdadapt"`` backend in vLLM's ``WeightTransferEngineFactory`` (vLLM calls
    it in each of its processes through this package's ``vllm.general_plugins`` entry point;
    calling it again, or without vLLM installed, does nothing).

    Returns:
        None.

    Example::

        import sdadapt.vllm
        sdadapt.vllm.register()  # then LLM(..., weight_transfer_config={"backend": "sdadapt"})
    """
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError:
        return
    from ._refit.vllm_worker import engine_class

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())


def _call(client: Any, method: str, payload: dict[str, Any] | None = None) -> None:
    """One weight-transfer call: vLLM's ``LLM`` takes requests (``{"init_info": ...}``), a
    ``VLLMWeightSyncClient`` the payload itself."""
    fn = getattr(client, method)
    if payload is None:
        fn()
    elif hasattr(client, "llm_engine"):
        fn({"init_info" if method == "init_weight_transfer_engine" else "update_info": payload})
    else:
        fn(payload)


class VllmRefit:
    """A trainer connected to a live vLLM engine by :func:`connect`; call it on every trainer
    rank after each training step.

    Attributes:
        refits: the planned refits, one per engine rank this trainer rank writes.
        tp: the engine's tensor-parallel degree.
        staging: the shared-memory folder of the engine's staged shards.

    Example::

        refit = sdadapt.vllm.connect(model, llm if rank == 0 else None, adapter, vllm_llama.layout)
        reports = refit()  # after each optimizer step, on every trainer rank
    """

    def __init__(self, refits: list[Refit], client: Any, group: dist.ProcessGroup | None, tp: int, staging: str, delta: bool):
        self.refits, self.client, self.group, self.tp, self.staging, self.delta = refits, client, group, tp, staging, delta

    def __call__(self) -> list[RefitReport]:
        """The same as :meth:`run`."""
        return self.run()

    def run(self) -> list[RefitReport]:
        """Move the trainer's weights into the engine's staging, then (rank 0) have the engine load
        them: ``start_weight_update``, ``update_weights`` naming what changed, ``finish_weight_update``.
        Every trainer rank calls it; it returns once the engine serves the new weights.

        Returns:
            This rank's :class:`~sdadapt.reports.RefitReport` per engine rank it writes.

        Raises:
            RefitError: on every rank, when a transfer or the engine's update failed.

        Example::

            reports = refit.run()
        """
        reports = [r.run() for r in self.refits]
        rank, world = rank_and_world(self.group)
        names = sorted({k for rep in reports for k in rep.updated})
        if self.delta and world > 1:  # every engine rank reloads what any changed (the ranks' sets agree)
            names = sorted({k for got in gather_objects(names, self.group) for k in got})
        error: BaseException | None = None
        if rank == 0 and (names or not self.delta):
            try:
                _call(self.client, "start_weight_update")
                try:
                    _call(self.client, "update_weights", {"names": names if self.delta else None})
                finally:
                    _call(self.client, "finish_weight_update")
            except Exception as e:  # noqa: BLE001 - the engine's failure becomes every rank's
                error = RefitError(f"the vLLM engine's weight update failed: {type(e).__name__}: {e}")
        agree(error, self.group, RefitError)  # also: no rank writes the staging again before the engine read it
        return reports


def connect(
    trainer: nn.Module | Mapping[str, torch.Tensor],
    client: Any,
    adapter: Adapter | None,
    layout: LayoutFn,
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 256 << 20,
    delta: bool = False,
    timeout: float = 600.0,
    staging: str | None = None,
    **patterns: Unpack[KeyPatterns],
) -> VllmRefit:
    """Connect a trainer to a live vLLM engine started with ``weight_transfer_config={"backend":
    "sdadapt"}`` on this host, and plan the refit (every trainer rank calls it; collective).

    Rank 0 of ``process_group`` has the engine lay out its staging (``init_weight_transfer_engine``);
    then every rank maps the engine ranks it writes and plans :func:`sdadapt.refit_plan` into them
    with ``adapter`` and ``layout(tp, rank)``. Keys or shapes that do not line up are a
    :class:`~sdadapt.errors.RefitError` on every rank, before any byte moves: the engine keeps
    serving what it served.

    Args:
        trainer: this rank's training model or state dict (DTensors as FSDP2 / TP leave them).
        client: on rank 0, vLLM's ``LLM`` or any ``VLLMWeightSyncClient`` (its HTTP client, a Ray
            actor's); ignored on the other ranks (pass ``None``).
        adapter: the trainer -> vLLM adapter (``vllm_llama.build(tp=..., ...)``, possibly after a
            family's adapter inverted).
        layout: the vLLM layout's ``layout`` function (``vllm_llama.layout``); its ``tp`` must be
            the engine's.
        process_group: the trainer's group (default: the world).
        bucket_bytes: as for :func:`sdadapt.refit_plan`.
        delta: send, and reload, only what changed in place since the last run.
        timeout: seconds a run waits for any one transfer.
        staging: the shared-memory folder (default: a new one under ``/dev/shm``, else the temp folder).
        **patterns: ``allow_missing=`` / ``allow_unexpected=``, as for :func:`sdadapt.refit_plan`:
            engine key patterns the trainer does not provide (left as they are) / adapted trainer
            key patterns the engine does not hold (not sent) (:class:`~sdadapt.KeyPatterns`).

    Returns:
        The :class:`VllmRefit`; call it after each training step.

    Example::

        llm = LLM(model=path, weight_transfer_config={"backend": "sdadapt"})   # rank 0's process
        refit = sdadapt.vllm.connect(fsdp_model, llm if rank == 0 else None,
                                     vllm_llama.build(n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336),
                                     vllm_llama.layout)
        refit()
    """
    patterns = key_patterns("sdadapt.vllm.connect", patterns)
    rank, world = rank_and_world(process_group)
    error: BaseException | None = None
    folder = ""
    if rank == 0:
        try:
            if client is None:
                raise RefitError("rank 0 of the trainer's group drives the vLLM engine: pass client= (the LLM, or a weight-sync client)")
            root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            folder = staging or tempfile.mkdtemp(prefix="sdadapt-vllm-", dir=root)
            _call(client, "init_weight_transfer_engine", {"staging": folder})
        except RefitError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the engine's refusal becomes every rank's error
            if not staging:  # made here for the engine, which refused it (else its shutdown removes it)
                shutil.rmtree(folder, ignore_errors=True)
            error = RefitError(
                f"the vLLM engine did not set up the sdadapt staging: {type(e).__name__}: {e}. Start it with "
                "weight_transfer_config={'backend': 'sdadapt'} and sdadapt installed in its environment"
            )
    agree(error, process_group, RefitError)
    if is_distributed() and world > 1:
        box = [folder]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group)
        folder = box[0]
    error = None
    engines: list[tuple[int, dict[str, torch.Tensor] | None]] = []
    tp = 0
    try:
        manifest, views = read_staging(folder, 0)
        tp = manifest.world
        for j in range(rank, -(-tp // world) * world, world):
            engines.append((j, read_staging(folder, j)[1] if j < tp else None))
    except RefitError as e:
        error = e
    agree(error, process_group, RefitError)
    refits = []
    for j, engine in engines:
        lay = layout(tp, j) if engine is not None else None
        refits.append(refit_plan(trainer, engine, adapter, engine_layout=lay, process_group=process_group, bucket_bytes=bucket_bytes,
                                 delta=delta, timeout=timeout, **patterns))  # fmt: skip
    here = sum(e is not None for _, e in engines)
    log.info("connected to a vLLM engine of TP %d through %s: %d engine ranks written here", tp, folder, here)
    return VllmRefit(refits, client if rank == 0 else None, process_group, tp, folder, delta)


__all__ = ["BACKEND", "VllmRefit", "connect", "register"]
