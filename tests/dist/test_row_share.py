"""TP peers share the rows of column slices (``share_reads=True``), on 4 gloo ranks.

A model with row-parallel weights (``wo``, ``w2``: ``Shard(1)`` under TP, uneven: TP 4 cuts
11 columns 3/3/3/2, TP 2 6/5) is loaded from a bf16 checkpoint into fp32 (a cast recipe) on TP 4, on
2 x 2 FSDP x TP and on HSDP (2 replicas) x TP 2 (replicas and rows shared together; the
replicas decide alike for TP peers whose slices differ in width), with rounds small
enough that a tensor is cut into blocks and the exchange takes several rounds (``w4``'s blocks
too small to split go whole to one peer). Each shard
must equal the eager cast of the full tensor bit for bit, and each rank's bytes read, bytes
from storage and bytes received must be the ones :func:`sdadapt.dry_run` predicts for it. A
read error on one rank during the rounds is every rank's error, promptly (no hang).

The default, ``share_rows="auto"``, on 2 x 2 FSDP x TP with the hosts played by
``SDADAPT_HOST_ID``: one host (rows not shared, and no rank asks its TP group anything), each TP
group split over two hosts (shared), two hosts each holding a whole TP group (not shared, each
group asked once); the dry run with the matching ``ranks_per_node`` predicts each.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from support.dist_helper import outcome, run_distributed, stage
from torch import nn

import sdadapt

D, H, F, LAYERS = 1024, 11, 40, 2
ROUND = sdadapt.EngineConfig(share_rows=True, share_round_bytes=16 << 10)  # several rounds; w2 (40 KiB a rank) cut in blocks
MESHES = {"tp4": {"tp": 4}, "fsdp_tp": {"dp_shard": 2, "tp": 2}, "hsdp_tp": {"dp_replicate": 2, "dp_shard": 1, "tp": 2}}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D, H, bias=False)
        self.wo = nn.Linear(H, D, bias=False)
        self.w1 = nn.Linear(D, F, bias=False)
        self.w2 = nn.Linear(F, D, bias=False)
        self.w4 = nn.Linear(8, 256, bias=False)  # small: its rows go whole to one peer
        self.norm = nn.RMSNorm(D)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})


def _checkpoint(path: str) -> None:
    torch.manual_seed(0)
    save_file({k: v.detach().to(torch.bfloat16) for k, v in Model().state_dict().items()}, path)


def _parallel(spec: dict[str, int]) -> nn.Module:
    """The model on meta: TP (``wq``/``w1`` columns, ``wo``/``w2`` rows), then FSDP2 / HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", tuple(spec.values()), mesh_dim_names=tuple(spec))
    with torch.device("meta"):
        model = Model()
    for layer in model.layers.values():
        parallelize_module(layer, mesh["tp"], {"wq": ColwiseParallel(), "wo": RowwiseParallel(),
                                               "w1": ColwiseParallel(), "w2": RowwiseParallel(), "w4": RowwiseParallel()})  # fmt: skip
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in spec)
    if dp:  # two dims: HSDP, the parameters Replicate on dp_replicate
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh[dp] if len(dp) > 1 else mesh[dp[0]])
    return model


def _cases(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from sdadapt._engine import direct, share

    full = {k: v.float() for k, v in load_file(path).items()}
    # a replica threshold between the two widths of wo's uneven TP-2 slices (24 and 20 KiB):
    # replicas must decide alike for TP peers whose slices differ in width
    share.MIN_SPLIT = 11 << 10
    out: dict[str, Any] = {"path": path, "header": 8 + int.from_bytes(open(path, "rb").read(8), "little")}
    for name, spec in MESHES.items():
        stage(f"case {name}")
        mesh = ",".join(f"{k}={v}" for k, v in spec.items() if v > 1)
        model = _parallel(spec)
        alone = sdadapt.dry_run(model, path, mesh=mesh, share_reads=False, dtype="model", engine=ROUND, max_ranks=64)
        predicted = sdadapt.dry_run(model, path, mesh=mesh, share_reads=True, dtype="model", engine=ROUND, max_ranks=64)
        mine = next(r for r in predicted.ranks if r.rank == dist.get_rank())
        rep = sdadapt.load(model, path, dtype="model", share_reads=True, engine=ROUND)
        for k, t in model.state_dict().items():
            local, want = t, full[k]
            if isinstance(t, DTensor):
                local, want = t.to_local(), want[tuple(slice(a, b) for a, b in _box(t))]
            assert torch.equal(local, want), (name, k)
        got = {
            "load": [rep.bytes_read, rep.storage_bytes, rep.bytes_shared],
            "predicted": [mine.bytes_read, mine.storage_bytes, mine.shared_bytes],
            "alone": next(r for r in alone.ranks if _same_class(r.coordinate, mesh)).storage_bytes,
            "rows": [k for k, t in model.state_dict().items() if isinstance(t, DTensor) and _row_shared(t)],
        }
        out[name] = got

    # a read error on rank 1 inside the rounds (a w2 block): every rank fails, none waits
    stage("case read error")
    real = direct.IOEngine

    class Failing(real):  # type: ignore[misc, valid-type]
        def run(self, jobs: Any) -> Any:
            if any(j.key.endswith("w2.weight") for j in jobs) and self.on_done is None:
                raise OSError(5, "Input/output error (injected)")
            return real.run(self, jobs)

    direct.IOEngine = Failing if dist.get_rank() == 1 else real  # type: ignore[misc]
    try:
        model = _parallel(MESHES["tp4"])
        kind, message, seconds = outcome(lambda: sdadapt.load(model, path, dtype="model", share_reads=True, engine=ROUND))
    finally:
        direct.IOEngine = real  # type: ignore[misc]
    out["error"] = {"kind": kind, "message": message, "seconds": seconds}
    # the group is still healthy: the next load succeeds
    sdadapt.load(_parallel(MESHES["tp4"]), path, dtype="model", share_reads=True, engine=ROUND)
    for name, (host, per_node) in HOSTS.items():
        stage(f"case hosts {name}")
        out[f"hosts_{name}"] = _auto_case(full, path, host(dist.get_rank()), per_node)
    return out


AUTO = sdadapt.EngineConfig(share_round_bytes=16 << 10)  # share_rows="auto", the default
# each case: this rank's host, and the ranks per node that gives the dry run the same hosts
# (on dp_shard=2,tp=2 ranks 0, 1 form one TP group and 2, 3 the other)
HOSTS = {"one": (lambda r: "a", 4), "tp_apart": (lambda r: f"h{r % 2}", 1), "tp_together": (lambda r: f"h{r // 2}", 2)}


def _auto_case(full: dict[str, torch.Tensor], path: str, host: str, per_node: int) -> dict[str, Any]:
    """A load with the default ``share_rows`` on ``host`` (``SDADAPT_HOST_ID``), checked bit for
    bit; its figures, the dry run's for the same hosts, and how many TP groups it asked."""
    from torch.distributed.tensor import DTensor

    from sdadapt._engine import direct

    asked: list[bool] = []
    real = direct.spans_hosts

    def counted(group: Any) -> bool:
        asked.append(real(group))
        return asked[-1]

    os.environ["SDADAPT_HOST_ID"], direct.spans_hosts = host, counted  # type: ignore[assignment]
    try:
        model = _parallel(MESHES["fsdp_tp"])
        predicted = sdadapt.dry_run(model, path, mesh="dp_shard=2,tp=2", share_reads=True, dtype="model", engine=AUTO,
                                    ranks_per_node=per_node, max_ranks=64)  # fmt: skip
        rep = sdadapt.load(model, path, dtype="model", share_reads=True, engine=AUTO)
    finally:
        del os.environ["SDADAPT_HOST_ID"]
        direct.spans_hosts = real  # type: ignore[assignment]
    exact = all(torch.equal(t.to_local(), full[k][tuple(slice(a, b) for a, b in _box(t))]) if isinstance(t, DTensor)
                else torch.equal(t, full[k]) for k, t in model.state_dict().items())  # fmt: skip
    mine = next(r for r in predicted.ranks if r.rank == dist.get_rank())
    return {"exact": exact, "load": [rep.bytes_read, rep.storage_bytes, rep.bytes_shared], "asked": asked,
            "predicted": [mine.bytes_read, mine.storage_bytes, mine.shared_bytes], "rows_bytes": mine.rows_bytes,
            "said": predicted.share_rows, "agreement": predicted.agreement_bytes_per_rank}  # fmt: skip


def _same_class(coordinate: dict[str, int], mesh: str) -> bool:
    """Whether a planned rank holds this rank's shards (replicas, not shared, plan as one)."""
    from sdadapt._plan.layout import Mesh

    grid = Mesh.parse(mesh)
    mine = dict(zip(grid.names, grid.coordinate(dist.get_rank()), strict=True))
    return all(coordinate[k] == c for k, c in mine.items() if k != "dp_replicate")


def _box(t: Any) -> tuple[tuple[int, int], ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


def _row_shared(t: Any) -> bool:
    from sdadapt._engine import row_cut

    box, mesh = _box(t), t.device_mesh
    cut = row_cut(box, tuple(t.shape), tuple(mesh.shape), tuple(mesh.get_coordinate()), tuple(t.placements), 4, ROUND.gap_bytes)
    return cut is not None


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = os.path.join(str(tmp_path_factory.mktemp("rows")), "model.safetensors")
    _checkpoint(path)
    return run_distributed(_cases, 4, path, timeout=300)


@pytest.mark.parametrize("case", list(MESHES))
def test_rows_shared_bit_exact_and_as_predicted(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert sorted(got["rows"]) == [f"layers.{i}.{w}.weight" for i in range(LAYERS) for w in ("w2", "w4", "wo")], (rank, got["rows"])
        assert got["load"] == got["predicted"], (rank, got)  # bytes read, from storage, received: as planned
        # each TP rank reads about its own share of whole rows: less from storage than its slices' rows
        assert got["load"][1] < got["alone"], (rank, got)
        assert got["load"][2] > 0
    if case == "tp4":  # the ranks together read each byte once; the norms (plain tensors) on every rank
        norms = LAYERS * D * 2
        tensors = os.path.getsize(results[0]["path"]) - results[0]["header"]
        assert sum(r[case]["load"][0] for r in results) == tensors + 3 * norms


def test_a_read_error_in_a_round_is_every_ranks_error(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        err = res["error"]
        assert err["kind"] == "LoadError", (rank, err)
        assert err["seconds"] < 60, (rank, err)
    assert "injected" in results[1]["error"]["message"] or "Input/output" in results[1]["error"]["message"], results[1]["error"]


@pytest.mark.parametrize("hosts", list(HOSTS))
def test_auto_shares_rows_only_where_a_tp_group_spans_hosts(results: list[dict[str, Any]], hosts: str) -> None:
    apart = hosts == "tp_apart"
    for rank, res in enumerate(results):
        got = res[f"hosts_{hosts}"]
        assert got["exact"], (rank, got)
        assert got["load"] == got["predicted"], (rank, got)  # bytes read, from storage, received: as the dry run says
        assert (got["load"][2] > 0) == apart and (got["rows_bytes"] > 0) == apart, (rank, got)
        assert got["said"].startswith("auto (on" if apart else "auto (off"), got["said"]
        assert got["agreement"] == 72, got  # the plan's agreement carries the host: 16 bytes more
        # one host: the agreement said so, no group is asked; else each rank's TP group once
        assert got["asked"] == ([] if hosts == "one" else [apart]), (rank, got)
    if apart:  # each rank of a TP group reads about half its rows' pages: less than its slices' rows alone
        one = [r["hosts_one"]["load"][1] for r in results]
        assert all(r["hosts_tp_apart"]["load"][1] < o for r, o in zip(results, one, strict=True))
