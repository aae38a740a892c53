"""Saves that do not stop training (issue 62, item 4), on 2 gloo ranks in one launched group.

An FSDP2 model and its Adam optimizer train while :class:`sdadapt.Checkpointer` saves every 2
steps in the background, keeping 2: each folder holds the state as it was when its save was
called (training changed the model meanwhile), bit for bit, and only the last two remain (the
later saves took the state dicts remembered from the first). Then a check failing on one rank
(raised by every rank's ``wait()``), and faults, each over the complete checkpoints before it: a full disk on rank 1 mid-write (every
rank's ``wait()`` raises, the folder never looks complete, ``latest()`` is the previous one),
and last a rank killed mid-write (the other rank raises instead of hanging).
"""

from __future__ import annotations

import errno
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as fs
from support.dist_helper import WorkerError, outcome, run_distributed
from support.models import TinyTransformer, parallelize
from support.training import train_steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._state import taken
from sdadapt._state.checkpointer import complete

WORLD = 2


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    model = parallelize(TinyTransformer(), mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _break_write(rank: int, fail) -> object:
    """DCP's item writer, failing on ``rank``."""
    orig = fs._write_item

    def write_item(*args, **kwargs):
        if dist.get_rank() == rank:
            fail()
        return orig(*args, **kwargs)

    return write_item


def _cases(root: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    model, opt = _model()
    ckpt = sdadapt.Checkpointer(os.path.join(root, "run"), every=2, keep=2)
    wanted: dict[int, dict[str, torch.Tensor]] = {}
    held = []
    for step in range(1, 7):
        train_steps(model, opt, 1)
        if step % 2 == 0:
            wanted[step] = _full(model)
        pending = ckpt.step(step, model, opt, extra={"step": step})
        if pending is not None:
            held.append((pending.staging_seconds, pending.held_seconds))
    ckpt.close()
    dist.barrier()  # rank 0 prunes
    out["kept"] = sorted(os.listdir(os.path.join(root, "run")))
    out["latest"] = os.path.basename(ckpt.latest() or "")
    out["held"] = held
    out["remembered"] = model in taken._TAKEN  # steps 4 and 6 were taken from the remembered dicts
    for step in (4, 6):  # what each save holds: the model as it was when save_state returned
        back, back_opt = _model()
        extra = {"step": 0}
        sdadapt.load_state(back, os.path.join(root, "run", f"step_{step:08d}"), back_opt, extra=extra)
        got = _full(back)
        out[f"same_{step}"] = extra["step"] == step and all(torch.equal(got[k], v) for k, v in wanted[step].items())

    # a check failing on rank 0 only (its folder is not empty): the call returns, every rank's wait() raises
    busy = os.path.join(root, "busy")
    if rank == 0:
        os.makedirs(busy)
        open(os.path.join(busy, "x"), "w").close()
    pending = sdadapt.save_state(model, busy, opt, async_=True)
    out["busy"] = outcome(lambda: pending.wait())

    # a full disk on rank 1 in the background write: wait() raises on both ranks; step 6 stays the latest
    def enospc() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    fs._write_item = _break_write(1, enospc)
    train_steps(model, opt, 1)
    pending = ckpt.step(8, model, opt)
    out["full"] = outcome(lambda: pending.wait())
    ckpt.pending = None
    dist.barrier()
    out["full_complete"] = complete(os.path.join(root, "run", "step_00000008"))
    out["latest_after_full"] = os.path.basename(ckpt.latest() or "")

    # last (the group is broken afterwards): rank 1 dies mid-write; rank 0's wait() raises
    with open(os.path.join(root, f"before-kill.{rank}.json"), "w") as f:
        json.dump(out, f)
    fs._write_item = _break_write(1, lambda: os._exit(9))
    pending = ckpt.step(10, model, opt)
    killed = outcome(lambda: pending.wait())
    with open(os.path.join(root, f"kill.{rank}.json"), "w") as f:
        json.dump([killed[0], killed[1], complete(os.path.join(root, "run", "step_00000010")), ckpt.latest()], f)
    return out


def test_background_saves_while_training(tmp_path):
    try:
        run_distributed(_cases, WORLD, str(tmp_path), timeout=240)
        raise AssertionError("rank 1 was to die in the last case")
    except WorkerError as failed:
        assert [(f.rank, f.type_name) for f in failed.failures] == [(1, "Crash")], str(failed)[:3000]
    results = [json.loads((tmp_path / f"before-kill.{r}.json").read_text()) for r in range(WORLD)]
    for r in results:
        assert r["kept"] == ["step_00000004", "step_00000006"], r["kept"]
        assert r["latest"] == "step_00000006"
        assert r["same_4"] and r["same_6"] and r["remembered"]
        assert r["busy"][0] in ("StateError", "RemoteRankError") and "exists and is not empty" in r["busy"][1], r["busy"]
        assert len(r["held"]) == 3 and all(0 < staging <= held for staging, held in r["held"])  # the staging within the hold
        assert r["full"][0] in ("StateError", "RemoteRankError"), r["full"]
        assert not r["full_complete"] and r["latest_after_full"] == "step_00000006"
    assert "No space left" in results[1]["full"][1]
    kind, message, was_complete, latest = json.loads((tmp_path / "kill.0.json").read_text())
    assert kind == "StateError", message
    assert not was_complete and latest.endswith("step_00000006")
