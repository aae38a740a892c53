"""The load transaction in one process: the cost of loading into a model that holds values
(no second copy by default, a full one with ``atomic=True``) and the mark a failed in-place
load leaves (its text, the forward refusing, a later successful load clearing it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import sdadapt
from sdadapt._engine import syscalls
from sdadapt._transaction.transaction import PARTLY_LOADED, is_marked

LAYERS, DIM = 8, 2048  # 8 x 16 MiB float32 = 128 MiB
MiB = 1 << 20


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])


_PEAK = textwrap.dedent(
    """
    import sys, threading, time, torch
    from torch import nn
    import sdadapt
    load = sdadapt.load  # sdadapt imports its modules on first use: do it before measuring
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear({dim}, {dim}, bias=False) for _ in range({layers})])

    def anon():  # anonymous resident memory: allocations, not the page cache of mapped files
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    base = anon()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    load(model, sys.argv[1], atomic=sys.argv[2] == "staged")
    peak[0] = max(peak[0], anon())
    done.set()
    thread.join()
    print(peak[0] - base)
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path_factory.mktemp("txn") / "m.safetensors")
    sd = {k: v.contiguous() for k, v in _model(0).state_dict().items()}
    save_file(sd, path)
    return path, sd


def _extra_peak(path: str, mode: str) -> int:
    code = _PEAK.format(dim=DIM, layers=LAYERS)
    out = subprocess.run([sys.executable, "-c", code, path, mode], capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


def test_in_place_by_default_costs_no_second_copy(checkpoint: Any) -> None:
    """Peak extra anonymous RSS of the load itself (fresh process, model already holding values,
    sampled every millisecond): by default far below the shards' size; with atomic=True at
    least one more copy of them (the staging shards live until the commit)."""
    path, _ = checkpoint
    model_bytes = LAYERS * DIM * DIM * 4
    in_place = _extra_peak(path, "in_place")
    staged = _extra_peak(path, "staged")
    assert in_place < 32 * MiB, f"in place: +{in_place / MiB:.0f} MiB for a {model_bytes / MiB:.0f} MiB model"
    assert staged >= 0.9 * model_bytes, f"staged: +{staged / MiB:.0f} MiB (the measurement must see the copy)"


def test_failed_in_place_load_marks_until_a_load_succeeds(checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sd = checkpoint
    model = _model(1)
    x = torch.randn(2, DIM)
    calls = {"n": 0}
    real = syscalls.preadv_into

    def fail_later(*a: Any, **k: Any) -> int:  # the first reads land, then the disk fails
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(5, "Input/output error (injected)")
        return real(*a, **k)

    monkeypatch.setattr(syscalls, "preadv_into", fail_later)
    with pytest.raises(sdadapt.errors.LoadError, match="partly overwritten") as e:
        sdadapt.load(model, path)
    assert f"{LAYERS} model key(s)" in str(e.value) and path in str(e.value)
    assert is_marked(model)
    with pytest.raises(sdadapt.errors.ModelError) as fwd:
        model(x)
    assert str(fwd.value) == PARTLY_LOADED
    # staged, the same fault changes nothing (and the earlier mark stays)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls["n"] = 0
    with pytest.raises(sdadapt.errors.LoadError, match="Nothing was kept"):
        sdadapt.load(model, path, atomic=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and is_marked(model)
    monkeypatch.setattr(syscalls, "preadv_into", real)
    sdadapt.load(model, path)
    assert not is_marked(model)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    ref = _model(2)
    ref.load_state_dict(sd)
    assert torch.equal(model(x), ref(x))  # the forward runs again, on the checkpoint's values


def test_overwritten_message_always_has_a_subject() -> None:
    """The sentence after a failed in-place read names what raises, and says nothing raises
    when only a fresh optimizer (its state cleared again) was written."""
    from types import SimpleNamespace

    from sdadapt._transaction.transaction import Transaction

    txn = Transaction(None, None, "ckpt")
    model_part = SimpleNamespace(targets={"a": 0, "b": 0}, of_model=True)
    optim_part = SimpleNamespace(targets={"a": 0}, of_model=False)
    for written, was_empty, says, lacks in (
        ([optim_part], True, "its state was cleared again", "raises ModelError"),
        ([optim_part], False, "The optimizer's step raises ModelError", "model's forward"),
        ([model_part], False, "The model's forward raises ModelError", "optimizer"),
        ([model_part, optim_part], True, "2 model key(s) and 1 optimizer state tensor(s)", "optimizer's step"),
    ):
        txn.written, txn.optimizer_was_empty = written, was_empty  # type: ignore[assignment]
        msg = txn._overwritten()
        assert says in msg and lacks not in msg, msg
        assert "; raise" not in msg and " raise ModelError" not in msg, msg


def test_load_state_report_names_the_stored_keys(tmp_path: Any) -> None:
    """A load_state mismatch names, as the source of each value, the key the checkpoint stores
    (``model.0.weight``, ``optim.state.0.weight.exp_avg``), not the parameter's name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sdadapt.save_state(model, str(tmp_path / "s"), opt)
    other = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(sdadapt.errors.PlanError) as e:
        sdadapt.load_state(other, str(tmp_path / "s"), torch.optim.Adam(other.parameters()))
    rows = {m.key: m.recipe for m in e.value.report.shape_mismatch}
    assert rows["0.weight"] == "model.0.weight", rows
    assert rows["optim.state.0.weight.exp_avg"] == "optim.state.0.weight.exp_avg", rows


def _prepare_raising_on_rank_1() -> dict[str, Any]:
    import torch.distributed as dist

    from sdadapt._transaction.transaction import Transaction

    out: dict[str, Any] = {}
    for exc in (ZeroDivisionError("division by zero"), RecursionError("deep"), IsADirectoryError(21, "Is a directory", "/x/refs/main")):
        txn = Transaction(None, None, "ckpt.safetensors")

        def step(exc: BaseException = exc) -> int:
            if dist.get_rank() == 1:
                raise exc
            return 1

        try:
            txn.prepare(step)
            out[type(exc).__name__] = None
        except sdadapt.SdadaptError as e:
            out[type(exc).__name__] = (type(e).__name__, str(e))
    return out


def test_a_foreign_exception_while_preparing_is_every_ranks_error() -> None:
    """Whatever one rank raises while preparing (here only rank 1), every rank raises one of our
    errors naming the file, and none waits."""
    from support.dist_helper import run_distributed

    r0, r1 = run_distributed(_prepare_raising_on_rank_1, 2, timeout=120)
    for name in ("ZeroDivisionError", "RecursionError", "IsADirectoryError"):
        assert r0[name][0] == "RemoteRankError" and name in r0[name][1], r0
        assert r1[name][0] == "SourceError" and name in r1[name][1], r1
    assert "/x/refs/main" in r1["IsADirectoryError"][1] and "ckpt.safetensors" in r1["ZeroDivisionError"][1]
