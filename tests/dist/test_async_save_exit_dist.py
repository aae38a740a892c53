"""A process that exits while its background save is in flight (issue 62, item 4).

Each of 2 gloo ranks trains an FSDP2 model, saves it (``prev``), trains a step, starts
``save_state(..., async_=True)`` (``new``: its first background save, so the writing thread is
still making its gloo group too) and returns from its main at once: once with the world still
up, once after ``destroy_process_group()``. sdadapt's exit handler lets the save end (or fail)
before the interpreter finalizes: every rank exits 0, with no "terminate called" abort, and
``prev`` stays complete; with the world up, ``new`` is complete too and holds the state as it was
when the call returned. With the world destroyed under it, the save fails (a writer that finds
the world gone never writes its rank's shards as a single process's checkpoint), or a writer
still making its group for a rank that already gave up is left after
``background.DESTROYED_WAIT_S``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.dist_helper import SRC_DIR, TESTS_DIR
from support.models import TinyTransformer

import sdadapt
from sdadapt._state.checkpointer import complete

WORLD = 2

RANK = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from support.models import TinyTransformer, parallelize
    from support.training import train_steps
    import sdadapt

    def main(folder: str, rank: int, how: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = parallelize(TinyTransformer(), init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, opt, 1)
        sdadapt.save_state(model, os.path.join(folder, "prev"), opt)
        train_steps(model, opt, 1)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(folder, "wanted.pt"))
        sdadapt.save_state(model, os.path.join(folder, "new"), opt, extra={"step": 2}, async_=True)
        if how == "destroy":
            dist.destroy_process_group()
        train_steps(model, opt, 1) if how == "up" else None  # the model changes while the save writes

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    """
)


@pytest.mark.parametrize("how", ["up", "destroy"])
def test_exit_with_a_save_in_flight(tmp_path, how):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    folder = tmp_path / "run"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(r), how], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and "terminate called" not in out, f"rank {r} rc {p.returncode}:\n{out[-3000:]}"
    assert complete(str(folder / "prev"))  # with the world destroyed under it, the new save fails (logged at exit)
    if how == "up":
        assert complete(str(folder / "new"))
        back = TinyTransformer()
        sdadapt.load_state(back, str(folder / "new"))
        wanted = torch.load(folder / "wanted.pt")
        assert all(torch.equal(back.state_dict()[k], v) for k, v in wanted.items())
