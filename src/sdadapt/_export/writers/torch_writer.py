"""One ``torch.save`` file, written tensor by tensor.

torch's own serializer lays the file out: ``torch.save`` of fake tensors (shapes and dtypes,
no memory) under ``torch.serialization.skip_data`` writes the pickle and reserves every
storage record. We then write each tensor's bytes at its record's offset and fix the
record's CRC-32 in the zip headers, so the file is an ordinary zip that ``torch.load``
(also with ``mmap=True``) and zip tools accept.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..._base.schema import TensorInfo
from ..._base.tensor_bytes import tensor_bytes
from ...errors import SdadaptError
from .base import Pull, Writer, check_pulled, write_bytes


class TorchSaveWriter(Writer):
    """``path`` is the file to write: a flat ``{key: tensor}`` dict."""

    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        with FakeTensorMode():
            fake = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in entries.items()}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, self.path)
        del fake
        # typed as Any: torch's stubs do not declare PyTorchFileReader.get_record_offset
        reader: Any = torch._C.PyTorchFileReader(self.path)
        stored = sum(1 for r in reader.get_all_records() if r.startswith("data/"))
        if stored != len(entries):
            raise SdadaptError(f"{self.path}: torch.save laid out {stored} storages for {len(entries)} tensors")
        offsets = [reader.get_record_offset(f"data/{i}") for i in range(len(entries))]
        del reader
        crcs: dict[str, int] = {}
        with open(self.path, "r+b") as f:
            for i, (key, info) in enumerate(entries.items()):
                t = pull(key)
                check_pulled(key, t, info)
                data = tensor_bytes(t)
                if len(data) != info.nbytes:
                    raise SdadaptError(f"key {key!r}: {len(data)} bytes, expected {info.nbytes}")
                f.seek(offsets[i])
                write_bytes(f, data)
                crcs[f"data/{i}"] = zlib.crc32(data)
                del t, data
        _fix_crcs(self.path, crcs)


def _fix_crcs(path: str, crcs: dict[str, int]) -> None:
    """Set the CRC-32 of records ``crcs`` (names below the archive folder) in both zip headers."""
    with zipfile.ZipFile(path) as z:
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist() if "/" in i.filename}
        cd_start = z.start_dir
    with open(path, "r+b") as f:
        for name, crc in crcs.items():
            info = infos[name]
            f.seek(info.header_offset)
            if f.read(4) != b"PK\x03\x04":
                raise SdadaptError(f"{path}: unexpected zip layout at record {name!r}")
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crc))
        # central directory: walk its entries in order
        f.seek(cd_start)
        for _ in range(len(infos) + 8):
            head = f.read(46)
            if len(head) < 46 or head[:4] != b"PK\x01\x02":
                break
            n, m, k = struct.unpack("<HHH", head[28:34])
            name = f.read(n).decode()
            rest = m + k
            short = name.split("/", 1)[1] if "/" in name else name
            if short in crcs:
                pos = f.tell()
                f.seek(pos - n - 46 + 16)
                f.write(struct.pack("<I", crcs[short]))
                f.seek(pos)
            f.seek(rest, os.SEEK_CUR)
