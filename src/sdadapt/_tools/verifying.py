"""``sdadapt.verify``: does the loaded (parallelised) model compute what the checkpoint's own
model computes? One forward pass of both on the same random tokens, compared by the largest
absolute logit difference and the KL divergence of the next-token distributions, then layer by
layer.

The reference is any model that maps tokens to logits: the transformers class named by the
checkpoint's ``config.json`` (:func:`reference_from_checkpoint`), a model of your own, or the
same model loaded on another mesh (parity between two meshes).

The tolerance is not a fixed number: it comes from the models' dtype and the logits' scale. A
right load differs from its reference only by rounding (in float32 about 1e-6 of the largest
logit), while a wrong one (a missing rotary permute, swapped gate/up, a norm under the wrong
name, a few keys off) changes the logits by far more than that, however small its absolute
effect; a fixed ``atol=1e-3`` would pass a float32 load whose logits are a few 1e-4 off. The
outputs of each decoder layer are compared as well, and the first layer that disagrees is
named; inside it, the first module whose output matches nothing the reference computes in
that layer (not even up to a permutation of features, or as consecutive outputs concatenated,
as a fused qkv is) is named, with the loaded tensors that explain the difference
(:mod:`.localise`).

Call on every rank when the model is parallelised: its forward is a collective. The tokens
come from a seeded generator, so every rank uses the same ones; DTensor outputs are gathered.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.env import parse
from .._base.summary import Summarized
from ..errors import SourceError, VerifyError
from ..sources import HFConfig, fetch_all, local_path, read_json
from .localise import drill, recording

if TYPE_CHECKING:
    from .._plan.adapter import Adapter

log = logging.getLogger(__name__)

__all__ = [
    "LayerDiff", "VerifyError", "VerifyReport", "compare_logits", "default_rtol", "random_tokens",
    "reference_from_checkpoint", "verify",
]  # fmt: skip

RTOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""Relative tolerance of a right load per compute dtype: a multiple of the rounding seen when
the same weights run through two implementations (float32: ~1e-6 of the largest logit)."""


class LayerDiff(BaseModel):
    """One decoder layer's output (or ``"logits"``) compared: largest absolute and relative difference."""

    name: str
    max_abs_diff: float
    rel_diff: float
    ok: bool


class VerifyReport(Summarized, BaseModel):
    """The outcome of :func:`verify`: ``passed`` when the logits agree within tolerance.

    ``atol`` is the absolute tolerance used: given, or ``rtol`` times the reference's largest
    |logit| (``tolerance`` says which). ``layers`` compares each decoder layer's output (empty
    when the two models' layer lists could not be paired); ``first_difference`` names the first
    layer that disagrees and, inside it, the first module whose output matches nothing of the
    reference, with its parameters.

    Attributes:
        passed: the logits agree within tolerance.
        max_abs_diff: the largest |logit difference|.
        kl: the mean KL divergence.
        atol: the absolute tolerance used.
        kl_max: the KL bound used.
        rtol: the relative tolerance.
        dtype: the least precise parameter dtype.
        tolerance: where ``atol`` came from.
        model: the model's label.
        reference: the reference's label.
        tokens: the tokens' shape.
        layers: the per-layer comparison.
        first_difference: the first layer and module that disagree, if any.

    Example::

        report = sdadapt.verify(model, reference)
        assert report.passed, str(report)
    """

    passed: bool
    max_abs_diff: float
    kl: float
    atol: float
    kl_max: float
    rtol: float = 0.0
    dtype: str = "float32"
    tolerance: str = ""
    model: str
    reference: str
    tokens: list[int]  # [batch, seq]
    layers: list[LayerDiff] = []
    first_difference: str | None = None

    def format(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"{verdict}  {self.model} vs {self.reference}: max|logit diff| {self.max_abs_diff:.3e} (tolerance "
            f"{self.atol:.1e}{', ' + self.tolerance if self.tolerance else ''}), KL {self.kl:.3e} (max {self.kl_max:.0e}) "
            f"on random tokens {self.tokens}"
        ]
        if self.layers and not self.passed:
            bad = [x for x in self.layers if not x.ok]
            shown = self.layers if len(self.layers) <= 8 else [x for x in self.layers if not x.ok][:4] or self.layers[:4]
            for x in shown:
                lines.append(f"  {x.name}: max|diff| {x.max_abs_diff:.3e}, {x.rel_diff:.1e} of its scale {'ok' if x.ok else 'DIFFERS'}")
            if len(shown) < len(self.layers):
                lines.append(f"  ({len(bad)} of {len(self.layers)} layer outputs differ)")
        if self.first_difference and not self.passed:
            lines.append(f"  first difference: {self.first_difference}")
        return "\n".join(lines)


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """``[batch, seq]`` token ids in ``[0, vocab_size)``, the same for the same arguments (on every rank)."""
    if vocab_size < 1 or batch < 1 or seq < 1:
        raise VerifyError(f"random tokens need a positive vocab size, batch and length; got {vocab_size}, {batch}, {seq}")
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _full(out: Any) -> torch.Tensor | None:
    """The first tensor of a module's output, gathered when it is a DTensor, as float32 on CPU."""
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return out.detach().float().cpu()


def _logits(out: Any) -> torch.Tensor:
    """Logits from a forward's output: a tensor, a DTensor (gathered), an HF output (``.logits``) or a tuple."""
    got = _full(out)
    if got is None:
        raise VerifyError(f"the forward returned a {type(out).__name__}, not logits (a tensor, .logits, or a tuple starting with them)")
    return got


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


def _compute_dtype(*models: nn.Module) -> torch.dtype:
    """The least precise floating dtype among the models' parameters (float32 when there are none)."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    worst = torch.float64
    seen = False
    for m in models:
        for p in m.parameters():
            if p.is_floating_point() and p.dtype in order:
                seen = True
                worst = max(worst, p.dtype, key=order.index)
    return worst if seen else torch.float32


def default_rtol(dtype: torch.dtype) -> float:
    """The relative tolerance :func:`verify` uses for models computing in ``dtype``."""
    return RTOL.get(dtype, RTOL[torch.bfloat16])


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


def _layer_list(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """The model's decoder layers: the ModuleList / ModuleDict of like blocks holding the most parameters."""
    best: tuple[int, str, list[tuple[str, nn.Module]]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)) or len(mod) == 0:
            continue
        items = list(mod.named_children())
        if len({type(m).__name__ for _, m in items}) > 2:  # blocks, not a bag of unrelated modules
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[0]:
            best = (size, name, items)
    return None if best is None else (best[1], best[2])


def _recording(modules: list[tuple[str, nn.Module]], into: list[tuple[str, torch.Tensor | None]]) -> AbstractContextManager[None]:
    """Append ``(name, output)`` of each of ``modules`` to ``into`` as their forwards complete."""
    return recording(modules, into, None, _full)


def _forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    with torch.no_grad():
        return _logits(model(tokens.to(device)))


def _rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    return diff, diff / max(scale, 1e-30)


def verify(
    model: nn.Module,
    reference: nn.Module,
    *,
    tokens: torch.Tensor | None = None,
    vocab_size: int | None = None,
    batch: int = 2,
    seq: int = 16,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    kl_max: float | None = None,
    layers: bool = True,
    model_name: str | None = None,
    reference_name: str | None = None,
    adapter: Adapter | None = None,
) -> VerifyReport:
    """Compare ``model`` (loaded, possibly parallelised) with ``reference`` on the same tokens.

    Args:
        model: the loaded model (call on every rank when it is parallelised).
        reference: any model mapping ``[batch, seq]`` token ids to logits (the checkpoint's own
            class, or the same model on another mesh: parity).
        tokens: the token ids; default :func:`random_tokens` of ``vocab_size`` (default: the
            reference's ``config.vocab_size`` or first embedding's size), ``batch`` x ``seq``, ``seed``.
        atol: the largest allowed |logit difference|; default ``rtol`` times the reference's
            largest |logit|.
        rtol: relative tolerance; default from the least precise parameter dtype of both models
            (:func:`default_rtol`: 2e-5 for float32, 3e-2 for bfloat16).
        kl_max: the largest allowed mean KL divergence; default ``max(atol**2, 1e-12)``.
        layers: also compare each decoder layer's output and, when they differ, find the first
            layer and module that disagree (one or two extra forwards).
        model_name, reference_name: labels of the report (default: the class names).
        adapter: the adapter the model was loaded with: the localisation of a failure then says
            whether its rules cover the tensors that explain it (a rotary order left undecided).

    Returns:
        A :class:`VerifyReport`; ``passed`` when max |diff| <= the tolerance and KL <= ``kl_max``.

    Example:
        >>> rep = sdadapt.verify(model, reference_from_checkpoint("ckpt"))  # doctest: +SKIP
        >>> str(rep)  # doctest: +SKIP
        'FAIL  MetaLlama vs LlamaForCausalLM: max|logit diff| 3.9e-04 (tolerance 4.1e-05, ...)'
    """
    if tokens is None:
        vocab = vocab_size or _vocab_size(reference, model)
        if vocab is None:
            raise VerifyError("cannot tell the vocabulary size from either model; pass vocab_size= (--vocab-size)")
        tokens = random_tokens(vocab, batch, seq, seed)
    dtype = _compute_dtype(model, reference)
    rel = rtol if rtol is not None else default_rtol(dtype)
    modes = [m.training for m in (model, reference)]
    model.eval()
    reference.eval()
    m_layers, r_layers = (_layer_list(model), _layer_list(reference)) if layers else (None, None)
    pair = m_layers is not None and r_layers is not None and len(m_layers[1]) == len(r_layers[1])
    got_l: list[tuple[str, torch.Tensor | None]] = []
    want_l: list[tuple[str, torch.Tensor | None]] = []
    try:
        with _recording(m_layers[1] if pair and m_layers else [], got_l):
            got = _forward(model, tokens)
        with _recording(r_layers[1] if pair and r_layers else [], want_l):
            want = _forward(reference, tokens)
        max_abs, kl = compare_logits(got, want)
        scale = want.double().abs().max().item() if want.numel() else 0.0
        tol = atol if atol is not None else rel * max(scale, 1e-30)
        how = "given" if atol is not None else f"{rel:.0e} x max|logit| {scale:.2g}, {str(dtype).replace('torch.', '')}"
        kmax = kl_max if kl_max is not None else max(tol * tol, 1e-12)
        passed = bool(max_abs <= tol and kl <= kmax)
        diffs: list[LayerDiff] = []
        first: str | None = None
        if pair and m_layers and r_layers and len(got_l) == len(want_l):
            prefix = f"{m_layers[0]}." if m_layers[0] else ""
            for i, ((name, g), (_, w)) in enumerate(zip(got_l, want_l, strict=True)):
                if g is None or w is None or g.shape != w.shape:
                    continue
                d, r = _rel(g, w)
                diffs.append(LayerDiff(name=f"{prefix}{name}", max_abs_diff=d, rel_diff=r, ok=r <= rel))
                if first is None and r > rel and not passed:
                    rl = (f"{r_layers[0]}.{r_layers[1][i][0]}", r_layers[1][i][1])
                    first = drill(model, reference, (f"{prefix}{name}", m_layers[1][i][1]), rl, tokens, rel,
                                  _forward, _full, adapter)
            if first is None and not passed and diffs and all(x.ok for x in diffs):
                first = "every decoder layer's output agrees: the difference is after the last layer (final norm, output projection)"
    finally:
        model.train(modes[0])
        reference.train(modes[1])
    rep = VerifyReport(
        passed=passed, max_abs_diff=max_abs, kl=kl, atol=tol, kl_max=kmax, rtol=rel,
        dtype=str(dtype).replace("torch.", ""), tolerance=how,
        model=model_name or type(model).__name__, reference=reference_name or type(reference).__name__,
        tokens=list(tokens.shape), layers=diffs, first_difference=first,
    )  # fmt: skip
    log.info("%s", rep.format())  # the verdict is the return value; the CLI prints it
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
    fetch_all(folder)  # a URL's mirror: from_pretrained reads the files itself
    # transformers before 4.56 takes the dtype as torch_dtype= (dtype= reaches the model's __init__)
    key = "dtype" if parse(transformers.__version__) >= (4, 56) else "torch_dtype"
    return cls.from_pretrained(folder, local_files_only=True, **{key: dtype}).eval()
