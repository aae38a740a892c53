"""Versions: ``sdadapt.env()`` / ``sdadapt env``, errors that come from a dependency's API
reported as the version problem they are, the CLI's one line for an unexpected exception, and
the fallbacks for what older transformers releases lack (checked here against the installed
transformers' own behaviour; tests/support/compat_cases.py runs the real older releases)."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import torch

import sdadapt
from sdadapt._base import env as env_mod
from sdadapt._transaction.transaction import foreign_error
from sdadapt.errors import AdapterError, SourceError, VersionError

transformers = pytest.importorskip("transformers")


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("nothing raised")


# --- sdadapt.env() and `sdadapt env` -------------------------------------------------------------
def test_env_reports_the_installed_versions() -> None:
    import pydantic

    report = sdadapt.env()
    assert report.versions["sdadapt"] == sdadapt.__version__
    assert report.versions["torch"].startswith(torch.__version__)
    assert ("CPU build" in report.versions["torch"]) == (torch.version.cuda is None)
    assert report.versions["transformers"] == transformers.__version__
    assert report.versions["pydantic"] == pydantic.__version__
    for name in ("torchtitan", "safetensors", "huggingface_hub", "compressed-tensors"):
        assert name in report.versions
    features = {f.name: f for f in report.features}
    hf = features["transformers models without an adapter (hf_adapter)"]
    assert hf.available and transformers.__version__ in hf.detail
    text = str(report)
    assert f"transformers        {transformers.__version__}" in text and "features:" in text


def test_a_missing_package_is_a_feature_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    real = env_mod.version_of
    monkeypatch.setattr(env_mod, "version_of", lambda d: None if d == "huggingface_hub" else real(d))
    report = sdadapt.env()
    assert report.versions["huggingface_hub"] is None
    hub = next(f for f in report.features if f.name.startswith("Hub ids"))
    assert not hub.available and "sdadapt[hub]" in hub.detail
    assert "(not installed)" in report.format()


def test_env_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "sdadapt" in out and "torch" in out and "features:" in out
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["transformers"] == transformers.__version__
    assert {"name", "available", "detail"} <= set(data["features"][0])


# --- errors from a dependency's API ---------------------------------------------------------------
def test_missing_attribute_of_a_transformers_module_is_a_version_error() -> None:
    import transformers.core_model_loading as cml

    e = _raised(lambda: cml.no_such_function)
    err = foreign_error(e, "ckpt", "preparing")
    assert isinstance(err, VersionError), err
    text = str(err)
    assert f"transformers {transformers.__version__}" in text and "no_such_function" in text
    assert "transformers >= 4.57" in text and "sdadapt env" in text and "malformed" not in text
    assert err.__cause__ is e


def test_an_import_from_torch_that_fails_is_a_version_error() -> None:
    def bad_import() -> None:
        from torch.distributed import no_such_name  # type: ignore[attr-defined]  # noqa: F401

    err = foreign_error(_raised(bad_import), "ckpt", "preparing")
    # the installed distribution's version: the registry's CUDA builds carry no "+cu130" there,
    # which torch.__version__ does
    assert isinstance(err, VersionError) and f"torch {torch.__version__.split('+')[0]}" in str(err)


def test_a_type_error_raised_inside_torch_is_a_version_error() -> None:
    e = _raised(lambda: torch.nn.Module().register_buffer(1, None))  # type: ignore[arg-type]
    assert env_mod.dependency_of(e) == ("torch", env_mod.version_of("torch"))
    assert isinstance(foreign_error(e, "ckpt", "preparing"), VersionError)


def test_other_foreign_errors_still_name_the_file() -> None:
    err = foreign_error(ValueError("bad header"), "ckpt.pt", "preparing")
    assert isinstance(err, SourceError) and "malformed" in str(err)
    # an AttributeError of sdadapt's own objects is no version problem
    e = _raised(lambda: types.SimpleNamespace().missing)
    assert env_mod.dependency_of(e) is None
    assert isinstance(foreign_error(e, "ckpt.pt", "preparing"), SourceError)


# --- the CLI: an unexpected exception is one line (exit 2), the traceback on request ----------------
def _failing_command(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    import sdadapt.cli.env as cmd

    def run(args: Any) -> int:
        raise exc

    monkeypatch.setattr(cmd, "run", run)


def test_cli_unexpected_exception_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    _failing_command(monkeypatch, RuntimeError("boom"))
    monkeypatch.delenv("SDADAPT_DEBUG", raising=False)
    assert main(["env"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "unexpected RuntimeError: boom" in err and f"torch {env_mod.version_of('torch')}" in err and "Traceback" not in err
    monkeypatch.setenv("SDADAPT_DEBUG", "1")
    assert main(["env"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_cli_version_problem_names_the_package(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers.core_model_loading as cml

    from sdadapt.cli import main

    _failing_command(monkeypatch, _raised(lambda: cml.apply_renamings_gone))  # type: ignore[arg-type]
    assert main(["env"]) == 2
    err = capsys.readouterr().err
    assert f"inside transformers {transformers.__version__}" in err and "version mismatch" in err, err


# --- older transformers: up-front error, and the fallbacks ------------------------------------------
def _tiny(**overrides: Any) -> Any:
    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, **overrides,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg)


def test_transformers_below_the_floor_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    real = env_mod.version_of
    monkeypatch.setattr(env_mod, "version_of", lambda d: "4.45.2" if d == "transformers" else real(d))
    with torch.device("meta"):
        model = _tiny()
    with pytest.raises(AdapterError) as info:
        sdadapt.hf_adapter(model)
    text = str(info.value)
    assert "transformers 4.45.2 is installed" in text and "transformers >= 4.57" in text
    assert "pass an adapter" in text and "pip install" in text


def test_renamings_without_apply_renamings_match_transformers() -> None:
    from transformers import conversion_mapping as cm
    from transformers import core_model_loading as cml

    from sdadapt._plan import hf_compat

    renamings = [t for t in cm.get_checkpoint_conversion_mapping("legacy") if isinstance(t, cml.WeightRenaming)]
    renamings += [t for t in cm.get_checkpoint_conversion_mapping("mixtral") if isinstance(t, cml.WeightRenaming)]
    keys = ["model.layers.0.mlp.gate_proj.weight", "enc.LayerNorm.gamma", "model.layers.1.block_sparse_moe.gate.weight",
            "conv.weight_v", "language_model.model.model.norm.weight"]
    older = types.SimpleNamespace()  # a core_model_loading without apply_renamings
    for key in keys:
        assert hf_compat.apply_renamings(older, key, renamings) == hf_compat.apply_renamings(cml, key, renamings)
    assert any(hf_compat.apply_renamings(older, k, renamings) != k for k in keys)  # some renaming did apply


def test_ties_from_shared_parameters_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdadapt._plan import hf_compat

    model, untied = _tiny(tie_word_embeddings=True), _tiny(tie_word_embeddings=False)
    expected = hf_compat.tied_weights(model)
    assert expected == {"lm_head.weight": "model.embed_tokens.weight"}
    monkeypatch.setattr(type(model), "get_expanded_tied_weights_keys", None)  # as on transformers 4.x
    assert hf_compat.tied_weights(model) == expected
    assert hf_compat.tied_weights(untied) == {}


def test_absent_capabilities_take_the_older_behaviour() -> None:
    from transformers import conversion_mapping as cm

    from sdadapt._plan import hf_compat

    class Mine(torch.nn.Module):  # a class of one's own, on a transformers with no is_custom_code
        pass

    assert not hf_compat.skips_custom_code(types.SimpleNamespace(), Mine, "llama")
    assert not hf_compat.is_prefix_change(types.SimpleNamespace(), object())
    assert not hf_compat.transposes_only_when_shapes_differ(types.SimpleNamespace(dim0=0, dim1=1))
    llama = type(_tiny())
    assert not hf_compat.skips_custom_code(cm, llama, "llama")  # transformers' own class


def test_version_of_reads_the_version_line_of_the_metadata() -> None:
    """``version_of`` gives what ``importlib.metadata.version`` gives, from the metadata file's
    headers alone; ``None`` for a distribution that is not installed."""
    from importlib import metadata

    for dist in ("torch", "pydantic", "safetensors", "transformers", "numpy"):
        assert env_mod.version_of(dist) == metadata.version(dist), dist
    assert env_mod.version_of("sdadapt-no-such-distribution") is None
