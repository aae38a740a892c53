"""PEFT LoRA folders written for the LoRA tests, and the Meta-layout Llama they merge into."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")


peft = pytest.importorskip("peft", reason="the test extra installs peft")


VOCAB, SEQ = 40, 7


LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, rope_theta=500000.0)  # fmt: skip


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]


def spread(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Random weights large enough that a wrong merge changes the outputs clearly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_scale = p.dim() == 1 and "norm" in name
            p.copy_(1.0 + 0.1 * noise if is_scale else std * noise)


def write_peft_case(root: str, base: torch.nn.Module, seed: int, **lora: Any) -> dict[str, Any]:
    """Save ``base`` (``root/base``) and a LoRA of it with random A and B (``root/lora``); return
    the paths, peft's merged state dict and its logits on fixed tokens."""
    base.eval()
    base.save_pretrained(os.path.join(root, "base"))
    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(os.path.join(root, "lora"))
    merged = model.merge_and_unload().eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        logits = merged(tokens).logits.float()
    return dict(base=os.path.join(root, "base"), lora=os.path.join(root, "lora"), tokens=tokens, logits=logits,
                merged={k: v.detach().clone() for k, v in merged.state_dict().items()})  # fmt: skip


def llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    spread(model, seed)
    return model
