"""The user's scenario (shared/seed/discussion.txt), end to end on a 2x2 FSDP2+TP gloo mesh."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize, split_qkv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt

QKV = sdadapt.Adapter(
    [
        sdadapt.fuse(
            ["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.k_proj.{p}", "layers.{i}.attn.v_proj.{p}"],
            "layers.{i}.attn.qkv.{p}",
        )
    ],
    name="split-qkv",
)


def _scenario(folder: str) -> dict[str, int]:
    torch.manual_seed(0)
    ref = TinyTransformer()
    path = os.path.join(folder, "ckpt.pt")
    if dist.get_rank() == 0:
        torch.save({"model": split_qkv(ref.state_dict()), "step": 3}, path)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    with torch.device("meta"):
        model = TinyTransformer()
    parallelize(model, mesh)
    rep = sdadapt.load(model, path, QKV, subtree="model")
    expected = ref.state_dict()
    for k, v in model.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        assert torch.equal(full, expected[k]), k
    return {"keys": rep.keys_loaded, "bytes": rep.bytes_read, "local": rep.local_bytes}


def test_discussion_scenario_fsdp_tp_2x2(tmp_path, monkeypatch):
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    results = run_distributed(_scenario, 4, str(tmp_path), timeout=120)
    assert all(r["keys"] == len(TinyTransformer().state_dict()) for r in results)
    assert all(r["bytes"] <= r["local"] for r in results)
    jobs = [m for m in made if os.path.basename(m).startswith("sdadapt-dist-")]
    assert jobs and not any(os.path.exists(job) for job in jobs)  # the launch's own folder is gone


def test_worker_error_puts_the_first_cause_first():
    """The ranks that only saw a peer's process end come last in the report (a long report is cut
    from its end, and the rank that failed on its own is the one to read)."""
    from support.dist_helper import RankFailure, WorkerError

    gone = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8368"
    failures = [
        RankFailure(0, "RuntimeError", gone, "tb0", []),
        RankFailure(1, "RuntimeError", gone, "tb1", []),
        RankFailure(2, "ValueError", "rank 2 broke", "tb2", []),
        RankFailure(3, "Crash", "exit code -11, no result", "", []),
    ]
    text = str(WorkerError(failures, ""))
    order = [text.index(f"--- rank {r}:") for r in (3, 2, 0, 1)]
    assert order == sorted(order), text
    assert text.startswith("4 rank(s) failed:")
