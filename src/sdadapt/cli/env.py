"""``sdadapt env``: the versions sdadapt runs with and the optional features available, for bug reports."""

from __future__ import annotations

import argparse
import json

NAME = "env"
HELP = ("print the versions of sdadapt, Python, torch (and its CUDA), transformers, torchtitan and the other packages "
        "it works with, and which optional features are available (and why not); paste it into bug reports")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print it as JSON")


def run(args: argparse.Namespace) -> int:
    from .._base.env import env

    report = env()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.format())
    return 0
