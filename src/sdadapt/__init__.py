"""sdadapt: load checkpoints of any layout into models parallelised with torch-native tools.

    report = sdadapt.load(model, "ckpt.pt", sdadapt.Adapter([sdadapt.fuse([...], "...")]))

Data flow: source headers -> SourceSchema; model -> TargetSchema; Adapter + schemas -> Plan +
Report (strict: raise on every rank, nothing read); ``dcp.load`` with a reader that presents
the target schema and reads, per shard, only the source regions the recipe needs.
"""

from __future__ import annotations

import torch

from .adapter import Adapter
from .diff import diff
from .errors import AdapterError, LoadError, PlanError, RemoteRankError, SdadaptError, SourceError
from .load import LoadReport, load, plan_load
from .plan import Plan, build_plan
from .report import Report
from .rules import Cast, Drop, Fuse, Rename, Rule, Split, Tie
from .sources import Source, TensorInfo, open_source

__version__ = "0.1.0"


def rename(src: str, dst: str) -> Rename:
    """``src`` keys become ``dst`` keys; ``{name}`` captures carry over (``layers.{i}.wq``)."""
    return Rename(src=src, dst=dst)


def fuse(srcs: list[str], dst: str, dim: int = 0, sizes: list[int] | None = None) -> Fuse:
    """Concatenate ``srcs`` along ``dim`` into ``dst`` (q, k, v -> qkv)."""
    return Fuse(srcs=srcs, dst=dst, dim=dim, sizes=sizes)


def split(src: str, dsts: list[str], dim: int = 0, sizes: list[int] | None = None) -> Split:
    """Cut ``src`` along ``dim`` into ``dsts``; sizes default to the target's, else equal."""
    return Split(src=src, dsts=dsts, dim=dim, sizes=sizes)


def cast(keys: str, dtype: str | torch.dtype, from_dtype: str | torch.dtype | None = None) -> Cast:
    """Convert tensors matching ``keys`` to ``dtype`` (only those stored as ``from_dtype``, if given)."""
    return Cast(keys=keys, dtype=dtype, from_dtype=from_dtype)  # type: ignore[arg-type]


def drop(keys: str) -> Drop:
    """Ignore source keys matching ``keys`` on purpose."""
    return Drop(keys=keys)


def tie(dst: str, src: str) -> Tie:
    """Fill ``dst`` from ``src`` when the checkpoint lacks ``dst`` (tied embeddings)."""
    return Tie(dst=dst, src=src)


__all__ = [
    "Adapter",
    "AdapterError",
    "Cast",
    "Drop",
    "Fuse",
    "LoadError",
    "LoadReport",
    "Plan",
    "PlanError",
    "RemoteRankError",
    "Rename",
    "Report",
    "Rule",
    "SdadaptError",
    "Source",
    "SourceError",
    "Split",
    "TensorInfo",
    "Tie",
    "build_plan",
    "cast",
    "diff",
    "drop",
    "fuse",
    "load",
    "open_source",
    "plan_load",
    "rename",
    "split",
    "tie",
]
