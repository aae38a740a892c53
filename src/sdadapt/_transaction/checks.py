"""The verdict after a transaction's reads: one collective that gathers each rank's read errors,
files changed while read and (``check_finite``) non-finite values, and gives every rank the same
:class:`LoadError` or none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._base.distributed import gather_if_any, is_distributed
from .._plan.plan import Plan
from ..errors import LoadError, SdadaptError
from ..sources import Fingerprint, Source, check_unchanged, nonfinite_counts


class Checked(Protocol):
    """What the checks read of a transaction's part (``transaction.Part``): its name, whether it
    holds the model's tensors, and where each key's values came from."""

    name: str
    of_model: bool
    source: Source
    plan: Plan


def after_read_checks(
    files: Fingerprint,
    loaded: dict[str, torch.Tensor],
    parts: Sequence[Checked],
    check_finite: bool,
    group: dist.ProcessGroup | None,
    errors: list[str],
    what: str,
) -> LoadError | None:
    """One collective after reading: each rank's read errors, files unchanged during the read,
    and (``check_finite``) no NaN/Inf. The same verdict on every rank: a read failure on any
    rank is a :class:`LoadError` everywhere that names the failing ranks and their errors (its
    ``failures`` maps rank -> message). ``loaded`` keys are ``"<part>:<key>"``."""
    problems: list[str] = []
    try:
        check_unchanged(files, "while it was being read")
    except SdadaptError as e:
        problems.append(str(e))
    bad: dict[str, tuple[int, int]] = nonfinite_counts(loaded) if check_finite and not errors else {}
    mine = (errors, problems, bad)
    gathered: list[Any] = [mine]
    if is_distributed():
        gathered = [g or ([], [], {}) for g in gather_if_any(mine, bool(errors or problems or bad), group)]
    failed = {r: "\n".join(errs) for r, (errs, _, _) in enumerate(gathered) if errs}
    if failed:
        lines = [f"  rank {r}: {m}" for r, m in sorted(failed.items())]
        err = LoadError(f"reading {what} failed on rank(s) {', '.join(map(str, sorted(failed)))}:\n" + "\n".join(lines))
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
        by_name = {p.name: p for p in parts}
        rows = []
        for k in sorted(counts):
            name, key = k.split(":", 1)
            part = by_name[name]
            files_of = sorted({part.source.file_of(leaf) for leaf in part.plan.recipes[key].leaves()})
            label = key if part.of_model and name == "model" else f"{name} {key}"
            rows.append(f"  {label}: {counts[k][0]} NaN, {counts[k][1]} Inf (from {', '.join(files_of)})")
        all_problems.append(
            f"non-finite values (check_finite=True) in {len(counts)} key(s):\n"
            + "\n".join(rows)
            + "\nThe checkpoint holds NaN/Inf there; use another checkpoint, or load without check_finite"
        )
    if not all_problems:
        return None
    return LoadError("the load was refused:\n" + "\n".join(all_problems))
