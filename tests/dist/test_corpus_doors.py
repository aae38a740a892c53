"""The hostile corpus of the newer doors (tests/support/corpus_doors.py) on 1 process and on 2 gloo ranks.

For every case and every rank: one of sdadapt's errors (the case's exact class; on a rank that
only hears of another rank's failure, :class:`~sdadapt.errors.RemoteRankError` quoting it), a message
naming the file (or the ``hf://`` id), within ``BOUND_S`` seconds, and the model as the load
transaction promises: a meta model stays on meta, a model holding values keeps them bit for bit
(or, after a failure while reading in place, says "partly overwritten" and is marked). CLI cases
must return 2 and print ``error: ...`` naming the file. No case may raise anything else, hang
(the launch has a timeout), or read outside the Hub cache.

One launched group runs every case (launching is slow): the 1-process run is a group of one
whose process group is torn down first, so the code takes its single-process paths.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.corpus import BOUND_S, all_meta, make_corpus_model, model_snapshot, model_unchanged, state_problems
from support.corpus_doors import build_door_cases
from support.dist_helper import group_seconds, run_distributed
from torch import nn

import sdadapt
from sdadapt._transaction.transaction import is_marked

TIMEOUT_S = 400.0


def _model(kind: str, meta: bool) -> nn.Module:
    if kind == "mx":
        with torch.device("meta" if meta else "cpu"):
            torch.manual_seed(7)
            return nn.Linear(32, 4, bias=False)
    return make_corpus_model(None, meta)


def _load(case: dict[str, Any], meta: bool) -> dict[str, Any]:
    model = _model(case["model_kind"], meta)
    snap = None if meta else model_snapshot(model)
    took = group_seconds()  # the group's own time: a loaded machine does not count
    out: dict[str, Any] = {"error": None}
    try:
        sdadapt.load(model, case["path"], case["adapter"], **case["kwargs"])
    except sdadapt.SdadaptError as e:
        # ranks other than 0 get one line pointing at rank 0's error; the whole message is kept
        out = {"error": type(e).__name__, "message": getattr(e, "full_message", str(e)), "line": str(e)}
    except BaseException as e:  # noqa: BLE001 - anything else is a failure of the test
        out = {"error": f"UNHANDLED {type(e).__name__}", "message": str(e)}
    out["seconds"] = took()
    out["unchanged"] = all_meta(model) if meta else model_unchanged(model, snap)  # type: ignore[arg-type]
    out["marked"] = is_marked(model)
    return out


def _cli(case: dict[str, Any]) -> dict[str, Any]:
    from sdadapt.cli import main

    err, out = io.StringIO(), io.StringIO()
    took = group_seconds()  # the group's own time: a loaded machine does not count
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(list(case["argv"]))
        got: dict[str, Any] = {"error": "rc" if rc == 2 else f"RC {rc}", "message": err.getvalue()}
    except BaseException as e:  # noqa: BLE001 - a traceback is a failure of the test
        got = {"error": f"UNHANDLED {type(e).__name__}", "message": str(e) + err.getvalue()}
    got["seconds"] = took()
    got["unchanged"], got["marked"] = True, False
    return got


def run_cases(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every case on this rank (every rank runs the same cases in the same order). A group of
    one is torn down first: the 1-process run."""
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
    out: dict[str, dict[str, Any]] = {}
    for c in cases:
        if c["action"] == "cli":
            out[f"{c['name']}/cli"] = _cli(c)
            continue
        for mode in ("meta", "real"):
            out[f"{c['name']}/{mode}"] = _load(c, mode == "meta")
    return out


def problems_of(case: dict[str, Any], got: dict[str, Any], rank: int, label: str) -> list[str]:
    where = f"{label} rank {rank}"
    msg = got.get("message", "")
    if case["action"] == "cli":
        ok = got["error"] == "rc" and "error:" in msg
    else:
        ok = got["error"] == case["error"] or (rank > 0 and got["error"] == "RemoteRankError")
    if not ok:
        return [f"{where}: expected {case['error'] or 'rc 2'}, got {got['error']}: {msg[:600]}"]
    out = [f"{where}: message lacks {f!r}: {msg[:600]}" for f in (case["file"], *case["fragments"]) if f not in msg]
    line = got.get("line", msg)
    if line != msg and (rank == 0 or "\n" in line or "rank 0's error" not in line):
        out.append(f"{where}: shortened, but not to one line pointing at rank 0's error: {line[:400]}")
    if got["seconds"] > BOUND_S:
        out.append(f"{where}: took {got['seconds']:.1f} s")
    return out + state_problems(got, label, where)


@pytest.fixture(scope="module")
def door_cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    root = str(tmp_path_factory.mktemp("doors"))
    return [c.payload() for c in build_door_cases(root)], root


@pytest.fixture(scope="module")
def door_results(door_cases: Any) -> dict[int, Any]:
    cases, root = door_cases
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("HF_")]}
    os.environ.update(HF_HUB_CACHE=os.path.join(root, "hub"), HF_HUB_OFFLINE="1")
    out: dict[int, Any] = {}
    try:
        for world in (1, 2):
            try:
                out[world] = run_distributed(run_cases, world, cases, timeout=TIMEOUT_S)
            except AssertionError as e:  # a hang or a crash: reported by the test
                out[world] = e
    finally:
        for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE"):
            os.environ.pop(k, None)
        os.environ.update(saved)
    return out


def test_door_corpus_is_large_and_covers_every_door(door_cases: Any) -> None:
    cases, _ = door_cases
    doors = {c["door"] for c in cases}
    assert doors == {"hub", "config", "index", "lora", "quant", "shrink", "convert", "verify"}
    assert len(cases) >= 40


@pytest.mark.parametrize("world", [1, 2])
def test_door_corpus(door_cases: Any, door_results: dict[int, Any], world: int) -> None:
    cases, root = door_cases
    results = door_results[world]
    if isinstance(results, BaseException):
        raise results
    by_name = {c["name"]: c for c in cases}
    problems: list[str] = []
    for rank, r in enumerate(results):
        assert len(r) >= len(cases)
        for label, got in r.items():
            problems += problems_of(by_name[label.rsplit("/", 1)[0]], got, rank, label)
    assert not problems, "\n".join(problems)
    assert not os.listdir(os.path.join(root, "cli_out")) if os.path.isdir(os.path.join(root, "cli_out")) else True
