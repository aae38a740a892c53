"""Acceptance of issue 2 on real gloo processes: every mesh x every source, bit-exact, bytes.

One launched group per world size (1, 2, 3, 4) runs every (mesh, source) case of that size and
returns per-case facts; the parametrised tests below check them. For every case:

- every parameter's full tensor (``DTensor.full_tensor()``) equals the reference state dict
  (the same transform applied eagerly to full tensors: identity, fuse of split q/k/v, or a
  bf16 round trip for the cast case);
- every rank's local shard equals the slice of the reference at the offset DTensor itself
  computes (``compute_local_shape_and_global_offset``), uneven and ``_StridedShard`` included;
- a forward pass matches the unsharded reference model, and a backward pass gives every
  parameter a gradient (meshes whose TP plan is forward-correct, see ``models.TP_PLAN_FORWARD``);
- ``LoadReport.bytes_read`` is at most the rank's shard bytes (scaled by source/target dtype
  size for casts), and summed over a pure FSDP mesh it is exactly the checkpoint's size.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_hf_sharded, write_safetensors, write_torch_save
from support.dist_helper import run_distributed, stage
from support.models import TP_PLAN_FORWARD, TinyTransformer, parallelize, split_qkv
from torch.distributed.checkpoint import DefaultLoadPlanner, Metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import sdadapt
from sdadapt._engine.direct import direct_targets, local_jobs
from sdadapt._engine.reader import AdaptedLoadPlanner

# Model sizes: vocab 37, ffn 40, dim 16 give uneven shards over 2, 3 and 4 ranks; "tiny" has a
# vocab of 3, so FSDP over 4 ranks leaves one rank with an empty shard of the embedding.
CONFIGS: dict[str, dict[str, int]] = {
    "base": dict(layers=2, dim=16, heads=4, ffn=40, vocab=37),
    "tiny": dict(layers=1, dim=8, heads=2, ffn=6, vocab=3),
    # torch's RowwiseParallel builds its input DTensor from local shards assuming even sizes,
    # so a forward pass over 3 TP ranks needs an ffn divisible by 3 (the vocab stays uneven).
    "ffn42": dict(layers=2, dim=16, heads=4, ffn=42, vocab=37),
}

QKV = sdadapt.Adapter(
    [
        sdadapt.fuse(
            ["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.k_proj.{p}", "layers.{i}.attn.v_proj.{p}"],
            "layers.{i}.attn.qkv.{p}",
        )
    ],
    name="split-qkv",
)
BF16 = sdadapt.Adapter([sdadapt.cast("**", "float32", from_dtype="bfloat16")], name="bf16-to-fp32")

# source kind -> (file name inside the config's folder, adapter, subtree, source dtype)
SOURCES: dict[str, tuple[str, sdadapt.Adapter | None, str | None, torch.dtype]] = {
    "torch_save": ("plain.pt", None, None, torch.float32),
    "torch_save_split_qkv": ("split.pt", QKV, "model", torch.float32),
    "safetensors": ("single.safetensors", None, None, torch.float32),
    "hf_sharded": ("hf", None, None, torch.float32),
    "safetensors_bf16_cast": ("bf16.safetensors", BF16, None, torch.bfloat16),
}
ALL_SOURCES = list(SOURCES)
# the same sources loaded with share_reads=True (replicas split the reads and broadcast)
SHARED = {"hf_sharded_shared": "hf_sharded", "torch_save_split_qkv_shared": "torch_save_split_qkv"}
SOURCES.update({k: SOURCES[v] for k, v in SHARED.items()})

# mesh kind -> (mesh shape, mesh dim names, TP plan or None for the discussion's, forward-correct)
# "plain_meta"/"plain_cpu" are unsharded models (replicated: every rank holds everything).
MESHES: dict[str, tuple[tuple[int, ...] | None, tuple[str, ...] | None, dict | None, bool]] = {
    "plain_meta": (None, None, None, True),
    "plain_cpu": (None, None, None, True),
    "fsdp": ((-1,), ("fsdp",), None, True),
    "tp": ((-1,), ("tp",), None, False),
    "tp_fwd": ((-1,), ("tp",), TP_PLAN_FORWARD, True),
    "fsdp_tp": ((2, 2), ("fsdp", "tp"), None, False),
    "fsdp_tp_fwd": ((2, 2), ("fsdp", "tp"), TP_PLAN_FORWARD, True),
    "hsdp": ((2, 2), ("replicate", "fsdp"), None, True),
    # the discussion script's own mesh: (N, 1) named ("fsdp", "tp"), so TP is a no-op
    "fsdp_tp1": ((-1, 1), ("fsdp", "tp"), None, True),
}

# (world size, mesh kind, config, sources)
CASES: list[tuple[int, str, str, list[str]]] = [
    (1, "plain_meta", "base", ALL_SOURCES),
    (1, "plain_cpu", "base", ["torch_save", "hf_sharded"]),
    (1, "fsdp", "base", ["torch_save", "torch_save_split_qkv"]),
    (2, "plain_cpu", "base", ["torch_save", "safetensors_bf16_cast"]),
    (2, "fsdp", "base", ALL_SOURCES),
    (2, "tp", "base", ALL_SOURCES + list(SHARED)),
    (2, "tp_fwd", "base", ["torch_save", "hf_sharded"]),
    (3, "plain_meta", "base", ["torch_save_split_qkv", "hf_sharded"]),
    (3, "fsdp", "base", ALL_SOURCES),
    (3, "tp", "base", ALL_SOURCES),
    (3, "tp_fwd", "ffn42", ["torch_save", "safetensors_bf16_cast"]),
    (4, "fsdp", "base", ALL_SOURCES),
    (4, "fsdp", "tiny", ["torch_save", "hf_sharded"]),
    (4, "tp", "base", ["torch_save", "torch_save_split_qkv"]),
    (4, "fsdp_tp", "base", ALL_SOURCES + list(SHARED)),
    (4, "fsdp_tp_fwd", "base", ALL_SOURCES),
    (4, "hsdp", "base", ALL_SOURCES + list(SHARED)),
    (4, "plain_cpu", "base", ["hf_sharded", "hf_sharded_shared"]),
    (4, "fsdp_tp1", "base", ["torch_save", "torch_save_split_qkv"]),
]
WORLD_SIZES = sorted({c[0] for c in CASES})
TIMEOUT = {1: 90, 2: 120, 3: 150, 4: 180}


def case_id(world: int, mesh: str, config: str, source: str) -> str:
    return f"w{world}-{mesh}-{config}-{source}"


PARAMS = [(w, m, c, s) for w, m, c, srcs in CASES for s in srcs]


# --------------------------------------------------------------------------------------
# checkpoints (written once by the test process with the reference writers, never sdadapt)
# --------------------------------------------------------------------------------------
def reference_state_dict(config: str) -> dict[str, torch.Tensor]:
    """The model's state dict with every entry random (LayerNorm ones/zeros would hide a
    misplaced slice)."""
    torch.manual_seed(0)
    model = TinyTransformer(**CONFIGS[config])
    gen = torch.Generator().manual_seed(1234)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in model.state_dict().items()}


def write_sources(folder: str, config: str) -> None:
    sd = reference_state_dict(config)
    d = os.path.join(folder, config)
    os.makedirs(d, exist_ok=True)
    write_torch_save(os.path.join(d, "plain.pt"), sd)
    write_torch_save(os.path.join(d, "split.pt"), {"model": split_qkv(sd), "step": 3})
    write_safetensors(os.path.join(d, "single.safetensors"), sd)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    write_hf_sharded(os.path.join(d, "hf"), sd, max_shard_bytes=max(512, nbytes // 5))
    write_safetensors(os.path.join(d, "bf16.safetensors"), {k: v.to(torch.bfloat16) for k, v in sd.items()})


def expected_state_dict(config: str, source: str) -> dict[str, torch.Tensor]:
    sd = reference_state_dict(config)
    if SOURCES[source][3] == torch.bfloat16:
        return {k: v.to(torch.bfloat16).to(torch.float32) for k, v in sd.items()}
    return sd


def source_nbytes(config: str, source: str) -> int:
    itemsize = SOURCES[source][3].itemsize
    return sum(v.numel() * itemsize for v in reference_state_dict(config).values())


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------
def _build(mesh_kind: str, config: str, meshes: dict[str, Any]) -> torch.nn.Module:
    shape, names, plan, _ = MESHES[mesh_kind]
    if mesh_kind == "plain_cpu":
        torch.manual_seed(99)  # real memory, values unlike the checkpoint's
        return TinyTransformer(**CONFIGS[config])
    with torch.device("meta"):
        model = TinyTransformer(**CONFIGS[config])
    if shape is None:
        return model
    if mesh_kind not in meshes:
        world = dist.get_world_size()
        meshes[mesh_kind] = init_device_mesh("cpu", tuple(world if s == -1 else s for s in shape), mesh_dim_names=names)
    return parallelize(model, meshes[mesh_kind], plan)


def _check_model(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    full_bad, shard_bad, empty, placements, uneven = [], [], [], set(), False
    sd = model.state_dict()
    assert set(sd) == set(expected), sorted(set(sd) ^ set(expected))
    for k, v in sd.items():
        want = expected[k]
        if isinstance(v, DTensor):
            placements.add(str(tuple(v.placements)))
            local = v.to_local()
            shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            region = want[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            if tuple(local.shape) != tuple(shape) or not torch.equal(local, region):
                shard_bad.append(k)
            if any(a != b for a, b in zip(shape, _even_shape(v))):
                uneven = True
            if local.numel() == 0 and v.numel() > 0:
                empty.append(k)
            full = v.full_tensor()  # collective: every rank runs it for every key in the same order
        else:
            full = v
        if full.dtype != want.dtype or not torch.equal(full, want):
            full_bad.append(k)
    return {"full_mismatch": full_bad, "shard_mismatch": shard_bad, "placements": sorted(placements), "uneven": uneven, "empty": empty}


def _plans_agree(model: torch.nn.Module) -> bool:
    """sdadapt's memoised local plan is DCP's ``DefaultLoadPlanner`` plan, item for item; and the
    jobs a load without ``dcp.load`` runs (``direct.local_jobs``) are those items: key, box and
    destination (the same memory, the same shape)."""
    sd = {k: v for k, v in sorted(model.state_dict().items()) if isinstance(v, torch.Tensor)}  # dcp.load sorts the keys
    md = Metadata(
        state_dict_metadata={
            k: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(), [ChunkStorageMetadata(torch.Size([0] * v.dim()), v.size())])
            for k, v in sd.items()
        }
    )
    ours, theirs = AdaptedLoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(sd, md, False)
    theirs.set_up_planner(sd, md, False)
    items = theirs.create_local_plan().items
    if ours.create_local_plan().items != items or not direct_targets(sd):
        return False
    plan = SimpleNamespace(recipes={k: SimpleNamespace(shape=tuple(v.shape)) for k, v in sd.items()})
    jobs, _ = local_jobs(plan, sd)  # type: ignore[arg-type] - local_jobs reads only the recipes' shapes
    dests = [theirs.resolve_tensor(it).detach() for it in items]
    return [(j.key, j.box, j.dest.data_ptr(), tuple(j.dest.shape)) for j in jobs] == [
        (it.storage_index.fqn, tuple((o, o + n) for o, n in zip(it.storage_offsets, it.lengths)), d.data_ptr(), tuple(d.shape))
        for it, d in zip(items, dests)
    ]


def _even_shape(v: DTensor) -> tuple[int, ...]:
    """The local shape this shard would have if every sharded dim divided evenly (for flagging
    uneven cases: any rank whose shape differs from the ceil-division share)."""
    shape = list(v.shape)
    for mesh_dim, p in enumerate(v.placements):
        if p.is_shard():
            d = p.dim  # type: ignore[attr-defined]
            n = v.device_mesh.size(mesh_dim)
            shape[d] = -(-shape[d] // n)
    return tuple(shape)


def _forward_diff(model: torch.nn.Module, config: str, expected: dict[str, torch.Tensor]) -> float:
    ref = TinyTransformer(**CONFIGS[config])
    ref.load_state_dict(expected)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CONFIGS[config]["vocab"], (2, 5), generator=gen)
    with torch.no_grad():
        want = ref(tokens)
        got = model(tokens)
    if isinstance(got, DTensor):
        got = got.full_tensor()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max())


def _untrained(model: torch.nn.Module, config: str) -> list[str]:
    """The parameters that get no gradient from a backward pass through the loaded model, or
    are no longer trainable ``nn.Parameter``s (materialising a meta model must keep both)."""
    tokens = torch.randint(0, CONFIGS[config]["vocab"], (2, 5), generator=torch.Generator().manual_seed(3))
    out = model(tokens)
    (out.full_tensor() if isinstance(out, DTensor) else out).sum().backward()
    bad = [n for n, p in model.named_parameters() if not isinstance(p, torch.nn.Parameter) or not p.requires_grad or p.grad is None]
    model.zero_grad(set_to_none=True)
    return bad


def _materialised(model: torch.nn.Module) -> list[Any]:
    """What materialising left in ``model``: each parameter's object, kind and layout (its local
    tensor's too), each buffer's, and FSDP2's view of each parameter (the module's parameter
    object, its sharded data on the local tensor's memory, the padded size)."""
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        facts = [name, id(p), type(p), getattr(p, "_is_param", None), p.requires_grad, p.is_leaf, p.grad_fn, p.device, p.dtype,
                 tuple(p.shape), p.stride()]  # fmt: skip
        if isinstance(p, DTensor):
            lt = p._local_tensor
            facts += [p.placements, p.device_mesh, type(lt), lt.requires_grad, lt.device, tuple(lt.shape), lt.stride(), lt.is_contiguous()]
        out.append(facts)
    for name, b in model.named_buffers(remove_duplicate=False):
        out.append([name, type(b), b.device, b.dtype, tuple(b.shape), b.stride()])
    from sdadapt._transaction.materialize import _param_groups  # either torch layout of FSDP2's groups

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in _param_groups(m) or ():
                for fp in group.fsdp_params:
                    held = getattr(fp._module_info.module, fp._module_info.param_name)
                    data = fp._sharded_param_data
                    out.append([fp._param_fqn, fp.sharded_param is held, tuple(data.shape),
                                data.untyped_storage().data_ptr() == held._local_tensor.untyped_storage().data_ptr(),
                                fp._sharding_spec == held._spec])  # fmt: skip
    return out


def _to_empty_facts(mesh_kind: str, config: str, meshes: dict[str, Any]) -> dict[str, Any]:
    """sdadapt's ``to_empty`` against ``Module._apply`` (what ``model.to_empty`` runs) on two
    fresh builds of one meta model: whether its own walk was taken, and whether both leave
    the same objects, layouts and FSDP2 state (parameter ids compared with each build's own)."""
    from sdadapt._transaction.materialize import _empty_like, _plain_apply, to_empty

    cpu = torch.device("cpu")
    theirs, ours = _build(mesh_kind, config, meshes), _build(mesh_kind, config, meshes)
    before = ([id(p) for p in theirs.parameters()], [id(p) for p in ours.parameters()])
    walked = _plain_apply(list(ours.modules()))
    theirs._apply(lambda t: _empty_like(t, cpu))
    to_empty(ours, cpu)
    a, b = _materialised(theirs), _materialised(ours)
    after = ([id(p) for p in theirs.parameters()], [id(p) for p in ours.parameters()])
    ids_kept = [x == y for x, y in zip(before, after)]  # [Module._apply's, ours]
    for facts in (a, b):  # object ids differ between the builds: compared above, each with its own
        for f in facts:
            if len(f) > 1 and isinstance(f[1], int):
                f[1] = None
    return {"walked": walked, "same": a == b, "ids_kept": ids_kept}


def _run_cases(folder: str, cases: list[tuple[str, str, str]]) -> dict[str, dict[str, Any]]:
    """On every rank: for each (mesh kind, config, source kind), build, load, check; for each
    meta (mesh kind, config) once, materialising compared with ``Module._apply``."""
    meshes: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    world = dist.get_world_size()
    for mesh_kind, config in dict.fromkeys((m, c) for m, c, _ in cases):
        if mesh_kind != "plain_cpu":
            out[f"to_empty-w{world}-{mesh_kind}-{config}"] = _to_empty_facts(mesh_kind, config, meshes)
    for mesh_kind, config, source in cases:
        stage(case_id(world, mesh_kind, config, source))
        name, adapter, subtree, _ = SOURCES[source]
        model = _build(mesh_kind, config, meshes)
        # replicas only: TP peers' shared rows are tests/dist/test_row_share.py's
        engine = sdadapt.EngineConfig(share_rows=False) if source in SHARED else None
        rep = sdadapt.load(model, os.path.join(folder, config, name), adapter, subtree=subtree, share_reads=source in SHARED, engine=engine)
        expected = expected_state_dict(config, source)
        facts = _check_model(model, expected)
        facts.update(
            keys_loaded=rep.keys_loaded,
            bytes_read=rep.bytes_read,
            bytes_shared=rep.bytes_shared,
            local_bytes=rep.local_bytes,
            materialized=rep.materialized,
            on_meta=any(p.is_meta or (isinstance(p, DTensor) and p.to_local().is_meta) for p in model.parameters()),
            forward_diff=_forward_diff(model, config, expected) if MESHES[mesh_kind][3] else None,
            untrained=_untrained(model, config) if MESHES[mesh_kind][3] else [],
            plans_agree=_plans_agree(model),
        )
        out[case_id(world, mesh_kind, config, source)] = facts
        dist.barrier()
    return out


# --------------------------------------------------------------------------------------
# test side
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("dist_load_sources")
    for config in CONFIGS:
        write_sources(str(d), config)
    return str(d)


_RESULTS: dict[int, list[dict[str, dict[str, Any]]] | AssertionError] = {}


def results_for(world: int, folder: str) -> list[dict[str, dict[str, Any]]]:
    """Per-rank results of the world size's one launch (run on first use, then cached; a
    failed or hung launch is cached too, so its cases fail at once instead of relaunching: the
    first with the launch's whole report, the others with its first line)."""
    if world not in _RESULTS:
        cases = [(m, c, s) for w, m, c, srcs in CASES if w == world for s in srcs]
        try:
            _RESULTS[world] = run_distributed(_run_cases, world, folder, cases, timeout=TIMEOUT[world])
        except AssertionError as e:  # WorkerError or a hang
            _RESULTS[world] = e
            raise
    got = _RESULTS[world]
    if isinstance(got, AssertionError):
        head = " / ".join(str(got).split("\n")[:2])[:500]  # what failed, and the first rank's line
        raise AssertionError(f"the {world}-rank launch failed (its first case has the ranks' report): {head}")
    return got


@pytest.mark.parametrize(("world", "mesh", "config", "source"), PARAMS, ids=[case_id(*p) for p in PARAMS])
def test_load_bit_exact(world: int, mesh: str, config: str, source: str, folder: str) -> None:
    per_rank = [r[case_id(world, mesh, config, source)] for r in results_for(world, folder)]
    n_keys = len(reference_state_dict(config))
    for rank, f in enumerate(per_rank):
        assert f["keys_loaded"] == n_keys, (rank, f["keys_loaded"])
        assert f["full_mismatch"] == [], f"rank {rank}: full tensors differ for {f['full_mismatch']}"
        assert f["shard_mismatch"] == [], f"rank {rank}: local shards differ for {f['shard_mismatch']}"
        assert not f["on_meta"], f"rank {rank}: parameters left on meta"
        assert f["plans_agree"], f"rank {rank}: AdaptedLoadPlanner's plan differs from DefaultLoadPlanner's"
        assert f["materialized"] == (mesh != "plain_cpu"), (rank, f["materialized"])
        if f["forward_diff"] is not None:
            assert f["forward_diff"] <= 1e-5, f"rank {rank}: forward differs by {f['forward_diff']}"
        assert f["untrained"] == [], f"rank {rank}: no gradient after loading for {f['untrained']}"
    # the mesh really is what the case claims
    placements = set().union(*(f["placements"] for f in per_rank))
    if mesh.startswith("plain"):
        assert placements == set()
    elif world > 1:
        assert placements, "no DTensor parameters"
    if mesh == "fsdp_tp" and world == 4:
        assert any("_StridedShard" in p for p in placements), placements


@pytest.mark.parametrize(("world", "mesh", "config", "source"), PARAMS, ids=[case_id(*p) for p in PARAMS])
def test_load_bytes(world: int, mesh: str, config: str, source: str, folder: str) -> None:
    per_rank = [r[case_id(world, mesh, config, source)] for r in results_for(world, folder)]
    ratio = SOURCES[source][3].itemsize / torch.float32.itemsize  # the models are fp32
    for rank, f in enumerate(per_rank):
        limit = f["local_bytes"] * ratio
        assert f["bytes_read"] <= limit, f"rank {rank} read {f['bytes_read']} bytes for {limit:.0f} of shards"
    total = sum(f["bytes_read"] for f in per_rank)
    ckpt = source_nbytes(config, source)
    if source in SHARED:
        shared = sum(f["bytes_shared"] for f in per_rank)
        if mesh.startswith("plain"):  # no DTensors: nothing to share, every rank reads it all
            assert total == world * ckpt and shared == 0, (total, shared)
        else:  # replicas split every replicated DTensor shard: less read than without sharing
            alone = sum(r[case_id(world, mesh, config, SHARED[source])]["bytes_read"] for r in results_for(world, folder))
            assert ckpt <= total < alone, (total, ckpt, alone)
            assert shared == alone - total, (shared, alone, total)
            if mesh == "hsdp":  # every parameter is a DTensor: the ranks together read it once
                assert total == ckpt, (total, ckpt)
        return
    if mesh in ("fsdp", "fsdp_tp1"):  # shards partition every tensor: the ranks together read the checkpoint once
        assert total == ckpt, (total, ckpt)
    elif mesh.startswith("plain"):  # replicated: every rank reads all of it
        assert total == world * ckpt, (total, world, ckpt)
    elif mesh == "hsdp":  # two replicas of an FSDP-sharded model
        assert total == 2 * ckpt, (total, ckpt)
    else:  # TP leaves norms and some biases replicated: more than once, less than everywhere
        assert ckpt < total < world * ckpt, (total, world, ckpt)


TO_EMPTY = [(w, m, c) for w, m, c in dict.fromkeys((w, m, c) for w, m, c, _ in CASES) if m != "plain_cpu"]


@pytest.mark.parametrize(("world", "mesh", "config"), TO_EMPTY, ids=[f"w{w}-{m}-{c}" for w, m, c in TO_EMPTY])
def test_to_empty_matches_module_apply(world: int, mesh: str, config: str, folder: str) -> None:
    """sdadapt's ``to_empty`` leaves what ``Module._apply`` leaves (objects, layouts, FSDP2's
    state, uneven shards' padding), taking its own walk where every parameter is a DTensor."""
    for rank, r in enumerate(results_for(world, folder)):
        f = r[f"to_empty-w{world}-{mesh}-{config}"]
        if "fsdp" in mesh or mesh == "hsdp":  # every parameter a DTensor (TP plans may leave norms plain)
            assert f["walked"], (rank, f)
        if mesh.startswith("plain"):
            assert not f["walked"], (rank, f)
        assert f["same"], f"rank {rank}: materialising differs from Module._apply"
        theirs, ours = f["ids_kept"]
        assert ours == theirs and (ours or not f["walked"]), f"rank {rank}: parameter objects kept: {f['ids_kept']}"


def test_uneven_shards_are_exercised(folder: str) -> None:
    """The 3-rank cases really produce uneven shards, and the vocab-3 case an empty one."""
    for mesh in ("fsdp", "tp"):
        assert any(r[case_id(3, mesh, "base", "torch_save")]["uneven"] for r in results_for(3, folder)), mesh
    empty = [r[case_id(4, "fsdp", "tiny", "torch_save")]["empty"] for r in results_for(4, folder)]
    assert "embedding.weight" in empty[3], empty
