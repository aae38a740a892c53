"""``sdadapt plan SRC --mesh dp_shard=16,tp=8 [--target T]``: a dry run of a load at any world size."""

from __future__ import annotations

import argparse
from typing import Any

from .diff import adapter_of, add_adapter, parse_options

NAME = "plan"
HELP = "dry run: what each rank of a load on a mesh of any size would read, open and hold (headers only, one process)"

EPILOG = """\
The mesh is NAME=SIZE per dim, among pp, dp_replicate, dp_shard, ep, tp (--ep and --pp add
those dims). Each rank's shards follow torchtitan's parallelisation of a transformer (FSDP2,
HSDP, TP, EP, PP; see docs/scaling.md), each rank's reads the engine's own planning. Ranks with
the same shards are planned once; past --max-ranks classes, an evenly spaced sample is planned
and the totals are estimated from it (the output says so). T is a model (module:function or
file.py:function, built on the meta device) or a checkpoint whose keys are the target; without
it the target is the checkpoint's own layout through the adapter. Exit status: 0 when the plan
lines up, 1 when it has problems, 2 for usage errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("src", metavar="SRC", help="checkpoint: .safetensors, HF sharded folder, DCP folder, torch.save file")
    parser.add_argument("--mesh", "-m", required=True, metavar="DIMS", help="e.g. dp_replicate=8,dp_shard=16,tp=8")
    parser.add_argument("--ep", type=int, metavar="N", help="expert-parallel degree")
    parser.add_argument("--pp", type=int, metavar="N", help="pipeline stages")
    parser.add_argument("--target", "-t", metavar="T", help="model (module:function) or checkpoint; default: SRC's own layout")
    parser.add_argument("--target-option", action="append", default=[], metavar="KEY=VALUE", help="keyword for the target function")
    add_adapter(parser)
    parser.add_argument("--subtree", "-s", metavar="S", help="nested dict of a torch.save SRC to use")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the shards are (default cpu)")
    share = parser.add_mutually_exclusive_group()
    share.add_argument("--share-reads", dest="share_reads", action="store_true", default=None,
                       help="replicas read once and broadcast; TP peers share column slices' rows")
    share.add_argument("--no-share-reads", dest="share_reads", action="store_false", help="every replica reads (default for cpu)")
    parser.add_argument("--headers", choices=("once", "every"), default="once", help="one rank reads the headers (default) or every rank")
    parser.add_argument("--ranks-per-node", type=int, default=8, metavar="N", help="ranks per node for the node figures (default 8)")
    parser.add_argument("--max-ranks", type=int, default=16, metavar="N", help="plan at most N classes of ranks (default 16)")
    parser.add_argument("--dtype", metavar="D", help="convert every tensor to D, as sdadapt.load(..., dtype=D)")
    parser.add_argument("--allow-missing", action="append", default=[], metavar="PAT", help="key pattern the target may lack")
    parser.add_argument("--allow-unexpected", action="append", default=[], metavar="PAT", help="checkpoint key pattern to ignore")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    import sys

    from .._dry_run import dry_run
    from .._plan.resolve import resolve_target_on_meta
    from ..errors import PlanError
    from ..sources import open_source

    target: Any = None
    if args.target:
        target, note = resolve_target_on_meta(args.target, **parse_options(args.target_option))
        if note:
            print(f"note: {note}", file=sys.stderr)
        if isinstance(target, str):
            with open_source(target) as t:
                target = dict(t.schema)
    adapter = adapter_of(args)
    try:
        report = dry_run(
            target, args.src, adapter, mesh=args.mesh, ep=args.ep, pp=args.pp, device=args.device,
            share_reads=args.share_reads, headers=args.headers, ranks_per_node=args.ranks_per_node,
            max_ranks=args.max_ranks, subtree=args.subtree, dtype=args.dtype,
            allow_missing=args.allow_missing or None, allow_unexpected=args.allow_unexpected or None,
        )
    except PlanError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(report.model_dump_json(indent=2) if args.json else report.format())
    return 0
