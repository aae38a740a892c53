"""Shipped adapters, ``sdadapt draft``, resume (``save_state``/``load_state``), ``export`` and
``convert`` on the pipeline's model, in one process (the same calls work on every rank of a
parallelised model under torchrun).

    python examples/resume_export.py [--dir DIR]

docs/adapters.md (the adapters shipped by name, ``sdadapt draft``) and
docs/resume-and-export.md walk through the same steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pipeline  # noqa: E402 - examples/pipeline.py: the model, its checkpoint, its adapter

import sdadapt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where to write the files (default: a temporary folder, removed at the end)")
    args = ap.parse_args(argv)
    if args.dir is None:
        with tempfile.TemporaryDirectory(prefix="sdadapt-example-") as folder:
            return run(folder)
    os.makedirs(args.dir, exist_ok=True)
    return run(args.dir)


def run(folder: str) -> int:
    """The steps, writing their files into ``folder``."""
    cfg = pipeline.Config()
    ckpt = os.path.join(folder, "pretrained.pt")
    pipeline.write_checkpoint(ckpt, cfg)  # q_proj/k_proj/v_proj apart; the model fuses them

    # 1. Shipped adapters: by name, options as keyword arguments (or from the checkpoint
    #    folder's config.json); .inverse() maps the other way; adapters are JSON.
    for name, summary in sdadapt.list_adapters():
        print(f"{name:<10} {summary}")
    llama = sdadapt.get_adapter("llama", n_heads=32, n_kv_heads=8)
    assert sdadapt.Adapter.from_json(llama.to_json()) == llama
    print(llama.inverse().describe().splitlines()[0])

    # 2. A first adapter drafted from headers: it finds the q/k/v -> qkv fuse.
    d = sdadapt.draft(pipeline.build_model(), ckpt)
    print(d.format())
    assert d.related and d.report.ok

    # 3. Load (one process here: a plain model; under torchrun, a meta + TP/FSDP2 model).
    adapter = pipeline.qkv_adapter(cfg.dim)
    model = pipeline.build_model()
    print(sdadapt.load(model, ckpt, adapter, init_buffers=pipeline.Transformer.init_buffers))

    # 4. Train a step, save model + optimizer + a step counter, resume into fresh objects.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    state_dir = os.path.join(folder, "step1")
    sdadapt.save_state(model, state_dir, opt, extra={"step": 1}, adapter=adapter)

    model2 = pipeline.build_model()
    model2 = model2.to_empty(device="cpu")
    model2.init_buffers()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    extra: dict = {"step": 0}
    print(sdadapt.load_state(model2, state_dir, opt2, extra=extra))
    assert extra["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))

    # 5. Export in the checkpoint's own layout (through adapter.inverse()) and load it back.
    out = os.path.join(folder, "export")
    print(sdadapt.export(model, out, adapter, format="safetensors", checksums=True).format_text())
    model3 = pipeline.build_model()
    sdadapt.load(model3, out, adapter, init_buffers=pipeline.Transformer.init_buffers, checksums=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model3.state_dict().values(), strict=True))

    # 6. Convert the pretrained file offline to a DCP folder in the model's layout; a DCP
    #    folder is a source like any other (no adapter needed now). Offline there is no model
    #    to read a TP degree from, so this adapter only fuses (the layout of an unsharded model).
    fuse_only = sdadapt.Adapter([adapter.rules[0]], name="fuse-qkv")
    dcp_dir = os.path.join(folder, "pretrained-dcp")
    print(sdadapt.convert(ckpt, dcp_dir, fuse_only, "dcp", read_back=True).format_text())
    model4 = pipeline.build_model()
    print(sdadapt.load(model4, dcp_dir, init_buffers=pipeline.Transformer.init_buffers))
    print(f"example finished; files in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
