"""``sdadapt.verify``: does the loaded (parallelised) model compute what the checkpoint's own
model computes? One forward pass of both on the same random tokens, compared by the largest
absolute logit difference and the KL divergence of the next-token distributions.

The reference is any model that maps tokens to logits: the transformers class named by the
checkpoint's ``config.json`` (:func:`reference_from_checkpoint`), a model of your own, or the
same model loaded on another mesh (parity between two meshes). A wrong adapter (a missing
rotary permute, swapped gate/up) changes the logits by far more than rounding does, so one
pass on random tokens catches it; the tolerances are for rounding (float32 by default).

Call on every rank when the model is parallelised: its forward is a collective. The tokens
come from a seeded generator, so every rank uses the same ones; DTensor logits are gathered.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import SourceError, VerifyError
from .sources import local_path
from .sources._json import HFConfig, read_json

log = logging.getLogger(__name__)

__all__ = ["VerifyError", "VerifyReport", "compare_logits", "random_tokens", "reference_from_checkpoint", "verify"]


class VerifyReport(BaseModel):
    """The outcome of :func:`verify`: ``passed`` when both measures are within tolerance."""

    passed: bool
    max_abs_diff: float
    kl: float
    atol: float
    kl_max: float
    model: str
    reference: str
    tokens: list[int]  # [batch, seq]

    def format(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}  {self.model} vs {self.reference}: max|logit diff| {self.max_abs_diff:.3e} (atol {self.atol:.0e}), "
            f"KL {self.kl:.3e} (max {self.kl_max:.0e}) on random tokens {self.tokens}"
        )

    def __str__(self) -> str:
        return self.format()


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """``[batch, seq]`` token ids in ``[0, vocab_size)``, the same for the same arguments (on every rank)."""
    if vocab_size < 1 or batch < 1 or seq < 1:
        raise VerifyError(f"random tokens need a positive vocab size, batch and length; got {vocab_size}, {batch}, {seq}")
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(out: Any) -> torch.Tensor:
    """Logits from a forward's output: a tensor, a DTensor (gathered), an HF output (``.logits``) or a tuple."""
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise VerifyError(f"the forward returned a {type(out).__name__}, not logits (a tensor, .logits, or a tuple starting with them)")
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return out.detach().float().cpu()


def compare_logits(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want|, mean KL(softmax(want) || softmax(got)))`` over every position."""
    if tuple(got.shape) != tuple(want.shape):
        raise VerifyError(f"the model's logits are {list(got.shape)} but the reference's are {list(want.shape)}")
    got64, want64 = got.double(), want.double()
    max_abs = (got64 - want64).abs().max().item() if got.numel() else 0.0
    log_p = torch.log_softmax(want64, dim=-1)
    log_q = torch.log_softmax(got64, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return max_abs, max(kl, 0.0)


def _vocab_size(*models: nn.Module) -> int | None:
    for m in models:
        size = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
        get = getattr(m, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        if isinstance(emb, nn.Embedding):
            return emb.num_embeddings
        for mod in m.modules():
            if isinstance(mod, nn.Embedding):
                return mod.num_embeddings
    return None


def _forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    with torch.no_grad():
        return _logits(model(tokens.to(device)))


def verify(
    model: nn.Module,
    reference: nn.Module,
    *,
    tokens: torch.Tensor | None = None,
    vocab_size: int | None = None,
    batch: int = 2,
    seq: int = 16,
    seed: int = 0,
    atol: float = 1e-3,
    kl_max: float = 1e-4,
    model_name: str | None = None,
    reference_name: str | None = None,
) -> VerifyReport:
    """Compare ``model`` (loaded, possibly parallelised) with ``reference`` on the same tokens.

    ``tokens`` defaults to :func:`random_tokens` of ``vocab_size`` (default: the reference's
    ``config.vocab_size`` or first embedding's size), ``batch`` x ``seq``, ``seed``. Both models
    run in eval mode under ``torch.no_grad``; their logits are compared in float64:
    ``passed`` when max |diff| <= ``atol`` and the mean KL <= ``kl_max``. Call on every rank of
    a parallelised model (``reference`` may be the same model on another mesh: parity).
    ``model_name`` / ``reference_name`` label the report (default: the class names)."""
    if tokens is None:
        vocab = vocab_size or _vocab_size(reference, model)
        if vocab is None:
            raise VerifyError("cannot tell the vocabulary size from either model; pass vocab_size= (--vocab-size)")
        tokens = random_tokens(vocab, batch, seq, seed)
    modes = [m.training for m in (model, reference)]
    model.eval()
    reference.eval()
    try:
        got = _forward(model, tokens)
        want = _forward(reference, tokens)
    finally:
        model.train(modes[0])
        reference.train(modes[1])
    max_abs, kl = compare_logits(got, want)
    rep = VerifyReport(
        passed=bool(max_abs <= atol and kl <= kl_max),
        max_abs_diff=max_abs,
        kl=kl,
        atol=atol,
        kl_max=kl_max,
        model=model_name or type(model).__name__,
        reference=reference_name or type(reference).__name__,
        tokens=list(tokens.shape),
    )
    (log.info if rep.passed else log.warning)("%s", rep.format())
    return rep


def reference_from_checkpoint(src: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model named by ``architectures`` in the ``config.json`` beside ``src``
    (a folder, or a file in one), loaded with its own ``from_pretrained`` (local files only)."""
    path = local_path(src)  # a Hub id (hf://...): its snapshot folder
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise VerifyError(f"{config_path}: no config.json names the reference model; give --reference module:function")
    try:
        names = read_json(config_path, HFConfig, what="config.json").architectures
    except SourceError as e:
        raise VerifyError(f"{e}; fix it, or give a reference model with --reference module:function") from None
    if not names:
        raise VerifyError(f"{config_path} names no model class ('architectures'); give --reference module:function")
    try:
        import transformers
    except ImportError:
        raise VerifyError("the reference named by config.json needs transformers (pip install transformers)") from None
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise VerifyError(f"transformers {transformers.__version__} has no class {names[0]!r} (named in {config_path})")
    log.info("reference: %s.from_pretrained(%s)", names[0], folder)
    return cls.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
