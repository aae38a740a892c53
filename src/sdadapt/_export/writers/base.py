"""What writers share: the pull interface, size parsing, raw byte writes."""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Callable
from typing import BinaryIO

import torch

from ..._base.schema import TensorInfo
from ...errors import SdadaptError

Pull = Callable[[str], torch.Tensor]  # pull(key): the tensor of output key, made when the writer asks
FORMATS = ("safetensors", "torch", "dcp", "torch_dist")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` -> 5e9 (decimal, as HF counts), ``512MiB`` -> 512 * 2**20, ints as bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(size).lower())
        if not m or m.group(2) not in _UNITS:
            raise SdadaptError(f"shard size {size!r}: give bytes or a number with a unit such as 5GB, 500MB, 2GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise SdadaptError(f"shard size {size!r} must be positive")
    return n


def write_bytes(f: BinaryIO, data: memoryview | bytes) -> None:
    """Every byte of tensor data goes through here (tests simulate a full disk by patching it)."""
    f.write(data)


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """Every byte of a write at an offset (several ranks writing one file) goes through here
    (tests simulate a full disk by patching it)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def check_pulled(key: str, t: torch.Tensor, info: TensorInfo) -> None:
    if tuple(t.shape) != tuple(info.shape) or t.dtype != info.dtype:
        raise SdadaptError(
            f"key {key!r}: pulled {t.dtype} {list(t.shape)}, but the plan said {info.dtype} {list(info.shape)}"
        )


class Writer(abc.ABC):
    """Writes ``entries`` to ``path`` (a file or folder that does not exist yet)."""

    def __init__(self, path: str):
        self.path = path

    @abc.abstractmethod
    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        """Write every entry; ``pull(key)`` returns that tensor (called once per key)."""
