"""Every code block of README.md and docs/*.md runs as a test or is visibly marked a fragment.

The convention and the runner are in tests/support/doc_blocks.py: a ```python or ```bash block runs as
written unless its first line is ``# fragment: <why>``; ```json blocks are docs/rules.md's
adapters (tests/project/test_docs_rules.py); ```text blocks are output and diagrams. Each file's blocks
run in one fresh process (a block's registered rule kinds, imports and working directory stay
there; forked from the launcher's fork server, which imported torch, transformers and sdadapt
once, where tests/support/dist_helper.py can fork), each block in its own temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from support import aborts, dist_helper, doc_blocks, load_clock
from support.doc_blocks import DOC_FILES, EXECUTED_ELSEWHERE, LANGUAGES, ROOT, all_blocks, blocks, runnable


def test_every_block_is_executed_or_marked():
    problems = []
    for b in all_blocks():
        if b.lang not in LANGUAGES:
            problems.append(f"{b.name}: fence language {b.lang!r}; use one of {sorted(LANGUAGES)} (```text for output)")
        elif b.lang == "json" and (b.file, "json") not in EXECUTED_ELSEWHERE:
            problems.append(f"{b.name}: a JSON block that no test reads")
        elif b.fragment and (b.file, b.lang) in EXECUTED_ELSEWHERE:
            problems.append(f"{b.name}: marked a fragment, but {EXECUTED_ELSEWHERE[(b.file, b.lang)]} runs every such block")
        elif b.run_by and (not (ROOT / b.run_by).exists() or f"{b.file}" not in (ROOT / b.run_by).read_text()):
            problems.append(f"{b.name}: marked 'run by {b.run_by}', which does not exist or does not read {b.file}")
        elif "fragment" in b.code.split("\n", 1)[0] and not b.fragment:
            problems.append(f"{b.name}: write the mark as the first line '# fragment: <why it does not run>'")
    assert problems == [], "\n".join(problems)


def test_the_blocks_run_elsewhere_are_those_the_other_tests_read():
    """tests/draft/test_draft_families.py and tests/project/test_docs_rules.py pick their blocks with their own
    pattern: they must see exactly the blocks this convention gives them."""
    for (file, lang), _ in EXECUTED_ELSEWHERE.items():
        theirs = re.findall(rf"```{lang}\n(.*?)```", (ROOT / file).read_text(), flags=re.S)
        ours = [b.code for b in blocks(file) if b.lang == lang]
        assert theirs == ours, file


def test_the_convention_sees_real_marks_and_fences():
    kinds = {b.how().split(":")[0].split(" by ")[0] for b in all_blocks()}
    assert kinds == {"executed", "fragment", "display (text, not code)"}, kinds
    # the README's Quick start and CLI run; so do most of the guide's blocks
    assert len([b for b in all_blocks() if b.file == "README.md" and not b.fragment and b.lang != "text"]) >= 2
    assert len([b for b in all_blocks() if b.file != "README.md" and not b.fragment and b.lang != "text"]) >= 10


def test_the_guide_numbers_its_pages_once():
    numbers = [int(m) for m in re.findall(r"^(\d+)\. \[", (ROOT / "docs" / "README.md").read_text(), flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_the_readmes_first_block_speaks_to_a_reader():
    """The first lines a newcomer reads: what the commands do, in no word of the project's own
    (the CI script, the docs test's fragment mark)."""
    first = next(b for b in blocks("README.md") if b.lang != "text")
    head = first.code.lstrip("\n").split("\n", 1)[0]
    assert first.fragment and head.startswith("# in a clone:"), head
    assert ".ci/run" not in first.code and "fragment" not in first.code


@pytest.mark.parametrize("file", [f for f in DOC_FILES if runnable(f)])
def test_doc_blocks_run(file, tmp_path):
    out = tmp_path / "outcome.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    # a process of the page (a torchrun rank included) that aborts prints every thread's Python stack
    env["PYTHONFAULTHANDLER"] = "1"
    env[doc_blocks.CHILD_TMPDIR] = str(tmp_path / "tmp")  # what the page's processes leave goes with tmp_path
    # the timeout counts the page's own time (support.load_clock): a loaded machine slows it, a hang fails it
    if dist_helper.forkable():  # forked from a process that imported torch, transformers and sdadapt once
        r = dist_helper.run_forked(doc_blocks.main, file, str(out), cwd=str(tmp_path), env=env, timeout=600)
    else:
        r = load_clock.run([sys.executable, str(ROOT / "tests" / "support" / "doc_blocks.py"), file, str(out)],
                           cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    # a process that aborted at teardown after its work (a torchrun rank) is written down even when the page passes
    aborts.scan(f"{file}'s blocks", r.stdout + r.stderr)
    assert r.returncode == 0 and out.exists(), r.stdout[-4000:] + r.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [x["block"] for x in results] == [b.name for b in runnable(file)]
    failed = [f"{x['block']}: {x['outcome']}" for x in results if x["outcome"] != "ok"]
    assert failed == [], "\n\n".join(failed) + "\n--- output ---\n" + r.stdout[-3000:] + r.stderr[-3000:]
