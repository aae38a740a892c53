"""The bad-checkpoint corpus (tests/support/corpus.py) through single-process, 2- and 4-process loads.

For every case and every rank: the exact SdadaptError subclass, a message naming the file (and
the key where there is one), the load failing within BOUND_S seconds, and the model as the
load transaction promises (sdadapt._transaction.transaction): a model on meta stays (or is put back) on
meta; a model holding values keeps them bit for bit, in the same storage, when the failure is
found before writing or the load was staged (``atomic=True``, the ``/staged`` cases); a failure
after in-place writing began says "partly overwritten" and leaves the model marked (its forward
raises). Pickles that would run code leave no marker file.

On top of the static corpus, faults injected on ONE rank while reading (the others read
fine): an I/O error, a file that grows while being read, a file truncated after planning,
and a raising DCP read. Every rank must raise, within the bound, with the model unchanged;
finally the same process group loads the good checkpoint bit-exactly (it is still healthy).

Meshes: 2 ranks FSDP(2); 4 ranks FSDP(2) x TP(2) (``_StridedShard`` placements), both meta-
initialised and materialised models.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.corpus import (
    BOUND_S,
    KEY,
    all_meta,
    build_corpus,
    good_state_dict,
    make_corpus_model,
    model_snapshot,
    model_unchanged,
    state_problems,
)
from support.dist_helper import group_seconds, run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._engine import syscalls
from sdadapt._transaction.transaction import is_marked
from sdadapt.errors import LoadError, SourceError

TIMEOUT_S = 240.0


def _attempt(model: nn.Module, path: str, **kw: Any) -> dict[str, Any]:
    """Load and describe the outcome: ``unchanged`` (bit for bit, or back on meta), ``marked``
    (a failed in-place load left it partly overwritten: its forward raises ModelError)."""
    meta = all_meta(model)
    snap = None if meta else model_snapshot(model)
    took = group_seconds()  # the group's own time: a loaded machine does not count
    out: dict[str, Any] = {"error": None}
    try:
        sdadapt.load(model, path, **kw)
    except sdadapt.SdadaptError as e:
        # ranks other than 0 get one line pointing at rank 0's error; the whole message is kept
        out = {"error": type(e).__name__, "message": str(e), "full": getattr(e, "full_message", str(e))}
    except BaseException as e:  # noqa: BLE001 - anything else is a failure of the test
        out = {"error": f"UNHANDLED {type(e).__name__}", "message": str(e)}
    out["seconds"] = took()
    out["unchanged"] = all_meta(model) if meta else model_unchanged(model, snap)  # type: ignore[arg-type]
    out["marked"] = _forward_refused(model)
    return out


def _forward_refused(model: nn.Module) -> bool:
    """Whether a failed load marked the model partly overwritten (its forward then raises
    ModelError; tests/dist/test_transaction_dist.py runs that forward)."""
    return is_marked(model)


def _modes(both: bool, phase: str) -> list[str]:
    """meta: a meta-initialised model; real: one holding values (in place); staged: the same
    with atomic=True."""
    return ["meta", "real", "staged"] if (both or phase == "read") else ["meta"]


def _run_corpus(cases: list[dict[str, Any]], mesh: Any, both: bool) -> dict[str, dict[str, Any]]:
    out = {}
    for c in cases:
        for mode in _modes(both, c["phase"]):
            kw = dict(c["load_kwargs"], **({"atomic": True} if mode == "staged" else {}))
            out[f"{c['name']}/{mode}"] = _attempt(make_corpus_model(mesh, mode == "meta"), c["path"], **kw)
    return out


# --------------------------------------------------------------------------------------------
# faults on one rank, while reading
# --------------------------------------------------------------------------------------------
def _fresh(src: str, folder: str, name: str) -> str:
    dst = os.path.join(folder, name)
    if dist.get_rank() == 0:
        shutil.copy(src, dst)
    dist.barrier()
    return dst


def _one_rank_faults(good: dict[str, str], scratch: str, mesh: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tag in ("meta", "real", "staged"):
        out |= _faults_in_mode(tag, good, scratch, mesh)
    return out


def _faults_in_mode(tag: str, good: dict[str, str], scratch: str, mesh: Any) -> dict[str, dict[str, Any]]:
    """The faults on one rank for one kind of model (``meta``, ``real``: values, in place,
    ``staged``: values, atomic=True)."""
    rank = dist.get_rank()
    out: dict[str, dict[str, Any]] = {}
    real_pread = syscalls.preadv_into
    meta = tag == "meta"
    kw: dict[str, Any] = {"atomic": True} if tag == "staged" else {}

    # 1. an I/O error on rank 1 in the middle of its reads
    path = _fresh(good["st"], scratch, f"eio_{tag}.safetensors")

    def eio(*a: Any, **k: Any) -> int:
        raise OSError(5, "Input/output error (injected)")

    syscalls.preadv_into = eio if rank == 1 else real_pread
    try:
        out[f"eio_rank1/{tag}"] = _attempt(make_corpus_model(mesh, meta), path, **kw) | {"path": path}
        # the same with share_reads: rank 1's replicas must not wait for its blocks
        out[f"eio_rank1_shared/{tag}"] = _attempt(make_corpus_model(mesh, meta), path, share_reads=True, **kw) | {"path": path}
    finally:
        syscalls.preadv_into = real_pread

    # 2. the file grows (is being written) while rank 1 reads it
    path = _fresh(good["st"], scratch, f"grow_{tag}.safetensors")
    grown = []

    def grow(fd: int, mem: Any, pos: int, offset: int, nbytes: int) -> int:
        if not grown:
            with open(path, "ab") as f:
                f.write(b"\0" * 64)
            grown.append(True)
        return real_pread(fd, mem, pos, offset, nbytes)

    syscalls.preadv_into = grow if rank == 1 else real_pread
    try:
        out[f"grows_while_read/{tag}"] = _attempt(make_corpus_model(mesh, meta), path, **kw) | {"path": path}
    finally:
        syscalls.preadv_into = real_pread

    # 3. truncated by rank 1 after planning (its buffer hook runs after planning, before reading)
    path = _fresh(good["st"], scratch, f"trunc_{tag}.safetensors")

    def truncate(_model: nn.Module) -> None:
        if rank == 1:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 100)

    from sdadapt._transaction.transaction import Transaction

    real_check = Transaction.check_files

    def truncate_then_check(self: Transaction) -> None:  # a model with values has no hook: truncate here
        truncate(None)  # type: ignore[arg-type]
        real_check(self)

    Transaction.check_files = real_check if meta else truncate_then_check  # type: ignore[method-assign]
    try:
        res = _attempt(make_corpus_model(mesh, meta), path, **({"init_buffers": truncate} if meta else kw))
    finally:
        Transaction.check_files = real_check  # type: ignore[method-assign]
    out[f"truncated_after_plan/{tag}"] = res | {"path": path}

    # 4. a DCP read (through Source.read, not direct file reads) raising on rank 1
    from sdadapt.sources._dcp_dir import DCPSource

    real_read = DCPSource.read

    def bad_read(self: DCPSource, key: str, box: Any) -> torch.Tensor:
        if key == KEY:
            raise RuntimeError("injected failure reading the DCP data file")
        return real_read(self, key, box)

    real_locate = DCPSource.locate_region  # rank 1 reads through Source.read, not the raw chunks

    DCPSource.read = bad_read if rank == 1 else real_read  # type: ignore[method-assign]
    DCPSource.locate_region = (lambda self, key, box: None) if rank == 1 else real_locate  # type: ignore[method-assign]
    try:
        out[f"dcp_read_raises_rank1/{tag}"] = _attempt(make_corpus_model(mesh, meta), good["dcp"], **kw) | {"path": good["dcp"]}
    finally:
        DCPSource.read = real_read  # type: ignore[method-assign]
        DCPSource.locate_region = real_locate  # type: ignore[method-assign]
    return out


def _fail_once(model: nn.Module) -> None:
    raise RuntimeError("buffer hook fails after materialising")


def _good_load(good: dict[str, str], mesh: Any) -> dict[str, Any]:
    """After all the failures, the same group loads the good checkpoints bit-exactly."""
    sd = good_state_dict()
    out = {}
    for name in ("pt", "st", "hf", "dcp"):
        model = make_corpus_model(mesh, True)
        try:  # a failed load puts the model back on meta; the same model then loads fine
            sdadapt.load(model, good[name], check_finite=True, init_buffers=_fail_once)
        except sdadapt.errors.ModelError:
            assert all_meta(model)
        sdadapt.load(model, good[name], checksums=name in ("st",), check_finite=True)
        out[name] = all(
            torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, sd[k]) for k, v in model.state_dict().items()
        )
    return out


def dist_worker(cases: list[dict[str, Any]], good: dict[str, str], scratch: str, both: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    t0 = time.perf_counter()
    res = _run_corpus(cases, mesh, both)
    t1 = time.perf_counter()
    faults = _one_rank_faults(good, scratch, mesh)
    return {"corpus": res, "faults": faults, "good": _good_load(good, mesh), "corpus_s": t1 - t0}


# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[str, str]]:
    folder = str(tmp_path_factory.mktemp("corpus"))
    cases = build_corpus(folder)
    good = {
        "pt": os.path.join(folder, "good", "good.pt"),
        "st": os.path.join(folder, "good", "good.safetensors"),
        "hf": os.path.join(folder, "good", "hf"),
        "dcp": os.path.join(folder, "good", "dcp"),
    }
    sdadapt.write_checksums(good["st"])
    return cases, good


def _problems(case: Any, got: dict[str, Any], rank: int, label: str) -> list[str]:
    where = f"{label} rank {rank}"
    if got["error"] != case.error.__name__:
        return [f"{where}: expected {case.error.__name__}, got {got['error']}: {got.get('message', '')[:800]}"]
    full = got.get("full", got["message"])
    out = [f"{where}: message lacks {m}: {full[:800]}" for m in case.check_message(full)]
    if rank != 0 and full != got["message"] and ("\n" in got["message"] or "rank 0's error" not in got["message"]):
        out.append(f"{where}: not one line pointing at rank 0's error: {got['message'][:400]}")
    if got["seconds"] > BOUND_S:
        out.append(f"{where}: took {got['seconds']:.1f} s")
    out += state_problems(got, label, where)
    return out


def test_corpus_covers_every_kind(corpus: Any) -> None:
    cases, _ = corpus
    kinds = {c.kind for c in cases}
    assert kinds == {"torch_save", "safetensors", "hf_sharded", "dcp"}
    for kind in kinds:
        mine = [c for c in cases if c.kind == kind]
        assert any("trunc" in c.name for c in mine), kind
        assert any("flip" in c.name for c in mine), kind
    assert any(c.marker for c in cases if c.kind == "torch_save") and any(c.marker for c in cases if c.kind == "dcp")


def test_corpus_single_process(corpus: Any) -> None:
    cases, _ = corpus
    problems: list[str] = []
    for c in cases:
        for mode in _modes(True, c.phase):
            kw = dict(c.load_kwargs, **({"atomic": True} if mode == "staged" else {}))
            got = _attempt(make_corpus_model(None, mode == "meta"), c.path, **kw)
            problems += _problems(c, got, 0, f"{c.name}/{mode}")
    for c in cases:
        if c.marker:
            assert not os.path.exists(c.marker), f"{c.name}: code from the checkpoint ran"
    assert not problems, "\n".join(problems)


def test_in_place_failure_says_partly_overwritten(corpus: Any) -> None:
    """By default a model with values is written in place; a read failure then says the model
    was partly written and marks it; atomic=True keeps it bit for bit."""
    cases, _ = corpus
    case = next(c for c in cases if c.name == "st_flip_data_verify")
    model = make_corpus_model(None, False)
    with pytest.raises(LoadError, match="partly overwritten"):
        sdadapt.load(model, case.path, checksums=True)
    assert _forward_refused(model)
    model = make_corpus_model(None, False)
    snap = model_snapshot(model)
    with pytest.raises(LoadError, match="Nothing was kept"):
        sdadapt.load(model, case.path, checksums=True, atomic=True)
    assert model_unchanged(model, snap) and not _forward_refused(model)


def test_verify_accepts_good_and_checks_only_what_is_read(corpus: Any, tmp_path: Any) -> None:
    _, good = corpus
    sd = good_state_dict()
    model = make_corpus_model(None, True)
    sdadapt.load(model, good["st"], checksums=True)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    # a checksums file that does not describe this checkpoint (shape differs) is refused before reading
    import json

    other = tmp_path / "m.safetensors"
    shutil.copy(good["st"], other)
    sums = json.loads(open(good["st"] + ".sdadapt.checksums.json").read())
    sums["tensors"][KEY]["shape"] = [12, 9]
    (tmp_path / "m.safetensors.sdadapt.checksums.json").write_text(json.dumps(sums))
    model = make_corpus_model(None, False)
    snap = model_snapshot(model)
    with pytest.raises(SourceError, match="checksums file records") as e:
        sdadapt.load(model, other, checksums=True)
    assert model_unchanged(model, snap) and str(other) in str(e.value)
    assert repr(KEY) in str(e.value)


@pytest.fixture(scope="module")
def dist_results(corpus: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    cases, good = corpus
    payload = [{"name": c.name, "path": c.path, "load_kwargs": c.load_kwargs, "phase": c.phase} for c in cases]
    out: dict[int, Any] = {}
    for world in (2, 4):
        scratch = str(tmp_path_factory.mktemp(f"faults{world}"))
        try:
            out[world] = run_distributed(dist_worker, world, payload, good, scratch, world == 2, timeout=TIMEOUT_S)
        except AssertionError as e:
            out[world] = e
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_corpus_distributed(corpus: Any, dist_results: dict[int, Any], world: int) -> None:
    cases, _ = corpus
    results = dist_results[world]
    if isinstance(results, BaseException):
        raise results
    problems: list[str] = []
    by_name = {c.name: c for c in cases}
    for rank, r in enumerate(results):
        for label, got in r["corpus"].items():
            problems += _problems(by_name[label.split("/")[0]], got, rank, label)
    assert len(results[0]["corpus"]) >= len(cases)
    for c in cases:
        if c.marker:
            assert not os.path.exists(c.marker), f"{c.name}: code from the checkpoint ran"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_faults_on_one_rank(dist_results: dict[int, Any], world: int) -> None:
    results = dist_results[world]
    if isinstance(results, BaseException):
        raise results
    problems = []
    for label in results[0]["faults"]:
        kind = label.split("/")[0]
        for rank, r in enumerate(results):
            got = r["faults"][label]
            where = f"{label} rank {rank}"
            want = {"LoadError"}
            if kind == "truncated_after_plan":  # found before reading; others may only hear of it
                want = {"SourceError"} if rank == 1 or label.endswith("meta") else {"SourceError", "RemoteRankError"}
            if got["error"] not in want:
                problems.append(f"{where}: expected {want}, got {got['error']}: {got.get('message', '')[:600]}")
                continue
            msg = got["message"]
            path = os.path.join(got["path"], "__0_0.distcp") if kind.startswith("dcp") else got["path"]
            if path not in msg:
                problems.append(f"{where}: message does not name {path}: {msg[:600]}")
            names_key = repr(KEY) in msg or "key '" in msg
            if kind in ("eio_rank1", "eio_rank1_shared", "dcp_read_raises_rank1") and ("rank(s) 1" not in msg or not names_key):
                problems.append(f"{where}: message does not name rank 1 and a key: {msg[:600]}")
            if kind == "grows_while_read" and "size changed" not in msg:
                problems.append(f"{where}: {msg[:600]}")
            if got["seconds"] > BOUND_S:
                problems.append(f"{where}: took {got['seconds']:.1f} s")
            problems += state_problems(got, label, where)
    assert not problems, "\n".join(problems)
    for r in results:
        assert r["good"] == {"pt": True, "st": True, "hf": True, "dcp": True}


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_export_and_save_state_checksums_then_verify(tmp_path: Any, fmt: str) -> None:
    """export(checksums=True) / save_state(checksums=True) write the sidecar; load(checksums=True)
    accepts the output, and names the key when a data byte is then flipped."""
    sd = good_state_dict()
    src = make_corpus_model(None, False)
    src.load_state_dict(sd)
    dst = str(tmp_path / ("out.pt" if fmt == "torch" else "out"))
    sdadapt.export(src, dst, format=fmt, checksums=True)
    model = make_corpus_model(None, True)
    sdadapt.load(model, dst, checksums=True)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    # flip one data byte of KEY where the file stores it
    from sdadapt.sources import open_source

    with open_source(dst) as s:
        path = s.file_of(KEY)
        value = s.read(KEY, ((0, 12), (0, 8))).contiguous().numpy().tobytes()
    if os.path.isdir(path):  # a DCP folder: its data file
        path = os.path.join(path, next(n for n in os.listdir(path) if n.endswith(".distcp")))
    raw = bytearray(open(path, "rb").read())
    at = raw.find(value[:32])
    assert at >= 0
    raw[at + 9] ^= 0x04
    open(path, "wb").write(bytes(raw))
    model = make_corpus_model(None, False)
    snap = model_snapshot(model)
    with pytest.raises(LoadError, match="checksum mismatch") as e:
        sdadapt.load(model, dst, checksums=True, atomic=True)
    assert repr(KEY) in str(e.value) and model_unchanged(model, snap)
    if fmt == "dcp":  # save_state: the sidecar keys are the folder's full names (model.*)
        folder = str(tmp_path / "state")
        sdadapt.save_state(src, folder, torch.optim.SGD(src.parameters(), lr=0.1), checksums=True)
        model = make_corpus_model(None, True)
        sdadapt.load(model, folder, checksums=True)
        assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
