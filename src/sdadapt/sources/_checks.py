"""What every load checks on its files and values: fingerprints (files unchanged while read) and
NaN/Inf counts (``check_finite=True``), described with the checksums in :mod:`._integrity`, which
only ``checksums=True`` and the writers of checksums import. :data:`CHECKSUMS_WHY` is here too:
``load``'s signature names it (the renamed ``verify`` keyword) when it is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

from ..errors import SourceError

CHECKSUMS_WHY = (
    "check every region read against sdadapt.checksums.json, the file save_state(checksums=True) and "
    "export(checksums=True) write; sdadapt.verify compares a loaded model's outputs with a reference"
)


# --- fingerprints ---------------------------------------------------------------------------


Fingerprint = dict[str, tuple[int, int, int, int]]


def fingerprint(paths: Iterable[str]) -> Fingerprint:
    """(size, mtime_ns, inode, device) of each file; a file that cannot be stat'ed is a SourceError."""
    out: Fingerprint = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as e:
            raise SourceError(f"cannot stat: {e.strerror or e}; was the checkpoint moved or deleted?", path=p) from None
        out[p] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    return out


def check_unchanged(before: Fingerprint, when: str) -> None:
    """Raise :class:`SourceError` naming the first file whose size, mtime or inode changed."""
    now = fingerprint(before)
    for p, old in before.items():
        new = now[p]
        if new != old:
            what = (
                f"its size changed from {old[0]} to {new[0]} bytes"
                if new[0] != old[0]
                else "it was replaced (other inode)"
                if new[2:] != old[2:]
                else "it was modified (mtime changed)"
            )
            raise SourceError(
                f"the file changed {when}: {what}. It is being written or replaced; load again once "
                "it is complete",
                path=p,
            )


# --- finite values --------------------------------------------------------------------------


def nonfinite_counts(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """key -> (NaN count, Inf count) of the local shards of floating-point tensors that have any."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, t in tensors.items():
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not (local.is_floating_point() or local.is_complex()) or local.numel() == 0:
            continue
        if local.dtype.itemsize == 1 and local.is_floating_point():  # float8: compare in float32
            local = local.float()
        if bool(torch.isfinite(local).all()):
            continue
        out[key] = (int(torch.isnan(local).sum()), int(torch.isinf(local).sum()))
    return out
