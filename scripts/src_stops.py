"""Follow ``src`` through ``sdadapt.load``, call by call: every call into sdadapt code whose
arguments hold the checkpoint path or the Source opened from it, in call order (one stop per
function, its first call), and how often the path enters each module.

By default the stops inside the sources package (what ``src`` becomes) and the engine (what reads
it) are left out: the count is the path through the operations. ``--all`` keeps them.

    .venv/bin/python scripts/src_stops.py [--all]
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import FrameType
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import sdadapt
from sdadapt.sources import Source

ROOT = os.path.dirname(sdadapt.__file__)


def follow(keep_all: bool) -> list[tuple[str, str]]:
    """The ``(module, function)`` stops of one plain load (a rename adapter, a safetensors file)."""
    path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    save_file({"layer.weight": torch.zeros(3, 4), "layer.bias": torch.zeros(3)}, path)
    model = nn.Sequential(nn.Linear(4, 3))
    adapter = sdadapt.Adapter([sdadapt.rename("layer.{p}", "0.{p}")])
    stops: list[tuple[str, str]] = []

    def holds_src(v: object) -> bool:
        return (isinstance(v, (str, os.PathLike)) and os.fspath(v) == path) or isinstance(v, Source)

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(ROOT) or code.co_name.startswith("<"):
            return
        module = os.path.relpath(code.co_filename, ROOT)
        if not keep_all and module.startswith(("sources", "_engine")):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        stop = (module, code.co_qualname)
        if stop not in stops and any(holds_src(frame.f_locals.get(n)) for n in names):
            stops.append(stop)

    sys.settrace(tracer)
    try:
        sdadapt.load(model, path, adapter)
    finally:
        sys.settrace(None)
    return stops


def main() -> None:
    stops = follow("--all" in sys.argv)
    entries: dict[str, int] = {}
    for i, (module, fn) in enumerate(stops):
        if i == 0 or stops[i - 1][0] != module:
            entries[module] = entries.get(module, 0) + 1
        print(f"{i + 1:3d} {module}:{fn}")
    more = {m: n for m, n in entries.items() if n > 2}
    print(f"{len(stops)} stops in {len(entries)} modules; modules entered more than twice: {more or 'none'}")


if __name__ == "__main__":
    main()
