"""``sdadapt adapters [NAME]``: the shipped adapters, one line each; with NAME, its options."""

from __future__ import annotations

import argparse
import textwrap

NAME = "adapters"
HELP = "list the adapters shipped by name (--adapter NAME); with NAME, show that adapter's options"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="an adapter name: show its description and options")


def run(args: argparse.Namespace) -> int:
    from .._plan import registry as registry

    if args.name is None:
        rows = registry.list_adapters()
        if not rows:
            print("no adapters are shipped in this installation")
            return 0
        width = max(len(n) for n, _ in rows)
        for name, summary in rows:
            print(f"{name:<{width}}  {summary}")
        return 0
    mod = registry.adapter_module(args.name)
    print(f"{args.name}: {mod.SUMMARY}")
    doc = (mod.__doc__ or "").strip()
    if doc:
        print()
        print(doc)
    opts = registry.options_of(args.name)
    print()
    if not opts:
        print("options: none")
        return 0
    print("options (--option NAME=VALUE on the command line, keyword arguments of sdadapt.get_adapter):")
    width = max(len(k) for k in opts)
    for k, how in opts.items():
        print(f"  {k:<{width}}  {how}")
    reader = getattr(mod, "options_from_config", None)
    if reader is not None:
        how = " ".join((reader.__doc__ or "").strip().split("\n\n")[0].replace("``", "").split())
        text = "Options not given are read from the checkpoint folder (config files, key names)."
        print(textwrap.fill(text + (f" {how}" if how else ""), 88))
    return 0
