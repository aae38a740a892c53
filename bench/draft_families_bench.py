"""Time `sdadapt.draft` on the twelve transformers families of the draft tests, with its default
numerical check and with headers only (``reference=None``).

    python bench/draft_families_bench.py [--families mistral,phi] [--repeat 1]

Each family: a tiny perturbed transformers 5.x model (tests/support/draft_natives2.py: Mistral,
Helium, Granite, OLMo2, StableLM, Cohere, Phi, GPT-NeoX, Starcoder2, GLM, Mixtral, Qwen2-MoE)
written with ``save_pretrained``; the target is the tests' native torchtitan-style decoder
(Meta's interleaved rotary) on the meta device. For each draft: wall seconds (best of
``--repeat``), the candidate loads the check ran, whether the values were checked, rules left
UNCERTAIN or DECIDE, and whether the drafted adapter, loaded as it is, passes `sdadapt.verify`
against transformers. Prints a Markdown table for a report in bench/reports/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import sdadapt  # noqa: E402


def main() -> None:
    import transformers as T
    from support.draft_natives import perturb
    from support.draft_natives2 import FAMILIES, Native2, more_configs, native2_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    configs = more_configs()
    root = Path(tempfile.mkdtemp(prefix="draft-families-"))
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parent).stdout.strip()
    print(f"machine: {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, transformers "
          f"{T.__version__}, tree {tree}")
    print("| family | keys | default s | loads | values checked | uncertain + DECIDE | verify | headers only s |"
          " uncertain + DECIDE | verify |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for i, family in enumerate(args.families.split(",")):
        torch.manual_seed(100 + i)
        hf = T.AutoModelForCausalLM.from_config(configs[family], attn_implementation="eager").eval()
        perturb(hf, 100 + i)
        path = root / family
        hf.save_pretrained(path)
        cfg = native2_config(json.loads((path / "config.json").read_text()))

        def native(cfg: dict = cfg) -> torch.nn.Module:
            with torch.device("meta"):
                return Native2(cfg).eval()

        row = [family]
        for reference in ("auto", None):
            best = float("inf")
            for _ in range(args.repeat):
                start = time.perf_counter()
                d = sdadapt.draft(native(), path, reference=reference)
                best = min(best, time.perf_counter() - start)
            model = native()
            sdadapt.load(model, path, d.adapter)
            passed = sdadapt.verify(model, hf, layers=False).passed
            open_ = len(d.uncertain) + len(d.questions)
            if reference == "auto":
                loads = next((m.group(1) for s in d.summary if (m := re.search(r"(\d+) load\(s\)", s))), "-")
                row += [str(len(model.state_dict())), f"{best:.2f}", loads, "yes" if d.report.values_checked else "no",
                        str(open_), "PASS" if passed else "FAIL"]
            else:
                row += [f"{best:.2f}", str(open_), "PASS" if passed else "FAIL"]
            totals[reference is None] += best
        print("| " + " | ".join(row) + " |", flush=True)
    print(f"| total | | {totals[0]:.2f} | | | | | {totals[1]:.2f} | | |")


if __name__ == "__main__":
    main()
