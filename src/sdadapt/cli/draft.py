"""``sdadapt draft SRC --target T [-o my_adapter.py]``: a first adapter inferred from headers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .diff import adapter_of, add_adapter, add_compared

NAME = "draft"
HELP = "infer a first adapter from a checkpoint and a model (headers, then a numerical check); review it, then use it"

EPILOG = """\
T is a checkpoint path, or module:function / path/to/file.py:function returning the model
(build it on the meta device: only shapes and dtypes are used). The adapter module goes to
-o FILE (then the summary and the remaining diff are printed), or to stdout without -o (the
summary then goes to stderr). SRC's config.json, when present, gives head counts, the family
and quantization. Rules on weak evidence, or among same-shaped tensors the evidence cannot tell
apart, are marked UNCERTAIN with the alternative; choices shapes cannot show (rotary row order,
Gemma's 1 + w norms, FP8 dequantisation, per-rank layout of fused tensors) are DECIDE comments
with the rule to enable. A line-up is names, not numbers, so by default (--reference auto) the
draft settles those choices by experiment when SRC's config.json names a class the installed
transformers has: a copy of the model with --layers layers is loaded under each candidate and
compared with that class built from the config, layer by layer; each rule then says whether it
was checked numerically, what no experiment settles stays UNCERTAIN, and the summary says which
check ran (or why none did). --reference config asks for it (a copy without buffer values is then an error),
--reference module:function builds the checkpoint's own model from a config dict, --reference
none reads headers only. The copy's non-persistent buffers (rotary tables) come from the
model's init_weights() / init_buffers() / reset_parameters(), else from building T again with
its parameters on meta, else --init-buffers module:function; a copy whose buffers get no values
is never compared. Without a check, use `sdadapt verify`; docs/writing-adapters.md walks
through it. Exit status: 0 when the drafted adapter lines everything up, 1 when problems
remain or the two look unrelated, 2 for usage errors (bad arguments, unreadable checkpoint,
a target that cannot be imported or built)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_compared(parser, EPILOG)
    add_adapter(parser, "start from this adapter (name, .json, module:ATTR)")
    parser.add_argument("--reference", "-r", metavar="R", default="auto",
                        help="settle open choices numerically: 'auto' (default: 'config' when SRC's config.json names "
                             "a class the installed transformers has), 'config', module:function(config) -> model, "
                             "or 'none' (headers only)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the copies the numerical check runs (default 2)")
    parser.add_argument("--init-buffers", metavar="FN", help="module:function(model) filling non-persistent buffers")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the adapter module here (refuses to overwrite)")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    parser.add_argument("--json", action="store_true", help="print the draft (proposals, questions, report) as JSON")


def run(args: argparse.Namespace) -> int:
    from .._draft import Check, run_draft
    from .._plan.resolve import resolve_target, resolve_target_on_meta
    from ..errors import ResolveError
    from ..sources import open_source
    from .diff import parse_options

    if args.output and os.path.exists(args.output) and not args.force:
        raise ResolveError(f"{args.output} exists; pass --force to overwrite it or choose another -o")
    target: Any
    target, note = resolve_target_on_meta(args.target, **parse_options(args.target_option))
    if note:
        print(f"note: {note}", file=sys.stderr)
    if isinstance(target, str) and args.target_subtree:
        target = open_source(target, subtree=args.target_subtree)
    adapter = adapter_of(args)
    if args.reference not in ("auto", "none") and isinstance(target, str):
        raise ResolveError("--reference needs the model as --target (module:function), not a checkpoint")
    init_buffers = None
    if args.init_buffers:
        from .._plan.resolve import load_object

        init_buffers = load_object(args.init_buffers)
        if not callable(init_buffers):
            raise ResolveError(f"--init-buffers {args.init_buffers!r} names no function: give module:function(model)")
    options = parse_options(args.target_option)

    def rebuild() -> Any:  # the target built again, its parameters on meta: its buffers for the check's copy
        return resolve_target(args.target, **options)

    check = Check(args.reference, args.layers, init_buffers, rebuild if not isinstance(target, str) else None)
    d = run_draft(target, args.src, adapter, args.subtree, check)
    if args.json:
        print(d.model_dump_json(indent=2))
    elif args.output:
        if d.related:
            try:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(d.module)
            except OSError as e:
                raise ResolveError(f"cannot write {args.output}: {e.strerror or e}") from None
        print(d.format())
        if d.related:
            print(f"wrote {args.output}: review it, then `sdadapt diff {args.src} --target {args.target} "
                  f"--adapter {args.output}:ADAPTER`")
    else:
        if d.related:
            sys.stdout.write(d.module)
        print(d.format(), file=sys.stderr if d.related else sys.stdout)
    return 0 if d.related and d.report.ok else 1
