"""Checkpoint writers that stream: they ask for one tensor at a time and write it out.

Every writer gets the full list of entries (key -> shape, dtype) up front, then pulls each
tensor through ``produce(key)`` in an order of its choosing, writes its bytes, and drops it.
So memory stays at about one tensor, whatever the size of the checkpoint.

- :class:`SafetensorsWriter`: HF layout, ``model.safetensors`` or size-bounded shards +
  ``model.safetensors.index.json``;
- :class:`TorchSaveWriter`: one ``torch.save`` zip file (readable with ``mmap=True``);
- :class:`DCPWriter`: a torch.distributed.checkpoint folder, through ``dcp.save``.
"""

from .base import Produce, Writer, make_writer, parse_size
from .dcp_writer import DCPWriter
from .safetensors_writer import SafetensorsWriter
from .torch_writer import TorchSaveWriter

__all__ = ["DCPWriter", "Produce", "SafetensorsWriter", "TorchSaveWriter", "Writer", "make_writer", "parse_size"]
