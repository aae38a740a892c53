"""Keeping or discarding what a load read: staging, roll-back, and the checks after reading.

A load either lands whole or leaves the model as it was. A model that was on the meta device
is read into directly and put back on meta if anything fails; a model that already held values
is read into staging shards (same mesh and placements) and committed only once every rank
succeeded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from . import _integrity as integrity
from ._distributed import agree, gather_if_any, is_distributed
from ._plan import Plan
from ._target import model_state_dict
from .errors import LoadError, SdadaptError
from .sources import Source

log = logging.getLogger(__name__)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def staging_like(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty shards laid out like ``wanted`` (same DTensor mesh, placements, global shape)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in wanted.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(
                torch.empty_like(v._local_tensor), v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
            )
        else:
            out[k] = torch.empty_like(v.detach())
    return out


def commit_staged(staged: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, s in staged.items():
            local(wanted[k]).copy_(local(s))


def roll_back(model: nn.Module, was_meta: bool) -> None:
    """A failed load leaves no half-loaded model: one this load materialised goes back to meta."""
    if was_meta:
        model.to_empty(device="meta")
        log.info("load failed: the model is back on the meta device")


def agree_or_roll_back(
    error: BaseException | None, group: dist.ProcessGroup | None, source: Source, model: nn.Module, was_meta: bool
) -> None:
    """``agree``; if any rank failed, close the source and roll the model back before raising."""
    try:
        agree(error, group)
    except SdadaptError:
        source.close()
        roll_back(model, was_meta)
        raise


def read_errors(e: CheckpointException) -> list[str]:
    """This rank's own read errors out of DCP's exception (file, key), one line each."""
    failures = [(p[0] if isinstance(p, tuple) else p) for _, p in sorted((getattr(e, "failures", {}) or {}).items())]
    return [f"{type(exc).__name__}: {exc}" for exc in failures] or [str(e)]


def after_read_checks(
    files: integrity.Fingerprint,
    loaded: dict[str, torch.Tensor],
    plan: Plan,
    source: Source,
    check_finite: bool,
    group: dist.ProcessGroup | None,
    read_errors: list[str] | None = None,
    what: str = "the checkpoint",
) -> LoadError | None:
    """One collective after reading: each rank's read errors, files unchanged during the read,
    and (``check_finite``) no NaN/Inf. The same verdict on every rank: a read failure on any
    rank is a :class:`LoadError` everywhere that names the failing ranks and their errors (its
    ``failures`` maps rank -> message)."""
    read_errors = list(read_errors or [])
    problems: list[str] = []
    try:
        integrity.check_unchanged(files, "while it was being read")
    except SdadaptError as e:
        problems.append(str(e))
    bad: dict[str, tuple[int, int]] = integrity.nonfinite_counts(loaded) if check_finite and not read_errors else {}
    mine = (read_errors, problems, bad)
    gathered: list[Any] = [mine]
    if is_distributed():
        gathered = [g or ([], [], {}) for g in gather_if_any(mine, bool(read_errors or problems or bad), group)]
    failed = {r: "\n".join(errs) for r, (errs, _, _) in enumerate(gathered) if errs}
    if failed:
        lines = [f"  rank {r}: {m}" for r, m in sorted(failed.items())]
        err = LoadError(
            f"reading {what} failed on rank(s) {', '.join(map(str, sorted(failed)))}; nothing was "
            "kept from this load:\n" + "\n".join(lines)
        )
        err.failures = failed  # type: ignore[attr-defined]
        return err
    all_problems = [f"rank {r}: {p}" for r, (_, ps, _) in enumerate(gathered) for p in ps]
    counts: dict[str, list[int]] = {}
    for _, _, b in gathered:
        for k, (n, i) in b.items():
            c = counts.setdefault(k, [0, 0])
            c[0] += n
            c[1] += i
    if counts:
        rows = []
        for k in sorted(counts):
            files_of = sorted({source.file_of(leaf) for leaf in plan.recipes[k].leaves()})
            rows.append(f"  {k}: {counts[k][0]} NaN, {counts[k][1]} Inf (from {', '.join(files_of)})")
        all_problems.append(
            f"non-finite values (check_finite=True) in {len(counts)} key(s):\n"
            + "\n".join(rows)
            + "\nThe checkpoint holds NaN/Inf there; use another checkpoint, or load without check_finite"
        )
    if not all_problems:
        return None
    return LoadError("the load was refused; nothing was kept from it:\n" + "\n".join(all_problems))


def copy_back_if_detached(model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """DCP wrote into the state dict's tensors. They are the model's own (sharded) tensors for
    plain modules, TP and FSDP2; if some are copies (other wrappers), copy them back.

    Cheap check first: when every loaded tensor's memory is that of one of the model's own
    parameters or buffers, nothing is detached (no second ``get_model_state_dict``)."""
    own = {local(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
    if all(local(v).data_ptr() in own or local(v).numel() == 0 for v in loaded.values()):
        return
    current = model_state_dict(model)
    detached = {k: v for k, v in loaded.items() if not _same_storage(current.get(k), v)}
    if detached:
        log.debug("copying %d detached tensors back into the model", len(detached))
        set_model_state_dict(model, detached, options=StateDictOptions(strict=False))


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None:
        return False
    la, lb = local(a), local(b)
    return la.data_ptr() == lb.data_ptr() or la.numel() == 0
