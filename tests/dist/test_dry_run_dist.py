"""The dry run against real loads on gloo ranks, and the headers read once per job.

A small transformer-shaped model (uneven sizes) is parallelised on 4 gloo ranks with FSDP2 +
tensor parallelism, and with HSDP: every key's shard box on every rank equals the box
:mod:`sdadapt._plan.layout` computes for that rank without a process group, and a real
``sdadapt.load`` reads exactly the bytes and opens exactly the files :func:`sdadapt.dry_run`
predicted for each rank (with ``share_reads=True`` too, and the bytes received from replicas).
Stacked experts under expert parallelism (torchtitan's layout: ``Shard(0)`` on ``ep``, FSDP2
over ``dp_shard`` with ``_StridedShard`` or ``Shard(1)``, the rest over ``dp_shard`` and ``ep``
flattened) have the boxes the rules give too, and a dry run of the already-parallelised model
itself (its own placements) predicts each rank's reads.
The headers: only the first rank opens the index and the shard headers, a broken header is
every rank's error, and the collectives of a load (count and bytes per rank) are the same at 2,
4 and 8 ranks.
"""

from __future__ import annotations

import builtins
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from support.dist_helper import run_distributed
from torch import nn

import sdadapt
from sdadapt._plan.layout import Mesh, default_layouts, local_box
from sdadapt._plan.target import schema_of
from sdadapt.errors import UsageError

D, H, F, V, LAYERS = 12, 10, 14, 22, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D, H, bias=False)
        self.wo = nn.Linear(H, D, bias=False)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, F, bias=False)
        self.w2 = nn.Linear(F, D, bias=False)
        self.w3 = nn.Linear(D, F, bias=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(D)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)


E0, E1 = 4, 2  # experts of the two MoE layers: 4 = dp_shard * ep (strided dim 0), 2 < 4 (Shard(1))


class Experts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, F, D))
        self.w2 = nn.Parameter(torch.randn(n, D, F))
        self.w3 = nn.Parameter(torch.randn(n, F, D))


class MoE(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.router = nn.Linear(D, n, bias=False)
        self.experts = Experts(n)


class MoELayer(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.moe = MoE(n)
        self.attention_norm = nn.RMSNorm(D)


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({"0": MoELayer(E0), "1": MoELayer(E1)})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)


def _checkpoint(folder: str) -> str:
    """The model's values in an HF sharded folder of three files."""
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in Model().state_dict().items()}
    keys = sorted(sd)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for i, k in enumerate(keys):
        files.setdefault(f"model-{i % 3:05d}.safetensors", {})[k] = sd[k]
    for name, part in files.items():
        save_file(part, os.path.join(folder, name))
    weight_map = {k: name for name, part in files.items() for k in part}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    torch.manual_seed(1)
    os.makedirs(os.path.join(folder, "moe"))
    save_file({k: v.detach().clone() for k, v in MoEModel().state_dict().items()}, os.path.join(folder, "moe", "model.safetensors"))
    return folder


def _parallel(mesh_spec: dict[str, int]) -> nn.Module:
    """The model on meta, parallelised as torchtitan does (TP, then FSDP2 / HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = tuple(mesh_spec)
    mesh = init_device_mesh("cpu", tuple(mesh_spec.values()), mesh_dim_names=names)
    with torch.device("meta"):
        model = Model()
    if "tp" in names:
        tp = mesh["tp"]
        parallelize_module(model, tp, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()})
        for layer in model.layers.values():
            parallelize_module(layer, tp, {
                "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            })  # fmt: skip
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    dp_mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _parallel_ep() -> nn.Module:
    """The MoE model on meta on ``dp_shard=2, ep=2``, as torchtitan parallelises experts: the
    stacked weights ``Shard(0)`` on ``ep``, then FSDP2 over ``dp_shard`` (``Shard(1)`` where
    ``dp_shard * ep`` exceeds the experts), the rest FSDP2 over ``dp_shard`` and ``ep`` flattened."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    flat = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    with torch.device("meta"):
        model = MoEModel()

    def expert_parallel(name: str, module: nn.Module, device_mesh: Any) -> None:
        for n, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(n, nn.Parameter(distribute_tensor(p, device_mesh, [Shard(0)])))

    for layer in model.layers.values():
        experts = layer.moe.experts
        n = experts.w1.shape[0]
        distribute_module(experts, mesh["ep"], expert_parallel)
        fully_shard(experts, mesh=mesh["dp_shard"], shard_placement_fn=lambda p, n=n: Shard(1) if 2 * 2 > n else Shard(0))
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    return model


class _Opens:
    """Counts the opens of files under ``folder`` (``open`` and ``os.open``) while active."""

    def __init__(self, folder: str):
        self.folder = os.path.realpath(folder)
        self.paths: list[str] = []

    def __enter__(self) -> _Opens:
        self._open, self._os_open = builtins.open, os.open
        outer = self

        def counting_open(file: Any, *a: Any, **k: Any) -> Any:
            outer._note(file)
            return outer._open(file, *a, **k)

        def counting_os_open(path: Any, *a: Any, **k: Any) -> int:
            outer._note(path)
            return outer._os_open(path, *a, **k)

        builtins.open, os.open = counting_open, counting_os_open  # type: ignore[assignment]
        return self

    def _note(self, path: Any) -> None:
        if isinstance(path, (str, os.PathLike)) and os.path.realpath(os.fspath(path)).startswith(self.folder + os.sep):
            self.paths.append(os.path.basename(os.fspath(path)))

    def __exit__(self, *exc: object) -> None:
        builtins.open, os.open = self._open, self._os_open  # type: ignore[assignment]


def _boxes(model: nn.Module) -> dict[str, list[list[int]]]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for k, t in model.state_dict().items():
        assert isinstance(t, DTensor), k
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        out[k] = [[o, o + n] for o, n in zip(offset, shape, strict=True)]
    return out


def _cases(folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec, share in (
        ("fsdp_tp", {"dp_shard": 2, "tp": 2}, False), ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, True), ("ep", None, False),
    ):  # fmt: skip
        model = _parallel(spec) if spec else _parallel_ep()
        path = folder if spec else os.path.join(folder, "moe")
        boxes = _boxes(model)
        # a dry run of this already-parallelised model: its own placements, this rank's figures
        mesh = ",".join(f"{k}={v}" for k, v in spec.items()) if spec else "dp_shard=2,ep=2"
        mine = next(r for r in sdadapt.dry_run(model, path, mesh=mesh, share_reads=share, max_ranks=64).ranks if r.rank == dist.get_rank())
        try:
            sdadapt.dry_run(model, path, mesh="dp_shard=4")
            wrong_mesh = ""
        except UsageError as e:
            wrong_mesh = str(e)
        with _Opens(path) as opens:
            rep = sdadapt.load(model, path, share_reads=share)
        out[name] = {
            "boxes": boxes, "bytes_read": rep.bytes_read, "bytes_shared": rep.bytes_shared, "storage_bytes": rep.storage_bytes,
            "opens": sorted(opens.paths), "local_bytes": rep.local_bytes, "wrong_mesh": wrong_mesh,
            "model_dry_run": [mine.bytes_read, mine.shared_bytes, mine.local_bytes],
        }  # fmt: skip
        torch.manual_seed(0 if spec else 1)
        ref = Model() if spec else MoEModel()
        for k, t in model.state_dict().items():
            full = t.full_tensor()
            assert torch.equal(full, ref.state_dict()[k]), k
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    folder = _checkpoint(str(tmp_path_factory.mktemp("ckpt")))
    return folder, run_distributed(_cases, 4, folder, timeout=600)


CASES = [("fsdp_tp", "dp_shard=2,tp=2", False), ("hsdp", "dp_replicate=2,dp_shard=2", True), ("ep", "dp_shard=2,ep=2", False)]


@pytest.mark.parametrize("case,mesh,share", CASES)
def test_boxes_and_reads_are_those_predicted(loaded: tuple[str, list[dict[str, Any]]], case: str, mesh: str, share: bool) -> None:
    folder, results = loaded
    path = os.path.join(folder, "moe") if case == "ep" else folder
    with torch.device("meta"):
        schema = schema_of((MoEModel() if case == "ep" else Model()).state_dict())
    grid = Mesh.parse(mesh)
    layouts = default_layouts(schema, grid)
    if case == "ep":  # the rules' placements for stacked experts: strided where the experts divide, else dim 1
        assert "_StridedShard" in repr(layouts["layers.0.moe.experts.w1"].groups)
        assert "Shard(dim=1)" in repr(layouts["layers.1.moe.experts.w1"].groups)
    for rank, res in enumerate(results):
        coord = grid.coordinate(rank)
        for key, box in res[case]["boxes"].items():
            assert [list(b) for b in local_box(schema[key], grid, layouts[key], coord) or ()] == box, (rank, key)
    report = sdadapt.dry_run(schema, path, mesh=mesh, share_reads=share, max_ranks=64)
    assert report.exact and report.world_size == 4
    by_rank = {r.rank: r for r in report.ranks}
    assert sorted(by_rank) == [0, 1, 2, 3]  # every rank its own class here
    for rank, res in enumerate(results):
        predicted = by_rank[rank]
        got = res[case]
        assert got["bytes_read"] == predicted.bytes_read > 0, (rank, got, predicted)
        # what a cold cache reads from storage for the rank: the load's count is the prediction
        assert got["storage_bytes"] == predicted.storage_bytes >= got["bytes_read"], (rank, got, predicted)
        assert got["bytes_shared"] == predicted.shared_bytes, (rank, got, predicted)
        assert got["local_bytes"] == predicted.local_bytes, rank
        assert len(got["opens"]) == predicted.opens, (rank, got["opens"], predicted)
        # the dry run of the parallelised model on that rank, from its own DTensors, agrees
        assert got["model_dry_run"] == [got["bytes_read"], got["bytes_shared"], got["local_bytes"]], (rank, got)
        assert "not a set of dims" in got["wrong_mesh"] or "beyond the dry run's mesh" in got["wrong_mesh"], got["wrong_mesh"]
    # one host (the 4 ranks are its first node): its page cache serves a page to every rank that
    # touches it, so the node reads the union of their pages; each load's figure is its rank alone
    alone = [res[case]["storage_bytes"] for res in results]
    assert max(alone) <= report.node_storage_bytes <= sum(alone), (report.node_storage_bytes, alone)
    if case == "fsdp_tp":  # TP peers' column slices share pages
        assert report.node_storage_bytes < sum(alone), (report.node_storage_bytes, alone)
    # headers once: the first rank opened the index and every shard's header, the others none
    files = 1 if case == "ep" else 4  # one file; or the index and 3 shards
    first = results[0][case]["opens"]
    assert report.ranks[0].opens >= files and report.ranks[0].header_bytes > 0
    assert all(r.header_bytes == 0 and r.header_bytes_received > 0 for r in report.ranks[1:])
    if case != "ep":
        assert first.count("model.safetensors.index.json") == 1
        for res in results[1:]:
            assert "model.safetensors.index.json" not in res[case]["opens"]
    assert sum(r.bytes_read * r.ranks for r in report.ranks) == report.total_bytes_read
    if share:
        assert report.total_bytes_read == report.checkpoint_bytes  # each replica group reads every byte once


# ---------------------------------------------------------------------------- collectives
def _count_collectives(folder: str) -> dict[str, Any]:
    """The collectives one rank makes in a load (count and tensor bytes by name)."""
    from torch.distributed import distributed_c10d as c10d

    calls: list[tuple[str, int]] = []
    names = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "gather", "gather_object", "scatter",
             "reduce", "all_to_all", "broadcast_object_list", "barrier", "all_gather_into_tensor", "reduce_scatter")  # fmt: skip
    saved = {n: getattr(c10d, n) for n in names}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            t = a[0] if a and isinstance(a[0], torch.Tensor) else None
            calls.append((name, t.numel() * t.element_size() if t is not None else 0))
            return fn(*a, **k)

        return counted

    for n, fn in saved.items():
        setattr(c10d, n, wrap(n, fn))
        setattr(dist, n, getattr(c10d, n))
    try:
        with torch.device("meta"):
            model = Model()
        rep = sdadapt.load(model, folder)
        assert rep.bytes_read > 0
    finally:
        for n, fn in saved.items():
            setattr(c10d, n, fn)
            setattr(dist, n, fn)
    return {"calls": calls}


@pytest.mark.slow
def test_collectives_of_a_load_do_not_grow_with_the_world(tmp_path: Any) -> None:
    folder = _checkpoint(str(tmp_path))
    seen = {}
    for world in (2, 4, 8):
        results = run_distributed(_count_collectives, world, folder, timeout=600)
        calls = results[0]["calls"]
        assert all(r["calls"] == calls for r in results), world  # the same on every rank
        seen[world] = calls
    assert seen[2] == seen[4] == seen[8], seen
    names = [n for n, _ in seen[2]]
    assert "broadcast_object_list" in names and not any(n.startswith(("all_gather", "gather")) for n in names), names


def test_a_load_in_a_group_of_one_runs_no_collective(tmp_path: Any) -> None:
    """One rank has nobody to agree with: its load asks the backend nothing (on one GPU each
    all-reduce would also wait for the device)."""
    folder = _checkpoint(str(tmp_path))
    (result,) = run_distributed(_count_collectives, 1, folder, timeout=300)
    assert result["calls"] == []


# ---------------------------------------------------------------------------- a broken header
def _load_broken(folder: str) -> str:
    with torch.device("meta"):
        model = Model()
    try:
        sdadapt.load(model, folder)
    except sdadapt.SdadaptError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_broken_header_is_every_ranks_error(tmp_path: Any) -> None:
    folder = _checkpoint(str(tmp_path))
    path = os.path.join(folder, "model-00001.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"!")  # the header's JSON no longer parses
    results = run_distributed(_load_broken, 2, folder, timeout=300)
    for msg in results:
        assert "SourceError" in msg and "model-00001.safetensors" in msg, msg
