"""Report and ``sdadapt.diff``: every problem named, suggestions, compressed runs of keys."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import write_hf_sharded, write_safetensors, write_torch_save
from torch import nn

import sdadapt
from sdadapt._base.keyruns import compress
from sdadapt._base.schema import TensorInfo
from sdadapt._plan.plan import build_plan
from sdadapt._plan.report import Report


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 6)


class Model(nn.Module):
    def __init__(self, n: int = 32):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.norm = nn.LayerNorm(4)


def _sd(n=32):
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Model(n).state_dict().items()}


def _meta_model(n=32):
    with torch.device("meta"):
        return Model(n)


def test_diff_names_misspelt_extra_and_wrong_shape(tmp_path):
    sd = _sd()
    sd["norm.wieght"] = sd.pop("norm.weight")  # misspelt
    sd["extra.thing"] = torch.ones(2)  # extra
    sd["tok.weight"] = torch.zeros(11, 4)  # wrong shape
    path = write_torch_save(tmp_path / "bad.pt", sd)
    report = sdadapt.diff(_meta_model(), path)
    assert not report.ok
    assert report.missing == ["norm.weight"]
    assert sorted(report.unexpected) == ["extra.thing", "norm.wieght"]
    [mm] = report.shape_mismatch
    assert (mm.key, mm.model, mm.checkpoint) == ("tok.weight", "[10, 4]", "[11, 4]")
    assert report.problems == 4
    assert report.suggestions() == {"norm.weight": "norm.wieght"}
    text = report.format()
    assert str(path) in text
    assert "norm.weight    <- did you mean norm.wieght?" in text
    assert "extra.thing" in text
    assert "tok.weight: model [10, 4], checkpoint gives [11, 4]" in text
    assert text.endswith("NOT OK: 4 problem(s)")
    assert str(report) == text


def test_diff_matching_pair_is_ok(tmp_path):
    sd = _sd(3)
    for path in (
        write_torch_save(tmp_path / "m.pt", sd),
        write_safetensors(tmp_path / "m.safetensors", sd),
        write_hf_sharded(tmp_path / "hf", sd, max_shard_bytes=200),
    ):
        report = sdadapt.diff(_meta_model(3), path)
        assert report.ok and report.problems == 0
        assert report.matched == report.target_keys == report.source_keys == len(sd)
        assert report.format().endswith("OK: checkpoint and model line up by names and shapes; values unchecked")
        assert "note: this compares names" in report.format()
    checked = report.model_copy(update={"values_checked": "logits equal to 1e-7"}).format()
    assert checked.endswith("OK: checkpoint and model line up; values checked: logits equal to 1e-7")
    assert "note: this compares names" not in checked


def test_diff_targets_and_adapter(tmp_path):
    sd = _sd(2)
    renamed = {k.replace("layers.", "model.blocks."): v for k, v in sd.items()}
    src = write_safetensors(tmp_path / "src.safetensors", renamed)
    ref = write_torch_save(tmp_path / "ref.pt", sd)
    adapter = sdadapt.Adapter([sdadapt.rename("model.blocks.{rest:*}", "layers.{rest}")], name="blocks")
    for target in (_meta_model(2), ref, {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in sd.items()}):
        assert not sdadapt.diff(target, src).ok
        report = sdadapt.diff(target, src, adapter)
        assert report.ok, report.format()
        assert report.adapter == "blocks"
    # allow lists relax it
    report = sdadapt.diff(ref, src, allow_missing=["layers.**"], allow_unexpected=["model.blocks.**"])
    assert report.ok and len(report.allowed_missing) == len(report.allowed_unexpected) == 8
    assert "allowed: 8 missing and 8 unexpected key(s)" in report.format()


def test_runs_compressed_in_report(tmp_path):
    sd = _sd()
    for i in range(32):
        sd[f"layers.{i}.attn.wieght"] = sd.pop(f"layers.{i}.attn.weight")
    report = sdadapt.diff(_meta_model(), write_torch_save(tmp_path / "m.pt", sd))
    text = report.format()
    assert "layers.{0..31}.attn.weight    <- did you mean layers.{0..31}.attn.wieght?" in text
    assert "  layers.{0..31}.attn.wieght\n" in text
    assert "missing: the model has these, the checkpoint + adapter do not give them (32):" in text
    assert "layers.5.attn" not in text


def test_report_row_limit_and_json():
    r = Report(source="s", target="t", missing=[f"k{i}.x" for i in range(30)] + [f"a{i}.b" for i in range(30)])
    text = r.format(max_rows=5)
    assert "  ... and 55 more rows (report.format(max_rows=None) lists every row)" in text
    assert "--all" not in text  # a Python message names no CLI flag
    every = r.format(max_rows=None)
    assert "more rows" not in every and all(f"k{i}.x" in every for i in range(30))
    again = Report.model_validate_json(r.model_dump_json())
    assert again == r and again.problems == 60 and not again.ok


def test_dtype_and_rule_problems_grouped():
    src = {f"l.{i}.w": TensorInfo((2,), torch.float32) for i in range(4)}
    tgt = {f"l.{i}.w": TensorInfo((2,), torch.bfloat16) for i in range(4)}
    report = build_plan(src, tgt, sdadapt.Adapter([sdadapt.drop("nothing")])).report
    text = report.format()
    assert 'dtype mismatch (4), all fixed by sdadapt.cast("**", "model") if the conversion is intended:' in text
    [row] = [line for line in text.splitlines() if line.startswith("  l.{0..3}.w: ")]
    assert "model bfloat16, checkpoint gives float32 (from l." in row
    assert "rules that matched nothing (1):\n  #0 drop(keys='nothing')" in text


def test_dtype_only_mismatch_names_the_one_rule_that_fixes_it():
    """Mixed model dtypes (float32 norms, bfloat16 weights) from a float32 checkpoint: the root
    cause comes first, as one line, and the rule it names makes the plan line up."""
    src = {f"l.{i}.{n}": TensorInfo((2,), torch.float32) for i in range(12) for n in ("w", "norm")}
    tgt = {k: TensorInfo((2,), torch.bfloat16 if k.endswith(".w") else torch.float32) for k in src}
    text = build_plan(src, tgt).report.format()
    lines = text.splitlines()
    assert lines[3] == (
        'root cause: only dtypes differ: the checkpoint gives float32 where the model holds bfloat16 (12 keys); '
        'the one rule that fixes it: sdadapt.cast("**", "model") (or sdadapt.load(..., dtype="model"))'
    )
    assert build_plan(src, tgt).report.format(cli=True).splitlines()[3].endswith("(sdadapt diff --dtype model)")
    assert sum("root cause" in line for line in lines) == 1
    fixed = build_plan(src, tgt, sdadapt.Adapter([sdadapt.cast("**", "model")]))
    assert fixed.report.ok, fixed.report.format()
    assert {k: n.dtype for k, n in fixed.recipes.items()} == {k: i.dtype for k, i in tgt.items()}
    assert sdadapt.Adapter.from_json(sdadapt.Adapter([sdadapt.cast("**", "model")]).to_json()).rules[0].dtype == "model"


def test_diff_takes_the_dtype_that_load_takes(tmp_path, capsys):
    """``sdadapt.diff(..., dtype="model")`` and ``sdadapt diff --dtype model`` check the plan
    ``sdadapt.load(..., dtype="model")`` would run: a bfloat16 checkpoint lines up with a
    float32 model."""
    from sdadapt.cli import main

    path = write_safetensors(tmp_path / "m.safetensors", {"w": torch.ones(2, 3, dtype=torch.float32)})
    model = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))})
    assert not sdadapt.diff(model, path).ok
    report = sdadapt.diff(model, path, dtype="model")
    assert report.ok and report.adapter == "dtype=model"
    assert sdadapt.plan_load(model, path, dtype="model")[1].report.ok
    target = tmp_path / "target.safetensors"
    write_safetensors(target, {"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    assert main(["diff", str(path), "--target", str(target)]) == 1
    assert main(["diff", str(path), "--target", str(target), "--dtype", "model"]) == 0
    assert "OK: checkpoint and model line up" in capsys.readouterr().out


def test_prefix_root_cause_first():
    tgt = {f"layers.{i}.w": TensorInfo((2,), torch.float32) for i in range(10)}
    src = {f"model.{k}": v for k, v in tgt.items()}
    lines = build_plan(src, tgt).report.format().splitlines()
    assert lines[3] == (
        "root cause: 10 of the checkpoint's keys carry the prefix 'model.' that the other side lacks; "
        "add sdadapt.strip_prefix('model.') to the adapter"
    )
    lines = build_plan(tgt, src).report.format().splitlines()
    assert "add sdadapt.add_prefix('model.')" in lines[3]
    assert build_plan(src, tgt, sdadapt.Adapter([sdadapt.strip_prefix("model.")])).report.ok


def test_an_ok_report_says_names_are_not_numbers():
    tgt = {"w": TensorInfo((2,), torch.float32)}
    text = build_plan(tgt, tgt).report.format()
    assert "not values" in text and "sdadapt.verify(model, reference)" in text
    assert "`sdadapt verify SRC --model M --adapter A`" in build_plan(tgt, tgt).report.format(cli=True)
    assert text.endswith("OK: checkpoint and model line up by names and shapes; values unchecked")


@pytest.mark.parametrize(
    "keys, expected",
    [
        ([f"layers.{i}.attn.wq.weight" for i in range(32)], ["layers.{0..31}.attn.wq.weight"]),
        (["l.0.w", "l.1.w", "l.3.w", "l.4.w", "l.5.w"], ["l.{0..1,3..5}.w"]),
        ([f"layers.{i}.experts.{j}.w" for i in range(2) for j in range(8)], ["layers.{0..1}.experts.{0..7}.w"]),
        (["layers.0.a", "layers.1.a", "layers.1.b"], ["layers.1.b", "layers.{0..1}.a"]),
        (["x", "x.0", "x.1.y"], ["x", "x.0", "x.1.y"]),
        (["only.7.one"], ["only.7.one"]),
        ([], []),
        # distinct keys never merge into one: leading zeros and non-ASCII digits stay as they are
        (["a.01", "a.1"], ["a.01", "a.1"]),
        (["a.007.w", "a.7.w", "a.8.w"], ["a.007.w", "a.{7..8}.w"]),
        (["x.²", "x.1"], ["x.1", "x.²"]),
        (["a.0", "a.00"], ["a.0", "a.00"]),
    ],
)
def test_compress(keys, expected):
    assert compress(keys) == expected
    assert compress(set(keys)) == expected


def test_compress_never_loses_keys():
    import itertools
    import re

    keys = [f"{a}.{b}.{c}" for a, b, c in itertools.product(["0", "1", "01", "x"], ["2", "3", "03"], ["w", "4"])]
    keys = sorted(set(keys[::2] + keys[1::5]))
    rows = compress(keys)

    def expand(row: str) -> set[str]:
        out = [""]
        for seg in re.split(r"\.(?![^{]*\})", row):  # dots outside {..}
            if seg.startswith("{") and seg.endswith("}"):
                vals = []
                for part in seg[1:-1].split(","):
                    lo, _, hi = part.partition("..")
                    vals += [str(v) for v in range(int(lo), int(hi or lo) + 1)]
            else:
                vals = [seg]
            out = [f"{o}.{v}" if o else v for o in out for v in vals]
        return set(out)

    got = [k for r in rows for k in expand(r)]
    assert sorted(got) == keys


def test_problems_say_the_note_on_values_only_once_things_line_up(tmp_path):
    """The note that a line-up proves no values comes with a report that lines up (and in
    ``sdadapt diff``); an error about names or shapes does not repeat it."""
    sd = _sd(2)
    del sd["norm.bias"]
    report = sdadapt.diff(_meta_model(2), write_torch_save(tmp_path / "m.pt", sd))
    assert not report.ok and "note: this compares names" not in report.format()
    with pytest.raises(sdadapt.errors.PlanError) as e:
        sdadapt.load(_meta_model(2), tmp_path / "m.pt")
    assert "note: this compares names" not in str(e.value)


def test_shape_only_differences_count_as_found_not_unmatched(tmp_path):
    """A model of another width: every key is found by name, none lines up; the report says so
    rather than "0 of N model keys matched" and asking whether the adapter is right."""
    src = {f"l.{i}.w": TensorInfo((8, 4), torch.float32) for i in range(3)}
    tgt = {f"l.{i}.w": TensorInfo((16, 4), torch.float32) for i in range(3)}
    report = build_plan(src, tgt).report
    assert report.matched == 0 and report.found == 3 and not report.mostly_unmatched
    text = report.format()
    assert "3 of 3 model keys found by name (3 with another shape) (3 checkpoint keys); 3 problem(s)" in text
    assert "0 of 3 model keys matched" not in text and "right adapter" not in text
    assert "l.{0..2}.w: model [16, 4], checkpoint gives [8, 4]" in text
    plain = build_plan(src, src).report.format()
    assert "3 of 3 model keys matched (3 checkpoint keys); 0 problem(s)" in plain
