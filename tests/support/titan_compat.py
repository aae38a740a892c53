"""The torchtitan bridge under the installed torchtitan release (0.2.x or 0.3.x), against that
release's own state-dict adapter: ``python tests/support/titan_compat.py`` prints one JSON line and exits
0 when it passes.

A tiny llama (transformers, random values) is written with ``save_pretrained``; torchtitan's own
llama3 model of the same sizes is built twice on the meta device (0.2's ``Transformer(
TransformerModelArgs)``, 0.3's config classes) and filled once through torchtitan's own flow with
its own ``Llama3StateDictAdapter`` (``to_hf`` -> ``dcp.load`` with its HF reader -> ``from_hf``)
and once through the same flow with ``SdadaptStateDictAdapter.using("llama")``. The two state
dicts must be equal bit for bit, and the bridge's export (``to_hf`` of the loaded model) must give
the checkpoint's tensors back.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from importlib import metadata
from typing import Any

import torch

DIM, VOCAB, LAYERS, HEADS, KV, FFN = 32, 96, 2, 4, 2, 64


def _titan_llama() -> tuple[Any, Any, Any]:
    """(config for the adapters, a function building the meta model, torchtitan's adapter class)."""
    try:  # torchtitan 0.3
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from support.titan_models import llama3

        fam = llama3()
        return fam.titan_config, fam.titan_config.build, fam.titan_adapter
    except ImportError:  # torchtitan 0.2: model args and the Transformer class
        from torchtitan.models.llama3 import Llama3StateDictAdapter, Transformer, TransformerModelArgs

        # hidden size as torchtitan 0.2 computes it: 4 * dim * 2/3 = 85, * 0.75 = 63, up to a multiple of 64
        args = TransformerModelArgs(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV, vocab_size=VOCAB,
                                    multiple_of=FFN, ffn_dim_multiplier=0.75, norm_eps=1e-5, rope_theta=10000.0,
                                    max_seq_len=64)  # fmt: skip
        return args, lambda: Transformer(args), Llama3StateDictAdapter


def _load(build: Any, sd_adapter: Any, folder: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    state = model.state_dict()
    hf = sd_adapter.to_hf(state)
    dcp.load(hf, storage_reader=sd_adapter.get_hf_storage_reader(folder))
    model.load_state_dict(sd_adapter.from_hf(hf), strict=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> int:
    import transformers
    from safetensors.torch import load_file

    from sdadapt.torchtitan import SdadaptStateDictAdapter

    config, build, titan_adapter = _titan_llama()
    out: dict[str, Any] = {"torchtitan": metadata.version("torchtitan"), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="sdadapt-titan-") as root:
        hf_cfg = transformers.LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=VOCAB,
                                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(hf_cfg)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        folder = os.path.join(root, "llama")
        hf.save_pretrained(folder)
        try:
            theirs = _load(build, titan_adapter(config, folder), folder)
        except Exception as e:  # noqa: BLE001 - their own path failing is recorded, not ours to fix
            theirs = None
            out["their_path"] = f"{type(e).__name__}: {e}"[:300]
        bridge = SdadaptStateDictAdapter.using("llama")(config, folder)
        ours = _load(build, bridge, folder)
        if theirs is not None:
            differ = sorted(k for k in set(ours) | set(theirs) if k not in ours or k not in theirs or not torch.equal(ours[k], theirs[k]))
            out["load"] = "ok" if not differ else f"differs: {differ[:4]}"
        exported = {k: v.contiguous() for k, v in dict(SdadaptStateDictAdapter.using("llama")(config, folder).to_hf(ours)).items()}
        original = load_file(os.path.join(folder, "model.safetensors"))
        bad = sorted(k for k in original if k not in exported or not torch.equal(exported[k], original[k]))
        out["export"] = "ok" if not bad and set(exported) <= set(original) else f"differs: {bad[:4]}"
    out["ok"] = out.get("load") == "ok" and out["export"] == "ok"
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
