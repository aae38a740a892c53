"""``sdadapt inspect SRC``: keys, shapes, dtypes and bytes of a checkpoint, runs compressed."""

from __future__ import annotations

import argparse

NAME = "inspect"
HELP = "list a checkpoint's tensors (keys, shapes, dtypes, bytes) with runs of keys compressed; reads headers only"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", metavar="SRC",
        help="checkpoint: torch.save file, .safetensors, HF sharded folder, DCP folder, or hf://org/name[@rev]",
    )
    parser.add_argument("--subtree", "-s", metavar="S", help="nested dict of a torch.save file to list, e.g. model")
    parser.add_argument("--json", action="store_true", help="print the inventory as JSON")


def run(args: argparse.Namespace) -> int:
    from ..sources import inventory, open_source

    with open_source(args.src, subtree=args.subtree) as src:
        inv = inventory(src.schema, source=src.remote_url() or src.path, kind=src.kind, non_tensor=src.non_tensor)
    print(inv.model_dump_json(indent=2) if args.json else inv.format())
    return 0
