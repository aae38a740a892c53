"""Megatron-Bridge's HF export of a Megatron-Core checkpoint: the second reference for the tests and the bench.

Run in the bridge venv (``scripts/megatron_venv.py --bridge``), never imported by the suite::

    python tests/support/megatron_bridge.py JOBS.json

``JOBS.json`` is a list of ``{ckpt, hf_config, out, result}``: for each, a ``GPTModel`` (the local
layer spec, :func:`megatron_fixtures.build`) of the shape the checkpoint's ``common.pt`` args give
is loaded by Megatron-Core's own ``dist_checkpointing.load``, then written as an HF folder ``out``
by Megatron-Bridge (``AutoBridge.from_hf_pretrained(template).save_hf_weights(model, out)``:
its mapping registry, its safetensors writer; ``config.json`` copied beside). ``template`` is an HF folder made from the config
``hf_config`` (a ``config.json``), zero weights: Bridge reads a pretrained folder's keys to order
and shard what it writes (a user converting back has the folder the model came from). ``result``
gets the seconds of each step and the process's peak RSS so far.

Megatron-Bridge 0.3.1 (the last release for Python 3.11) installs only without its dependencies
here: ``mamba-ssm`` needs ``nvcc`` to build and ``transformer-engine[core_cu13]`` CUDA. Its
conversion code runs on CPU (its own ``export_ckpt`` does, over a gloo group) once two of its
modules that import Transformer Engine unconditionally, for LoRA adapters an export of plain
weights never builds (``megatron.bridge.peft.lora`` and ``lora_layers``), are empty stand-ins.
What Bridge 0.3.1 cannot export, as seen here: ``SequentialMLP`` experts (its expert gather parses
the expert number from Transformer Engine's ``weight<N>`` names and fails on
``local_experts.<e>.linear_fc1.weight``) and the legacy ``GroupedMLP`` (no mapping).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import resource
import shutil
import sys
import time
import types
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as a script
from support import megatron_fixtures as mf  # noqa: E402

STUBBED = {"megatron.bridge.peft.lora", "megatron.bridge.peft.lora_layers"}
"""Bridge's modules that import Transformer Engine for LoRA adapters: empty stand-ins."""


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in STUBBED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        made: dict[str, type] = {}

        def __getattr__(attr: str) -> type:  # noqa: N807 - a module's attribute hook
            if attr.startswith("__"):
                raise AttributeError(attr)
            return made.setdefault(attr, type(attr, (), {}))

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def spec_from_args(args: Any) -> dict[str, Any]:
    """:func:`megatron_fixtures.build`'s spec from Megatron-LM's ``args`` in ``common.pt``."""
    spec = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
                tied=not args.untie_embeddings_and_output_weights, qk_layernorm=args.qk_layernorm, tp=1,
                vocab=args.padded_vocab_size, dtype=str(args.params_dtype).removeprefix("torch."))  # fmt: skip
    if args.num_experts:
        spec.update(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                    grouped=args.moe_grouped_gemm, expert_bias=args.moe_router_enable_expert_bias)  # fmt: skip
    return spec


def _template(hf_config: str, folder: str, dtype: torch.dtype) -> None:
    """An HF folder of ``hf_config``'s model with zero weights (Bridge's ``from_hf_pretrained``)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]  # what Bridge picks its model bridge by
    config.save_pretrained(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: torch.zeros(v.shape, dtype=dtype) for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}  # fmt: skip
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def export(job: dict[str, str]) -> dict[str, Any]:
    """One job: Megatron's load, then Bridge's HF export; the seconds of each step."""
    from megatron.bridge import AutoBridge
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    args = dist_checkpointing.load_common_state_dict(job["ckpt"])["args"]
    spec = spec_from_args(args)
    model = mf.build(spec)
    t1 = time.perf_counter()
    mf.load_megatron(model, spec, job["ckpt"])
    t2 = time.perf_counter()
    template = job["out"] + ".template"
    os.makedirs(template, exist_ok=True)
    _template(job["hf_config"], template, mf._dtype(spec))
    bridge = AutoBridge.from_hf_pretrained(template)
    t3 = time.perf_counter()
    bridge.save_hf_weights([model], job["out"], show_progress=False)
    t4 = time.perf_counter()
    shutil.copy(os.path.join(template, "config.json"), job["out"])  # its save_hf_pretrained wants a tokenizer too
    return {"build_s": t1 - t0, "megatron_load_s": t2 - t1, "template_s": t3 - t2, "bridge_export_s": t4 - t3,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # fmt: skip


def main() -> None:
    sys.meta_path.insert(0, _Stubs())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    mf._cpu_patches()
    mf._init(0, 1, mf._free_port(), 1)  # one process, as Bridge's own export_ckpt runs on CPU
    for job in jobs:
        result = export(job)
        with open(job["result"], "w") as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
