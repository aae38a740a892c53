"""A sharded load against the same load on one process, inside a launched gloo rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from support.dist_helper import shard_of


def sharded_differs(build: Callable[[], Any], path: str, adapter: Any, mesh: Any, **load: Any) -> list[str]:
    """The keys whose FSDP2 shard differs from the same region of the one-process load: ``build()``
    (a model with ``layers``) loaded whole from ``path`` with ``adapter``, then built on the meta
    device, every layer and the root wrapped by ``fully_shard`` on ``mesh``, and loaded alike."""
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    whole = build()
    sdadapt.load(whole, path, adapter, **load)
    want = whole.state_dict()
    with torch.device("meta"):
        model = build()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sdadapt.load(model, path, adapter, **load)
    return [k for k, v in model.state_dict().items() if not torch.equal(*shard_of(v, want[k]))]
