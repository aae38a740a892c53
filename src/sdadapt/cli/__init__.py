"""The ``sdadapt`` command line (also ``python -m sdadapt``).

Each subcommand is a module of this package (``sdadapt.cli.diff``, ...) with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Exit codes: 0 fine, 1 problems found,
2 errors (bad arguments, unreadable input, an installed package's version lacking what is
needed, and any unexpected exception: one line with the versions installed; the traceback
too with ``SDADAPT_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
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
        from .._plan.registry import spelled_for_cli

        print(f"sdadapt {args.command}: error: {spelled_for_cli(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `sdadapt inspect big.pt | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"sdadapt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, for what nothing above expected
        _unexpected(args.command, e)
        return 2


def _unexpected(command: str, e: Exception) -> None:
    """Print an exception no code path expected: the version mismatch it is, where it is one;
    else one line asking for a report. The traceback only with ``SDADAPT_DEBUG=1``."""
    from .._base.env import version_problem, versions_line

    said = version_problem(e, f"sdadapt {command}")
    if said is None:
        said = (f"unexpected {type(e).__name__}: {e} (a bug, or input sdadapt does not check yet: please report it "
                "with the output of `sdadapt env`; SDADAPT_DEBUG=1 shows the traceback)")
    print(f"sdadapt {command}: error: {said} [{versions_line()}]", file=sys.stderr)
    if os.environ.get("SDADAPT_DEBUG", "") not in ("", "0"):
        import traceback

        traceback.print_exception(e, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
