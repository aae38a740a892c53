"""The ``sdadapt`` CLI: ``diff`` and ``inspect`` (in-process through ``cli.main``), and the
spec resolution of :mod:`sdadapt._plan.resolve`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sdadapt
from sdadapt._plan.resolve import resolve_adapter, resolve_target
from sdadapt.cli import main
from sdadapt.errors import ResolveError

MODEL_PY = """
import torch
from torch import nn

import sdadapt


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)


class Net(nn.Module):
    def __init__(self, layers=3, dim=8):
        super().__init__()
        self.embed = nn.Embedding(11, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])


def build(layers=3):
    with torch.device("meta"):
        return Net(layers)


def cpu_model():
    return Net()


NOT_A_MODEL = 42

ADAPTER = sdadapt.Adapter(
    [sdadapt.fuse(["blocks.{i}.q.{p}", "blocks.{i}.k.{p}", "blocks.{i}.v.{p}"], "blocks.{i}.qkv.{p}")],
    name="split-qkv",
)


def make_adapter(prefix=""):
    if not prefix:
        return ADAPTER
    return sdadapt.Adapter([sdadapt.rename(prefix + "{x:*}", "{x}")], name="strip") + ADAPTER
"""


def _fused(layers: int = 3, dim: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"embed.weight": torch.randn(11, dim, generator=g)}
    for i in range(layers):
        sd[f"blocks.{i}.qkv.weight"] = torch.randn(3 * dim, dim, generator=g)
        sd[f"blocks.{i}.qkv.bias"] = torch.randn(3 * dim, generator=g)
        sd[f"blocks.{i}.out.weight"] = torch.randn(dim, dim, generator=g)
        sd[f"blocks.{i}.out.bias"] = torch.randn(dim, generator=g)
    return sd


def _split(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if ".qkv." in k:
            for n, part in zip("qkv", v.chunk(3), strict=True):
                out[k.replace(".qkv.", f".{n}.")] = part.clone()
        else:
            out[k] = v
    return out


@pytest.fixture()
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # a uniquely named module per test, importable as module:function from the current folder
    (tmp_path / "cli_models.py").write_text(textwrap.dedent(MODEL_PY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cli_models", raising=False)
    torch.save(_fused(), tmp_path / "good.pt")
    bad = _fused()
    bad["blocks.1.qkv.wieght"] = bad.pop("blocks.1.qkv.weight")  # misspelt
    bad["blocks.0.extra.weight"] = torch.zeros(2)  # extra
    bad["blocks.2.out.weight"] = torch.zeros(8, 9)  # wrong shape
    torch.save({"model": bad, "step": 7}, tmp_path / "bad.pt")
    torch.save(_split(_fused()), tmp_path / "split.pt")
    yield tmp_path
    sys.modules.pop("cli_models", None)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_diff_names_misspelt_extra_and_wrong_shape(work, capsys):
    for target in ("cli_models.py:build", "cli_models:build", "good.pt"):
        rc, out, _ = _run(capsys, "diff", "bad.pt", "--subtree", "model", "--target", target)
        assert rc == 1, out
        assert "blocks.1.qkv.weight" in out and "did you mean blocks.1.qkv.wieght" in out
        assert "blocks.0.extra.weight" in out
        assert "shape mismatch" in out and "blocks.2.out.weight: model [8, 8], checkpoint gives [8, 9]" in out
        assert "NOT OK: 4 problem(s)" in out  # 1 missing, 2 unexpected, 1 shape
    rc, out, _ = _run(capsys, "diff", "bad.pt", "-s", "model", "-t", "cli_models:build", "--json")
    assert rc == 1
    rep = sdadapt.reports.Report.model_validate_json(out)
    assert rep.missing == ["blocks.1.qkv.weight"]
    assert sorted(rep.unexpected) == ["blocks.0.extra.weight", "blocks.1.qkv.wieght"]
    assert [m.key for m in rep.shape_mismatch] == ["blocks.2.out.weight"]
    # without --subtree the nested dict shows as model.* keys plus a non-tensor "step"
    rc, out, _ = _run(capsys, "diff", "bad.pt", "-t", "cli_models:build")
    assert rc == 1 and "not tensors" in out and "step" in out
    # allow-lists turn the two key problems into accepted ones; the shape stays a problem
    rc, out, _ = _run(
        capsys, "diff", "bad.pt", "-s", "model", "-t", "cli_models:build",
        "--allow-missing", "blocks.1.qkv.weight", "--allow-unexpected", "blocks.*.extra.weight",
        "--allow-unexpected", "**.wieght",
    )
    assert rc == 1 and "NOT OK: 1 problem(s)" in out


def test_diff_matching_pairs_exit_0(work, capsys):
    for target in ("cli_models:build", "cli_models.py:cpu_model", str(work / "good.pt")):
        rc, out, err = _run(capsys, "diff", "good.pt", "--target", target)
        assert rc == 0, out + err
        assert "OK: checkpoint and model line up" in out
    # checkpoint vs checkpoint, the target taken from a subtree
    torch.save({"model": _fused()}, work / "nested.pt")
    rc, out, _ = _run(capsys, "diff", "good.pt", "-t", "nested.pt", "--target-subtree", "model")
    assert rc == 0, out
    rc, out, _ = _run(capsys, "diff", "good.pt", "-t", "cli_models:build", "--target-option", "layers=2")
    assert rc == 1 and "blocks.2.out.weight" in out  # the 2-layer model lacks block 2


def test_diff_with_adapters(work, capsys):
    rc, out, _ = _run(capsys, "diff", "split.pt", "-t", "cli_models:build")
    assert rc == 1  # without the adapter: fused keys missing, split keys unexpected, compressed
    assert "blocks.{0..2}.qkv.weight" in out and "blocks.{0..2}.q.weight" in out
    for spec in ("cli_models:ADAPTER", "cli_models.py:ADAPTER", "cli_models:make_adapter"):
        rc, out, err = _run(capsys, "diff", "split.pt", "-t", "cli_models:build", "--adapter", spec)
        assert rc == 0, out + err
    (work / "adapter.json").write_text(resolve_adapter("cli_models:ADAPTER").to_json())
    rc, out, _ = _run(capsys, "diff", "split.pt", "-t", "cli_models:build", "-a", "adapter.json")
    assert rc == 0 and "adapter split-qkv" in out
    torch.save({f"m.{k}": v for k, v in _split(_fused()).items()}, work / "prefixed.pt")
    rc, out, err = _run(capsys, "diff", "prefixed.pt", "-t", "cli_models:build", "-a", "cli_models:make_adapter", "-O", 'prefix="m."')
    assert rc == 0, out + err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["diff", "nope.pt", "-t", "cli_models:build"], "nope.pt: no such file"),
        (["diff", "good.pt", "-t", "missing.pt"], "missing.pt: no such file"),
        (["diff", "good.pt", "-t", "cli_models:nothere"], "no attribute 'nothere'"),
        (["diff", "good.pt", "-t", "no_such_module_xyz:build"], "no module named 'no_such_module_xyz'"),
        (["diff", "good.pt", "-t", "cli_models:NOT_A_MODEL"], "not an nn.Module"),
        (["diff", "good.pt", "-t", "gone/models.py:build"], "no such Python file"),
        (["diff", "good.pt", "-t", "cli_models:build", "-a", "cli_models:build"], "not an sdadapt.Adapter"),
        (["diff", "good.pt", "-t", "cli_models:build", "-a", "none.json"], "cannot read adapter JSON"),
        (["diff", "good.pt", "-t", "cli_models:build", "-O", "x=1"], "--adapter-option needs --adapter"),
        (["diff", "bad.pt", "-s", "nomodel", "-t", "cli_models:build"], "subtree 'nomodel'"),
        (["inspect", "nope.pt"], "nope.pt: no such file"),
        (["diff", "good.pt", "-t", "cli_models.py"], "give cli_models.py:FUNCTION naming the function that returns the model"),
        (["diff", "good.pt", "-t", "cli_models.py"], "(it defines Block, Net, build, cpu_model, make_adapter)"),
        (["diff", "good.pt", "-t", "cli_models"], "'cli_models' is a module, not a checkpoint: give cli_models:FUNCTION"),
        (["diff", "good.pt", "-t", "cli_models.build"], "did you mean cli_models:build (module:function)?"),
        (["diff", "good.pt", "-t", "cli_models:biuld"], "no attribute 'biuld'; did you mean cli_models:build?"),
        (["diff", "good.pt", "-t", "cli_models.py:cpu_modle"], "did you mean cli_models.py:cpu_model?"),
        (["diff", "Qwen/Qwen2.5-0.5B", "-t", "good.pt"], "write hf://Qwen/Qwen2.5-0.5B"),
        (["inspect", "meta-llama/Llama-3.1-8B"], "looks like a Hugging Face Hub id"),
        # added after the cases above: appended, so their node ids (argv0..argv18) stay as they were
        (["convert", "good.pt", "out.safetensors", "--to", "safetensors", "--option", "x=1"], "--adapter-option needs --adapter"),
    ],
)
def test_usage_errors_exit_2(work, capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2, out + err
    assert message in err and err.startswith(f"sdadapt {argv[0]}: error: ")


def test_diff_all_lists_every_row(work, capsys):
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]
    torch.save({f"extra.{w}": torch.zeros(1) for w in words}, work / "odd.pt")
    rc, out, _ = _run(capsys, "diff", "odd.pt", "-t", "good.pt")
    assert rc == 1 and "more rows (--all lists every row)" in out
    rc, out, _ = _run(capsys, "diff", "odd.pt", "-t", "good.pt", "--all")
    assert rc == 1 and "more rows" not in out
    assert all(f"extra.{w}" in out for w in words)


def test_bad_arguments_exit_2(work, capsys):
    with pytest.raises(SystemExit) as e:
        main(["diff", "good.pt"])  # --target is required
    assert e.value.code == 2
    assert main([]) == 2  # no command: help, exit 2


def test_broken_target_file_is_a_usage_error(work, capsys):
    (work / "broken.py").write_text("import not_a_real_dependency_xyz\n")
    rc, _, err = _run(capsys, "diff", "good.pt", "-t", "broken.py:build")
    assert rc == 2 and "ModuleNotFoundError" in err and "broken.py" in err


def test_inspect_compresses_runs(tmp_path, capsys):
    sd = {}
    for i in range(32):
        sd[f"layers.{i}.attn.wq.weight"] = torch.zeros(16, 8, dtype=torch.bfloat16)
        sd[f"layers.{i}.norm.weight"] = torch.zeros(8)
    sd["layers.7.norm.weight"] = torch.zeros(9)  # an odd one out stays its own row
    sd["tok.weight"] = torch.zeros(100, 8)
    torch.save({"model": sd, "step": 1}, tmp_path / "c.pt")
    rc, out, _ = _run(capsys, "inspect", str(tmp_path / "c.pt"), "--subtree", "model")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"TorchSaveFile {tmp_path / 'c.pt'}"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert rows["layers.{0..31}.attn.wq.weight"] == ["32", "[16,", "8]", "bfloat16", "8.0", "KiB"]
    assert rows["layers.{0..6,8..31}.norm.weight"][:4] == ["31", "[8]", "float32", "992"]
    assert rows["layers.7.norm.weight"][:3] == ["1", "[9]", "float32"]
    assert rows["tok.weight"][:3] == ["1", "[100,", "8]"]
    assert len(rows) == 4
    total = 32 * 16 * 8 * 2 + 31 * 8 * 4 + 9 * 4 + 100 * 8 * 4
    assert lines[-1].startswith("total: 65 tensors in 4 rows,")
    rc, out, _ = _run(capsys, "inspect", str(tmp_path / "c.pt"), "--json")
    data = json.loads(out)
    assert data["tensors"] == 65 and data["bytes"] == total and data["non_tensor"] == ["step"]
    assert sum(r["count"] for r in data["rows"]) == 65 and sum(r["bytes"] for r in data["rows"]) == total
    assert data["rows"][0]["keys"] == "model.layers.{0..31}.attn.wq.weight"
    assert data["dtypes"] == {"bfloat16": 32 * 16 * 8 * 2, "float32": total - 32 * 16 * 8 * 2}


def test_resolve_api(work):
    model = resolve_target("cli_models:build")
    assert isinstance(model, torch.nn.Module) and next(model.parameters()).is_meta
    assert resolve_target("good.pt") == "good.pt"
    assert resolve_target("not/there.pt") == "not/there.pt"  # opening it reports the missing file
    ad = resolve_adapter("cli_models:make_adapter", prefix="x.")
    assert ad.name == "strip+split-qkv"
    assert resolve_adapter(ad) is ad
    with pytest.raises(ResolveError, match="takes no options"):
        resolve_adapter("cli_models:ADAPTER", tp=2)
    with pytest.raises(sdadapt.SdadaptError):
        resolve_adapter("no-such-adapter-name-xyz")


def test_resolve_shipped_adapter_by_name():
    from sdadapt._plan import registry as registry

    names = [n for n, _ in registry.list_adapters()]
    assert "discussion" in names
    assert resolve_adapter("discussion") == registry.get_adapter("discussion")
    with pytest.raises(sdadapt.SdadaptError, match="no-such-adapter"):
        resolve_adapter("no-such-adapter")


def test_python_dash_m(work):
    r = subprocess.run(
        [sys.executable, "-m", "sdadapt", "diff", "good.pt", "--target", "good.pt"],
        capture_output=True, text=True, timeout=60, cwd=work,
    )
    assert r.returncode == 0, r.stderr
    assert "OK: checkpoint and model line up" in r.stdout


def _subcommands() -> list[str]:
    from sdadapt.cli import _command_modules

    return [m.NAME for m in _command_modules()]


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in _subcommands()], ["diff"], ["bogus"]])
def test_help_and_usage_errors_are_fast_and_import_no_torch(argv):
    """``--help``, every ``SUB --help`` and usage errors answer without importing torch, pydantic,
    numpy or safetensors: what keeps them fast (about 0.2 s on an idle 2-core machine). No time
    is asserted: on a loaded machine a bound either flakes or checks nothing."""
    probe = (
        "import sys\n"
        "from sdadapt.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'pydantic', 'numpy', 'safetensors') if m in sys.modules)\n"
        "print('HEAVY', heavy, 'CODE', code, file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "HEAVY [] CODE" in r.stderr, r.stderr
    expected = "CODE 0" if argv[-1] == "--help" else "CODE 2"
    assert expected in r.stderr, r.stderr
    if argv[-1] == "--help":
        assert "usage: sdadapt" in r.stdout
    r = subprocess.run([sys.executable, "-m", "sdadapt", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == (0 if argv[-1] == "--help" else 2)
