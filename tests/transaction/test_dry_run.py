"""The dry run on one process: meshes, layouts, symmetry, sampling, the CLI, the header record."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import sdadapt
from sdadapt._plan.layout import Mesh, default_layouts, local_box
from sdadapt.cli import main
from sdadapt.errors import SourceError, UsageError
from sdadapt.sources import TensorInfo, _headers, open_source


@pytest.fixture
def ckpt(tmp_path: Any) -> str:
    sd = {}
    for i in range(4):
        sd[f"layers.{i}.attention.wq.weight"] = torch.randn(16, 8)
        sd[f"layers.{i}.attention.wo.weight"] = torch.randn(8, 16)
        sd[f"layers.{i}.attention_norm.weight"] = torch.randn(8)
        for e in range(4):
            sd[f"layers.{i}.moe.experts.{e}.w1.weight"] = torch.randn(6, 8)
    sd["tok_embeddings.weight"] = torch.randn(20, 8)
    sd["norm.weight"] = torch.randn(8)
    sd["output.weight"] = torch.randn(20, 8)
    names = sorted(sd)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for i, k in enumerate(names):
        files.setdefault(f"model-{i % 2}.safetensors", {})[k] = sd[k]
    for name, part in files.items():
        save_file(part, os.path.join(tmp_path, name))
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: n for n, p in files.items() for k in p}}, f)
    return str(tmp_path)


def test_mesh_parse_and_coordinates() -> None:
    mesh = Mesh.parse("tp=8,dp_shard=16,dp_replicate=8")
    assert mesh.names == ("dp_replicate", "dp_shard", "tp") and mesh.size == 1024
    assert mesh.coordinate(9) == (0, 1, 1) and mesh.rank_of((0, 1, 1)) == 9
    assert Mesh.parse("dp_shard=4", ep=2, pp=2).names == ("pp", "dp_shard", "ep")
    for bad in ("dp_shard=x", "cp=2", "dp_shard"):
        with pytest.raises(UsageError):
            Mesh.parse(bad)
    with pytest.raises(UsageError, match="given twice"):
        Mesh.parse("ep=2,dp_shard=2", ep=4)


def test_layouts_own_stages_and_experts() -> None:
    schema = {
        "tok_embeddings.weight": TensorInfo((20, 8), torch.float32),
        "layers.0.moe.experts.0.w1.weight": TensorInfo((6, 8), torch.float32),
        "layers.3.moe.experts.3.w1.weight": TensorInfo((6, 8), torch.float32),
        "layers.3.attention.wq.weight": TensorInfo((16, 8), torch.float32),
        "norm.weight": TensorInfo((8,), torch.float32),
    }
    mesh = Mesh.parse("dp_shard=2", ep=2, pp=2)
    lay = default_layouts(schema, mesh)
    # pp stage 0 holds the embedding and layer 0; expert 3 lives on ep rank 1
    assert local_box(schema["tok_embeddings.weight"], mesh, lay["tok_embeddings.weight"], (0, 0, 0)) is not None
    assert local_box(schema["tok_embeddings.weight"], mesh, lay["tok_embeddings.weight"], (1, 0, 0)) is None
    assert local_box(schema["norm.weight"], mesh, lay["norm.weight"], (1, 0, 0)) is not None
    k = "layers.3.moe.experts.3.w1.weight"
    assert local_box(schema[k], mesh, lay[k], (1, 0, 0)) is None and local_box(schema[k], mesh, lay[k], (1, 1, 1)) == ((3, 6), (0, 8))
    # a non-expert key is sharded over dp_shard and ep flattened: 4 shards of 4 rows
    k = "layers.3.attention.wq.weight"
    assert [local_box(schema[k], mesh, lay[k], (1, d, e)) for d in range(2) for e in range(2)] == [
        ((0, 4), (0, 8)), ((4, 8), (0, 8)), ((8, 12), (0, 8)), ((12, 16), (0, 8))]  # fmt: skip


def test_symmetry_sampling_and_headers(ckpt: str) -> None:
    # gap_bytes=0: a column slice's rows read one call each, only their own pages asked for
    runs = sdadapt.EngineConfig(gap_bytes=0)
    full = sdadapt.dry_run(None, ckpt, mesh="dp_replicate=2,dp_shard=4,tp=2", max_ranks=64, engine=runs)
    assert full.exact and full.classes == 8 and full.world_size == 16  # the replicas plan alike
    assert all(r.ranks == 2 for r in full.ranks)
    assert full.total_bytes_read == sum(r.bytes_read * 2 for r in full.ranks)
    norms = (4 * 8 + 8) * 4  # replicated over tp as well
    assert full.total_local_bytes == 2 * (full.checkpoint_bytes + norms)  # two replicas of every byte
    assert full.total_bytes_read == full.total_local_bytes  # the checkpoint's own layout: shards are read as stored
    assert full.amplification == pytest.approx(2 * (1 + norms / full.checkpoint_bytes))
    assert full.max_node_bytes_read == full.total_bytes_read // 2  # 8 ranks per node: one replica each
    # by default the rows of a column slice are read with the gaps between them: the same bytes
    # read, as much or more asked of storage (here every page of the rows is touched either way)
    joined = sdadapt.dry_run(None, ckpt, mesh="dp_replicate=2,dp_shard=4,tp=2", max_ranks=64)
    assert joined.total_bytes_read == full.total_bytes_read
    for j, r in zip(joined.ranks, full.ranks, strict=True):
        assert j.storage_bytes >= r.storage_bytes >= r.bytes_read == j.bytes_read
    replicas = sdadapt.EngineConfig(gap_bytes=0, share_rows=False)
    shared = sdadapt.dry_run(None, ckpt, mesh="dp_replicate=2,dp_shard=4,tp=2", share_reads=True, max_ranks=64, engine=replicas)
    # each replica pair reads a byte once; a norm, replicated over tp too, is shared over one dim only
    assert shared.classes == 16 and shared.total_bytes_read == shared.checkpoint_bytes + norms
    assert sum(r.shared_bytes for r in shared.ranks) == shared.checkpoint_bytes + norms
    sample = sdadapt.dry_run(None, ckpt, mesh="dp_shard=32", max_ranks=4)
    assert not sample.exact and [r.rank for r in sample.ranks] == [0, 10, 21, 31] and sample.max_node_bytes_read is None
    once = sdadapt.dry_run(None, ckpt, mesh="dp_shard=4", max_ranks=64)
    every = sdadapt.dry_run(None, ckpt, mesh="dp_shard=4", headers="every", max_ranks=64)
    assert once.total_header_bytes * 4 == every.total_header_bytes
    assert every.total_opens - once.total_opens == 3 * 3  # index and 2 headers, on 3 more ranks
    assert once.ranks[1].header_bytes == 0 and once.ranks[1].header_bytes_received == once.collective_bytes_per_rank > 0
    assert once.agreement_bytes_per_rank == 56 and "56 B in the ranks' agreement" in once.format(), once.format()  # any world size


def test_cli_plan_prints_a_table_and_json(ckpt: str, capsys: Any) -> None:
    assert main(["plan", ckpt, "--mesh", "dp_shard=4,tp=2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "16 ranks" in out and "amplification" in out
    assert main(["plan", ckpt, "--mesh", "dp_shard=4", "--json", "--share-reads"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["share_reads"] and len(data["ranks"]) == 4
    assert main(["plan", ckpt, "--mesh", "cp=2"]) == 2


def test_header_record_round_trip_and_corruption(ckpt: str) -> None:
    with _headers.recording() as rec:
        with open_source(ckpt) as src:
            keys = set(src.schema)
    assert len(rec.files) == 3  # the index and two headers
    payload = _headers.encode(rec)
    got = _headers.decode(payload)
    assert got.files == rec.files
    os.rename(os.path.join(ckpt, "model-0.safetensors"), os.path.join(ckpt, "moved"))  # replay opens nothing
    open(os.path.join(ckpt, "model-0.safetensors"), "wb").close()  # exists (the index check), but empty
    with _headers.replaying(got), open_source(ckpt) as src:
        assert set(src.schema) == keys
    for bad in (payload[:-3], payload + b"x", b"nonsense"):
        with pytest.raises(SourceError):
            _headers.decode(bad)
    # a recorded header is validated on receipt as one read from disk
    path = next(p for p in rec.files if p.endswith(".safetensors"))
    data, size = rec.files[path]
    broken = _headers.HeaderRecord({**rec.files, path: (data[:8] + b"!" + data[9:], size)})
    with pytest.raises(SourceError, match="not valid JSON"), _headers.replaying(broken):
        open_source(ckpt)


def test_a_meta_model_as_target_and_sampled_totals(ckpt: str) -> None:
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wo = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.attention_norm = Attention(), nn.RMSNorm(8)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(20, 8)
            self.layers = nn.ModuleDict({str(i): Layer() for i in range(4)})
            self.norm, self.output = nn.RMSNorm(8), nn.Linear(8, 20, bias=False)

    with torch.device("meta"):
        model = Model()
    # the experts of the checkpoint are not in the model: allowed, and not read
    report = sdadapt.dry_run(model, ckpt, mesh="dp_shard=2,tp=2", allow_unexpected=["**experts**"])
    assert report.target == "Model" and report.exact and report.ranks[0].keys == len(model.state_dict())
    assert report.total_bytes_read == report.total_local_bytes  # every shard read as stored (norms once per tp rank)
    with pytest.raises(sdadapt.errors.PlanError):
        sdadapt.dry_run(model, ckpt, mesh="dp_shard=2")
    # sampled: the bytes read are estimated from the sample's ratio to its shards, exact here
    sampled = sdadapt.dry_run(None, ckpt, mesh="dp_shard=64", max_ranks=3)
    assert not sampled.exact and sampled.total_bytes_read == sampled.total_local_bytes == sampled.checkpoint_bytes


def test_mapping_granule_is_what_a_fault_maps(tmp_path: Any) -> None:
    from sdadapt._engine.predict import _span, mapping_granule

    save_file({"big": torch.zeros(5 << 20, dtype=torch.uint8)}, str(tmp_path / "big.safetensors"))
    save_file({"small": torch.zeros(16)}, str(tmp_path / "small.safetensors"))
    big, small = open_source(str(tmp_path / "big.safetensors")), open_source(str(tmp_path / "small.safetensors"))
    try:
        granule = mapping_granule(big)
        assert granule & (granule - 1) == 0 and 4096 <= granule <= 2 << 20  # a page, or a large folio
        assert mapping_granule(small) == 4096  # too small to see one
        loc = big.locate("big")
        assert loc is not None
        # a 1-byte region makes one granule resident; a region over a boundary two
        offset = -loc.offset % granule + granule
        assert _span(big, "big", ((offset, offset + 1),), 1, granule) == granule
        assert _span(big, "big", ((offset - 1, offset + 1),), 2, granule) == 2 * granule
    finally:
        big.close()
        small.close()
    report = sdadapt.dry_run({"big": TensorInfo((5 << 20,), torch.uint8)}, str(tmp_path / "big.safetensors"), mesh="dp_shard=2")
    assert report.mapping_granule == granule


def test_a_node_never_holds_more_ranks_than_the_job(ckpt: str, capsys: Any) -> None:
    """``sdadapt plan ... --mesh dp_shard=2`` said "busiest node (8 ranks)": the default of 8
    ranks per node is a ceiling, the world size the count."""
    small = sdadapt.dry_run(None, ckpt, mesh="dp_shard=2")
    assert small.ranks_per_node == 2 and "busiest node (2 ranks)" in small.format()
    assert sdadapt.dry_run(None, ckpt, mesh="dp_shard=16", max_ranks=64).ranks_per_node == 8
    assert main(["plan", ckpt, "--mesh", "dp_shard=2"]) == 0
    out = capsys.readouterr().out
    assert "busiest node (2 ranks)" in out and "(8 ranks)" not in out


def _sparse_8b(folder: Any, layers: int = 2) -> str:
    """Llama-3-8B shapes (``layers`` of them), bf16, one safetensors file of the right size
    holding no data (sparse): a dry run reads headers only."""
    h, kv, f, v = 4096, 1024, 14336, 128256
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.v_proj.weight": [kv, h],
                   p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                   p + "mlp.down_proj.weight": [h, f], p + "input_layernorm.weight": [h]}  # fmt: skip
    header, at = {}, 0
    for k, shape in shapes.items():
        n = 2 * math.prod(shape)
        header[k] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    path = os.path.join(str(folder), "model.safetensors")
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        out.truncate(8 + len(raw) + at)
    return path


@pytest.mark.parametrize("mesh", ["tp=8", "dp_shard=2,tp=8"])
def test_a_lone_tp_rank_reads_its_rows_once_when_peers_share_them(tmp_path: Any, mesh: str) -> None:
    # o_proj / down_proj are column slices of 8 and 28 KiB rows: alone, a TP-8 rank's reads
    # touch every page of their rows; sharing the rows, each rank reads whole rows of its own
    path = _sparse_8b(tmp_path)
    alone = sdadapt.dry_run(None, path, mesh=mesh, device="cuda", share_reads=False, max_ranks=4)
    rows = sdadapt.EngineConfig(share_rows=True)
    shared = sdadapt.dry_run(None, path, mesh=mesh, device="cuda", share_reads=True, max_ranks=4, engine=rows)
    for a, s in zip(alone.ranks, shared.ranks, strict=True):
        assert a.storage_bytes > 1.5 * a.bytes_read, a  # 3.1x with 32 layers; the embeddings weigh more here
        assert s.storage_bytes <= 1.1 * s.bytes_read and s.bytes_read <= 1.01 * s.local_bytes, s
        assert s.shared_bytes > 0 and s.device_bytes > s.local_bytes  # the round buffers
    assert shared.total_bytes_read <= alone.total_bytes_read  # the norms, replicated over tp, read once too


def test_by_default_tp_rows_are_shared_only_across_nodes(tmp_path: Any) -> None:
    # share_rows="auto": a TP-8 group within a node of 8 ranks reads its own slices (the node's
    # page cache serves every rank, so the node reads each byte once); spread over nodes of 4
    # ranks, the peers share rows and each rank's storage comes to about its bytes read
    path = _sparse_8b(tmp_path)
    one = sdadapt.dry_run(None, path, mesh="tp=8", device="cuda", max_ranks=4)
    two = sdadapt.dry_run(None, path, mesh="tp=8", device="cuda", max_ranks=4, ranks_per_node=4)
    assert one.share_rows.startswith("auto (off") and two.share_rows.startswith("auto (on"), (one.share_rows, two.share_rows)
    assert one.agreement_bytes_per_rank == two.agreement_bytes_per_rank == 72
    for a, s in zip(one.ranks, two.ranks, strict=True):
        assert a.rows_bytes == 0 and a.storage_bytes > 1.5 * a.bytes_read, a
        assert s.rows_bytes > 0 and s.storage_bytes <= 1.1 * s.bytes_read, s
        assert s.device_bytes > a.device_bytes == a.local_bytes  # the round buffers only where rows are shared
    assert "TP rows shared: auto (on" in two.format()
    # either way the first node's ranks, sharing its page cache, make storage deliver about
    # what they read: on one node the TP peers' column slices together cover their rows
    for report in (one, two):
        assert report.node_bytes_read > 0 and report.node_storage_bytes <= 1.1 * report.node_bytes_read, report
    assert one.node_bytes_read == pytest.approx(one.total_bytes_read, rel=1e-3)  # the node is the whole job (a sample: estimated)
    assert "from storage cold (one page cache)" in one.format()
