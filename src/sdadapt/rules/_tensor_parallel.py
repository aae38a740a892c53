"""Tensor-parallel layout rules: :class:`Interleave` lays fused parts out per TP rank (so a
``ColwiseParallel`` shard holds ``[q_r; k_r; v_r]``), :class:`Deinterleave` undoes it, and
:func:`tp_degree` reads the TP degree from a tensor's placements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from .._recipes import nodes as N
from .._recipes.arithmetic import AffineMapped
from .._recipes.interleave import Interleaved
from .._recipes.moves import UnitPermuted
from .._recipes.nodes import Converted, Node
from ..errors import AdapterError
from ._base import InPlaceRule, Keys, RuleBase, built_by, matching_dim, target_info
from ._custom import register_rule

if TYPE_CHECKING:
    from .._base.schema import TensorInfo
    from ._base import PlanContext


TP_MESH_NAMES = frozenset({"tp", "tensor", "tensor_parallel", "model_parallel", "mp"})
DP_MESH_NAMES = frozenset(
    {"dp", "ddp", "fsdp", "hsdp", "replicate", "shard", "data", "data_parallel", "dp_shard", "dp_replicate",
     "dp_shard_cp", "dp_cp", "cp", "ep", "pp"}
)  # fmt: skip


def tp_degree(info: TensorInfo, dim: int) -> int | str:
    """How many tensor-parallel ranks split ``dim`` of a target tensor: the product of the sizes
    of the mesh dims that shard ``dim`` and are named like TP (:data:`TP_MESH_NAMES`). Mesh dims
    named like data parallel (:data:`DP_MESH_NAMES`, ``dp*``, ``*fsdp*``) or ``_StridedShard``
    (FSDP2 over TP) do not count. Returns a message when a sharding mesh dim is unnamed or
    unknown: the caller should ask for ``tp=``."""
    if info.mesh is None:
        if info.placements is None:
            return 1  # a plain tensor: no TP
        return f"the model's placements {info.placements} are not described in detail; pass tp="
    nd = len(info.shape)
    tp = 1
    for i, md in enumerate(info.mesh):
        if md.shard_dim is None or md.shard_dim % nd != dim or md.size == 1:
            continue
        name = (md.name or "").lower()
        if name in TP_MESH_NAMES:
            tp *= md.size
        elif md.strided or name in DP_MESH_NAMES or name.startswith("dp") or "fsdp" in name:
            continue
        else:
            label = f"mesh dim {i} ({md.name!r}, size {md.size}, {md.placement})" if md.name else (
                f"unnamed mesh dim {i} (size {md.size}, {md.placement})"
            )
            return (
                f"cannot tell whether {label} is tensor or data parallel; name the mesh dims "
                f"(mesh_dim_names=('dp', 'tp')) or pass tp="
            )
    return tp


@built_by('"layers.{i}.feed_forward.w13.weight", sizes=[hidden, hidden]')
class Interleave(InPlaceRule):
    """Lay a fused tensor ``[part0; part1; ...]`` (``sizes`` along ``dim``, e.g. q, k, v rows)
    out per TP rank: ``[p0_r0; p1_r0; ...; p0_r1; ...]``, so that a ``ColwiseParallel`` shard on
    TP rank ``r`` holds ``[q_r; k_r; v_r]`` as the layer's code expects. ``keys`` is one pattern
    or a list (a fused weight and its bias: a 1-D bias has only dim 0, laid out like the
    weight's rows).

    ``tp`` omitted: the TP degree of the target's placements for that key (see
    :func:`tp_degree`; a plain target tensor means 1, nothing moves). Every size must divide by
    the degree. The inverse is :class:`Deinterleave`.

    ``replicas`` (one per part, each dividing the degree): part ``p`` is shared by
    ``replicas[p]`` consecutive ranks, as vLLM shares each KV head over ``tp / n_kv_heads``
    ranks when it has fewer KV heads than ranks: the part is cut in ``tp / replicas[p]`` blocks,
    rank ``r`` holds block ``r // replicas[p]``, and the laid-out tensor is longer by the
    copies. :class:`Deinterleave` with the same ``replicas`` reads each block from the first
    rank holding it."""

    kind: Literal["interleave"] = "interleave"
    keys: Keys
    sizes: list[int]
    tp: int | None = Field(default=None, gt=0)
    dim: int = 0
    replicas: list[int] | None = None

    backward: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check(self) -> Interleave:
        if not self.sizes or any(s < 0 for s in self.sizes):
            raise AdapterError(f"{self.kind} of {self.keys!r}: sizes must be a non-empty list of sizes >= 0, got {self.sizes}")
        if self.replicas is not None and (len(self.replicas) != len(self.sizes) or any(n < 1 for n in self.replicas)):
            raise AdapterError(f"{self.kind} of {self.keys!r}: replicas {self.replicas} must give one count >= 1 per part of {self.sizes}")
        if self.tp is not None:
            problem = self._indivisible(self.tp, f"tp={self.tp}")
            if problem:
                raise AdapterError(f"{self.kind} of {self.keys!r}: {problem}")
        return self

    def _reps(self) -> list[int]:
        return list(self.replicas) if self.replicas is not None else [1] * len(self.sizes)

    def _indivisible(self, tp: int, degree: str) -> str | None:
        """Why the parts cannot be laid out over ``tp`` ranks (``degree`` names it), or ``None``."""
        reps = self._reps()
        if any(tp % n for n in reps):
            return f"replicas {reps} do not all divide {degree}"
        if any(s % (tp // n) for s, n in zip(self.sizes, reps, strict=True)):
            over = "" if self.replicas is None else f" (over replicas {reps})"
            return f"sizes {self.sizes} do not all divide by {degree}{over}"
        return None

    def _degree(self, ctx: PlanContext, key: str, node: Node, d: int, index: int) -> int | str:
        if self.tp is not None:
            return self.tp
        if ctx.target is None:
            return "there is no model to read the TP degree from; pass tp="
        info = target_info(ctx, key, index)
        if info is None:
            return "the model has no such key to read the TP degree from; pass tp="
        return tp_degree(info, d)

    def apply(self, ctx: PlanContext, index: int) -> None:
        reps = self._reps()
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            # the input of a deinterleave with replicas holds the copies
            want = sum(s * r for s, r in zip(self.sizes, reps, strict=True)) if self.backward else sum(self.sizes)
            if want != n:
                copies = f" with replicas {reps}" if self.backward and self.replicas is not None else ""
                ctx.issue(index, key, f"sizes {self.sizes}{copies} add up to {want}, but dim {d} has {n}")
                continue
            tp = self._degree(ctx, key, node, d, index)
            if isinstance(tp, str):
                ctx.issue(index, key, tp)
                continue
            problem = self._indivisible(tp, f"the TP degree {tp}")
            if problem:
                ctx.issue(index, key, problem)
                continue
            ctx.mark(index)
            if tp > 1 and (len(self.sizes) > 1 or any(r > 1 for r in reps)):
                replicas = tuple(reps) if any(r > 1 for r in reps) else None
                ctx.replace(key, Interleaved(node, d, tuple(self.sizes), tp, self.backward, replicas))

    def inverse(self) -> list[RuleBase]:
        return [Deinterleave(keys=self.keys, sizes=list(self.sizes), tp=self.tp, dim=self.dim, replicas=self.replicas)]


@built_by('"layers.{i}.feed_forward.w13.weight", sizes=[hidden, hidden], tp=4')
class Deinterleave(Interleave):
    """The inverse of :class:`Interleave`: a per-TP-rank layout ``[p0_r0; p1_r0; ...; p0_r1; ...]``
    back to contiguous parts ``[part0; part1; ...]``. ``tp`` omitted: the TP degree of the
    *source's* placements (a parallelised model's state dict being exported), else a plan
    issue asking for ``tp=`` (the degree the checkpoint was saved with).

    Parts that alternate row by row (GPT-OSS stores gate and up rows as ``g0, u0, g1, u1...``
    along the last dim) are this layout with one row per block: ``deinterleave(keys, sizes=[F,
    F], tp=F, dim=-1)`` gives contiguous ``[gate; up]``, which a split then cuts in two."""

    kind: Literal["deinterleave"] = "deinterleave"  # type: ignore[assignment]
    backward: ClassVar[bool] = True

    def _degree(self, ctx: PlanContext, key: str, node: Node, d: int, index: int) -> int | str:
        if self.tp is not None:
            return self.tp
        # through value-only steps (a cast, an affine map, a row order inside heads): the tensor
        # they take is the model's, laid out as that tensor is placed
        while isinstance(node, Converted | AffineMapped | UnitPermuted) and node.child.shape == node.shape:
            node = node.child
        if isinstance(node, N.Leaf) and node.key in ctx.source:
            return tp_degree(ctx.source[node.key], d)
        return "the checkpoint's TP degree is not known here; pass tp= (the TP degree it was saved with)"

    def inverse(self) -> list[RuleBase]:
        return [Interleave(keys=self.keys, sizes=list(self.sizes), tp=self.tp, dim=self.dim, replicas=self.replicas)]


# imported on first use (sdadapt._base.rule_kinds.ON_USE): its kinds are registered here
for _cls in (Interleave, Deinterleave):
    register_rule(_cls)
