"""The one box function (:func:`sdadapt._base.regions.shard_box`): DTensor's own offset rule for
export, refit and the dry run; ``None`` where a rank's shard is not one box."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from sdadapt._base.regions import shard_box


def _rows(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple) -> list[tuple[int, int]]:
    return [shard_box(shape, mesh, (a, b), placements)[0] for a in range(mesh[0]) for b in range(mesh[1])]  # type: ignore[index]


def test_fsdp_over_tp_is_one_box_per_rank_cut_by_tp_first():
    # torchtitan's 2-D layout: dp holds _StridedShard(0, split_factor=tp), tp holds Shard(0)
    rows = _rows((8, 3), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    assert rows == [(0, 2), (4, 6), (2, 4), (6, 8)]  # (dp, tp) = (0,0), (0,1), (1,0), (1,1)


def test_uneven_and_empty_shards_follow_dtensor():
    assert [shard_box((5,), (4,), (c,), (Shard(0),)) for c in range(4)] == [((0, 2),), ((2, 4),), ((4, 5),), ((5, 5),)]
    assert shard_box((5, 2), (2,), (1,), (Replicate(),)) == ((0, 5), (0, 2))
    assert shard_box((5, 2), (), (), ()) == ((0, 5), (0, 2))


def test_a_shard_that_is_not_one_box_has_none():
    assert shard_box((8,), (2, 2), (0, 1), (Shard(0), _StridedShard(0, split_factor=2))) is None  # strided after a cut
    assert shard_box((8,), (2, 2), (0, 1), (_StridedShard(0, split_factor=3), Shard(0))) is None  # split_factor not tp's
