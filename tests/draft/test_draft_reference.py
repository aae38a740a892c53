"""``sdadapt draft``'s numerical check by default, and the buffers of its model copy.

The checkpoint is a tiny transformers Llama (``save_pretrained``, perturbed norms); the target is
Meta's layout with its rotary table as a non-persistent buffer (``freqs_cis``), built on the meta
device as ``sdadapt draft --target`` builds it: nothing in a checkpoint gives that buffer values.
Cases: the check runs by default and says so; a copy whose buffer nothing fills is never
compared (the check stops and says what to pass); each way of filling it (``init_buffers``, the
model's ``init_weights``, a module's ``reset_parameters``, the CLI building the target again
with its parameters on meta) gives a right, numerically checked adapter; an experiment that
cannot tell candidates apart says why; the summary's config line is short, and transformers'
"Writing model shards" bar does not leak.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sdadapt
from sdadapt.errors import ModelError

T = pytest.importorskip("transformers", reason="the test extra installs transformers")

from support.reference_models import MetaLlama, precompute_freqs_cis  # noqa: E402

CFG = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, hidden_dim=48, norm_eps=1e-6, rope_theta=1e4)
TABLE = 64  # rows of the rotary table


def table() -> torch.Tensor:
    return precompute_freqs_cis(CFG["dim"] // CFG["n_heads"], TABLE, CFG["rope_theta"])


class BufLlama(MetaLlama):
    """Meta's Llama with its rotary table as a non-persistent buffer computed in ``__init__``."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.register_buffer("freqs_cis", table(), persistent=False)

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        return (self.freqs_cis[:seqlen],)


class InitLlama(BufLlama):
    """torchtitan's convention: ``init_weights()`` computes the buffers."""

    def init_weights(self) -> None:
        self.freqs_cis.copy_(table())


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", table(), persistent=False)

    def reset_parameters(self) -> None:
        self.table.copy_(table())


class ModuleRotaryLlama(MetaLlama):
    """The table in a submodule of its own that recomputes it in ``reset_parameters()``."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.rope = Rotary()

    def rotary(self, seqlen: int) -> tuple[torch.Tensor, ...]:
        return (self.rope.table[:seqlen],)


def on_meta(cls: type[nn.Module] = BufLlama) -> nn.Module:
    with torch.device("meta"):
        return cls(CFG)


def fill(model: nn.Module) -> None:
    model.freqs_cis.copy_(table())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    cfg = T.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=TABLE, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("draft_reference") / "llama"
    hf.save_pretrained(path)
    return path, hf


def checked_right(d: Any, path: Path, hf: nn.Module, cls: type[nn.Module] = BufLlama) -> None:
    """The draft was settled numerically and its adapter loads logits equal to transformers'."""
    assert d.report.ok and d.report.values_checked, d.format()
    assert not d.uncertain and not d.questions, d.format()
    assert any(line.startswith("rotary: needed") for line in d.summary), d.summary
    model = on_meta(cls)
    init = {BufLlama: fill, ModuleRotaryLlama: lambda m: m.rope.reset_parameters()}.get(cls)
    sdadapt.load(model, path, d.adapter, init_buffers=init)
    assert sdadapt.verify(model, hf).passed


def test_check_runs_by_default_and_fills_buffers_by_init_buffers(ckpt: tuple[Path, nn.Module]) -> None:
    path, hf = ckpt
    d = sdadapt.draft(on_meta(), path, init_buffers=fill)
    assert any("numerical check against LlamaForCausalLM (run by default" in s for s in d.summary), d.summary
    assert any("non-persistent buffers filled by init_buffers" in s for s in d.summary), d.summary
    checked_right(d, path, hf)


def test_model_methods_fill_the_buffers(ckpt: tuple[Path, nn.Module]) -> None:
    path, hf = ckpt
    d = sdadapt.draft(on_meta(InitLlama), path)
    assert any("filled by the model's init_weights()" in s for s in d.summary), d.summary
    checked_right(d, path, hf, InitLlama)
    d = sdadapt.draft(on_meta(ModuleRotaryLlama), path)
    assert any("filled by rope.reset_parameters()" in s for s in d.summary), d.summary
    checked_right(d, path, hf, ModuleRotaryLlama)


def test_buffers_nothing_fills_stop_the_check(ckpt: tuple[Path, nn.Module]) -> None:
    """Never compared on garbage: by default the check is left out and the summary says what to
    pass; asked for with reference="config", it is an error naming the buffer."""
    path, _ = ckpt
    d = sdadapt.draft(on_meta(), path)
    line = next(s for s in d.summary if s.startswith("values unproven: the numerical check did not run"))
    assert "freqs_cis" in line and "init_buffers=fn(model)" in line, line
    assert d.questions and not d.report.values_checked  # the rotary question stays open
    assert any(s.strip().startswith("unproven: rotary") for s in d.summary), d.summary
    with pytest.raises(ModelError, match=r"freqs_cis without values.*init_buffers=fn\(model\)"):
        sdadapt.draft(on_meta(), path, reference="config")


def test_skipped_and_not_run_say_why(ckpt: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, _ = ckpt
    d = sdadapt.draft(on_meta(), path, reference=None)
    assert "numerical check skipped (reference=None)" in d.summary, d.summary
    assert any(s.startswith("values unproven: no numerical check ran") for s in d.summary)
    schema = sdadapt.sources.open_source(str(path)).schema
    d = sdadapt.draft(dict(schema), path)
    assert any("numerical check not run: the target is not a model" in s for s in d.summary), d.summary
    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "model.safetensors").symlink_to(path / "model.safetensors")
    (alien / "config.json").write_text((path / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchForCausalLM"))
    d = sdadapt.draft(on_meta(), alien)
    assert any("has no class 'NoSuchForCausalLM'" in s for s in d.summary), d.summary


def test_an_experiment_that_cannot_tell_candidates_apart_says_why(ckpt: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """Decoder layers that pass their input through, on both sides: every candidate mapping of
    the layers' tensors gives the same outputs; the draft says so and claims nothing about them."""
    path, _ = ckpt
    cfg = {**T.AutoConfig.from_pretrained(path).to_dict(), "tie_word_embeddings": True}
    tied = T.LlamaForCausalLM(T.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    tied.save_pretrained(tmp_path / "tied")

    def passthrough(model: nn.Module, layers: Any) -> nn.Module:
        for layer in layers:
            layer.forward = lambda x, *args, **kwargs: x
        return model

    def reference(config: dict) -> nn.Module:
        from sdadapt._draft.numeric import _hf_reference

        m = _hf_reference(config)
        return passthrough(m, m.model.layers)

    target = on_meta()
    passthrough(target, target.layers)
    d = sdadapt.draft(target, tmp_path / "tied", reference=reference, init_buffers=fill)
    text = "\n".join(d.summary)
    assert "not settled by the experiment" in text and "cannot tell any candidate from another" in text, text
    assert d.uncertain, d.format()


def test_cli_default_rebuilds_buffers_short_config_line_no_bar(ckpt: tuple[Path, nn.Module], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI builds ``--target`` again with its parameters on meta for the copy's buffers; the
    config line is relative to the working directory; no "Writing model shards" bar."""
    from sdadapt.cli import main

    path, hf = ckpt
    build = tmp_path / "build.py"
    build.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_draft_reference import BufLlama, CFG\n\n\n"
        "def build():\n"
        "    return BufLlama(CFG)\n"
    )
    monkeypatch.chdir(path.parent)
    out = tmp_path / "adapter.py"
    assert main(["draft", path.name, "--target", f"{build}:build", "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert "Writing model shards" not in cap.err + cap.out
    assert f"  config: {os.path.join(path.name, 'config.json')}: model_type 'llama'" in cap.out, cap.out
    assert "filled by the model built again off the meta device" in cap.out and "values checked" in cap.out
    from sdadapt._plan.resolve import resolve_adapter

    model = on_meta()
    sdadapt.load(model, path, resolve_adapter(f"{out}:ADAPTER"), init_buffers=fill)
    assert sdadapt.verify(model, hf).passed
    # from elsewhere the config line does not print an absolute path; --reference none reads headers only
    monkeypatch.chdir(tmp_path)
    assert main(["draft", str(path), "--target", f"{build}:build", "--reference", "none", "-o", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert "  config: config.json beside the checkpoint: model_type 'llama'" in printed, printed
    assert "numerical check skipped" in printed
