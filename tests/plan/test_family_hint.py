"""A report made without an adapter points to the shipped adapter of the checkpoint's family.

A tiny transformers Llama (``save_pretrained``: its ``config.json`` says ``model_type:
"llama"``) against Meta's layout: ``diff`` without an adapter says the shipped ``llama`` adapter
fits (it plans with it to say so), the CLI prints it, ``draft`` says it, and a ``load`` that
fails to plan names it in its error. A Mixtral checkpoint against the same model names its
family's adapter without claiming that it fits; a family without a shipped adapter gets no
hint; an adapter module's ``MODEL_TYPES`` claims other families.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sdadapt
from sdadapt._plan import registry
from sdadapt.errors import PlanError

T = pytest.importorskip("transformers", reason="the test extra installs transformers")

from support.reference_models import MetaLlama  # noqa: E402

CFG = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, hidden_dim=48, norm_eps=1e-6, rope_theta=1e4)
FITS = "config.json says model_type 'llama': the shipped adapter 'llama' fits; pass adapter='llama' (command line: --adapter llama)"


def meta_llama() -> MetaLlama:
    with torch.device("meta"):
        return MetaLlama(CFG)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_hint")
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    T.LlamaForCausalLM(T.LlamaConfig(**common)).save_pretrained(root / "llama")
    T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=2)).save_pretrained(root / "mixtral")
    T.MistralForCausalLM(T.MistralConfig(**common)).save_pretrained(root / "mistral")
    return {p.name: p for p in root.iterdir()}


def test_diff_without_adapter_names_the_family_adapter(ckpts: dict[str, Path]) -> None:
    report = sdadapt.diff(meta_llama(), ckpts["llama"])
    assert not report.ok and report.suggestion == FITS
    # printed from Python it names the keyword, from the command line the flag
    assert "hint: config.json says model_type 'llama': the shipped adapter 'llama' fits; pass adapter='llama'\n" \
        in report.format() and "--adapter" not in report.format()
    assert "the shipped adapter 'llama' fits; pass --adapter llama\n" in report.format(cli=True)
    assert sdadapt.diff(meta_llama(), ckpts["llama"], "llama").ok  # what the hint says
    mixtral = sdadapt.diff(meta_llama(), ckpts["mixtral"])
    assert mixtral.suggestion is not None and "shipped adapter 'mixtral'; problems remain with it too" in mixtral.suggestion
    assert "fits" not in mixtral.suggestion
    assert sdadapt.diff(meta_llama(), ckpts["mistral"]).suggestion is None  # no shipped adapter claims it
    assert "hint:" not in sdadapt.diff(meta_llama(), ckpts["mistral"]).format()
    # an adapter was given: no hint, even where problems remain
    given = sdadapt.diff(meta_llama(), ckpts["mixtral"], "llama")
    assert not given.ok and given.suggestion is None and "hint: config.json" not in given.format()


def test_cli_diff_and_draft_print_it(ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    build = tmp_path / "build.py"
    build.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_family_hint import meta_llama\n\n\n"
        "def build():\n"
        "    return meta_llama()\n"
    )
    assert main(["diff", str(ckpts["llama"]), "--target", f"{build}:build"]) == 1
    assert "hint: config.json says model_type 'llama': the shipped adapter 'llama' fits; pass --adapter llama" \
        in capsys.readouterr().out
    d = sdadapt.draft(meta_llama(), ckpts["llama"], reference=None)
    assert f"hint: {FITS}" in d.summary, d.summary
    assert f"hint: {FITS}" in d.format()  # the draft's summary serves Python and the command line alike
    d = sdadapt.draft(meta_llama(), ckpts["llama"], "llama", reference=None)
    assert not any(s.startswith("hint:") for s in d.summary)


def test_plan_error_of_a_load_names_it(ckpts: dict[str, Path]) -> None:
    with pytest.raises(PlanError) as e:
        sdadapt.load(meta_llama(), ckpts["llama"])
    assert "hint: config.json says model_type 'llama': the shipped adapter 'llama' fits; pass adapter='llama'\n" \
        in str(e.value)
    assert e.value.report.suggestion == FITS
    sdadapt.load(meta_llama(), ckpts["llama"], "llama")  # what the hint says


def _without(folder: Path, dst: Path, drop: str) -> Path:
    """A copy of the release ``folder`` without the tensor ``drop`` (a truncated download)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    del sd[drop]
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _hf_llama(**over: int) -> torch.nn.Module:
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    with torch.device("meta"):
        return T.LlamaForCausalLM(T.LlamaConfig(**{**common, **over}))


def test_no_hint_for_a_transformers_model_that_needs_no_adapter(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The newcomer's case: a release missing one tensor, loaded into transformers' own Llama.
    The shipped ``llama`` adapter aims at another layout (1 of 21 keys): never suggested."""
    cut = _without(ckpts["llama"], tmp_path / "cut", "model.norm.weight")
    with pytest.raises(PlanError) as e:
        sdadapt.load(_hf_llama(), cut)
    assert "hint:" not in str(e.value) and e.value.report.suggestion is None
    assert "20 of 21 model keys matched" in str(e.value)
    with pytest.raises(PlanError) as e:  # another hidden size: every key found, with another shape
        sdadapt.load(_hf_llama(hidden_size=16, intermediate_size=24), ckpts["llama"])
    assert "hint:" not in str(e.value) and "found by name" in str(e.value)
    assert "hint:" not in sdadapt.diff(_hf_llama(), cut).format()


def test_a_hint_that_finds_fewer_keys_is_not_given(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A model in the checkpoint's own layout (not transformers' class) that lacks one of its
    tensors: with no adapter 20 of 21 keys line up, the family's adapter would find fewer."""
    cut = _without(ckpts["llama"], tmp_path / "cut", "model.norm.weight")
    from safetensors.torch import load_file

    names = load_file(str(ckpts["llama"] / "model.safetensors"))

    class Plain(torch.nn.Module):  # the release's own names, as a module of one's own holds them
        def __init__(self) -> None:
            super().__init__()
            for k, v in names.items():
                self.register_parameter(k.replace(".", "__"), torch.nn.Parameter(torch.empty(v.shape, device="meta")))

        def state_dict(self, *a: object, **kw: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {k.replace("__", "."): v for k, v in self.named_parameters()}

    report = sdadapt.diff(Plain(), cut)
    assert not report.ok and report.matched == 20 and report.suggestion is None, report.format()


def test_model_types_claim_other_families(ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import support.fake_adapters.tiny as tiny

    monkeypatch.setattr(registry, "PACKAGE", "support.fake_adapters")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny_family"}))
    assert registry.family_adapter(folder) is None
    monkeypatch.setattr(tiny, "MODEL_TYPES", ("tiny_family",), raising=False)
    assert registry.family_adapter(folder) == ("tiny", "tiny_family")
    assert registry.family_adapter(folder / "model.safetensors") is None  # no such file: no folder
    (folder / "config.json").write_text("{not json")
    assert registry.family_adapter(folder) is None
