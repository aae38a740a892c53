"""The concise pipeline: meta init -> tensor parallel -> FSDP2 -> sdadapt.load -> train.

    torchrun --nproc-per-node 4 examples/pipeline.py                 # 2x2 mesh: FSDP x TP
    torchrun --nproc-per-node 4 examples/pipeline.py --mesh 4x1      # FSDP only
    torchrun --nproc-per-node 2 examples/pipeline.py --mesh 1x2      # TP only
    torchrun --nproc-per-node 4 examples/pipeline.py --ckpt my.pt --steps 20 --check
    python examples/pipeline.py                                      # one process, no parallelism

CPU (gloo) or GPU (nccl, one GPU per process) is picked from ``torch.cuda.is_available()``.
The "pretrained" checkpoint is one ``torch.save`` file in another layout than the model (q, k
and v saved apart; the model fuses them); the script writes it if ``--ckpt`` does not exist.
The order of the steps matters; docs/pipeline.md says why.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdadapt

# --------------------------------------------------------------------------------------
# The model: the discussion's SimpleTransformer (fused qkv), with two changes so that its
# forward pass is right under tensor parallelism: shapes use the local head count (-1), and
# a non-persistent positional table shows how buffers outside the state dict get values.


@dataclass
class Config:
    layers: int = 2
    dim: int = 128
    heads: int = 4
    ffn: int = 256
    vocab: int = 100
    max_seq: int = 64


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # rows: see qkv_adapter() for their order
        self.o_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Under TP this rank holds [q_r; k_r; v_r]: the rows of its own heads (qkv_adapter).
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class FFN(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.linear1 = nn.Linear(cfg.dim, cfg.ffn)
        self.activation = nn.ReLU()
        self.linear2 = nn.Linear(cfg.ffn, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.ffn = FFN(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("pos", torch.empty(cfg.max_seq, cfg.dim), persistent=False)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        if not self.pos.is_meta:
            self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Sinusoidal positions. Not in the state dict, so a load cannot fill them."""
        n, d = self.pos.shape
        t = torch.arange(n, dtype=torch.float32, device=self.pos.device)[:, None]
        freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=self.pos.device) * (-math.log(1e4) / d))
        self.pos[:, 0::2] = torch.sin(t * freq)
        self.pos[:, 1::2] = torch.cos(t * freq)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or with ``labels`` the mean next-token loss."""
        x = self.embedding(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_model(layers: int = 2, dim: int = 128, heads: int = 4, ffn: int = 256, vocab: int = 100) -> Transformer:
    """The model on the meta device: no memory, no init. Also a target for `sdadapt diff`:
    ``sdadapt diff ckpt.pt --target examples/pipeline.py:build_model``."""
    with torch.device("meta"):
        return Transformer(Config(layers, dim, heads, ffn, vocab))


# --------------------------------------------------------------------------------------
# The adapter: the checkpoint has q_proj/k_proj/v_proj, the model one fused qkv.


def qkv_adapter(dim: int = 128) -> sdadapt.Adapter:
    """Fuse q, k, v into qkv, rows in the order ``ColwiseParallel`` needs.

    ColwiseParallel gives TP rank r the r-th contiguous block of qkv's rows. For attention to
    be right, that block must hold this rank's heads of q, k and v: [q_0; k_0; v_0; q_1; ...]
    where q_r is the r-th block of q's rows. ``interleave`` lays the fused rows out so, reading
    the TP degree from the model's placements (1 on an unparallelised model: plain [q; k; v])."""
    return sdadapt.Adapter(
        [
            sdadapt.fuse([f"layers.{{i}}.attn.{n}_proj.{{p}}" for n in "qkv"], "layers.{i}.attn.qkv.{p}"),
            sdadapt.interleave("layers.{i}.attn.qkv.{p}", sizes=[dim, dim, dim]),
        ],
        name="split-qkv",
    )


def write_checkpoint(path: str, cfg: Config, seed: int = 0) -> None:
    """Stand-in for a downloaded pretrained file: one torch.save, q/k/v saved apart."""
    torch.manual_seed(seed)
    sd = {}
    for key, t in Transformer(cfg).state_dict().items():
        if ".attn.qkv." in key:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3), strict=True):
                sd[key.replace(".qkv.", f".{name}.")] = part.clone()
        else:
            sd[key] = t
    torch.save(sd, path + ".tmp")
    os.replace(path + ".tmp", path)  # readers never see half a file


# --------------------------------------------------------------------------------------
# Parallelism: TP inside each FSDP group, FSDP2 across groups.

TP_PLAN = {
    "embedding": RowwiseParallel(input_layouts=Replicate()),  # vocab rows sharded
    "layers.*.attn.qkv": ColwiseParallel(),  # local heads out
    "layers.*.attn.o_proj": RowwiseParallel(),  # partial sums -> all-reduce
    "layers.*.ffn.linear1": ColwiseParallel(),
    "layers.*.ffn.linear2": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),  # full logits on every rank
}


def parallelize(model: Transformer, mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> Transformer:
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], TP_PLAN)
    if mesh["fsdp"].size() > 1:
        kw = {"mesh": mesh["fsdp"], **({"mp_policy": mp} if mp else {})}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    return model


# --------------------------------------------------------------------------------------


def reference_logits(path: str, cfg: Config, tokens: torch.Tensor) -> torch.Tensor:
    """The same checkpoint in one plain CPU model (q, k, v fused by hand): the check's oracle."""
    sd = torch.load(path, mmap=True, weights_only=True)
    for key in [k for k in sd if ".attn.q_proj." in k]:
        parts = [sd.pop(key.replace("q_proj", n)) for n in ("q_proj", "k_proj", "v_proj")]
        sd[key.replace("q_proj", "qkv")] = torch.cat(parts)
    ref = Transformer(cfg)
    ref.load_state_dict(sd)
    with torch.no_grad():
        return ref(tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default=None, help="DPxTP, e.g. 2x2 (default: TP 2 when the world size is even)")
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "sdadapt_pipeline_ckpt.pt"), help="torch.save file")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 params, fp32 reduce")
    ap.add_argument("--check", action="store_true", help="compare logits with a single-process reference")
    args = ap.parse_args(argv)
    cfg = Config()

    # 0. Processes and devices (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT;
    #    without torchrun, this is one process).
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port: several single runs may share the machine
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.mesh:
        dp, tp = (int(n) for n in args.mesh.lower().split("x"))
    else:
        tp = 2 if world % 2 == 0 else 1
        dp = world // tp
    if dp * tp != world:
        raise SystemExit(f"--mesh {dp}x{tp} needs {dp * tp} processes, not {world}")

    # 1. The pretrained checkpoint (written once, by rank 0, if absent).
    if rank == 0 and not os.path.exists(args.ckpt):
        write_checkpoint(args.ckpt, cfg)
        say(f"wrote {args.ckpt} (q/k/v split, {os.path.getsize(args.ckpt) / 2**20:.1f} MiB)")
    dist.barrier()

    # 2. Mesh, then the model on the meta device: shapes only, no memory, no init.
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("fsdp", "tp"))
    with torch.device("meta"):
        model = Transformer(cfg)

    # 3. Parallelise while still on meta: TP first, then FSDP2 (shards each TP shard further).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    parallelize(model, mesh, mp)

    # 4. Load: materialise on the device, re-init buffers, then each rank reads its shards only.
    adapter = qkv_adapter(cfg.dim)
    report = sdadapt.load(model, args.ckpt, adapter, device=device, init_buffers=Transformer.init_buffers)
    reports: list[str | None] = [None] * world
    dist.all_gather_object(reports, report.format())
    say(f"mesh {dp}x{tp} (fsdp x tp) on {device.type}, adapter {adapter.name}:")
    for line in reports:
        say("  " + str(line))

    batch = torch.Generator().manual_seed(1000 + mesh["fsdp"].get_local_rank())  # same batch within a TP group
    tokens = torch.randint(0, cfg.vocab, (4, 33), generator=batch)
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    if args.check:  # the parallel model must compute what the plain one computes
        with torch.no_grad():
            got = model(inputs).float().cpu()
        err = torch.tensor((got - reference_logits(args.ckpt, cfg, inputs.cpu())).abs().max().item(), device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        tol = 5e-2 if args.bf16 else 1e-4
        say(f"check: max |parallel - reference| logits = {err.item():.2e} (tolerance {tol:g})")
        if not err.item() <= tol:
            raise SystemExit("check failed: the parallel model does not match the reference")

    # 5. The optimizer, on the final (sharded, materialised, loaded) parameters.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(inputs, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM (gloo has no AVG)
        say(f"step {step} loss {mean.item() / world:.4f} ({time.perf_counter() - t0:.2f} s)")

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # main()'s end drops the model and the optimizer; the process group was destroyed last
    # (docs/errors-and-guarantees.md, "Ending a run")
    sys.exit(main())
