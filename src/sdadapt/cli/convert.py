"""``sdadapt convert SRC DST --to FORMAT [--adapter A]``: rewrite a checkpoint, one tensor at a time."""

from __future__ import annotations

import argparse
import math

from .diff import adapter_of, add_adapter

NAME = "convert"
HELP = "rewrite a checkpoint in another layout (adapter) and format, tensor by tensor, in one process"

EPILOG = """\
SRC is a torch.save file, a .safetensors file, an HF sharded folder, a DCP folder or a Hub id
(hf://org/name[@revision], read through the Hub cache; needs sdadapt[hub]). The
adapter (a shipped name, a .json file, or module:ATTR / file.py:ATTR) maps SRC's layout to
DST's, as for loading. DST must not exist (unless --overwrite); the output is written beside
it and renamed into place when complete. Memory stays at about the largest tensor (twice it
where a rule concatenates). --read-back reads DST back and compares every tensor with SRC.
Exit status: 0 done, 2 usage or input errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("src", metavar="SRC", help="checkpoint to read (a path, or hf://org/name[@rev])")
    parser.add_argument("dst", metavar="DST", help="file (torch) or folder (safetensors, dcp) to write")
    parser.add_argument("--to", dest="fmt", required=True, choices=["safetensors", "torch", "dcp", "torch_dist"], help="output format")
    add_adapter(parser)
    parser.add_argument("--shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard (default 5GB)")
    parser.add_argument("--subtree", "-s", metavar="S", help="nested dict of a torch.save file to convert, e.g. model")
    parser.add_argument("--read-back", action="store_true", help="read the result back and compare every tensor")
    # the old name of --read-back, refused with the new one ("verify" is the `sdadapt verify` command)
    parser.add_argument("--verify", dest="old_verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (one is drawn on stderr only when it is a terminal)")


def run(args: argparse.Namespace) -> int:
    from .._base.progress import progress_bar, show_progress
    from .._export import convert, plan_outputs
    from ..sources import open_source

    if args.old_verify:
        from ..errors import UsageError

        raise UsageError(
            "--verify is now --read-back (read the result back and compare every tensor); "
            "`sdadapt verify` compares a loaded model's outputs with a reference"
        )
    adapter = adapter_of(args)
    progress = None
    if not args.no_progress and show_progress():
        with open_source(args.src, subtree=args.subtree) as source:
            outputs, _ = plan_outputs(source.schema, adapter, non_tensor=source.non_tensor, what="convert")
            total = sum(n.dtype.itemsize * math.prod(n.shape) for n in outputs.values())
        bars = [progress_bar(total, "write")]
        if args.read_back:
            bars.append(progress_bar(total, "read back"))
        done = [0]

        def progress(key: str, nbytes: int) -> None:
            bars[min(done[0] // len(outputs), len(bars) - 1)].update(nbytes)
            done[0] += 1

    try:
        rep = convert(
            args.src,
            args.dst,
            adapter,
            args.fmt,
            max_shard_size=args.shard_size,
            subtree=args.subtree,
            overwrite=args.overwrite,
            read_back=args.read_back,
            on_progress=progress,
        )
    finally:
        if progress is not None:
            for bar in bars:
                bar.close()
    print(rep.format_text())
    if rep.skipped_non_tensor:
        print(f"not written (not tensors): {', '.join(rep.skipped_non_tensor)}")
    return 0
