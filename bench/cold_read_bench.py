"""Cold reads of an 8B-shaped checkpoint into TP 8 x FSDP layouts, one process per simulated rank.

    python bench/cold_read_bench.py write --dir /data/ck8b          # Llama-3-8B shapes, bf16, 4 files
    python bench/cold_read_bench.py run --dir /data/ck8b --meshes tp=8 dp_shard=2,tp=8 dp_shard=4,tp=8 \\
        --ranks 0,last --modes preadv,mapping [--node] --out results.jsonl

``run`` empties the page cache before every rank (``posix_fadvise(DONTNEED)`` on every file of
the checkpoint; ``DROP_ALL=1``: ``/proc/sys/vm/drop_caches`` too, as root), then starts a
fresh process for the rank (``rank``), which opens the checkpoint, makes its shards of every
tensor as a TP x FSDP load's rank holds them (:func:`sdadapt._plan.layout.local_box`, torchtitan's
rules: ``o_proj`` / ``down_proj`` column slices, the rest rows), has the engine read them into
CPU memory, and reports:

- ``local``: the rank's shard bytes; ``bytes_read``: the engine's figure of the bytes it read;
  ``storage``: the engine's count of the
  bytes a cold cache reads for those calls (every touched page once), and ``predicted``: the dry
  run's (:func:`sdadapt._engine.predict.predict`) figure for the same rank, before any read;
- ``from_storage``: what the process made storage deliver (``read_bytes`` of ``/proc/self/io``),
  and ``pgpgin``: the machine's paged-in bytes over the read (``/proc/vmstat``; the whole
  machine, so the truth where ``read_bytes`` is not kept);
- ``host_peak``: the process's peak resident memory, against its shards plus the engine's staging
  plus the interpreter and torch (``base``: its resident memory before reading);
- ``seconds``: the engine's run.

Modes: ``preadv`` (the engine's defaults: every located region read with ``preadv``, read-ahead
off), ``mapping`` (column slices copied out of the file's mapping and the kernel's read-ahead
on: the engine before this change), ``readahead`` (``preadv`` with read-ahead on), ``runs``
(``gap_bytes=0``: a column slice's rows read one call each, only their own pages). ``--node``
also loads the 8 ranks of ``tp=8`` at once, each in its own process, cold, as a fresh node does:
the machine's paged-in bytes against the checkpoint's size.

Mode ``shared`` (``share_reads``' row sharing) needs the peers that exchange: the ranks of the
mesh's first TP group run at once, one process each, cold, joined by a gloo group. Each reads its
row shards and, beside them, its range of whole rows of every column slice, and the slices are
exchanged as the engine does (:func:`sdadapt._engine.read_and_exchange`); each reports its own
figures as above (``predicted``: the dry run's count of the same runs and rounds), ``shared``
(bytes received from its peers), ``predicted_exchange`` (the dry run's round buffers, against
``host_peak - base``) and the group's wall time (``SDADAPT_IO_SHARE_ROUND_MB`` sets the round). Mode ``group``: the same processes at
once, each reading its own slices (the baseline for ``shared``: a TP group on one node, sharing
the page cache; what ``share_rows="auto"``, the default, does there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

GiB = 1 << 30
# Llama-3-8B: hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, MLP 14336, vocab 128256
H, L, KV, F, V = 4096, 32, 1024, 14336, 128256


def schema(layers: int = L) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s.update({
            p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (KV, H), p + "self_attn.v_proj.weight": (KV, H),
            p + "self_attn.o_proj.weight": (H, H), p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })
    s["model.norm.weight"] = (H,)
    s["lm_head.weight"] = (V, H)
    return s


def write(folder: Path, files: int = 4, layers: int = L) -> None:
    """An HF sharded folder of the shapes above (``layers`` of them), bf16, bytes from a repeated
    random block."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = schema(layers)
    total = sum(math.prod(s) * 2 for s in keys.values())
    per = total // files + 1
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    groups: list[list[str]] = [[]]
    size = 0
    for k, s in keys.items():
        n = math.prod(s) * 2
        if size + n > per and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, at = {}, 0
        for k in group:
            n = math.prod(keys[k]) * 2
            header[k] = {"dtype": "BF16", "shape": list(keys[k]), "data_offsets": [at, at + n]}
            at += n
            weight_map[k] = name
        raw = json.dumps(header).encode()
        with open(folder / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            left = at
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    print(f"wrote {total / GiB:.2f} GiB in {len(groups)} files to {folder}", flush=True)


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def _pgpgin() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("pgpgin "):
                return int(line.split()[1]) * 1024
    return 0


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def config(mode: str):  # noqa: ANN201 - EngineConfig, imported late
    from sdadapt._engine import EngineConfig

    cfg = EngineConfig.from_env()
    cfg.share_rows = mode == "shared"
    if mode == "mapping":
        cfg.min_span_bytes, cfg.readahead = 64 * 1024, True
    elif mode == "readahead":
        cfg.readahead = True
    elif mode == "runs":
        cfg.gap_bytes = 0
    return cfg


def rank(folder: Path, mesh_spec: str, rank_: int, mode: str, verify: bool) -> dict:
    """One simulated rank's cold read (see the module's docstring); prints and returns its figures."""
    from sdadapt._base.regions import box_shape
    from sdadapt._engine import IOEngine, Job
    from sdadapt._engine.predict import predict
    from sdadapt._plan.layout import Mesh, default_layouts, local_box
    from sdadapt._recipes.nodes import Leaf
    from sdadapt.sources import open_source

    cfg = config(mode)
    mesh = Mesh.parse(mesh_spec)
    coord = mesh.coordinate(rank_)
    with open_source(str(folder)) as src:
        layouts = default_layouts(src.schema, mesh)
        boxes = {}
        for key, info in src.schema.items():
            box = local_box(info, mesh, layouts[key], coord)
            if box is not None and math.prod(box_shape(box)):
                boxes[key] = (info, box)
        meta = [Job(k, Leaf(k, i.shape, i.dtype), b, torch.empty(box_shape(b), dtype=i.dtype, device="meta"))
                for k, (i, b) in boxes.items()]
        fig = predict(src, meta, cfg, torch.device("cpu"))
        jobs = [Job(k, Leaf(k, i.shape, i.dtype), b, torch.empty(box_shape(b), dtype=i.dtype)) for k, (i, b) in boxes.items()]
        local = sum(j.dest.numel() * j.dest.element_size() for j in jobs)
        for j in jobs:  # the shards' pages made resident before the clock starts, as a materialised model's are
            j.dest.view(-1).view(torch.uint8)[:: 4096] = 0
        base = _status("VmRSS")
        io0, pg0, t0 = _io(), _pgpgin(), time.perf_counter()
        st = IOEngine(src, cfg).run(jobs)
        seconds = time.perf_counter() - t0
        io1, pg1 = _io(), _pgpgin()
        exact = None
        if verify:
            # bit for bit (random bytes hold NaNs, which torch.equal calls unequal)
            exact = all(torch.equal(j.dest.view(torch.int16), src.read(j.key, j.box).view(torch.int16)) for j in jobs)
    out = {
        "mesh": mesh_spec, "rank": rank_, "mode": mode, "local": local, "bytes_read": st.bytes_read,
        "storage": st.storage_bytes, "predicted": fig.storage_bytes,
        "predicted_read": fig.bytes_read, "dry_run_host": local + fig.staging_touched + fig.mapped_span,
        "from_storage": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
        "pgpgin": pg1 - pg0, "host_peak": _status("VmHWM"), "base": base, "rss_file": _status("RssFile"),
        "staging": st.staging_bytes, "syscalls": st.syscalls, "threads": st.threads, "seconds": round(seconds, 3),
        "exact": exact,
    }
    print(json.dumps(out), flush=True)
    return out


def member(folder: Path, mesh_spec: str, rank_: int, port: int, verify: bool, mode: str = "shared") -> dict:
    """One rank of the mesh's first TP group, sharing rows with its peers (mode ``shared``), or
    reading its own slices beside them (mode ``group``)."""
    import torch.distributed as dist

    from sdadapt._base.regions import box_shape
    from sdadapt._engine import (
        IOEngine,
        Job,
        RowShare,
        read_and_exchange,
        rounds_memory,
        row_cut,
        row_read_jobs,
        row_received,
        row_rounds,
        rows_config,
    )
    from sdadapt._engine.predict import predict
    from sdadapt._plan.layout import Mesh, default_layouts, group_coordinate, local_box
    from sdadapt._recipes.nodes import Leaf
    from sdadapt.sources import open_source

    cfg = config("preadv")
    mesh = Mesh.parse(mesh_spec)
    coord = mesh.coordinate(rank_)
    tp = mesh.size_of("tp")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_ % tp, world_size=tp)
    with open_source(str(folder)) as src:
        layouts = default_layouts(src.schema, mesh)
        plain: list[Job] = []
        rows: list[RowShare] = []
        for key, info in src.schema.items():
            lay = layouts[key]
            box = local_box(info, mesh, lay, coord)
            if box is None or not math.prod(box_shape(box)):
                continue
            job = Job(key, Leaf(key, info.shape, info.dtype), box, torch.empty(box_shape(box), dtype=info.dtype))
            shape, at = group_coordinate(mesh, lay, coord)
            cut = row_cut(box, tuple(info.shape), shape, at, tuple(p for _, p in lay.groups), info.dtype.itemsize, cfg.gap_bytes)
            if cut is None or mode != "shared":
                plain.append(job)
            else:
                rows.append(RowShare(dist.group.WORLD, job, cut))
        rounds = row_rounds(rows, cfg.share_round_bytes)
        meta = [Job(j.key, j.node, j.box, torch.empty(j.dest.shape, dtype=j.dest.dtype, device="meta")) for j in plain]
        fig = predict(src, meta, cfg, torch.device("cpu"))
        for units in rounds:
            fig.add(predict(src, row_read_jobs(units), rows_config(cfg), torch.device("cpu")))
        jobs = plain + [r.job for r in rows]
        local = sum(j.dest.numel() * j.dest.element_size() for j in jobs)
        for j in jobs:  # the shards' pages made resident before the clock starts
            j.dest.view(-1).view(torch.uint8)[:: 4096] = 0
        base = _status("VmRSS")
        dist.barrier()
        io0, t0 = _io(), time.perf_counter()
        engine, rows_engine = IOEngine(src, cfg), IOEngine(src, rows_config(cfg))
        own, error, got = read_and_exchange(lambda: engine.run(plain), rows, rows_engine.run, cfg.share_round_bytes)
        if own or error:
            raise own or error  # type: ignore[misc]
        engine.stats.add(rows_engine.stats)
        seconds = time.perf_counter() - t0
        io1 = _io()
        dist.barrier()
        wall = time.perf_counter() - t0
        exact = None
        if verify:
            exact = all(torch.equal(j.dest.view(torch.int16), src.read(j.key, j.box).view(torch.int16)) for j in jobs)
    st = engine.stats
    out = {
        "mesh": mesh_spec, "rank": rank_, "mode": mode, "local": local, "bytes_read": st.bytes_read,
        "storage": st.storage_bytes, "predicted": fig.storage_bytes, "predicted_read": fig.bytes_read,
        "shared": got, "predicted_shared": sum(row_received(r) for r in rounds), "rounds": len(rounds),
        "round_bytes": cfg.share_round_bytes, "predicted_exchange": rounds_memory(rounds),
        "from_storage": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"], "pgpgin": 0,
        "host_peak": _status("VmHWM"), "base": base, "staging": st.staging_bytes, "syscalls": st.syscalls,
        "threads": st.threads, "seconds": round(seconds, 3), "group_wall": round(wall, 3), "exact": exact,
    }
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


def shared_group(folder: Path, mesh: str, port: int, mode: str = "shared") -> list[dict]:
    """The ranks of ``mesh``'s first TP group at once, cold, sharing rows (mode ``shared``) or
    each reading its own slices (mode ``group``)."""
    from sdadapt._plan.layout import Mesh

    tp = Mesh.parse(mesh).size_of("tp")
    drop(folder)
    pg0, t0 = _pgpgin(), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "member", "--dir", str(folder), "--mesh", mesh, "--rank", str(r),
                               "--port", str(port), "--mode", mode] + (["--verify"] if r == 0 else []),
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "LOCAL_WORLD_SIZE": str(tp)}) for r in range(tp)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    wall, paged = time.perf_counter() - t0, _pgpgin() - pg0
    rows = [json.loads(o.strip().splitlines()[-1]) for o in outs if o.strip()]
    for r in rows:
        r["pgpgin"] = paged  # the machine's, for the whole group
        print(_row(r), flush=True)
    print(json.dumps({"group": mesh, "mode": mode, "wall": round(wall, 2), "pgpgin": paged,
                      "sum_from_storage": sum(r["from_storage"] for r in rows), "ranks": len(rows)}), flush=True)
    return rows


def drop(folder: Path) -> None:
    """Empty the page cache of the checkpoint's files (``DROP_ALL=1``: all of it, as root)."""
    os.sync()
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.environ.get("DROP_ALL"):  # every cached page, the interpreter's libraries too (slower starts)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def _child(folder: Path, mesh: str, r: int, mode: str, verify: bool) -> list[str]:
    cmd = [sys.executable, __file__, "rank", "--dir", str(folder), "--mesh", mesh, "--rank", str(r), "--mode", mode]
    return cmd + (["--verify"] if verify else [])


def run(folder: Path, meshes: list[str], ranks: str, modes: list[str], node: bool, out: Path | None) -> None:
    from sdadapt._plan.layout import Mesh

    rows = []
    for mesh in meshes:
        size = Mesh.parse(mesh).size
        sample = sorted({size - 1 if r == "last" else int(r) for r in ranks.split(",")})
        for mode in (m for m in modes if m in ("shared", "group")):
            rows += shared_group(folder, mesh, 29500 + len(rows), mode)
        for mode in (m for m in modes if m not in ("shared", "group")):
            for i, r in enumerate(sample):
                drop(folder)
                child = _child(folder, mesh, r, mode, i == 0 and mode == modes[0])
                res = subprocess.run(child, capture_output=True, text=True, timeout=300)
                if res.returncode:
                    print(res.stderr[-3000:], flush=True)
                    continue
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(_row(rows[-1]), flush=True)
    if node:
        ckpt = sum(p.stat().st_size for p in folder.iterdir())
        for mode in (m for m in modes if m not in ("shared", "group")):
            drop(folder)
            pg0, t0 = _pgpgin(), time.perf_counter()
            procs = [subprocess.Popen(_child(folder, "tp=8", r, mode, False), stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "LOCAL_WORLD_SIZE": "8"}) for r in range(8)]
            outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
            wall, paged = time.perf_counter() - t0, _pgpgin() - pg0
            row = {"node": "tp=8", "mode": mode, "wall": round(wall, 2), "pgpgin": paged, "checkpoint": ckpt,
                   "slowest_engine": max(o["seconds"] for o in outs), "sum_from_storage": sum(o["from_storage"] for o in outs),
                   "sum_bytes_read": sum(o["bytes_read"] for o in outs)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out is not None:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(r: dict) -> str:
    g = lambda n: f"{n / GiB:.3f}"  # noqa: E731
    ratio = r["from_storage"] / r["bytes_read"] if r["bytes_read"] else 0
    return (f"| {r['mesh']} | {r['rank']} | {r['mode']} | {g(r['local'])} | {g(r['bytes_read'])} | {g(r['storage'])} | {g(r['predicted'])} "
            f"| {g(r['from_storage'])} | {g(r['pgpgin'])} | {ratio:.2f} | {g(r['host_peak'])} | {g(r['base'])} | {g(r['staging'])} "
            f"| {r['seconds']:.2f} | {r['exact']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--dir", type=Path, required=True)
    w.add_argument("--layers", type=int, default=L, help="fewer for a smoke run")
    r = sub.add_parser("rank")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--mesh", required=True)
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--mode", default="preadv", choices=["preadv", "mapping", "readahead", "runs"])
    r.add_argument("--verify", action="store_true")
    g = sub.add_parser("member")
    g.add_argument("--dir", type=Path, required=True)
    g.add_argument("--mesh", required=True)
    g.add_argument("--rank", type=int, required=True)
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--verify", action="store_true")
    g.add_argument("--mode", default="shared", choices=["shared", "group"])
    a = sub.add_parser("run")
    a.add_argument("--dir", type=Path, required=True)
    a.add_argument("--meshes", nargs="*", default=["tp=8", "dp_shard=2,tp=8", "dp_shard=4,tp=8"])
    a.add_argument("--ranks", default="0,last")
    a.add_argument("--modes", default="preadv,mapping")
    a.add_argument("--node", action="store_true")
    a.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.cmd == "write":
        write(args.dir, layers=args.layers)
    elif args.cmd == "rank":
        rank(args.dir, args.mesh, args.rank, args.mode, args.verify)
    elif args.cmd == "member":
        member(args.dir, args.mesh, args.rank, args.port, args.verify, args.mode)
    else:
        print("| mesh | rank | mode | shards GiB | bytes_read | storage (engine) | predicted | from storage | pgpgin "
              "| from storage / bytes_read | host peak | base | staging | engine s | bit-exact |\n|" + "---|" * 15, flush=True)
        run(args.dir, args.meshes, args.ranks, args.modes.split(","), args.node, args.out)


if __name__ == "__main__":
    main()
