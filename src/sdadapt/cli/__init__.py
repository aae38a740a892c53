"""The ``sdadapt`` command line (also ``python -m sdadapt``).

Each subcommand is a module of this package (``sdadapt.cli.diff``, ...) with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Exit codes: 0 fine, 1 problems found,
2 usage errors (bad arguments, unreadable input).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
import textwrap

from ..errors import SdadaptError


def _command_modules() -> list:
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]
    return sorted((m for m in mods if hasattr(m, "run")), key=lambda m: m.NAME)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdadapt")
    except PackageNotFoundError:  # running from a source tree
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdadapt", description="Load, compare and convert checkpoints across layouts.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"sdadapt {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        # filled here: subcommands with an epilog use RawDescriptionHelpFormatter, which does not wrap
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=textwrap.fill(mod.HELP, 79))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    logging.basicConfig(force=True,
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args))
    except SdadaptError as e:
        print(f"sdadapt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `sdadapt inspect big.pt | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
