"""The end of a run: after FSDP2 training on gloo, sdadapt's exit handler ends the process
groups that torch's DTensor caches still hold once the world is destroyed, so that no gloo
thread is alive when the interpreter finalizes (src/sdadapt/_base/teardown.py says why that
matters: the teardown abort, tests/reports/teardown-abort-cpu2-2026-12-07.md)."""

from __future__ import annotations

import datetime
import gc
import os
import weakref

import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from sdadapt._base import teardown
from sdadapt._state.background import background_group


def _view_keeps_mesh() -> bool:
    """Whether this torch keeps a DeviceMesh alive once the only DTensor on it, and a view of it
    (``detach``, which FSDP2 runs on each parameter it makes), are gone and DTensor's caches are
    emptied. torch 2.11 does: each view op's sharding propagation leaves its input strategies (and
    through them the mesh) referenced by no Python object, so gc cannot free them; torch 2.13 does not."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kept = weakref.ref(mesh)
    DTensor.from_local(torch.ones(2), mesh, [Replicate()]).detach()
    del mesh
    _clear_sharding_prop_cache()
    gc.collect()
    return kept() is not None


def _train_then_end(folder: str) -> dict[str, object]:
    torch.manual_seed(0)
    seen: dict[str, object] = {"one_group": teardown.gloo_threads()}  # the world's group alone
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    model[0].weight.full_tensor()
    background_group(None)  # sdadapt's own gloo group (the async saves'), made as a save makes it
    seen["training"] = teardown.gloo_threads()
    mesh_ref = weakref.ref(mesh)
    del model, optimizer, mesh  # as at the end of a main(): the user's references are gone
    dist.destroy_process_group()
    seen["destroyed"] = teardown.gloo_threads()  # torch's DTensor caches still hold the mesh and its group
    teardown.release_groups()  # what the exit handler runs
    seen["released"] = teardown.gloo_threads()
    seen["left"] = [n for n in teardown.thread_names() or [] if n in teardown.GLOO_THREADS]
    seen["mesh_kept"] = mesh_ref() is not None

    # a world made again in this process gets a background group of its own, not the destroyed one's
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'again')}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    group = background_group(None)
    assert group is not None
    seen["again"] = dist.get_process_group_ranks(group)
    seen["view_keeps_mesh"] = _view_keeps_mesh()
    dist.destroy_process_group()
    return seen


def test_exit_handler_ends_the_groups_dtensor_keeps(tmp_path):
    [seen] = run_distributed(_train_then_end, 1, str(tmp_path), timeout=120)
    assert seen["training"], seen  # the world's group and the background group run gloo threads
    assert seen["destroyed"], seen  # destroy_process_group() alone leaves them running
    assert seen["again"] == [0], seen
    if not seen["view_keeps_mesh"]:
        assert seen["released"] == 0 and seen["left"] == [] and not seen["mesh_kept"], seen
    else:
        # this torch keeps the mesh of every detached DTensor (FSDP2's parameters) with a reference
        # no Python object holds (_view_keeps_mesh): that mesh's group, the world's, cannot end
        # before the process does. sdadapt's background group still ends, and nothing else is left
        assert seen["mesh_kept"], seen
        assert 0 < seen["released"] == len(seen["left"]) <= seen["one_group"], seen


def _groups_destroyed_while_held(folder: str) -> dict[str, object]:
    first = background_group(None)
    seen: dict[str, object] = {"cached": background_group(None) is first}
    dist.destroy_process_group(first)  # this group alone, still held here
    second = background_group(None)
    seen["after_group"] = second is not first and second in dist.distributed_c10d._world.pg_map
    dist.destroy_process_group()  # the whole world, ``second`` still held here
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'again')}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    third = background_group(None)
    seen["after_world"] = third not in (first, second) and dist.get_process_group_ranks(third) == [0]
    dist.destroy_process_group()
    return seen


def test_background_group_made_again_once_destroyed(tmp_path):
    """A cached background group that torch's world no longer holds (the group destroyed, or the
    whole world) is made again, even while a reference keeps the old one alive."""
    [seen] = run_distributed(_groups_destroyed_while_held, 1, str(tmp_path), timeout=120)
    assert seen == {"cached": True, "after_group": True, "after_world": True}, seen
