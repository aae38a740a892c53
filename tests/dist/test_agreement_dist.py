"""The ranks' agreement on what they are about to do (``_base.agreement.agree_on``), on real gloo
processes: one launched group of 4 ranks runs every case.

- the same parts on every rank: nothing raised, one fixed-size all-reduce;
- an adapter that fuses its parts in another order on rank 3, transformers of another release
  on rank 1, a plan that makes one key otherwise on ranks 1 and 2: a ``DisagreementError`` on
  every rank, rank 0's naming the ranks and what differs;
- a rank that fails while the others agree: its own error there, the others' ``remote`` class
  (``RemoteRankError`` by default, ``RefitError`` where asked) quoting it;
- the mismatch's error class chosen by the caller (``RefitError`` for refit);
- ``gather_agreed``: every rank's object in rank order, or the failing rank's error everywhere.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from support.dist_helper import outcome, run_distributed

from sdadapt._base import agreement, distributed
from sdadapt.errors import DisagreementError, RefitError, RemoteRankError, SourceError


def _adapter(order: str) -> dict[str, Any]:
    srcs = [f"layers.{{i}}.attn.{p}_proj.weight" for p in order]
    return {"rules": [{"kind": "fuse", "srcs": srcs, "dst": "layers.{i}.attn.qkv.weight", "dim": 0}]}


def _outcome(fn: Any) -> tuple[str, str]:
    return outcome(fn)[:2]


def _cases() -> dict[str, Any]:
    rank = dist.get_rank()
    versions = {"sdadapt": "0.1.0", "torch": "2.13.0", "transformers": "5.25.0"}
    plan = {"qkv.weight": [[12, 4], "float32", "cat(q, k, v)"], "o.weight": [[4, 4], "float32", "o"]}
    out: dict[str, Any] = {}

    def same() -> None:
        agreement.agree_on({"adapter": _adapter("qkv"), "plan": plan, "versions": versions}, what="load x")

    out["same"] = _outcome(same)

    def fuse_order() -> None:
        adapter = _adapter("kqv" if rank == 3 else "qkv")
        agreement.agree_on({"adapter": adapter, "plan": plan, "versions": versions}, what="load x")

    out["fuse_order"] = _outcome(fuse_order)

    def old_transformers() -> None:
        mine = {**versions, "transformers": "5.17.0"} if rank == 1 else versions
        agreement.agree_on({"adapter": _adapter("qkv"), "plan": plan, "versions": mine}, what="load x")

    out["versions"] = _outcome(old_transformers)

    def other_plan() -> None:
        mine = {**plan, "qkv.weight": [[12, 4], "bfloat16", "cat(q, k, v)"]} if rank in (1, 2) else plan
        agreement.agree_on({"adapter": _adapter("qkv"), "plan": mine, "versions": versions}, what="load x")

    out["plan"] = _outcome(other_plan)

    def one_fails() -> None:
        error = SourceError("no such file", path="/ckpt/x") if rank == 2 else None
        agreed = {"adapter": _adapter("qkv"), "plan": plan, "versions": versions}
        parts = {"adapter": None, "plan": None, "versions": None} if rank == 2 else agreed
        agreement.agree_on(parts, error, what="load x")

    out["one_fails"] = _outcome(one_fails)

    def refit_kinds() -> None:
        error = RefitError("no plan here") if rank == 1 else None
        agreement.agree_on({"plan": plan}, error, what="refit", mismatch=RefitError, remote=RefitError, timeout=30)

    out["refit_fails"] = _outcome(refit_kinds)

    def refit_mismatch() -> None:
        agreement.agree_on({"adapter": _adapter("vqk" if rank == 2 else "qkv")}, what="refit", mismatch=RefitError, timeout=30)

    out["refit_mismatch"] = _outcome(refit_mismatch)
    # distributed.gather_agreed: agree, then gather, in one all-gather
    out["gathered"] = distributed.gather_agreed({"rank": rank}, None)
    failed = RefitError("no requests") if rank == 2 else None
    out["gather_fails"] = _outcome(lambda: distributed.gather_agreed(rank, failed, remote=RefitError))
    out["after"] = _outcome(same)  # the group is still usable
    return out


def test_agreement_four_ranks() -> None:
    results = run_distributed(_cases, 4, timeout=120)
    for r in results:
        assert r["same"] == ("ok", "") and r["after"] == ("ok", "")
        assert r["fuse_order"][0] == "DisagreementError"
        assert r["versions"][0] == "DisagreementError"
        assert r["plan"][0] == "DisagreementError"
        assert r["refit_mismatch"][0] == "RefitError"
    text = results[0]["fuse_order"][1]
    assert "rank 3's adapter (rule #0) fuses [layers.{i}.attn.k_proj.weight, layers.{i}.attn.q_proj.weight," in text, text
    assert "where rank 0's fuses [layers.{i}.attn.q_proj.weight, layers.{i}.attn.k_proj.weight," in text, text
    assert "nothing was read or written" in text
    assert "rank 1 runs transformers 5.17.0, rank 0 5.25.0" in results[0]["versions"][1], results[0]["versions"][1]
    assert "rank 1 runs" in results[3]["versions"][1]  # every rank's error keeps the whole message
    plan_text = results[0]["plan"][1]
    assert "ranks 1, 2's plan makes qkv.weight as" in plan_text and "bfloat16" in plan_text, plan_text
    # a failure: the failing rank's own error, the others' quoting it
    assert results[2]["one_fails"][0] == "SourceError"
    for r in (0, 1, 3):
        assert results[r]["one_fails"][0] == "RemoteRankError" and "rank 2 failed" in results[r]["one_fails"][1]
    assert [r["refit_fails"][0] for r in results] == ["RefitError"] * 4
    assert "rank 1 failed" in results[0]["refit_fails"][1] and "no plan here" in results[0]["refit_fails"][1]
    assert "rank 2's adapter (rule #0) fuses" in results[0]["refit_mismatch"][1]
    assert [r["gathered"] for r in results] == [[{"rank": i} for i in range(4)]] * 4
    assert [r["gather_fails"][0] for r in results] == ["RefitError"] * 4
    assert results[2]["gather_fails"][1] == "no requests"
    for r in (0, 1, 3):
        assert "rank 2 failed" in results[r]["gather_fails"][1] and "no requests" in results[r]["gather_fails"][1]


def test_agreement_bytes_are_flat() -> None:
    """One int64 flag and two int64 per part, whatever the world size."""
    assert agreement.agreement_bytes(3) == 56
    assert agreement.digest({"a": [1, 2]}) == agreement.digest({"a": [1, 2]}) != agreement.digest({"a": [2, 1]})
    assert 0 <= agreement.digest("x") < 2**62


def test_disagreement_message_names_ranks() -> None:
    every = [{"versions": {"torch": "2.13.0"}}, {"versions": {"torch": "2.13.0"}}, {"versions": {"torch": "2.11.0"}}]
    text = agreement.disagreement_message(every, ["versions"], "save")
    assert "rank 2 runs torch 2.11.0, rank 0 2.13.0" in text
    rules = [{"adapter": {"rules": [{"kind": "cast", "keys": "x", "dtype": "bfloat16"}]}},
             {"adapter": {"rules": [{"kind": "cast", "keys": "x", "dtype": "float16"}]}}]  # fmt: skip
    text = agreement.disagreement_message(rules, ["adapter"], "load")
    assert "rank 1's adapter rule #0 (cast) has dtype=float16 where rank 0's has dtype=bfloat16" in text, text
    assert RemoteRankError is not DisagreementError
