"""Hugging Face Hub ids as sources (``hf://org/name[@revision]``), offline against a cache folder
laid out as ``huggingface_hub`` lays it out (``models--org--name/{blobs,refs,snapshots}``, the
snapshot's files symlinks into ``blobs/``), with ``HF_HUB_OFFLINE=1``: nothing touches the network.

The environment variables are read by ``huggingface_hub`` when it is imported, so the cases that
set them run in fresh processes (a subprocess, or the gloo workers of ``run_distributed``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.dist_helper import SRC_DIR, TESTS_DIR, run_distributed
from support.models import TinyTransformer, parallelize, split_qkv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt.errors import SourceError

REPO = "org/tiny"
COMMIT = hashlib.sha1(b"tiny-v1").hexdigest()
INDEX = "model.safetensors.index.json"


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return split_qkv(TinyTransformer().state_dict())


def _put(repo_dir: Path, name: str, data: bytes) -> None:
    """A file of the snapshot, stored as the Hub cache stores it: a blob and a relative symlink."""
    digest = hashlib.sha256(data).hexdigest()
    (repo_dir / "blobs" / digest).write_bytes(data)
    link = repo_dir / "snapshots" / COMMIT / name
    link.symlink_to(os.path.join("..", "..", "blobs", digest))


def make_cache(cache: Path, *, shards: int = 2, drop: str | None = None, extra: bool = True) -> dict[str, torch.Tensor]:
    """``cache/models--org--tiny`` holding a split-qkv TinyTransformer checkpoint in ``shards``
    shards (+ config.json, the index), ``refs/main`` and the tag ``refs/v1`` at ``COMMIT``.
    ``drop`` leaves one file out of the snapshot; ``extra`` adds a file a load must not need."""
    sd = _reference()
    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    for sub in ("blobs", "refs", f"snapshots/{COMMIT}"):
        (repo_dir / sub).mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    (repo_dir / "refs" / "v1").write_text(COMMIT)
    keys = list(sd)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {k: names[i * shards // len(keys)] for i, k in enumerate(keys)}
    files = {"config.json": json.dumps({"architectures": ["Tiny"], "num_hidden_layers": 2}).encode()}
    files[INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    tmp = cache / "tmp.safetensors"
    for name in names:
        save_file({k: v for k, v in sd.items() if weight_map[k] == name}, str(tmp))
        files[name] = tmp.read_bytes()
    tmp.unlink()
    if extra:
        files["pytorch_model.bin"] = b"not needed by a safetensors load"
    for name, data in files.items():
        if name != drop:
            _put(repo_dir, name, data)
    return sd


def _env(cache: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    path = os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS_DIR), str(SRC_DIR), env.get("PYTHONPATH", "")])
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, **more}


def _run_children(env: dict[str, str], *calls: tuple[str, ...]) -> list[dict]:
    """Run ``test_hub.<func>(*args)`` for each ``(func, *args)`` of ``calls``, one after the other in
    one fresh Python (huggingface_hub reads ``env`` at its import); it prints one JSON line last."""
    code = f"import json, test_hub; print(json.dumps([getattr(test_hub, f)(*a) for f, *a in {list(calls)!r}]))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_child(func: str, env: dict[str, str], *args: str) -> dict:
    """Run ``test_hub.<func>(*args)`` in a fresh Python."""
    return _run_children(env, (func, *args))[0]


def _record_snapshot_calls() -> list[dict]:
    """Wrap ``huggingface_hub.snapshot_download`` to record each call's patterns and mode."""
    import huggingface_hub

    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        start = time.time()
        out = real(*args, **kwargs)
        calls.append({"patterns": kwargs.get("allow_patterns"), "local": kwargs.get("local_files_only"),
                      "start": start, "end": time.time()})
        return out

    huggingface_hub.snapshot_download = recording
    return calls


def _same(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> list[str]:
    """Keys of ``model`` (fused qkv) that differ from checkpoint ``sd`` (split q/k/v)."""
    want = dict(sd)
    for k in [k for k in want if ".q_proj." in k]:
        parts = [want.pop(k.replace("q_proj", n)) for n in ("q_proj", "k_proj", "v_proj")]
        want[k.replace("q_proj", "qkv")] = torch.cat(parts)
    out = []
    for k, v in model.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if not torch.equal(full, want[k]):
            out.append(k)
    return out


def child_load(spec: str) -> dict:
    """Load ``spec`` (a Hub id) into a TinyTransformer through the shipped ``discussion`` adapter."""
    calls = _record_snapshot_calls()
    model = TinyTransformer()
    rep = sdadapt.load(model, spec, "discussion")
    return {"differ": _same(model, _reference()), "keys": rep.report.matched, "calls": calls}


def child_error(spec: str) -> dict:
    try:
        sdadapt.sources.open_source(spec)
    except SourceError as e:
        return {"error": str(e)}
    return {"error": None}


def child_cli(*argv: str) -> dict:
    import contextlib
    import io

    from sdadapt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return {"rc": rc, "out": out.getvalue()}


# ------------------------------------------------------------------ one process
def test_load_from_hub_cache_offline(tmp_path):
    make_cache(tmp_path / "hub")
    got = _run_child("child_load", _env(tmp_path / "hub"), f"hf://{REPO}")
    assert got["differ"] == [] and got["keys"] > 0
    # only what the load needs: config (+ params.json) and the index first, then the shards it names
    first, second = (c["patterns"] for c in got["calls"])
    assert first == ["config.json", "params.json", INDEX]
    assert second == ["config.json", "params.json", INDEX, "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("revision", ["v1", COMMIT])
def test_revision_and_hf_home(tmp_path, revision):
    make_cache(tmp_path / "home" / "hub", shards=1)  # HF_HOME/hub is the default cache
    env = _env(tmp_path / "unused", HF_HOME=str(tmp_path / "home"))
    del env["HF_HUB_CACHE"]
    got = _run_child("child_load", env, f"hf://{REPO}@{revision}")
    assert got["differ"] == []


def test_missing_shard_and_missing_repo_name_the_cache(tmp_path):
    make_cache(tmp_path / "hub", drop="model-00002-of-00002.safetensors")
    env = _env(tmp_path / "hub")
    shard, repo = _run_children(env, ("child_error", f"hf://{REPO}"), ("child_error", "hf://org/absent"))
    err = shard["error"]
    assert "model-00002-of-00002.safetensors" in err and "not found in the local cache" in err
    err = repo["error"]
    assert "org/absent is not in the local Hub cache" in err and "HF_HUB_OFFLINE is set" in err
    assert str(tmp_path / "hub") in err


def test_cli_commands_take_hub_ids(tmp_path):
    make_cache(tmp_path / "hub")
    env = _env(tmp_path / "hub")
    dst = tmp_path / "out"
    got, converted = _run_children(env, ("child_cli", "inspect", f"hf://{REPO}"),
                                   ("child_cli", "convert", f"hf://{REPO}", str(dst), "--to", "torch", "-a", "discussion"))
    n = len(_reference())
    assert got["rc"] == 0 and f"total: {n} tensors" in got["out"]
    assert got["out"].startswith(f"HFShardedSource {tmp_path / 'hub' / 'models--org--tiny' / 'snapshots' / COMMIT}")
    assert converted["rc"] == 0
    out = torch.load(dst, weights_only=True)
    model = TinyTransformer()
    model.load_state_dict(out)
    assert _same(model, _reference()) == []


def test_hub_id_message_and_missing_package(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError, match="write hf://Qwen/Qwen3-8B"):
        sdadapt.sources.open_source("Qwen/Qwen3-8B")
    with pytest.raises(SourceError, match="hf://org/name or hf://org/name@revision"):
        sdadapt.sources.open_source("hf://just-a-name")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(SourceError, match=r"pip install 'sdadapt\[hub\]'"):
        sdadapt.sources.open_source("hf://org/not-installed")


# ------------------------------------------------------------------ several ranks
def _dist_load(spec: str) -> dict:
    calls = _record_snapshot_calls()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = TinyTransformer()
    parallelize(model, mesh)
    sdadapt.load(model, spec, "discussion")
    return {"differ": _same(model, _reference()), "calls": calls}


def test_one_process_per_node_downloads_the_others_wait(tmp_path, monkeypatch):
    make_cache(tmp_path / "hub")
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r0, r1 = run_distributed(_dist_load, 2, f"hf://{REPO}", timeout=240)
    assert r0["differ"] == [] and r1["differ"] == []
    # LOCAL_RANK 0 may download (offline, as here, it too asks the cache alone); rank 1 only looks
    # in the cache, and only after rank 0 finished
    assert [c["local"] for c in r0["calls"]] == [True, True]
    assert [c["local"] for c in r1["calls"]] == [True, True]
    assert min(c["start"] for c in r1["calls"]) >= max(c["end"] for c in r0["calls"])


def _dist_missing(spec: str) -> dict:
    try:
        sdadapt.sources.open_source(spec)
    except sdadapt.SdadaptError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def test_a_failed_download_is_every_ranks_error(tmp_path, monkeypatch):
    make_cache(tmp_path / "hub")
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r0, r1 = run_distributed(_dist_missing, 2, "hf://org/absent", timeout=120)
    assert r0["error"] == "SourceError" and "org/absent is not in the local Hub cache" in r0["message"]
    assert r1["error"] == "RemoteRankError" and "org/absent" in r1["message"]


# ------------------------------------------------------------------ ids, revisions, the cache's bounds
@pytest.mark.parametrize(
    "spec, says",
    [
        ("hf://org/tiny@../../x", "cannot contain '..'"),
        ("hf://org/tiny@refs/../main", "cannot contain '..'"),
        ("hf://org/tiny@main/", "cannot start or end with '/'"),
        ("hf://org/tiny@a//b", "contain '//'"),
        ("hf://org/tiny@", "1-256 characters"),
        ("hf://org/tiny@main.lock", "'.lock'"),
        ("hf://org/tiny@.x", "start with '.'"),
        ("hf://org/tiny@a~1", "~^:?*["),
        ("hf://org/tiny@a\\b", "~^:?*["),
        ("hf://org/tiny@x@{1}", "'@{'"),
        ("hf://org/ti--ny", "not a Hub repository id"),
        ("hf://org/tiny.git", "not a Hub repository id"),
        ("hf://.org/tiny", "not a Hub repository id"),
        ("hf://org/" + "x" * 97, "not a Hub repository id"),
        ("hf://org/a/b", "not a Hub repository id"),
    ],
)
def test_ids_and_revisions_are_checked_before_anything_is_read(monkeypatch, spec, says):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # nothing may even import the client
    with pytest.raises(SourceError) as e:
        sdadapt.sources.open_source(spec)
    assert says in str(e.value) and spec in str(e.value)


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release/2024-01", COMMIT, "feature_x"])
def test_ref_names_and_commits_pass(revision):
    from sdadapt.sources._hub import parse_hub_id

    assert parse_hub_id(f"hf://{REPO}@{revision}") == (REPO, revision)


def child_escape(cache: str) -> dict:
    """A revision walking out of the snapshots to a folder that holds a checkpoint, and a shard
    symlinked out of the cache: both refused, nothing read."""
    out = {}
    for spec in (f"hf://{REPO}@../../../outside", "hf://org/leak"):
        try:
            sdadapt.sources.open_source(spec)
            out[spec] = None
        except SourceError as e:
            out[spec] = str(e)
    return out


def test_nothing_is_read_outside_the_cache(tmp_path):
    make_cache(tmp_path / "hub", shards=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(_reference(), str(outside / "model.safetensors"))
    leak = tmp_path / "hub" / "models--org--leak"
    snap = leak / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (leak / "blobs").mkdir()
    (leak / "refs").mkdir()
    (leak / "refs" / "main").write_text(COMMIT)
    (snap / "model.safetensors").symlink_to(outside / "model.safetensors")
    got = _run_child("child_escape", _env(tmp_path / "hub"), str(tmp_path / "hub"))
    assert "cannot contain '..'" in got[f"hf://{REPO}@../../../outside"]
    assert "outside the repository's cache folder" in got["hf://org/leak"]


def _dist_bad_ids(specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        model = TinyTransformer()
        try:
            sdadapt.load(model, spec, "discussion")
            out[spec] = None
        except sdadapt.SdadaptError as e:
            out[spec] = type(e).__name__
        except Exception as e:  # noqa: BLE001 - reported as a failure
            out[spec] = f"UNHANDLED {type(e).__name__}"
    # the group is still healthy: a good id loads
    sdadapt.load(TinyTransformer(), f"hf://{REPO}", "discussion")
    return out


def test_bad_ids_fail_on_every_rank_without_a_hang(tmp_path, monkeypatch):
    """Ids the Hub client itself would refuse (HFValidationError) or trip over (a directory for a
    ref file) on the downloading rank only: every rank raises an sdadapt error, none waits."""
    make_cache(tmp_path / "hub")
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "dir").mkdir()
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    specs = ["hf://org/ti--ny", "hf://org/tiny@dir", "hf://org/tiny@main/", "hf://org/tiny@../../x", "hf://org/absent"]
    r0, r1 = run_distributed(_dist_bad_ids, 2, specs, timeout=240)
    for spec in specs:
        assert r0[spec] == "SourceError", (spec, r0[spec])
        assert r1[spec] in ("SourceError", "RemoteRankError"), (spec, r1[spec])
