"""What one computation of an FP8 load costs the device lane, by reading-thread count, band
size and band buffers per thread: is the lane's time per band the CUDA calls' own cost, the
readers taking the interpreter lock from it, or the wake-up of a reader waiting for the
buffer it hands back?

Writes an FP8 release of ``--tensors`` e4m3 matrices of ``--shape`` with float32 128x128
``weight_scale_inv`` (one safetensors file in ``--dir``, kept for the next run, then read once
to warm the page cache), and loads it through ``IOEngine.run`` into bf16 tensors on the GPU,
per band size and thread count once marked "warm-up" (it pins the slabs and loads the
kernels), then ``--repeat`` times. Per run it prints the engine's seconds and bytes, the
lane's items (each ``DeviceLane._do`` timed: sum and median), of which the kernels
(``DequantFP8._kernel``) and the copies' events, the lane's checks and waits for finished
copies (``_hand_back``, trees where the lane waits for them), and the readers' busy, read and
wait seconds; the first run's bits are checked against the whole-tensor dequantisation.
``SDADAPT_IO_*`` variables apply (e.g. ``SDADAPT_IO_BAND_DEPTH=2``)::

    python bench/lane_probe.py --tensors 64 --threads 1,4,12 --bands 0,32 --repeat 2   # a CUDA device
    python bench/lane_probe.py --device cpu --tensors 2 --shape 256,512 --threads 2    # no lane: a check of the script

Its runs so far are in the git history of bench/RESULTS.md and bench/results/ (the FP8
load's tuning on one H200); bench/reports/ holds the reports of current runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from sdadapt._base.regions import full_box
from sdadapt._engine import EngineConfig, IOEngine
from sdadapt._engine import device as D
from sdadapt._engine.tasks import Job
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt._recipes.nodes import Leaf
from sdadapt.sources import open_source

BLOCK = (128, 128)


def _timed(cls: type, name: str) -> list[float]:
    """Wrap method ``name`` of ``cls`` to record each call's seconds; returns the list it appends to."""
    times: list[float] = []
    real = getattr(cls, name)

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)

    setattr(cls, name, timed)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--shape", default="4096,14336", help="rows,cols of each matrix (multiples of 128)")
    p.add_argument("--threads", default="1,12")
    p.add_argument("--bands", default="0", help="band sizes in MiB to run (0: the default); staging grows to threads x band")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--device", default="cuda", help="cpu: the same runs with no lane (a check of this script)")
    a = p.parse_args()
    rows, cols = (int(n) for n in a.shape.split(","))
    path = os.path.join(a.dir, f"lane_probe_{a.tensors}x{rows}x{cols}.safetensors")
    dev = torch.device(a.device)
    if not os.path.exists(path):
        torch.manual_seed(0)
        sd = {}
        for i in range(a.tensors):  # quantized on the device: the CPU would take minutes
            w, s = Q.quantize_fp8(torch.randn(rows, cols, device=dev), BLOCK, "float32")
            sd[f"w{i}"], sd[f"w{i}_scale_inv"] = w.cpu(), s.cpu()
        save_file(sd, path)
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    lane, kernels = _timed(D.DeviceLane, "_do"), _timed(QN.DequantizedFP8, "_kernel")
    # the events behind the copies: recorded by the lane (and waited for by it, `_hand_back`),
    # or, in trees before that, handed to the readers to wait on
    copies = _timed(D.DeviceLane, "_record" if hasattr(D.DeviceLane, "_record") else "_copied")
    hand_backs = _timed(D.DeviceLane, "_hand_back") if hasattr(D.DeviceLane, "_hand_back") else []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def ms(xs: list[float]) -> str:
        xs = sorted(xs) or [0.0]
        return f"{sum(xs):.3f} s, median {xs[len(xs) // 2] * 1e3:.3f} ms"

    with open_source(path) as src:
        nodes = {f"w{i}": QN.DequantizedFP8(Leaf(f"w{i}", (rows, cols), Q.FP8_DTYPE),
                                        Leaf(f"w{i}_scale_inv", (rows // BLOCK[0], cols // BLOCK[1]), torch.float32),
                                        BLOCK, "float32", torch.bfloat16) for i in range(a.tensors)}
        dests = {k: torch.empty(rows, cols, dtype=torch.bfloat16, device=dev) for k in nodes}
        bands, counts = [float(b) for b in a.bands.split(",")], [int(t) for t in a.threads.split(",")]
        for (band, threads), r in itertools.product(itertools.product(bands, counts), range(a.repeat + 1)):
            cfg = EngineConfig.from_env()
            cfg.threads = threads
            if band:
                cfg.band_bytes = int(band * 2**20)
                cfg.staging_bytes = max(cfg.staging_bytes, cfg.band_bytes * threads)
            for d in dests.values():
                d.fill_(float("nan"))
            jobs = [Job(k, n, full_box(n.shape), dests[k]) for k, n in nodes.items()]
            for xs in (lane, kernels, copies, hand_backs):
                xs.clear()
            sync()
            t = time.perf_counter()
            st = IOEngine(src, cfg).run(jobs)
            sync()
            wall = time.perf_counter() - t
            print(f"band {cfg.band() / 2**20:.1f} MiB threads {threads:2d} run {r}: "
                  f"engine {wall:.3f} s, {st.bytes_read / 2**30:.2f} GiB; lane {len(lane)} items, "
                  f"busy {ms(lane)}; in kernels {ms(kernels)}; copies' events {ms(copies)}; lane's hand-backs "
                  f"{ms(hand_backs)}; readers busy "
                  f"{st.busy_seconds:.3f} s, read {st.read_seconds:.3f} s, waited {st.wait_seconds:.3f} s"
                  + (" (warm-up)" if r == 0 else ""), flush=True)
            if band == bands[0] and threads == counts[0] and r == 0:  # the bits, once
                for k, n in nodes.items():
                    assert torch.equal(dests[k].cpu().view(torch.int16), n.full(src).view(torch.int16)), k
                print("bits equal the whole-tensor dequantisation", flush=True)


if __name__ == "__main__":
    main()
