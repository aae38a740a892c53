"""``sdadapt verify SRC --model M [--adapter A]``: load SRC into M and compare it with a reference."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .diff import adapter_of, add_adapter

NAME = "verify"
HELP = "load a checkpoint into a model and compare its logits with a reference on random tokens (PASS/FAIL)"

EPILOG = """\
M is module:function or path/to/file.py:function returning the model (the meta device is
fine); A is an adapter as for `sdadapt diff`. The reference is, by default, the transformers
class named by SRC's config.json (loaded with from_pretrained from SRC); --reference R takes
module:function returning any model instead. One forward of both on the same random tokens;
PASS when max |logit diff| is within the tolerance and the mean KL <= --kl. The tolerance
follows the dtype and the logits' scale (--rtol times the largest reference logit; by default
2e-5 in float32, where a right load differs by ~1e-6 and a wrong one by far more), unless
--atol gives it. On FAIL each decoder layer's output is compared too and the first layer and
module that disagree are named, or, when that module's input differs already, the modules whose
outputs the difference comes from, with the rotary row order tested on them and A's rules for
them ("rotary order of wq/wk undecided" when A has none). --init-buffers module:function is called as function(model)
after the model is materialised, to fill non-persistent buffers (rotary tables) that its own
init_weights() does not.

One process: `sdadapt verify ...` loads and runs the model unparallelised. Parallelised: launch
with torchrun and give --mesh (e.g. fsdp=2,tp=2: mesh dim names and sizes) and --parallelize
module:function called as function(model, mesh); every rank loads its shards and takes part
in the forward; rank 0 prints the verdict. --parity-mesh builds and loads a second copy on
another mesh and compares the two (no reference model needed, e.g. --mesh fsdp=4
--parity-mesh tp=4). The process group is created from torchrun's environment (gloo on CPU,
nccl with --device cuda) unless one exists. Exit status: 0 PASS, 1 FAIL, 2 usage or input
errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("src", metavar="SRC", help="checkpoint to load (a path, or hf://org/name[@rev])")
    parser.add_argument("--model", "-m", required=True, metavar="M", help="module:function returning the model")
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for M (repeatable)")
    add_adapter(parser)
    parser.add_argument("--reference", "-r", metavar="R", help="module:function returning the reference (default: config.json's class)")
    parser.add_argument("--mesh", metavar="DIMS", help="device mesh under torchrun, e.g. fsdp=2,tp=2")
    parser.add_argument("--parallelize", metavar="FN", help="module:function(model, mesh) that parallelises the model")
    parser.add_argument("--parity-mesh", metavar="DIMS", help="compare with a second copy loaded on this mesh instead")
    parser.add_argument("--device", default="cpu", help="device of the model and the tokens (cpu, cuda)")
    parser.add_argument("--vocab-size", type=int, help="token ids are drawn from [0, V) (default: from the reference)")
    parser.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    parser.add_argument("--init-buffers", metavar="FN", help="module:function(model) filling non-persistent buffers after materialising")
    parser.add_argument("--rtol", type=float, help="tolerance relative to the largest |logit| (default from the dtype: 2e-5 float32)")
    parser.add_argument("--atol", type=float, help="largest allowed |logit difference| (default: --rtol x max|logit|)")
    parser.add_argument("--kl", type=float, help="largest allowed mean KL divergence (default: the tolerance squared)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _mesh_dims(spec: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``fsdp=2,tp=2`` -> ``(("fsdp", "tp"), (2, 2))``; a usage error for anything else."""
    from .._plan.resolve import ResolveError

    names, sizes = [], []
    for part in spec.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise ResolveError(f"mesh {spec!r}: give NAME=SIZE pairs separated by commas, e.g. fsdp=2,tp=2")
        names.append(name.strip())
        sizes.append(int(size))
    if len(set(names)) != len(names):
        raise ResolveError(f"mesh {spec!r}: a dim name appears twice")
    return tuple(names), tuple(sizes)


def _check_mesh(spec: str, world: int, flag: str) -> str | None:
    """Why mesh ``spec`` cannot be built on ``world`` processes, or None."""
    import math

    _, sizes = _mesh_dims(spec)
    if math.prod(sizes) != world:
        return (f"{flag} {spec} needs {math.prod(sizes)} processes but {world} were launched: "
                f"launch with torchrun --nproc-per-node {math.prod(sizes)}, or give a mesh whose sizes multiply to {world}")
    return None


def _mesh(spec: str, device: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = _mesh_dims(spec)
    return init_device_mesh(device.split(":")[0], sizes, mesh_dim_names=names)


def _loaded_model(args: argparse.Namespace, mesh_spec: str | None, adapter: Any, group: Any) -> Any:
    from torch import nn

    import sdadapt

    from .._plan.resolve import ResolveError, load_object, resolve_target
    from .diff import parse_options

    init_buffers = load_object(args.init_buffers) if args.init_buffers else None
    if init_buffers is not None and not callable(init_buffers):
        raise ResolveError(f"--init-buffers {args.init_buffers!r} names no function: give module:function(model)")
    model = resolve_target(args.model, **parse_options(args.model_option))
    if not isinstance(model, nn.Module):
        raise ResolveError(f"--model {args.model!r} names no model: give module:function returning an nn.Module")
    if mesh_spec:
        if not args.parallelize:
            raise ResolveError("--mesh needs --parallelize module:function(model, mesh)")
        out = load_object(args.parallelize)(model, _mesh(mesh_spec, args.device))
        model = out if isinstance(out, nn.Module) else model
    sdadapt.load(model, args.src, adapter, device=args.device, process_group=group, init_buffers=init_buffers)
    return model


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .._plan.resolve import ResolveError, resolve_target
    from .._tools import reference_from_checkpoint, verify

    started = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        started = True
    try:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if (args.mesh or args.parity_mesh) and world == 1:
            raise ResolveError("--mesh / --parity-mesh need several processes: launch with torchrun --nproc-per-node N")
        for flag, spec in (("--mesh", args.mesh), ("--parity-mesh", args.parity_mesh)):
            why = _check_mesh(spec, world, flag) if spec else None
            if why:  # the same on every rank: one line from rank 0, the same exit status everywhere
                if dist.get_rank() != 0:
                    return 2
                raise ResolveError(why)
        if (args.mesh or args.parity_mesh) and not args.parallelize:
            raise ResolveError("--mesh / --parity-mesh need --parallelize module:function(model, mesh)")
        adapter = adapter_of(args)
        model = _loaded_model(args, args.mesh, adapter, None)
        if args.parity_mesh:
            reference = _loaded_model(args, args.parity_mesh, adapter, None)
        elif args.reference:
            reference = resolve_target(args.reference)
            if isinstance(reference, str):
                raise ResolveError(f"--reference {args.reference!r} names no model: give module:function returning one")
        else:
            reference = reference_from_checkpoint(args.src).to(args.device)
        names: tuple[str | None, str | None] = (None, None)
        if args.parity_mesh:
            names = (f"{type(model).__name__} on mesh {args.mesh}", f"the same on mesh {args.parity_mesh}")
        rep = verify(
            model, reference, vocab_size=args.vocab_size, batch=args.batch, seq=args.seq, seed=args.seed, atol=args.atol,
            rtol=args.rtol, kl_max=args.kl, model_name=names[0], reference_name=names[1], adapter=adapter,
        )
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            print(rep.model_dump_json(indent=2) if args.json else rep.format())
        return 0 if rep.passed else 1
    finally:
        if started:
            dist.destroy_process_group()
