"""Column slices (TP's row-parallel shards) are read with ``preadv`` at the bytes asked for:
never through the file's mapping, runs with short gaps joined into one call, runs far apart
read one by one; the engine's count of the bytes it asked storage for is what the system saw
(``/proc/self/io``), and the dry run's prediction of it is the engine's own figure."""

from __future__ import annotations

import os

import pytest
import torch
from support.checkpoints import write_safetensors

from sdadapt._engine import EngineConfig, IOEngine, Job
from sdadapt._engine.predict import predict
from sdadapt._engine.syscalls import PAGE, join_runs, read_runs, requested, storage_bytes
from sdadapt._recipes import nodes as N
from sdadapt.sources import open_source

TP = 8
# "narrow": 4 KiB rows, a rank's 512-byte column slice: gaps of 3.5 KiB, read through (one call
# per 512 rows); "wide": 512 KiB rows, 64 KiB slices 448 KiB apart: one call per row
SPEC = {"narrow": ((96, 2048), torch.bfloat16), "wide": ((6, 128 * 1024), torch.float32)}


def _rchar() -> int | None:
    """The bytes this process's read calls returned so far (``None`` without ``/proc``)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except OSError:
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    gen = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(shape, generator=gen).to(dtype) for k, (shape, dtype) in SPEC.items()}
    return sd, write_safetensors(tmp_path_factory.mktemp("cold") / "m.safetensors", sd)


def _jobs(src, rank: int, contiguous: bool) -> list[Job]:
    jobs = []
    for key, info in src.schema.items():
        rows, cols = info.shape
        per = cols // TP
        box = ((0, rows), (rank * per, (rank + 1) * per))
        # a contiguous local shard (read straight into), or a view into a wider one (staged)
        dest = torch.empty(rows, per, dtype=info.dtype) if contiguous else torch.empty(rows, per + 5, dtype=info.dtype)[:, 2 : 2 + per]
        jobs.append(Job(key, N.Leaf(key, info.shape, info.dtype), box, dest))
    return jobs


@pytest.mark.parametrize("contiguous", [True, False], ids=["direct", "staged"])
def test_column_slices_are_read_with_preadv_at_the_bytes_asked_for(checkpoint, contiguous):
    sd, path = checkpoint
    cfg = EngineConfig(threads=2, direct_min_bytes=0 if contiguous else 1 << 40, chunk_bytes=1 << 20)
    with open_source(path) as src:

        def no_mapping(key, box):
            raise AssertionError(f"{key} {box} read through the source's mapping")

        src.read = no_mapping  # type: ignore[method-assign]
        for rank in range(TP):
            jobs = _jobs(src, rank, contiguous)
            fig = predict(src, _jobs(src, rank, contiguous), cfg, torch.device("cpu"))
            before = _rchar()
            stats = IOEngine(src, cfg).run(jobs)
            after = _rchar()
            for job in jobs:
                assert torch.equal(job.dest, sd[job.key][:, job.box[1][0] : job.box[1][1]]), (rank, job.key)
            wanted = sum(j.dest.numel() * j.dest.element_size() for j in jobs)
            assert stats.bytes_read == fig.bytes_read == wanted, (rank, stats, fig)
            # what the kernel was asked for (rchar counts every byte a read call returned): the
            # wanted bytes and the gaps read through ("narrow": its rows whole but the last
            # one's tail), no more
            narrow_rows, narrow_cols = SPEC["narrow"][0]
            gaps = (narrow_rows - 1) * narrow_cols * 2 * (TP - 1) // TP
            if before is not None and after is not None:
                assert wanted + gaps <= after - before <= wanted + gaps + PAGE, (rank, after - before, stats)
            # the figure the dry run predicts is the engine's own
            assert stats.storage_bytes == fig.storage_bytes and stats.syscalls == fig.preadv_calls, (rank, stats, fig)
            # independently: "narrow" joined (every page of its rows), "wide" one run per row
            # (only the pages of each run)
            pages: dict[str, set[int]] = {}
            for key, info in src.schema.items():
                loc = src.locate(key)
                assert loc is not None
                row = info.shape[1] * info.dtype.itemsize
                run = row // TP
                for r in range(info.shape[0]):
                    a = loc.offset + r * row + rank * run
                    b = a + run if key == "wide" else a + run + (row - run if r < info.shape[0] - 1 else 0)
                    pages.setdefault(key, set()).update(range(a // PAGE, -(-b // PAGE)))
            assert stats.storage_bytes == PAGE * len(pages["narrow"] | pages["wide"])
            wide = SPEC["wide"][0][0] * SPEC["wide"][0][1] * 4 // TP
            assert PAGE * len(pages["wide"]) <= 1.1 * wide  # runs far apart cost their own pages only
            assert stats.syscalls == 1 + SPEC["wide"][0][0] if contiguous else stats.syscalls >= 1 + SPEC["wide"][0][0]


def test_mapping_path_is_still_there_when_asked_for(checkpoint):
    """``min_span_bytes`` > 0: runs shorter than it are copied out of the mapping (the engine
    counts those bytes as asked of storage)."""
    sd, path = checkpoint
    cfg = EngineConfig(threads=2, min_span_bytes=64 * 1024 + 1)
    with open_source(path) as src:
        jobs = _jobs(src, 3, True)
        stats = IOEngine(src, cfg).run(jobs)
        for job in jobs:
            assert torch.equal(job.dest, sd[job.key][:, job.box[1][0] : job.box[1][1]])
        assert stats.syscalls == 0 and stats.storage_bytes == stats.bytes_read


def test_join_runs_cuts_at_large_gaps_and_at_iov_max():
    segs = [(i * 100, 10) for i in range(1500)]
    assert join_runs(segs, 90) == [(0, 512), (512, 1024), (1024, 1500)]
    assert join_runs(segs, 89) == [(i, i + 1) for i in range(1500)]
    assert requested([(0, 10), (20, 10), (1000, 5)], 10) == [(0, 30), (1000, 1005)]
    assert storage_bytes([(0, 1), (4095, 4097), (3 * PAGE, 3 * PAGE + 1)]) == 3 * PAGE


def test_joined_reads_go_on_after_a_short_read_and_stop_at_the_end(tmp_path):
    data = bytes(range(256)) * 40  # 10240 bytes
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    sink = torch.empty(64, dtype=torch.uint8)
    fd = os.open(f, os.O_RDONLY)
    try:
        mem = torch.zeros(30, dtype=torch.uint8)
        calls, ext = read_runs(fd, mem, 5, [(10, 5), (30, 10), (10200, 10)], 64, sink)
        assert (calls, ext) == (2, [(10, 40), (10200, 10210)])
        assert bytes(mem[5:30].tolist()) == data[10:15] + data[30:40] + data[10200:10210]
        with pytest.raises(OSError, match="truncated"):
            read_runs(fd, torch.zeros(20, dtype=torch.uint8), 0, [(10220, 10), (10250, 10)], 64, sink)
    finally:
        os.close(fd)
