"""A user's script whose load fails with a PlanError, uncaught, as ``torchrun`` would run it on
each rank (gloo on CPU; the ranks meet in the file ``argv[1]``). Run by
tests/transaction/test_load_newcomer.py on 4 processes to see what a user sees on each rank's stderr.

    python tests/support/user_plan_error.py RENDEZVOUS_FILE CHECKPOINT_FOLDER   # RANK, WORLD_SIZE set
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sdadapt


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8, bias=False)
        self.wk = nn.Linear(8, 8, bias=False)


class Tiny(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(layers)])


def write_checkpoint(folder: str) -> str:
    """A checkpoint in the HF layout that lacks layer 3's k projection (a truncated release)."""
    from safetensors.torch import save_file

    sd = {}
    for i in range(4):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(8, 8)
        if i != 3:
            sd[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(8, 8)
    path = os.path.join(folder, "model.safetensors")
    save_file(sd, path)
    return path


ADAPTER = sdadapt.Adapter([
    sdadapt.rename("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.wq.weight"),
    sdadapt.rename("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.wk.weight"),
], name="hf-to-tiny")


def main() -> None:
    rendezvous, path = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Tiny()
    fully_shard(model, mesh=mesh)
    try:
        sdadapt.load(model, path, ADAPTER)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
