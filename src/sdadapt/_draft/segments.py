"""Keys -> segments, index captures and scopes (headers only, linear in the number of keys).

A key such as ``model.layers.3.self_attn.q_proj.weight`` is split on dots. A numeric segment
is an *index* (a capture such as ``{i}``) when, among keys that differ only there, it takes at
least two consecutive values and the shapes do not depend on it, or when the segment before
it names a container (``layers``, ``h``, ``experts``...). Other numeric segments stay literal
(``mlp.0`` / ``mlp.2`` of an ``nn.Sequential`` have different shapes and gaps).

Keys with the same segments (indices generalised) form a :class:`Family`. Families live in a
tree of :class:`Scope` objects: the root, and one scope per index container
(``model.layers.{i}``, ``...experts.{e}``), so that matching compares like with like: the
tensors of a layer with the tensors of a layer.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from .._base.schema import TensorInfo

IDX = "{}"  # an index position inside Family.segs

CONTAINER_NAMES = frozenset(
    {"layers", "layer", "h", "blocks", "block", "experts", "local_experts", "double_blocks", "single_blocks",
     "transformer_blocks", "single_transformer_blocks", "resblocks", "decoder_layers", "encoder_layers"}
)

_BUFFER_LAST = frozenset(
    {"inv_freq", "masked_bias", "freqs_cis", "cos_cached", "sin_cached", "_float_tensor", "num_batches_tracked",
     "position_ids"}
)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def is_buffer_like(segs: tuple[str, ...], shape: tuple[int, ...]) -> str | None:
    """Why a key looks like a buffer rather than a weight (rotary tables, attention masks)."""
    last = segs[-1] if segs else ""
    if last in _BUFFER_LAST:
        return f"'{last}' is a buffer name (rotary table, mask or counter), not a weight"
    if last == "bias" and len(shape) == 4 and shape[0] == shape[1] == 1 and shape[2] == shape[3]:
        return f"'bias' of shape {list(shape)} is a causal attention mask, not a weight"
    return None


@dataclass(eq=False)
class Family:
    """Keys equal up to their index segments, e.g. ``model.layers.{}.mlp.up_proj.weight``."""

    segs: tuple[str, ...]  # IDX at index positions
    keys: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    regular: bool  # every key has this shape and dtype
    buffer: str | None  # why it looks like a buffer, if it does
    scope: Scope | None = None

    @property
    def count(self) -> int:
        return len(self.keys)

    def rel(self) -> tuple[str, ...]:
        """Segments after this family's scope (no index positions)."""
        assert self.scope is not None
        return self.segs[len(self.scope.path):]

    def pattern(self, names: list[str]) -> str:
        it = iter(names)
        return ".".join("{" + next(it) + "}" if s == IDX else s for s in self.segs)

    def star_pattern(self) -> str:
        return ".".join("*" if s == IDX else s for s in self.segs)


@dataclass(eq=False)
class Scope:
    """The root, or an index container such as ``model.layers.{}``: families directly inside,
    child containers, and how many instances (index values) it has."""

    path: tuple[str, ...]  # ends with IDX, except the root ()
    parent: Scope | None
    depth: int
    values: set[int] = field(default_factory=set)  # index values at this level
    instances: set[tuple[int, ...]] = field(default_factory=set)  # full index tuples
    families: list[Family] = field(default_factory=list)
    children: dict[tuple[str, ...], Scope] = field(default_factory=dict)
    capname: str = ""
    numel_total: int = 0  # non-buffer elements in the whole subtree
    keys_total: int = 0

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def rel(self) -> tuple[str, ...]:
        """Path from the parent scope, index dropped: ``("model", "layers")``."""
        start = len(self.parent.path) if self.parent else 0
        return self.path[start:-1]

    @property
    def per_instance_numel(self) -> float:
        return self.numel_total / max(1, len(self.instances) or 1)

    def names(self) -> list[str]:
        out: list[str] = []
        s: Scope | None = self
        while s is not None and s.path:
            out.append(s.capname)
            s = s.parent
        return out[::-1]

    def label(self) -> str:
        it = iter(self.names())
        return ".".join("{" + next(it) + "}" if s == IDX else s for s in self.path) or "(top level)"

    def walk(self) -> list[Scope]:
        out = [self]
        for c in self.children.values():
            out += c.walk()
        return out


@dataclass
class Tree:
    root: Scope
    families: list[Family]
    schema: dict[str, TensorInfo]


def _index_positions(
    keys: list[str], schema: dict[str, TensorInfo]
) -> tuple[dict[tuple[str, ...], list[tuple[str, tuple[int, ...]]]], dict[tuple[str, ...], tuple[int, ...]]]:
    """Keys grouped by skeleton (numeric segments as ``#``) with their numeric values, and for
    each skeleton the positions of its numeric segments that are index captures."""
    by_skel: dict[tuple[str, ...], list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for k in keys:
        segs = k.split(".")
        nums = [p for p, x in enumerate(segs) if x.isdigit()]
        if nums:
            for p in nums:
                segs[p] = "#"
            by_skel[tuple(segs)].append((k, tuple(int(k.split(".")[p]) for p in nums)))
        else:
            by_skel[tuple(segs)].append((k, ()))
    chosen_by_skel: dict[tuple[str, ...], tuple[int, ...]] = {}
    for skel, members in by_skel.items():
        positions = [p for p, x in enumerate(skel) if x == "#"]
        chosen: list[int] = []
        for j, p in enumerate(positions):
            if p > 0 and skel[p - 1] in CONTAINER_NAMES:
                chosen.append(p)
                continue
            vals = {v[j] for _, v in members}
            if len(vals) < 2 or max(vals) - min(vals) != len(vals) - 1:
                continue
            # an index runs over tensors of one shape; their dtypes may differ (a GGUF file's
            # quantization mixes types across layers: Q4_K_M keeps some ffn_down in Q6_K)
            rest: dict[tuple[int, ...], set[tuple[int, ...]]] = defaultdict(set)
            for k, v in members:
                rest[v[:j] + v[j + 1:]].add(tuple(schema[k].shape))
            if all(len(x) == 1 for x in rest.values()):
                chosen.append(p)
        chosen_by_skel[skel] = tuple(chosen)
    return by_skel, chosen_by_skel


def _capname(seg_before: str, depth: int, taken: list[str]) -> str:
    if "expert" in seg_before and "e" not in taken:
        return "e"
    for c in ("i", "j", "k", "l", "m", "n"):
        if c not in taken:
            return c
    return f"x{depth}"


def build_tree(schema: dict[str, TensorInfo]) -> Tree:
    """Families and scopes of a schema."""
    by_skel, chosen = _index_positions(list(schema), schema)
    groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
    idxvals: dict[str, tuple[int, ...]] = {}
    for skel, members in by_skel.items():
        pos = chosen[skel]
        nums = [p for p, x in enumerate(skel) if x == "#"]
        if len(pos) == len(nums):  # every numeric segment is an index: one family per skeleton
            fam_segs = tuple(IDX if x == "#" else x for x in skel)
            groups[fam_segs] = [k for k, _ in members]
            for k, v in members:
                idxvals[k] = v
            continue
        keep = [j for j, p in enumerate(nums) if p in pos]
        for k, v in members:
            named = list(skel)
            for j, p in enumerate(nums):
                named[p] = IDX if p in pos else str(v[j])
            groups[tuple(named)].append(k)
            idxvals[k] = tuple(v[j] for j in keep)
    root = Scope(path=(), parent=None, depth=0)
    families: list[Family] = []
    for segs, keys in groups.items():
        shapes = Counter((tuple(schema[k].shape), schema[k].dtype) for k in keys)
        (shape, dtype), n = shapes.most_common(1)[0]
        fam = Family(segs=segs, keys=keys, shape=shape, dtype=dtype, regular=n == len(keys),
                     buffer=is_buffer_like(segs, shape))
        idx_at = [p for p, s in enumerate(segs) if s == IDX]
        scope = root
        for d, p in enumerate(idx_at):
            path = segs[: p + 1]
            child = scope.children.get(path[len(scope.path):])
            if child is None:
                child = Scope(path=path, parent=scope, depth=d + 1)
                scope.children[path[len(scope.path):]] = child
            for k in keys:
                vals = idxvals[k]
                child.values.add(vals[d])
                child.instances.add(vals[: d + 1])
            scope = child
        fam.scope = scope
        scope.families.append(fam)
        families.append(fam)
    _aggregate(root)
    root.instances = {()}
    _name(root, [])
    return Tree(root=root, families=families, schema=schema)


def _aggregate(scope: Scope) -> None:
    total = 0
    nkeys = 0
    for f in scope.families:
        nkeys += f.count
        if not f.buffer:
            total += numel(f.shape) * f.count
    for c in scope.children.values():
        _aggregate(c)
        total += c.numel_total
        nkeys += c.keys_total
    scope.numel_total = total
    scope.keys_total = nkeys


def _name(scope: Scope, taken: list[str]) -> None:
    for c in scope.children.values():
        before = c.path[-2] if len(c.path) >= 2 else ""
        c.capname = _capname(before, c.depth, taken)
        _name(c, taken + [c.capname])


_TOKEN = re.compile(r"[A-Za-z]+|\d+")


def tokens(segment: str) -> list[str]:
    """``add_q_proj`` -> ``[add, q, proj]``; ``norm1`` -> ``[norm, 1]``."""
    return [t.lower() for t in _TOKEN.findall(segment)]
