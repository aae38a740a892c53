"""Checkpoint writers that stream: they ask for one tensor at a time and write it out.

Every writer gets the full list of entries (key -> shape, dtype) up front, then pulls each
tensor through ``produce(key)`` in an order of its choosing, writes its bytes, and drops it.
So memory stays at about one tensor, whatever the size of the checkpoint.

- :class:`SafetensorsWriter`: HF layout, ``model.safetensors`` or size-bounded shards +
  ``model.safetensors.index.json``;
- :class:`TorchSaveWriter`: one ``torch.save`` zip file (readable with ``mmap=True``);
- :class:`DCPWriter`: a torch.distributed.checkpoint folder, through ``dcp.save``.

The writer classes are imported on first use (module ``__getattr__``): a load imports this
package for :func:`~sdadapt._transaction.writers.base.tensor_bytes` only, and the DCP writer alone would
import ``torch.distributed.checkpoint``'s saving side with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Produce, Writer, make_writer, parse_size

if TYPE_CHECKING:
    from .dcp_writer import DCPWriter
    from .safetensors_writer import SafetensorsWriter
    from .torch_writer import TorchSaveWriter

_LAZY = {"DCPWriter": "dcp_writer", "SafetensorsWriter": "safetensors_writer", "TorchSaveWriter": "torch_writer"}


def __getattr__(name: str) -> Any:
    """Import a writer's module on first use of its class."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["DCPWriter", "Produce", "SafetensorsWriter", "TorchSaveWriter", "Writer", "make_writer", "parse_size"]
