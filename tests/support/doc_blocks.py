"""The fenced code blocks of README.md and docs/*.md, and a runner that executes them.

Convention (enforced by tests/project/test_doc_blocks.py): every block is one of
- ```python / ```bash that runs as written: executed by :func:`run_file` (each block in a fresh
  folder and namespace; the few blocks that continue an earlier one or need files get them
  from :data:`SETUPS`), except the Python blocks of docs/writing-adapters.md, which
  tests/draft/test_draft_families.py runs in order in one session;
- ```python / ```bash whose first line is a comment ``# fragment: <why it does not run as
  written>`` (a Hub id, your own model code, a 4-process launch...): shown, not run; the
  commands a reader runs in a clone of the repository (they install into it) say so instead,
  in words a reader needs no glossary for: ``# in a clone: <what they do>``;
- ```python whose first line is a comment ``# run by tests/<file>.py (<where>)``: one block that
  test runs in an environment of its own (docs/refit.md's live-vLLM example, in the vLLM venv);
- ```json: the adapters of docs/rules.md, read and planned by tests/project/test_docs_rules.py;
- ```text: sample output, diagrams and file layouts: not code.

In a bash block, ``sdadapt ARGS`` runs ``sdadapt.cli.main(ARGS)`` in this process and
``python ARGS`` runs a subprocess; a command must exit 0 unless its comment says ``exit status
N``. Python blocks see ``sdadapt`` imported (as the page's first block does).

    python tests/support/doc_blocks.py README.md out.json   # runs the file's blocks; each one's outcome in out.json

(tests/project/test_doc_blocks.py calls :func:`main` in a process forked from the launcher's fork
server, tests/support/dist_helper.py: a fresh process, without the cost of importing torch.)
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DOC_FILES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
FRAGMENT = re.compile(r"#\s*(fragment|in a clone):\s*\S")
RUN_BY = re.compile(r"#\s*run by (tests/\S+\.py)\b")
FENCE = re.compile(r"^(`{3,})(.*)$")
# blocks another test executes: (file, language) -> that test
EXECUTED_ELSEWHERE = {
    ("docs/writing-adapters.md", "python"): "tests/draft/test_draft_families.py::test_writing_adapters_guide_snippets_run",
    ("docs/rules.md", "json"): "tests/project/test_docs_rules.py",
}
LANGUAGES = {"python", "bash", "json", "text"}


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    heading: str  # the nearest heading above, without the #s
    code: str

    @property
    def fragment(self) -> bool:
        first = self.code.lstrip("\n").split("\n", 1)[0]
        return bool(FRAGMENT.match(first.strip()))

    @property
    def run_by(self) -> str | None:
        """The test that runs this block in an environment of its own (``# run by tests/...``)."""
        m = RUN_BY.match(self.code.lstrip("\n").split("\n", 1)[0].strip())
        return m.group(1) if m else None

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line} [{self.heading}]"

    def how(self) -> str:
        """How the suite treats this block: executed (by which test), fragment or display."""
        if self.lang == "text":
            return "display (text, not code)"
        if self.fragment:
            return "fragment: " + self.code.lstrip("\n").split("\n", 1)[0].split(":", 1)[1].strip()
        if (self.file, self.lang) in EXECUTED_ELSEWHERE:
            return "executed by " + EXECUTED_ELSEWHERE[(self.file, self.lang)]
        if self.run_by:
            return "executed by " + self.run_by
        return "executed by tests/project/test_doc_blocks.py"


def blocks(file: str) -> list[Block]:
    out: list[Block] = []
    heading = ""
    lines = (ROOT / file).read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if lines[i].startswith("#"):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        out.append(Block(file, i + 1, lang, heading, "\n".join(lines[i + 1 : j]) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in DOC_FILES for b in blocks(f)]


def runnable(file: str) -> list[Block]:
    """The blocks of ``file`` that :func:`run_file` executes."""
    return [
        b for b in blocks(file)
        if b.lang in ("python", "bash") and not b.fragment and not b.run_by and (b.file, b.lang) not in EXECUTED_ELSEWHERE
    ]


# --- what some blocks need -----------------------------------------------------------------------


def _hf_llama(folder: str, layers: int = 2) -> str:
    """A tiny HF Llama (transformers' own writer), every value drawn at random."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    hf.save_pretrained(folder)
    return folder


def _fp8_release(folder: str) -> dict[str, Any]:
    """A tiny FP8 block-scaled release (128 x 128 tiles, DeepSeek-V3's config) and a bf16 model
    for it, in the layout the page's ``my_layout_rules`` make (``model.`` stripped)."""
    import torch
    from torch import nn

    from support.checkpoints import write_safetensors

    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 192, generator=g) * 0.1).to(torch.float8_e4m3fn)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 192, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": weight,
        "model.layers.0.mlp.up_proj.weight_scale_inv": torch.rand(2, 2, generator=g) + 0.5,
        "model.norm.weight": torch.ones(192, dtype=torch.bfloat16),
    }
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    config = {"model_type": "deepseek_v3", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with torch.device("meta"):
        model = nn.Module()
        model.embed_tokens = nn.Embedding(64, 192, dtype=torch.bfloat16)
        model.layers = nn.ModuleList([nn.Module()])
        model.layers[0].mlp = nn.Module()
        model.layers[0].mlp.up_proj = nn.Linear(192, 256, bias=False, dtype=torch.bfloat16)
        model.norm = nn.Module()
        model.norm.weight = nn.Parameter(torch.empty(192, dtype=torch.bfloat16))
    import sdadapt

    return {"model": model, "my_layout_rules": [sdadapt.strip_prefix("model.")]}


def _after_quick_start(ns: dict[str, Any]) -> None:
    """docs/resume-and-export.md continues the README's Quick start (its model, loaded, and its
    adapter) with the optimizer and scheduler a training script has."""
    import torch

    (quick,) = [b for b in blocks("README.md") if b.heading == "Quick start" and b.lang == "python"]
    exec(compile(quick.code, quick.name, "exec"), ns)  # noqa: S102 - the README's own code
    ns["optimizer"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-3)
    ns["scheduler"] = torch.optim.lr_scheduler.LambdaLR(ns["optimizer"], lambda step: 1.0)


def _pipeline_stage(ns: dict[str, Any]) -> None:
    """A 4-layer HF Llama and the Meta-layout model (tests/support/reference_models.py) it loads into;
    ``layers`` are the whole model's layers, as before the split."""
    from torch import nn

    from support.reference_models import MetaLlama

    _hf_llama("hf_llama", layers=4)
    cfg = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=64, norm_eps=1e-5, rope_theta=10000.0)
    model = MetaLlama(cfg)
    ns.update(model=model, layers=model.layers, nn=nn)


def _pipeline_checkpoint(ns: dict[str, Any]) -> None:
    """The demo's checkpoint (examples/pipeline.py's writer), and examples/ beside it."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pipeline

    pipeline.write_checkpoint("pretrained.pt", pipeline.Config())
    os.symlink(ROOT / "examples", "examples")


def _megatron_checkpoint(ns: dict[str, Any]) -> None:
    """A Megatron-LM checkpoint folder holding the ``dense`` checkpoint Megatron-Core wrote
    (support.megatron_ckpt; the megatron venv is made if missing)."""
    import shutil

    from support.megatron_ckpt import megatron_checkpoints

    os.makedirs("checkpoints")
    shutil.copytree(os.path.join(megatron_checkpoints(), "dense"), os.path.join("checkpoints", "iter_0000007"))
    with open(os.path.join("checkpoints", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")


def _examples_folder(ns: dict[str, Any]) -> None:
    os.symlink(ROOT / "examples", "examples")


SETUPS: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {
    ("README.md", "The CLI"): _examples_folder,  # its first line writes pretrained.pt
    ("docs/adapters.md", "Drafting an adapter: `sdadapt draft`"): _pipeline_checkpoint,
    ("docs/adapters.md", "Adapters shipped by name"): lambda ns: ns.update(folder=_hf_llama("hf_llama_dir")),
    ("docs/resume-and-export.md", "Resume and export"): _after_quick_start,
    ("docs/pipeline.md", "Pipeline stages and expert parallel"): _pipeline_stage,
    ("docs/quantized.md", "Quantized releases: the `dequant` rules"): lambda ns: ns.update(_fp8_release("path/to/release")),
    ("docs/rules.md", "Quantized checkpoints: the dequant rules"): lambda ns: ns.update(release=_fp8_release("path/to/release")),
    ("docs/megatron.md", "Load and write back"): _megatron_checkpoint,
    ("docs/megatron.md", "From the command line"): _megatron_checkpoint,
}


# --- running ----------------------------------------------------------------------------------------


def _commands(code: str) -> list[tuple[list[str], int]]:
    """A bash block's commands (continuation lines joined), each with the exit status its
    comment states (``exit status N``), else 0."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        argv = shlex.split(line, comments=True)
        comment = line[line.index("#"):] if "#" in line else ""
        m = re.search(r"exit status (\d+)", comment)
        out.append((argv, int(m.group(1)) if m else 0))
    return out


def _run_bash(block: Block) -> None:
    from sdadapt.cli import main
    from support import load_clock

    for argv, want in _commands(block.code):
        if argv[0] == "sdadapt":
            got = main(argv[1:])
        elif argv[0] == "python":
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            got = load_clock.run([sys.executable, *argv[1:]], env=env, timeout=300, capture=False).returncode
        else:
            raise AssertionError(f"{block.name}: cannot run {argv[0]!r} here; mark the block '# fragment: ...'")
        assert got == want, f"{block.name}: `{shlex.join(argv)}` exited {got}, not {want}"


def run_block(block: Block) -> None:
    """Run ``block`` in a fresh temporary folder (the current directory meanwhile)."""
    import sdadapt

    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="sdadapt-doc-") as folder:
        os.chdir(folder)
        try:
            # the Quick start stands alone; later blocks assume its `import sdadapt`
            ns: dict[str, Any] = {} if block.heading == "Quick start" else {"sdadapt": sdadapt}
            setup = SETUPS.get((block.file, block.heading))
            if setup is not None:
                setup(ns)
            if block.lang == "python":
                # run as a script (its own __main__ module: dataclasses and pydantic resolve its
                # annotations there), named after the block so that a traceback points at it
                script = os.path.join(folder, f"{block.file.replace('/', '_')}_line{block.line}.py")
                with open(script, "w", encoding="utf-8") as f:
                    f.write(block.code)
                runpy.run_path(script, init_globals=ns, run_name="__main__")
            else:
                _run_bash(block)
        finally:
            os.chdir(here)


def run_file(file: str) -> list[dict[str, str]]:
    results = []
    for block in runnable(file):
        print(f"doc_blocks: running {block.name}", file=sys.stderr, flush=True)  # what a timeout's output ends with
        try:
            run_block(block)
            results.append({"block": block.name, "outcome": "ok"})
        except BaseException as e:  # noqa: BLE001 - each block's failure is reported, the next still runs
            results.append({"block": block.name, "outcome": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    return results


CHILD_TMPDIR = "SDADAPT_TEST_PAGE_TMPDIR"
"""Names the temporary folder of the processes a page starts (torchrun's ``torchelastic_*`` log
folders, a server's files): the test's own, removed with it. The page's process keeps the
machine's, where the checkpoints that :data:`SETUPS` make are cached between runs."""


def main(file: str, out: str) -> None:
    """Run ``file``'s blocks; each one's outcome, in order, to the JSON file ``out``."""
    children = os.environ.pop(CHILD_TMPDIR, None)
    if children:
        tempfile.gettempdir()  # this process's own, fixed before TMPDIR changes for its children
        os.makedirs(children, exist_ok=True)
        os.environ["TMPDIR"] = children
    outcome = run_file(file)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    sys.path[:0] = [str(TESTS)]
    main(sys.argv[1], sys.argv[2])
