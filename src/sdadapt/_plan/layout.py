"""A device mesh and where each target tensor lives on it, without a process group.

A dry run (:func:`sdadapt.dry_run`) needs every rank's shard of every tensor at world sizes no
machine here has. :class:`Mesh` is the mesh as ``init_device_mesh`` lays it out (named dims,
outermost first, ranks in row-major order); :func:`default_layouts` says, per target key, which
ranks hold it and its placement on each mesh dim, the way torchtitan parallelises a
transformer (FSDP2, HSDP, tensor parallel, expert parallel, pipeline stages); :func:`local_box`
computes a rank's box with DTensor's own offset rule (:func:`~sdadapt._base.regions.shard_box`,
the box export and refit use: ``Shard``, uneven and empty shards, ``_StridedShard``), from the
mesh's shape and the rank's coordinate alone.

The rules, per key (mesh dims in the order ``pp, dp_replicate, dp_shard, ep, tp``):

- ``pp``: a key under ``layers.{i}`` belongs to stage ``i * pp // n_layers``; an embedding
  (``embed``, ``tok_embeddings``, ``wte``) to the first stage; any other key to the last.
- ``ep``: a key under ``experts.{e}`` belongs to the ep rank ``e * ep // n_experts``;
  stacked experts (a 3-d ``experts.w1``) are ``Shard(0)`` on ``ep``; every other key is
  sharded by FSDP over ``dp_shard`` and ``ep`` flattened (torchtitan's ``dp_shard_cp`` mesh).
- ``tp``: column-parallel linears (``wq``, ``q_proj``, ``w1``, ``gate_proj``, ``lm_head``...)
  ``Shard(0)`` (their bias too), row-parallel ones (``wo``, ``o_proj``, ``w2``,
  ``down_proj``...) ``Shard(1)`` (bias replicated), embeddings ``Shard(0)``; a quantized
  weight's scales follow their weight; everything else (norms, the router) is replicated.
- ``dp_shard`` (FSDP2): ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)`` where tensor
  parallelism shards dim 0 too (FSDP2's own choice); 0-d tensors are replicated.
- ``dp_replicate`` (HSDP): replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._base.regions import shard_box
from .._base.schema import TensorInfo
from ..errors import UsageError

DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "tp")

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_STACKED = re.compile(r"(?:^|\.)experts\.[A-Za-z_]")
_EMBED = ("embed", "tok_embeddings", "wte", "word_embeddings")
_COLWISE = {
    "wq", "wk", "wv", "w1", "w3", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq_b", "wkv_b",
    "q_b_proj", "kv_b_proj", "lm_head", "output", "c_fc", "qkv_proj", "gate_up_proj", "fc1", "query_key_value",
}
_ROWWISE = {"wo", "w2", "o_proj", "down_proj", "c_proj", "fc2", "out_proj", "dense"}
_SCALES = ("weight_scale_inv", "weight_scale", "scale_inv", "scales", "weight_scale_2", "input_scale")


@dataclass(frozen=True)
class Mesh:
    """A device mesh by name and size, outermost dim first (``init_device_mesh``'s order).

    Example::

        mesh = Mesh.parse("dp_replicate=8,dp_shard=16,tp=8")
        assert mesh.size == 1024 and mesh.coordinate(9) == (0, 1, 1)
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, spec: str | Mapping[str, int], ep: int | None = None, pp: int | None = None) -> Mesh:
        """``"dp_shard=16,tp=8"`` (or a mapping), plus ``ep``/``pp`` degrees, as a mesh in
        :data:`DIM_ORDER`; a dim of size 1 is left out."""
        if isinstance(spec, str):
            items: dict[str, Any] = {}
            for part in (p.strip() for p in spec.split(",") if p.strip()):
                name, sep, value = part.partition("=")
                if not sep or not value.strip().isdigit():
                    raise UsageError(f"mesh dim {part!r} is not NAME=SIZE (e.g. dp_shard=16,tp=8)")
                items[name.strip()] = int(value)
        else:
            items = dict(spec)
        for name, degree in (("ep", ep), ("pp", pp)):
            if degree is not None:
                if name in items and items[name] != degree:
                    raise UsageError(f"mesh dim {name} given twice: {items[name]} and {degree}")
                items[name] = degree
        unknown = sorted(set(items) - set(DIM_ORDER))
        if unknown:
            raise UsageError(f"unknown mesh dim(s) {', '.join(unknown)}; known: {', '.join(DIM_ORDER)}")
        for name, size in items.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"mesh dim {name} must be a positive integer, got {size!r}")
        if items.get("ep", 1) > 1 and items.get("dp_shard", 1) < 1:
            raise UsageError("ep needs dp_shard")
        names = tuple(n for n in DIM_ORDER if items.get(n, 1) > 1)
        if not names:
            names = ("dp_shard",)
        return cls(names, tuple(items.get(n, 1) for n in names))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def size_of(self, name: str) -> int:
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s coordinate (row-major, as ``init_device_mesh`` numbers ranks)."""
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coordinate: tuple[int, ...]) -> int:
        r = 0
        for c, s in zip(coordinate, self.sizes, strict=True):
            r = r * s + c
        return r

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))


@dataclass(frozen=True)
class Layout:
    """Where one tensor lives: ``owners`` (mesh dim index -> the coordinate that holds it; the
    other coordinates of that dim hold nothing), and its DTensor placements on ``groups``: each
    a tuple of mesh dims flattened into one (row-major) with its placement."""

    owners: tuple[tuple[int, int], ...]
    groups: tuple[tuple[tuple[int, ...], Any], ...]

    def holds(self, coordinate: tuple[int, ...]) -> bool:
        return all(coordinate[d] == c for d, c in self.owners)

    def dims(self) -> set[int]:
        """The mesh dims on which ranks may differ in what they hold of this tensor."""
        out = {d for d, _ in self.owners}
        for dims, p in self.groups:
            if not p.is_replicate():
                out.update(dims)
        return out

    def replica_group(self, mesh: Mesh) -> tuple[int, ...] | None:
        """The mesh dims of the largest replicated group (size > 1; the first of equals), as
        ``share_reads`` picks it (:func:`sdadapt._engine.share.replica_dim`), or ``None``."""
        best: tuple[int, ...] | None = None
        best_size = 1
        for dims, p in self.groups:
            n = math.prod(mesh.sizes[d] for d in dims)
            if p.is_replicate() and n > best_size:
                best, best_size = dims, n
        return best


def _index_counts(keys: list[str]) -> tuple[int, int]:
    layers = [int(m.group(1)) for k in keys if (m := _LAYER.search(k))]
    experts = [int(m.group(1)) for k in keys if (m := _EXPERT.search(k))]
    return (max(layers) + 1 if layers else 0), (max(experts) + 1 if experts else 0)


def _tp_dim(key: str, ndim: int, stacked: bool) -> int | None:
    """The tensor dim tensor parallelism shards (see the module's rules), or ``None``."""
    parts = key.split(".")
    if len(parts) < 2:
        return None
    module, param = parts[-2], parts[-1]
    base = 1 if stacked else 0
    if stacked:
        module = param  # experts.w1: the stacked weight is named for its linear
        param = "weight"
    if any(e in module for e in _EMBED) and param == "weight":
        dim: int | None = 0
    elif module in _COLWISE:
        dim = base
    elif module in _ROWWISE:
        dim = None if param == "bias" else base + 1
    else:
        return None
    if param not in ("weight", "bias", *_SCALES):
        return None
    return dim if dim is not None and dim < ndim else None


def default_layouts(schema: Mapping[str, TensorInfo], mesh: Mesh) -> dict[str, Layout]:
    """Each key's :class:`Layout` on ``mesh`` by the module's rules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = {n: i for i, n in enumerate(mesh.names)}
    n_layers, n_experts = _index_counts(list(schema))
    pp, ep, tp, dps = (mesh.size_of(n) for n in ("pp", "ep", "tp", "dp_shard"))
    out: dict[str, Layout] = {}
    for key, info in schema.items():
        ndim = len(info.shape)
        owners: list[tuple[int, int]] = []
        if pp > 1:
            m = _LAYER.search(key)
            if m:
                stage = int(m.group(1)) * pp // max(1, n_layers)
            else:
                stage = 0 if any(e in key for e in _EMBED) else pp - 1
            owners.append((idx["pp"], stage))
        expert = _EXPERT.search(key)
        stacked = ndim == 3 and bool(_STACKED.search(key)) and not expert
        if ep > 1 and expert:
            owners.append((idx["ep"], int(expert.group(1)) * ep // max(1, n_experts)))
        groups: list[tuple[tuple[int, ...], Any]] = []
        tp_dim = _tp_dim(key, ndim, stacked) if tp > 1 else None
        if "dp_replicate" in idx:
            groups.append(((idx["dp_replicate"],), Replicate()))
        fsdp_dims = tuple(idx[n] for n in ("dp_shard", "ep") if n in idx and not (n == "ep" and (expert or stacked)))
        if ndim == 0:
            fsdp: Any = Replicate()
        elif stacked and ep > 1:
            fsdp = Shard(1) if dps * ep > info.shape[0] else _StridedShard(0, split_factor=ep)
        else:
            fsdp = _StridedShard(0, split_factor=tp) if tp_dim == 0 else Shard(0)
        if fsdp_dims:
            groups.append((fsdp_dims, fsdp))
        if stacked and ep > 1:
            groups.append(((idx["ep"],), Shard(0)))
        if "tp" in idx:
            groups.append(((idx["tp"],), Shard(tp_dim) if tp_dim is not None else Replicate()))
        out[key] = Layout(tuple(owners), tuple(groups))
    return out


def group_coordinate(mesh: Mesh, layout: Layout, coordinate: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The flattened mesh shape of ``layout``'s groups and ``coordinate`` on it."""
    shape, coord = [], []
    for dims, _ in layout.groups:
        n, c = 1, 0
        for d in dims:
            n, c = n * mesh.sizes[d], c * mesh.sizes[d] + coordinate[d]
        shape.append(n)
        coord.append(c)
    return tuple(shape), tuple(coord)


def local_box(info: TensorInfo, mesh: Mesh, layout: Layout, coordinate: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """The box of the tensor that the rank at ``coordinate`` holds (global coordinates; empty
    extents for an empty shard; :func:`~sdadapt._base.regions.shard_box`, the box export and
    refit use), or ``None`` when it holds none of it or its shard is not one box."""
    if not layout.holds(coordinate):
        return None
    shape, coord = group_coordinate(mesh, layout, coordinate)
    return shard_box(tuple(info.shape), shape, coord, tuple(p for _, p in layout.groups))


def model_layouts(state_dict: Mapping[str, Any], mesh: Mesh, defaults: Mapping[str, Layout]) -> dict[str, Layout]:
    """The layouts of an already-parallelised model: each DTensor's own placements, its mesh
    dims matched to ``mesh``'s by the ranks they span (a flattened dim, such as FSDP's over
    ``dp_shard`` and ``ep``, spans several); a plain tensor is held whole by every rank. Owners
    (pipeline stages, per-expert keys) stay those of ``defaults``, the keys the model lacks too.

    Raises:
        UsageError: a DTensor's mesh does not lie on ``mesh`` (another world size or layout).
    """
    from torch.distributed.tensor import DTensor

    out = dict(defaults)
    found: dict[tuple[int, tuple[Any, ...]], tuple[tuple[tuple[int, ...], Any], ...]] = {}
    for key, t in state_dict.items():
        if key not in defaults:
            continue
        if not isinstance(t, DTensor):
            out[key] = Layout(defaults[key].owners, ())
            continue
        cache = (id(t.device_mesh), tuple(t.placements))
        if (groups := found.get(cache)) is None:
            groups = found[cache] = tuple(
                (_mesh_dims(key, t.device_mesh, i, mesh), p) for i, p in enumerate(t.placements)
            )
        out[key] = Layout(defaults[key].owners, groups)
    return out


def _mesh_dims(key: str, dmesh: Any, i: int, mesh: Mesh) -> tuple[int, ...]:
    """The dims of ``mesh`` that mesh dim ``i`` of the DTensor mesh ``dmesh`` spans, in order."""
    ranks_t = dmesh.mesh
    coord = dmesh.get_coordinate()
    if coord is None:
        raise UsageError(f"{key}: this rank is not in its DTensor's mesh")
    index: list[Any] = list(coord)
    index[i] = slice(None)
    ranks = [int(r) for r in ranks_t[tuple(index)].reshape(-1).tolist()]
    name = (dmesh.mesh_dim_names or ())[i] if dmesh.mesh_dim_names else str(i)
    if max(ranks) >= mesh.size:
        raise UsageError(
            f"{key}: its mesh dim {name!r} spans rank {max(ranks)}, beyond the dry run's mesh {mesh} "
            f"({mesh.size} ranks); give mesh= the world the model was parallelised on"
        )
    coords = [mesh.coordinate(r) for r in ranks]
    dims = tuple(d for d in range(len(mesh.sizes)) if len({c[d] for c in coords}) > 1)
    flat = [0] * len(coords)
    for j, c in enumerate(coords):
        for d in dims:
            flat[j] = flat[j] * mesh.sizes[d] + c[d]
    if len(ranks) > 1 and (math.prod(mesh.sizes[d] for d in dims) != len(ranks) or flat != list(range(len(ranks)))):
        raise UsageError(
            f"{key}: its mesh dim {name!r} (ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}) is not a set of dims "
            f"of the dry run's mesh {mesh}; give mesh= the layout the model was parallelised on (same names and order)"
        )
    return dims
