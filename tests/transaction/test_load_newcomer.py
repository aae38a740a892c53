"""What a newcomer meets on a first load, checked for real (one process, then gloo ranks):

- keys the checkpoint lacks (``allow_missing``) never hold uninitialised memory: a meta model
  gives them ``init_missing=``, its ``init_weights()`` or ``reset_parameters()``, a materialised
  one keeps its values, and the report says which on one line;
- progress bars (rank 0 only, off with ``progress=False``), and a report whose seconds span the call;
- exact widenings load by default and are listed; narrowings and float <-> int stay errors;
- errors: one report on rank 0 and one line elsewhere, no internal traceback frames (all of them
  under ``SDADAPT_DEBUG=1``), closing advice that fits the problem, no CLI flags in Python messages;
- missing-key rows name the checkpoint key the adapter looked for;
- no DTensor random-op warning, no DCP single-process warning; ``save_state`` returns a report
  that still stands for the folder's path.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_safetensors
from support.dist_helper import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._load import loading as load_module

TESTS = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# models: a projection the checkpoint holds, and an ``extra`` one it lacks
# --------------------------------------------------------------------------------------
class Half(nn.Module):
    """A module whose own initialisation is 0.5 everywhere (``reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2, 4))

    def reset_parameters(self) -> None:
        self.weight.fill_(0.5)


class WithInit(nn.Module):
    """torchtitan's convention: ``init_weights()`` initialises every parameter (random ones
    included, which on a DTensor mesh is a DTensor random op)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.extra = nn.Linear(4, 2, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.proj.weight)
        self.proj.bias.fill_(7.0)
        self.extra.weight.fill_(0.25)


class Resettable(nn.Module):
    """No ``init_weights()``; the missing key's module has ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.extra = Half()


class Bare(nn.Module):
    """No ``init_weights()``, and the missing key sits on the root, which has no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.extra = nn.Parameter(torch.ones(2, 4))


def proj_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"proj.weight": torch.randn(3, 4, generator=gen).to(dtype), "proj.bias": torch.randn(3, generator=gen).to(dtype)}


def meta(cls: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return cls()


def on_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in model.parameters())


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return write_safetensors(tmp_path / "proj.safetensors", proj_state())


# --------------------------------------------------------------------------------------
# 1. allowed-missing keys get values
# --------------------------------------------------------------------------------------
def test_missing_key_gets_the_models_init_weights(ckpt: str) -> None:
    model = meta(WithInit)
    rep = sdadapt.load(model, ckpt, allow_missing=["extra.*"])
    assert torch.equal(model.extra.weight, torch.full((2, 4), 0.25))
    assert torch.equal(model.proj.weight, proj_state()["proj.weight"])  # init_weights' values overwritten
    assert rep.missing_values == "initialised by the model's init_weights()"
    [line] = [s for s in str(rep).splitlines() if s.startswith("not in the checkpoint")]
    assert line == "not in the checkpoint: 1 key(s) extra.weight: initialised by the model's init_weights()"


def test_missing_key_gets_its_modules_reset_parameters(ckpt: str) -> None:
    model = meta(Resettable)
    rep = sdadapt.load(model, ckpt, allow_missing=["extra.weight"])
    assert torch.equal(model.extra.weight, torch.full((2, 4), 0.5))
    assert torch.equal(model.proj.bias, proj_state()["proj.bias"])
    assert rep.missing_values == "initialised by reset_parameters() of their modules"
    # init_buffers= stops init_weights() from running: reset_parameters() then gives the values
    model = meta(WithInit)
    rep = sdadapt.load(model, ckpt, allow_missing=["extra.*"], init_buffers=lambda m: None)
    bound = 1 / 2  # nn.Linear's kaiming-uniform bound for 4 inputs
    assert model.extra.weight.abs().max() <= bound and model.extra.weight.abs().sum() > 0
    assert rep.missing_values == "initialised by reset_parameters() of their modules"


def test_init_missing_hook_gets_the_keys(ckpt: str) -> None:
    calls: list[list[str]] = []

    def init_missing(m: nn.Module, keys: list[str]) -> None:
        calls.append(keys)
        with torch.no_grad():
            m.extra.fill_(3.0)

    model = meta(Bare)
    rep = sdadapt.load(model, ckpt, allow_missing=["extra"], init_missing=init_missing)
    assert calls == [["extra"]] and torch.equal(model.extra, torch.full((2, 4), 3.0))
    assert rep.missing_values == "given by init_missing="


def test_missing_key_nothing_initialises_is_refused_before_any_change(ckpt: str) -> None:
    model = meta(Bare)
    with pytest.raises(sdadapt.errors.ModelError, match=r"allowed-missing key\(s\) extra would hold uninitialised memory") as e:
        sdadapt.load(model, ckpt, allow_missing=["extra"])
    assert "init_missing=fn(model, keys)" in str(e.value) and "no init_weights()" in str(e.value)
    assert on_meta(model)


def test_materialised_model_keeps_its_values(ckpt: str) -> None:
    model = Bare()
    rep = sdadapt.load(model, ckpt, allow_missing=["extra"])
    assert torch.equal(model.extra, torch.ones(2, 4))
    assert rep.missing_values == "kept the values the model holds"
    assert "not in the checkpoint: 1 key(s) extra: kept the values the model holds" in str(rep)


def test_strict_false_missing_keys_get_values_too(ckpt: str) -> None:
    model = meta(Resettable)
    rep = sdadapt.load(model, ckpt, strict=False)
    assert torch.equal(model.extra.weight, torch.full((2, 4), 0.5)) and not rep.report.ok


# --------------------------------------------------------------------------------------
# 4. progress, and the whole call's seconds
# --------------------------------------------------------------------------------------
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class CountingBar(load_module.TransferBar):
    made: list[CountingBar] = []

    def __init__(self, total: int, desc: str, **kw: Any) -> None:
        super().__init__(total, desc, **kw)
        self.total, self.done = total, 0
        CountingBar.made.append(self)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        super().update(nbytes)


def test_load_progress_on_a_terminal(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(load_module, "TransferBar", CountingBar)
    CountingBar.made.clear()
    rep = sdadapt.load(meta(Resettable), ckpt, allow_missing=["extra.*"])
    assert "sdadapt.load: 2 tensors" in term.getvalue()
    [bar] = CountingBar.made
    assert bar.on and bar.total == rep.local_bytes == bar.done  # every byte of the shards counted once
    term.truncate(0)
    sdadapt.load(meta(Resettable), ckpt, allow_missing=["extra.*"], progress=False)
    assert term.getvalue() == "" and not CountingBar.made[-1].on


def test_no_progress_off_a_terminal(ckpt: str, capsys: pytest.CaptureFixture[str]) -> None:
    sdadapt.load(meta(Resettable), ckpt, allow_missing=["extra.*"])
    assert "sdadapt.load" not in capsys.readouterr().err


def test_report_seconds_span_the_call(ckpt: str) -> None:
    import time

    start = time.perf_counter()
    rep = sdadapt.load(meta(Resettable), ckpt, allow_missing=["extra.*"])
    around = time.perf_counter() - start
    steps = sum(v for k, v in rep.phase_seconds.items() if not k.startswith("engine"))
    assert steps <= rep.seconds <= around
    assert rep.bytes_fetched == 0 and "fetched" not in str(rep)  # a local file: nothing fetched, nothing said


def test_export_and_load_state_progress(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Resettable()
    saved = sdadapt.save_state(model, tmp_path / "state")
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    sdadapt.load_state(Resettable(), saved)
    sdadapt.export(model, tmp_path / "out")
    assert "sdadapt.load_state: 3 tensors" in term.getvalue() and "sdadapt.export: 3 tensors" in term.getvalue()


# --------------------------------------------------------------------------------------
# 5. exact widenings load; the rest stays an error
# --------------------------------------------------------------------------------------
def test_bf16_release_into_float32_model_loads_exactly(tmp_path: Path) -> None:
    sd = proj_state(torch.bfloat16)
    path = write_safetensors(tmp_path / "bf16.safetensors", sd)
    model = meta(Resettable)
    rep = sdadapt.load(model, path, allow_missing=["extra.*"])
    for k, v in sd.items():
        assert model.state_dict()[k].dtype == torch.float32 and torch.equal(model.state_dict()[k], v.float()), k
    assert sorted(rep.report.widened) == ["proj.bias", "proj.weight"]
    assert "widened exactly to the model's dtype (no value changes): 2 key(s): proj.bias, proj.weight" in rep.report.format()


def test_fp8_widens_to_bfloat16_without_scales(tmp_path: Path) -> None:
    w = torch.randn(3, 4).to(torch.float8_e4m3fn)
    path = write_safetensors(tmp_path / "fp8.safetensors", {"proj.weight": w, "proj.bias": torch.zeros(3, dtype=torch.bfloat16)})
    model = Resettable().to(torch.bfloat16)
    rep = sdadapt.load(model, path, allow_missing=["extra.*"])
    assert torch.equal(model.proj.weight, w.to(torch.bfloat16)) and rep.report.widened == ["proj.weight"]


@pytest.mark.parametrize("stored, held", [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.int64, torch.float32)])
def test_narrowing_and_int_to_float_stay_errors(tmp_path: Path, stored: torch.dtype, held: torch.dtype) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {k: v.to(stored) for k, v in proj_state().items()})
    model = Resettable().to(held)
    with pytest.raises(sdadapt.errors.PlanError) as e:
        sdadapt.load(model, path, allow_missing=["extra.*"])
    assert len(e.value.report.dtype_mismatch) == 2 and not e.value.report.widened
    assert "Only dtypes differ, and these conversions lose values" in str(e.value)


# --------------------------------------------------------------------------------------
# 7 + 8. messages: advice by kind, no CLI flags, the checkpoint key looked for, tracebacks
# --------------------------------------------------------------------------------------
HF_ADAPTER = sdadapt.Adapter([
    sdadapt.rename("model.layers.{i}.q_proj.weight", "layers.{i}.wq.weight"),
    sdadapt.rename("model.norm.weight", "norm.weight"),
])


class Layers(nn.Module):
    def __init__(self, n: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"wq": nn.Linear(2, 2, bias=False)}) for _ in range(n)])
        self.norm = nn.LayerNorm(2, bias=False)


def test_missing_rows_name_the_checkpoint_key_and_advice_fits(tmp_path: Path) -> None:
    sd = {f"model.layers.{i}.q_proj.weight": torch.zeros(2, 2) for i in range(10)}  # a release cut after 10 layers
    sd["model.norm.weight"] = torch.ones(2)
    path = write_safetensors(tmp_path / "cut.safetensors", sd)
    with pytest.raises(sdadapt.errors.PlanError) as e:
        sdadapt.load(Layers(), path, HF_ADAPTER)
    text = str(e.value)
    assert "  layers.{10..11}.wq.weight (the adapter looked for model.layers.{10..11}.q_proj.weight)" in text
    assert e.value.report.looked_for["layers.10.wq.weight"] == ["model.layers.10.q_proj.weight"]
    assert text.endswith("pass allow_missing=[patterns].") and "check that it is complete" in text
    assert "Fix the adapter" not in text and "--" not in text.replace("->", "")


def test_row_limit_names_the_python_spelling() -> None:
    report = sdadapt.reports.Report(source="s", target="t", missing=[f"k{i}.x{j}" for i in range(3) for j in range(12)])
    text = report.format(max_rows=2)
    assert "(report.format(max_rows=None) lists every row)" in text and "--all" not in text
    # an error holds its report: the line names the way there
    assert "(err.report.format(max_rows=None) lists every row)" in str(sdadapt.errors.PlanError(report))


def run_user_script(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **(env or {})},
                         cwd=str(Path(__file__).resolve().parent))  # fmt: skip
    assert out.returncode == 1, out
    return out.stderr


def test_uncaught_error_shows_no_internal_frames(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"proj.weight": torch.zeros(3, 4)})
    code = f"import sdadapt, test_load_newcomer as t\nsdadapt.load(t.Resettable(), {path!r})\n"
    err = run_user_script(code)
    frames = [line for line in err.splitlines() if line.startswith('  File "')]
    assert len(frames) == 2, err  # the user's line, then the public call's one raise
    assert "_transaction/tidy.py" in frames[1] and "SDADAPT_DEBUG=1" in err
    assert "sdadapt.errors.PlanError: checkpoint does not match the model" in err
    assert "During handling" not in err and "direct cause" not in err
    debug = run_user_script(code, {"SDADAPT_DEBUG": "1"})
    assert "_transaction/transaction.py" in debug and "_load/loading.py" in debug


# --------------------------------------------------------------------------------------
# 9. loose ends
# --------------------------------------------------------------------------------------
def test_save_state_returns_a_report_that_is_the_path(tmp_path: Path) -> None:
    dst = str(tmp_path / "state")
    saved = sdadapt.save_state(Resettable(), dst, extra={"step": 3})
    assert isinstance(saved, sdadapt.reports.SaveReport)
    assert saved == dst and os.fspath(saved) == dst and saved.path == dst
    assert os.path.isfile(os.path.join(saved, ".metadata"))
    assert saved.model_keys == 3 and saved.extra == ["step"]
    assert str(saved).startswith(f"rank 0/1: saved 3 model keys, extras ['step'] to {dst}")


def test_one_process_load_state_and_save_state_do_not_warn(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        saved = sdadapt.save_state(Resettable(), tmp_path / "state", extra={"step": 1})
        sdadapt.load_state(Resettable(), saved, extra={"step": 0})
    assert not [w for w in seen if "single process" in str(w.message)], [str(w.message) for w in seen]


# --------------------------------------------------------------------------------------
# on gloo ranks: progress on rank 0 only, no DTensor random-op warning, FSDP missing keys
# --------------------------------------------------------------------------------------
WORLD = 2


def _rank_cases(folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    path = os.path.join(folder, "proj.safetensors")
    out: dict[str, Any] = {}

    def fsdp(cls: type[nn.Module]) -> nn.Module:
        model = meta(cls)
        fully_shard(model, mesh=mesh)
        return model

    # a DTensor random op outside a load warns (the control), init_weights inside one does not
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        probe = fsdp(WithInit)
        probe.to_empty(device="cpu")
        with torch.no_grad():
            probe.init_weights()
        control = [str(w.message) for w in seen if "DTensor random" in str(w.message)]
        del seen[:]
        model = fsdp(WithInit)
        term = FakeTerminal()
        stderr, sys.stderr = sys.stderr, term
        try:
            rep = sdadapt.load(model, path, allow_missing=["extra.*"])
        finally:
            sys.stderr = stderr
        out["warned_outside"] = bool(control)
        out["warned_inside"] = [str(w.message) for w in seen if "DTensor random" in str(w.message)]
    out["bar"] = "sdadapt.load: 2 tensors" in term.getvalue()
    out["missing_values"] = rep.missing_values
    extra = model.extra.weight
    out["extra_ok"] = isinstance(extra, DTensor) and torch.equal(extra.full_tensor(), torch.full((2, 4), 0.25))

    model = fsdp(Resettable)
    sdadapt.load(model, path, allow_missing=["extra.*"], progress=False)
    out["reset_ok"] = torch.equal(model.extra.weight.full_tensor(), torch.full((2, 4), 0.5))
    out["rank"] = rank
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("newcomer_ranks")
    write_safetensors(folder / "proj.safetensors", proj_state())
    return run_distributed(_rank_cases, WORLD, str(folder), timeout=180)


def test_ranks_progress_only_on_rank_0(rank_results: list[dict[str, Any]]) -> None:
    assert [r["bar"] for r in rank_results] == [True, False]


def test_ranks_no_dtensor_random_op_warning_from_load(rank_results: list[dict[str, Any]]) -> None:
    for r in rank_results:
        assert r["warned_outside"], "the control: torch warns for a DTensor random op on a CPU mesh"
        assert r["warned_inside"] == [], r


def test_ranks_missing_keys_of_sharded_model_get_values(rank_results: list[dict[str, Any]]) -> None:
    for r in rank_results:
        assert r["extra_ok"] and r["reset_ok"], r
        assert r["missing_values"] == "initialised by the model's init_weights()"


def launch_user_script(folder: Path, world: int) -> list[str]:
    """tests/support/user_plan_error.py on ``world`` processes; each rank's stderr."""
    sys.path.insert(0, str(TESTS))
    from support.user_plan_error import write_checkpoint

    path = write_checkpoint(str(folder))
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           # the package this process imported (the installed one), so that its frames are LIBRARY's
           "PYTHONPATH": os.pathsep.join([os.path.dirname(LIBRARY.rstrip(os.sep)), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    script = [sys.executable, str(TESTS / "support" / "user_plan_error.py"), str(folder / "rendezvous"), path]
    procs = [
        subprocess.Popen(script, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 1, err
        errs.append(err)
    return errs


def test_four_ranks_print_the_report_once(tmp_path: Path) -> None:
    errs = launch_user_script(tmp_path, 4)
    assert "layers.3.wk.weight (the adapter looked for model.layers.3.self_attn.k_proj.weight)" in errs[0]
    assert "check that it is complete" in errs[0]
    for rank, err in enumerate(errs[1:], 1):
        last = err.strip().splitlines()[-1]  # torch's excepthook prefixes "[rankN]: "
        # the one line names the kind of problem and the checkpoint (under tmp_path), and points at rank 0's
        assert "sdadapt.errors.PlanError: checkpoint does not match the model; nothing was loaded. " in last, err
        assert last.endswith(f"[rank {rank}, checkpoint {tmp_path / 'model.safetensors'}: "
                             "rank 0's error has the whole message; this error's .report holds the report]"), err
        assert "layers.3" not in err
    for err in errs:
        assert len(library_frames(err)) == 1 and "_transaction/tidy.py" in library_frames(err)[0], err


LIBRARY = os.path.dirname(os.path.abspath(sdadapt.__file__)) + os.sep
"""Where the installed package lives: a frame is the library's by this location, never by a path
fragment such as ``/sdadapt/`` (which a clone folder named ``sdadapt`` holds too)."""


def library_frames(err: str) -> list[str]:
    """The traceback lines of ``err`` that name a file of the installed sdadapt package."""
    return [s for s in err.splitlines() if 'File "' in s and f'File "{LIBRARY}' in s]


def test_library_frames_are_told_by_the_package_location() -> None:
    user = f'  File "{os.sep}home{os.sep}me{os.sep}sdadapt{os.sep}tests{os.sep}support{os.sep}user_plan_error.py", line 1'
    ours = f'  File "{LIBRARY}load.py", line 2'
    assert library_frames("\n".join([user, ours])) == [ours]


def test_split_checkpoint_keys_suggest_a_fuse_not_a_rename() -> None:
    """The demo's case: the model fuses q, k, v into qkv; the checkpoint stores them apart."""
    from sdadapt._plan.plan import build_plan
    from sdadapt.sources import TensorInfo

    src = {f"layers.{i}.attn.{p}_proj.weight": TensorInfo((4, 4), torch.float32) for i in range(2) for p in "qkv"}
    src.update({f"layers.{i}.mlp.weight": TensorInfo((4, 4), torch.float32) for i in range(2)})
    tgt = {f"layers.{i}.attn.qkv.weight": TensorInfo((12, 4), torch.float32) for i in range(2)}
    tgt.update({f"layers.{i}.mlp.weight": TensorInfo((4, 4), torch.float32) for i in range(2)})
    report = build_plan(src, tgt).report
    assert report.suggestions() == {}
    text = report.format()
    fuse = "a fuse of layers.{0..1}.attn.{k_proj,q_proj,v_proj}.weight? (sdadapt.fuse, not a rename)"
    assert f"layers.{{0..1}}.attn.qkv.weight    <- {fuse}" in text
    assert "did you mean" not in text
    # several model keys missing beside several checkpoint keys: renames, not a fuse
    src = {f"attn.{p}_proj.weight": TensorInfo((4, 4), torch.float32) for p in "qkvo"}
    src["mlp.weight"] = TensorInfo((4, 4), torch.float32)
    tgt = {f"attn.w{p}.weight": TensorInfo((4, 4), torch.float32) for p in "qkvo"}
    tgt["mlp.weight"] = TensorInfo((4, 4), torch.float32)
    assert "a fuse of" not in build_plan(src, tgt).report.format()
