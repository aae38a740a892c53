"""Block checksums summed from a safetensors file's bytes as they stream by (an every-rank
export's upload) are the ones reading each block back gives: for a matrix of several blocks, a
0-dim tensor, an empty one and one with empty rows, fed in chunks that cut blocks anywhere."""

from __future__ import annotations

import torch

from sdadapt._base.schema import TensorInfo
from sdadapt._base.tensor_bytes import tensor_bytes
from sdadapt._export.writers.safetensors_writer import plan_files
from sdadapt.sources import StreamedChecksums, tensor_checksums


def test_streamed_checksums_are_the_read_back_ones():
    torch.manual_seed(0)
    tensors = {"a.w": torch.randn(37, 11), "b.scalar": torch.tensor(3.5), "c.none": torch.empty(0, 4),
               "d.flat": torch.empty(5, 0), "e.v": torch.randn(9).to(torch.bfloat16)}  # fmt: skip
    infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    [layout] = plan_files(infos, 1 << 30)
    data = bytearray(layout.header)
    for k in sorted(layout.starts, key=layout.starts.__getitem__):
        assert len(data) == layout.starts[k]
        data += bytes(tensor_bytes(tensors[k].contiguous()))
    assert len(data) == layout.size
    want = {k: tensor_checksums(infos[k], lambda box, v=v: v[tuple(slice(a, b) for a, b in box)], block_bytes=64)
            for k, v in tensors.items()}  # fmt: skip
    for chunk in (1, 7, 64, len(data)):
        summed = StreamedChecksums(infos, layout.starts, block_bytes=64)
        for pos in range(0, len(data), chunk):
            summed.feed(pos, memoryview(data)[pos : pos + chunk])
        assert summed.done() == want, chunk
