"""``sdadapt convert SRC DST --to FORMAT [--adapter A]``: rewrite a checkpoint, one tensor at a time."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

NAME = "convert"
HELP = "rewrite a checkpoint in another layout (adapter) and format, tensor by tensor, in one process"

EPILOG = """\
SRC is a torch.save file, a .safetensors file, an HF sharded folder or a DCP folder. The
adapter (a shipped name, a .json file, or module:ATTR / file.py:ATTR) maps SRC's layout to
DST's, as for loading. DST must not exist (unless --overwrite); the output is written beside
it and renamed into place when complete. Memory stays at about the largest tensor (twice it
where a rule concatenates). --verify reads DST back and compares every tensor with SRC.
Exit status: 0 done, 2 usage or input errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("src", metavar="SRC", help="checkpoint to read")
    parser.add_argument("dst", metavar="DST", help="file (torch) or folder (safetensors, dcp) to write")
    parser.add_argument("--to", dest="fmt", required=True, choices=["safetensors", "torch", "dcp"], help="output format")
    parser.add_argument("--adapter", "-a", metavar="A", help="adapter name, .json file, or module:ATTR")
    parser.add_argument(
        "--adapter-option", "--option", "-O", action="append", default=[], metavar="KEY=VALUE",
        help="option passed to an adapter function or shipped adapter (repeatable)",
    )
    parser.add_argument("--shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard (default 5GB)")
    parser.add_argument("--subtree", "-s", metavar="S", help="nested dict of a torch.save file to convert, e.g. model")
    parser.add_argument("--verify", action="store_true", help="read the result back and compare every tensor")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _adapter(args: argparse.Namespace) -> Any:
    if not args.adapter:
        return None
    try:
        from .._resolve import resolve_adapter
    except ImportError:  # the resolver is optional: accept a JSON file
        from .._adapter import Adapter

        with open(args.adapter, encoding="utf-8") as f:
            return Adapter.from_json(f.read())
    from .diff import parse_options

    return resolve_adapter(args.adapter, source=args.src, **parse_options(args.adapter_option))


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, else a line every 10%)."""

    def __init__(self, total_bytes: int, total_items: int, label: str, stream: TextIO | None = None):
        self.total = max(total_bytes, 1)
        self.items = total_items
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done_bytes = 0
        self.done_items = 0
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()
        self.last_decile = -1

    def __call__(self, key: str, nbytes: int) -> None:
        self.done_bytes += nbytes
        self.done_items += 1
        frac = self.done_bytes / self.total if self.total > 1 else self.done_items / max(self.items, 1)
        secs = time.perf_counter() - self.start
        rate = self.done_bytes / 2**20 / secs if secs > 0 else 0.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = f"{self.label} [{bar}] {frac * 100:5.1f}% {self.done_items}/{self.items} tensors {rate:7.1f} MiB/s"
        if self.tty:
            self.stream.write("\r" + line)
            if self.done_items >= self.items:
                self.stream.write("\n")
        elif int(frac * 10) > self.last_decile or self.done_items >= self.items:
            self.last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from .._export import convert, plan_outputs
    from ..sources import open_source

    adapter = _adapter(args)
    progress = None
    if not args.no_progress:
        with open_source(args.src, subtree=args.subtree) as source:
            outputs, _ = plan_outputs(source.schema, adapter, non_tensor=source.non_tensor, what="convert")
            total = sum(n.dtype.itemsize * _numel(n.shape) for n in outputs.values())
        bar = ProgressBar(total, len(outputs), "write")
        verify_bar = ProgressBar(total, len(outputs), "verify")
        state = {"writing": True}

        def progress(key: str, nbytes: int) -> None:
            if state["writing"]:
                bar(key, nbytes)
                if bar.done_items >= bar.items:
                    state["writing"] = False
            else:
                verify_bar(key, nbytes)

    rep = convert(
        args.src,
        args.dst,
        adapter,
        args.fmt,
        max_shard_size=args.shard_size,
        subtree=args.subtree,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=progress,
    )
    print(rep.format_text())
    if rep.skipped_non_tensor:
        print(f"not written (not tensors): {', '.join(rep.skipped_non_tensor)}")
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
