"""Checkpoint writers that stream: they ask for one tensor at a time and write it out.

Every writer gets the full list of entries (key -> shape, dtype) up front, then pulls each
tensor through ``pull(key)`` in an order of its choosing, writes its bytes, and drops it.
So memory stays at about one tensor, whatever the size of the checkpoint.

- :class:`SafetensorsWriter`: HF layout, ``model.safetensors`` or size-bounded shards +
  ``model.safetensors.index.json``;
- :class:`TorchSaveWriter`: one ``torch.save`` zip file (readable with ``mmap=True``);
- :class:`DCPWriter`: a torch.distributed.checkpoint folder, through ``dcp.save``;
- :class:`MegatronWriter`: Megatron-Core's ``torch_dist`` (that DCP folder, its ``_extra_state``
  objects, ``common.pt`` and ``metadata.json``).

:func:`make_writer` imports a writer's module only when it is asked for that format: the DCP
writer imports ``torch.distributed.checkpoint``'s saving side, which an export to safetensors
does not need.
"""

from __future__ import annotations

from ...errors import SdadaptError
from .base import FORMATS, Pull, Writer, parse_size


def make_writer(fmt: str, path: str, max_shard_size: int | str = "5GB") -> Writer:
    """The writer of format ``fmt`` (one of :data:`FORMATS`) for ``path``; only that writer's
    module is imported."""
    if fmt == "safetensors":
        from .safetensors_writer import SafetensorsWriter

        return SafetensorsWriter(path, parse_size(max_shard_size))
    if fmt == "torch":
        from .torch_writer import TorchSaveWriter

        return TorchSaveWriter(path)
    if fmt == "dcp":
        from .dcp_writer import DCPWriter

        return DCPWriter(path)
    if fmt == "torch_dist":
        from .megatron_writer import MegatronWriter

        return MegatronWriter(path)
    raise SdadaptError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "Pull", "Writer", "make_writer", "parse_size"]
