"""Load benchmark: sdadapt against the loaders people use today, every path in one run.

    python bench/load_bench.py --preset 1.9g --nproc 2                    # CPU, gloo (issue 12's case)
    python bench/load_bench.py --preset 8b --nproc 2 --backend nccl       # 2 GPUs
    python bench/load_bench.py --preset 8b --nproc 1 --backend nccl --tp-paths '' --materialized-paths '' \
        --discussion '' --paths sdadapt,sdadapt-fp8,hf-reader,hf-fp8-reader    # FP8 vs bf16, one GPU
    python bench/load_bench.py --preset 8b --nproc 1 --backend nccl --tp-paths '' --materialized-paths '' \
        --discussion '' --paths sdadapt,sdadapt-fp8ch,sdadapt-nvfp4,sdadapt-fp8tensor,sdadapt-int8ch,sdadapt-w4a16,\
sdadapt-w4a16asym,sdadapt-mxfp8,sdadapt-fp8block,sdadapt-w8a16,sdadapt-mxfp8e8m0,sdadapt-fp8static,\
sdadapt-nvfp4modelopt,sdadapt-fp8modelopt    # every quantized format vs bf16 (about 120 GiB of disk;
        # with less, split the paths over several runs, each with sdadapt first: bench/reports/quant-formats-all-s2-h200-2026-12-04.md)
    python bench/load_bench.py --preset 8b --nproc 1 --backend nccl --tp-paths '' --materialized-paths '' \
        --discussion '' --paths sdadapt --raw-paths instanttensor,safetensors-gpu --import-in-load   # raw loaders

One synthetic Llama-shaped checkpoint (HF names, bf16) is written once as HF sharded
safetensors, one ``torch.save`` file and a DCP folder (a size that cannot fit the disk or RAM
is refused before anything is written; whatever was written is removed at the end unless
``--keep``). Then every path (``loadbench.paths``: sdadapt from each source and with a fused
adapter, rank-0 broadcast, DCP's HF reader, native DCP, the user discussion's
``BroadcastingTorchSaveReader``; the checkpoint's FP8 twin, e4m3 weights with float32
128x128 block scales, through sdadapt's dequant rules and torch's
``QuantizedHuggingFaceStorageReader``; and one quantized twin per format other tools write, each
in its tool's layout and read by ``sdadapt.dequant_rules(folder)``: ``sdadapt-fp8ch`` /
``-fp8tensor`` / ``-fp8block`` / ``-int8ch`` / ``-w4a16`` / ``-w4a16asym`` / ``-w8a16`` /
``-mxfp8`` / ``-mxfp8e8m0`` / ``-nvfp4`` (compressed-tensors FP8 per channel, per tensor and in
128x128 blocks, int8 per channel, int4 in groups of 128 without and with zero points, packed int8
in groups of 128, MXFP8 with U8 and with F8_E8M0 exponents, NVFP4), ``sdadapt-fp8static``
(``quant_method: fp8``, one scale per tensor), ``sdadapt-nvfp4modelopt`` and
``sdadapt-fp8modelopt`` (ModelOpt NVFP4 and FP8); ``loadbench.twins``) loads it
into a model built on meta and parallelised (FSDP2 or TP over all ranks), and the main paths also
into a model materialised with values first. Raw
loaders (``--raw-paths``: InstantTensor's backends, safetensors' ``safe_open`` on the GPU) load
every tensor onto the rank's device with no model, as the reference for moving the bytes alone.

The headline is what a job sees: the first load in a fresh process. Each row gets its own new
process group (libraries imported before timing; with ``--import-in-load`` only what builds the model, each
loader's own imports then being part of its first load), whose first load is timed, followed by
``--repeat`` steady-state loads in the same processes (``--fork-ranks``, for checking many rows on
a small machine: each group's ranks are forked from one process that imported torch's libraries
once, never sdadapt, which each rank imports before its first load). Per row and rank: wall time, bytes read,
extra RSS over the load's start (anonymous and file-backed apart), peak GPU memory; the machine's
own read rates in a last group. Every first load is checked bit-exactly against the source
(the quantized paths against the whole-tensor dequantisation of their file, rounded once to bf16,
and their quantized weights also against the format's own reference: compressed-tensors'
decompressors, or the published formula).
JSON and a markdown table out. The code is the ``loadbench`` package beside this file.
"""

from __future__ import annotations

import sys

from loadbench.cli import main
from loadbench.common import BenchError

if __name__ == "__main__":
    try:
        sys.exit(main(description=__doc__.split("\n\n")[0]))
    except BenchError as e:
        print(f"load_bench: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
