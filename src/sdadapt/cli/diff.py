"""``sdadapt diff SRC --target T [--adapter A]``: what lines up and what does not (headers only)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ResolveError

NAME = "diff"
HELP = "compare a checkpoint (through an adapter) with a model or another checkpoint; reads headers only"

EPILOG = """\
T is a checkpoint path, or module:function / path/to/file.py:function returning the model
(build it on the meta device: only shapes and dtypes are used). A is a shipped adapter name,
an adapter .json file, or module:ATTR / file.py:ATTR naming an Adapter or a function
returning one. Exit status: 0 when everything lines up, 1 when there are problems, 2 for
usage errors (bad arguments, unreadable checkpoint, import failures)."""


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """``["tp=2", "name=x", "bias=true"]`` -> ``{"tp": 2, "name": "x", "bias": True}`` (JSON values
    where they parse, strings otherwise)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ResolveError(f"option {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def add_adapter(parser: argparse.ArgumentParser, what: str = "adapter name, .json file, or module:ATTR") -> None:
    """The ``--adapter`` of a command (``what`` its help) and its ``--adapter-option`` list."""
    parser.add_argument("--adapter", "-a", metavar="A", help=what)
    parser.add_argument(
        "--adapter-option", "--option", "-O", action="append", default=[], metavar="KEY=VALUE",
        help="option passed to an adapter function or shipped adapter (repeatable)",
    )


def adapter_of(args: argparse.Namespace) -> Any:
    """The adapter ``--adapter`` names, built with its ``--adapter-option`` values; ``None``
    without one (options without an adapter are a usage error)."""
    if args.adapter_option and not args.adapter:
        raise ResolveError("--adapter-option needs --adapter")
    if not args.adapter:
        return None
    from .._plan.resolve import resolve_adapter

    return resolve_adapter(args.adapter, source=args.src, **parse_options(args.adapter_option))


def add_compared(parser: argparse.ArgumentParser, epilog: str) -> None:
    """What ``diff`` and ``draft`` compare: ``SRC``, ``--target`` and where in each to look."""
    parser.epilog = epilog
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "src", metavar="SRC",
        help="checkpoint: torch.save file, .safetensors, HF sharded folder, DCP folder, or hf://org/name[@rev]",
    )
    parser.add_argument("--target", "-t", required=True, metavar="T", help="model (module:function) or checkpoint")
    parser.add_argument(
        "--target-option", action="append", default=[], metavar="KEY=VALUE",
        help="keyword argument passed to the target function (repeatable)",
    )
    parser.add_argument("--subtree", "-s", metavar="S", help="nested dict of a torch.save SRC to use, e.g. model")
    parser.add_argument("--target-subtree", metavar="S", help="nested dict of a torch.save target checkpoint")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_compared(parser, EPILOG)
    add_adapter(parser)
    parser.add_argument("--allow-missing", action="append", default=[], metavar="PAT", help="key pattern the model may lack values for")
    parser.add_argument("--allow-unexpected", action="append", default=[], metavar="PAT", help="checkpoint key pattern to ignore")
    parser.add_argument(
        "--pipeline-stage", action="store_true",
        help="the target is one pipeline stage: checkpoint keys of the other stages' layers and of its None modules are allowed",
    )
    parser.add_argument(
        "--dtype", metavar="D",
        help="convert every tensor to D after the adapter's rules: 'model' (the target's dtype for each "
             "tensor) or a dtype name, as sdadapt.load(..., dtype=D) does",
    )
    parser.add_argument("--all", action="store_true", help="list every row of each section (text mode)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from .._plan.resolve import resolve_target_on_meta
    from .._tools import diff
    from ..sources import open_source

    target: Any
    target, note = resolve_target_on_meta(args.target, **parse_options(args.target_option))
    if note:
        print(f"note: {note}", file=sys.stderr)
    adapter = adapter_of(args)
    if isinstance(target, str) and args.target_subtree:
        target = open_source(target, subtree=args.target_subtree)
    report = diff(
        target,
        args.src,
        adapter,
        subtree=args.subtree,
        allow_missing=args.allow_missing or None,
        allow_unexpected=args.allow_unexpected or None,
        pipeline_stage=args.pipeline_stage,
        dtype=args.dtype,
    )
    print(report.model_dump_json(indent=2) if args.json else report.format(max_rows=None if args.all else 8, cli=True))
    return 0 if report.ok else 1
