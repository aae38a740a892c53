"""What the first ``sdadapt.load`` of a process pays in imports, as a user sees it.

    python bench/first_call_probe.py --preset tiny                       # CPU, gloo, world 1
    python3 bench/first_call_probe.py --preset 8b --dir /tmp/ck --device cuda   # one GPU

A child process does what a training job does before its checkpoint load: imports torch and
torch.distributed, builds a Llama-shaped model on meta and shards it with FSDP2 (world 1). Then,
timed as one: ``import sdadapt``, the adapter (a rename of HF names to torchtitan's), and
``sdadapt.load``, to the last byte on the device; then a second load in the same process (the
steady cost). The child runs twice: once under ``python -X importtime``, whose lines between
two markers are every module imported inside the timed region (summed: the import time the
first load pays, with the probe's overhead), and once plain, for the times. Prints a table: the
first load, the import time inside it, the modules that cost most, the second load.
``--preimport torch.distributed.checkpoint`` imports that before timing, as a trainer that
checkpoints has (torchtitan's does): what sdadapt itself then adds.

``-X importtime`` times what ``import`` statements import; a module imported through
``importlib.import_module`` (sdadapt's public names resolve so: ``sdadapt._load``,
``sdadapt._plan.adapter``, ...) gets no line of its own, so its own top-level code is missing from
the sum, while everything it imports is in it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/: the loadbench package
sys.path.insert(0, str(BENCH))
START, END = "@@sdadapt-first-call-start", "@@sdadapt-first-call-end"
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def child(args: argparse.Namespace) -> None:
    """Build the model, then time import + first load and a second load; JSON on stdout."""
    import datetime

    import torch
    import torch.distributed as dist
    from loadbench.models import build_model, parallelize
    from loadbench.shapes import RENAMES
    from torch.distributed.fsdp import fully_shard  # noqa: F401 - what an FSDP2 job has imported

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300),
                            device_id=dev if cuda else None)
    for name in args.preimport or []:  # what the job imported for its own needs (a trainer's checkpointing)
        importlib.import_module(name)
    before = set(sys.modules)
    model, blocks = build_model(_shape(args.preset), "titan")
    parallelize(model, blocks, "titan", "fsdp", dev.type)
    if cuda:
        torch.cuda.synchronize()
    built = set(sys.modules) - before
    sys.stderr.write(START + "\n")
    sys.stderr.flush()
    t0 = time.perf_counter()
    import sdadapt

    adapter = sdadapt.Adapter([sdadapt.rename(s, d) for s, d in RENAMES], name="llama-hf-to-titan")
    t_import = time.perf_counter()
    known = set(sys.modules)
    rep = sdadapt.load(model, args.hf, adapter)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    sys.stderr.write(END + "\n")
    sys.stderr.flush()
    inside = sorted(set(sys.modules) - known)
    model2, blocks2 = build_model(_shape(args.preset), "titan")
    parallelize(model2, blocks2, "titan", "fsdp", dev.type)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    rep2 = sdadapt.load(model2, args.hf, adapter)
    if cuda:
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    print(json.dumps({
        "first_s": t1 - t0, "import_and_adapter_s": t_import - t0, "first_load_call_s": t1 - t_import,
        "second_s": t3 - t2, "bytes": rep.bytes_read, "phases_first": rep.phase_seconds, "phases_second": rep2.phase_seconds,
        "modules_imported_by_load_call": inside, "modules_imported_building_model": len(built),
    }))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _shape(preset: str):
    from loadbench.shapes import PRESETS

    return PRESETS[preset]


def _import_lines(stderr: str) -> list[tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) for each import between the markers."""
    inside, out = False, []
    for line in stderr.splitlines():
        if START in line:
            inside = True
        elif END in line:
            break
        elif inside and (m := _LINE.search(line)):
            out.append((int(m[1]), int(m[2]), len(m[3]) // 2, m[4]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dir", default=None, help="where the checkpoint is (written there if missing)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--runs", type=int, default=2, help="plain (timed) child runs")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--preimport", action="append", metavar="MODULE",
                    help="import MODULE before timing, as the job would for its own needs (e.g. "
                         "torch.distributed.checkpoint, which torchtitan's trainer imports for its checkpointing); repeatable")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29511, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from loadbench.checkpoint import stamp, write_checkpoint
    from loadbench.shapes import PRESETS

    shape = PRESETS[args.preset]
    base = Path(args.dir or tempfile.gettempdir())
    folder = base / f"sdadapt-bench-{stamp(shape, 5.0, ['safetensors'])}"
    if not (folder / "DONE").exists():
        folder.mkdir(parents=True, exist_ok=True)
        files = write_checkpoint(folder, shape, 5.0, ["safetensors"])
        (folder / "DONE").write_text(json.dumps(files))
    hf = json.loads((folder / "DONE").read_text())["safetensors"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-X", "importtime", __file__, "--child", "--hf", hf, "--preset", args.preset, "--device", args.device]
    cmd += [f"--preimport={m}" for m in args.preimport or []]
    traced = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if traced.returncode != 0:
        sys.exit(f"child failed:\n{traced.stderr[-4000:]}")
    lines = _import_lines(traced.stderr)
    traced_res = json.loads(traced.stdout.strip().splitlines()[-1])
    plain = []
    for i in range(args.runs):
        r = subprocess.run(cmd[:1] + cmd[3:] + ["--port", str(29512 + i)], capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:
            sys.exit(f"child failed:\n{r.stderr[-4000:]}")
        plain.append(json.loads(r.stdout.strip().splitlines()[-1]))
    total_us = sum(s for s, _, _, _ in lines)
    tops = sorted(((c, n) for _, c, d, n in lines if d <= 1), reverse=True)[: args.top]
    print(f"preset {args.preset}, device {args.device}, {traced_res['bytes'] / 2**30:.3f} GiB read")
    print("| run | import sdadapt + adapter s | sdadapt.load s | first, both s | second load s |")
    print("|---|---|---|---|---|")
    for name, r in [*((f"plain {i + 1}", r) for i, r in enumerate(plain)), ("-X importtime", traced_res)]:
        print(f"| {name} | {r['import_and_adapter_s']:.3f} | {r['first_load_call_s']:.3f} | {r['first_s']:.3f} | {r['second_s']:.3f} |")
    r = traced_res
    print(f"imports inside the timed region (-X importtime, self times summed): {total_us / 1e6:.3f} s in {len(lines)} modules")
    print(f"modules first imported by the sdadapt.load call itself: {len(r['modules_imported_by_load_call'])}: "
          f"{', '.join(r['modules_imported_by_load_call'][:40])}")
    print("most costly top-level imports (cumulative s):")
    for c, n in tops:
        print(f"  {c / 1e6:.3f}  {n}")
    if args.out:
        Path(args.out).write_text(json.dumps({"plain": plain, "traced": traced_res, "import_s": total_us / 1e6,
                                              "imports": lines}, indent=1))


if __name__ == "__main__":
    main()
