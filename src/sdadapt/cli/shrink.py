"""``sdadapt shrink SRC DST --layers N``: a checkpoint cut to its first N layers (CI fixtures)."""

from __future__ import annotations

import argparse

NAME = "shrink"
HELP = "write a checkpoint's first N layers (embeddings, final norm and head kept) as a small real-weight fixture"

EPILOG = """\
SRC is an HF checkpoint folder (sharded with model.safetensors.index.json, or one
model.safetensors) or a .safetensors file. Keys whose layer index (found by --pattern, default
'layers.{i}.') is N or more are dropped; every other key is copied as stored (quantized scales
stay beside their weights). DST is a new folder: safetensors shards and index, config.json with
the layer count (and per-layer lists) rewritten, and the source folder's other small files
(tokenizer, generation config). Tensors are streamed one at a time. A progress bar is shown on
a terminal. Exit status: 0 done, 2 usage or input errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("src", metavar="SRC", help="HF checkpoint folder, .safetensors file, or hf://org/name[@rev]")
    parser.add_argument("dst", metavar="DST", help="folder to write (must not exist unless --overwrite)")
    parser.add_argument("--layers", "-n", type=int, required=True, metavar="N", help="number of leading layers to keep")
    parser.add_argument("--pattern", default="layers.{i}.", metavar="P", help="where keys carry the layer index (default 'layers.{i}.')")
    parser.add_argument("--shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from .._tools import shrink

    rep = shrink(
        args.src,
        args.dst,
        args.layers,
        pattern=args.pattern,
        max_shard_size=args.shard_size,
        overwrite=args.overwrite,
        progress=False if args.no_progress else None,
    )
    print(rep.format_text())
    return 0
