"""Where inside the first differing decoder layer a wrong load shows, and which loaded tensors explain it.

:func:`drill` runs the model and the reference once more with every module of that layer
recorded (its input and its output) and finds the first module whose output matches nothing
the reference's layer computes (not even up to a row order, or as consecutive outputs
concatenated, as a fused projection is). Then:

- when that module's *input* matches an input of the reference, its own parameters are the
  likeliest culprit and are named;
- when its input already differs, its weights are not the cause: the difference arises in the
  code around it (rotary embeddings, the attention itself), computed from the outputs of the
  modules that ran before it in the same parent. Those modules, and their parameters, are the
  inputs that explain the difference. A row-order hypothesis is then tested on them: the rows
  of one or two of them reordered per head between HF's "half" rotary order and Meta's
  "interleaved" one (head counts from the reference's config or the adapter's rotary rules),
  the layer run again on its recorded input. When that makes the layer equal to the
  reference's, the rotary row order of those tensors is the cause; given the adapter, the
  message says whether it has a rotary rule for them (none: the question is undecided, as a
  draft leaves it) and which rule to add.

For a norm whose own output differs while its input agrees, a second hypothesis is tested: the
weight plus one (Gemma's norms compute ``x_hat * (1 + w)`` and store ``w``); the message then
says whether the adapter has the ``affine(..., shift=1.0)`` rule for it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .._plan.adapter import Adapter

Recorded = list[tuple[str, torch.Tensor | None]]
Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]
Full = Callable[[Any], "torch.Tensor | None"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    return diff / max(scale, 1e-30)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    return tuple(got.shape) == tuple(want.shape) and _rel(got, want) <= rtol


def match(out: torch.Tensor, refs: list[torch.Tensor], rtol: float) -> str:
    """``"equal"`` when ``out`` equals one reference output, or several consecutive ones concatenated
    along the last dim (a fused projection); ``"permuted"`` when it does so only up to a permutation
    of the last dim (a rotary row order, or a wrong one); ``""`` when it matches nothing."""
    srt = out.sort(dim=-1).values
    permuted = False
    for i, ref in enumerate(refs):
        if ref.shape[:-1] != out.shape[:-1]:
            continue
        width, parts = 0, []
        for nxt in refs[i:i + 4]:
            if nxt.shape[:-1] != out.shape[:-1]:
                break
            parts.append(nxt)
            width += nxt.shape[-1]
            if width == out.shape[-1]:
                cat = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
                if _close(out, cat, rtol):
                    return "equal"
                permuted = permuted or _close(srt, cat.sort(dim=-1).values, rtol)
            if width >= out.shape[-1]:
                break
    return "permuted" if permuted else ""


def _params(name: str, mod: nn.Module) -> str:
    own = [f"{name}.{p}" for p, _ in mod.named_parameters()]
    return ", ".join(own[:6]) + (f" (+{len(own) - 6} more)" if len(own) > 6 else "")


@contextmanager
def recording(modules: list[tuple[str, nn.Module]], outs: Recorded, ins: dict[str, torch.Tensor | None] | None,
              full: Full) -> Iterator[None]:
    """Record each module's output (in ``outs``, in the order the forwards complete) and, given
    ``ins``, its first input."""

    def hook(name: str) -> Any:
        def record(_mod: nn.Module, args: Any, out: Any) -> None:
            outs.append((name, full(out)))
            if ins is not None:
                ins.setdefault(name, full(args[0]) if args else None)

        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def drill(model: nn.Module, reference: nn.Module, m_layer: tuple[str, nn.Module], r_layer: tuple[str, nn.Module],
          tokens: torch.Tensor, rtol: float, forward: Forward, full: Full, adapter: Adapter | None = None) -> str:
    """The first module of the model's layer whose output matches nothing of the reference's layer,
    and the loaded tensors that explain it (see the module docstring)."""
    m_name, m_mod = m_layer
    r_name, r_mod = r_layer
    got: Recorded = []
    want: Recorded = []
    got_in: dict[str, torch.Tensor | None] = {}
    want_in: dict[str, torch.Tensor | None] = {}
    m_subs = [(f"{m_name}.{n}", s) for n, s in m_mod.named_modules() if n]
    r_subs = [(f"{r_name}.{n}", s) for n, s in r_mod.named_modules() if n]
    call: list[tuple[Any, dict[str, Any]]] = []
    ref_out: list[torch.Tensor | None] = []
    pre = m_mod.register_forward_pre_hook(lambda _m, a, k: call.append((a, k)) if not call else None, with_kwargs=True)
    try:
        with recording(m_subs, got, got_in, full):
            forward(model, tokens)
    finally:
        pre.remove()
    post = r_mod.register_forward_hook(lambda _m, _a, out: ref_out.append(full(out)) if not ref_out else None)
    try:
        with recording(r_subs, want, want_in, full):
            forward(reference, tokens)
    finally:
        post.remove()
    refs = [t for _, t in want if t is not None]
    ref_ins = [t for t in want_in.values() if t is not None]
    mods = dict(m_subs)
    permuted: list[str] = []
    for i, (name, out) in enumerate(got):
        how = "equal" if out is None else match(out, refs, rtol)
        if how == "permuted":
            permuted.append(name)
        if how:
            continue
        inp = got_in.get(name)
        if inp is not None and not match(inp, ref_ins + refs, rtol):
            parent = name.rpartition(".")[0]
            before = [n for n, _ in got[:i]]
            feeders = [n for n in dict.fromkeys(before) if n.rpartition(".")[0] == parent and n != name
                       and any(True for _ in mods[n].parameters())]
            if feeders:
                return _upstream(m_name, r_name, name, parent, feeders, mods, got, (m_mod, call, ref_out), reference,
                                 rtol, full, adapter)
        offset = _offset_hypothesis(name, mods[name], inp, refs, rtol, full, adapter)
        if offset:
            return (f"{m_name} (its input agrees with the reference): {name}'s output matches no output of the "
                    f"reference's {r_name}, and its input does. {offset}")
        text = (f"{m_name} (its input agrees with the reference): {name}'s output matches no output of the "
                f"reference's {r_name}; check the mapping of {_params(name, mods[name]) or 'its inputs'}")
        if permuted:
            text += (f"; before it, {', '.join(permuted)} match the reference only up to a row order (right for a "
                     "rotary layout the model applies itself, wrong otherwise)")
        return text
    return f"{m_name}: every module's output has a counterpart in the reference's {r_name}, yet the layer's output differs"


def _offset_hypothesis(name: str, mod: nn.Module, inp: torch.Tensor | None, refs: list[torch.Tensor], rtol: float,
                       full: Full, adapter: Adapter | None) -> str | None:
    """For a norm (a module whose only parameter is a 1-D ``weight``): whether its output with 1
    added to the weight matches a reference output, as Gemma's ``x_hat * (1 + w)`` norms store
    ``w``; the sentence saying so, or ``None``."""
    params = dict(mod.named_parameters())
    weight = params.get("weight")
    if inp is None or list(params) != ["weight"] or weight is None or weight.dim() != 1:
        return None
    try:
        with torch.no_grad():
            weight.add_(1.0)
            try:
                out = full(mod(inp.to(dtype=weight.dtype)))
            finally:
                weight.sub_(1.0)
    except Exception:  # noqa: BLE001 - a module that cannot run alone on its input: no hypothesis
        return None
    if out is None or match(out, refs, rtol) != "equal":
        return None
    key = f"{name}.weight"
    text = (f"Norm offset of {key}: with 1 added to it, its output equals the reference's (the checkpoint stores w "
            f"for a norm computing x_hat * (1 + w), as Gemma's do)")
    fix = f'sdadapt.affine("{_pattern(key)}", shift=1.0)'
    if adapter is None:
        return f"{text}; an adapter loading it right has {fix} (for every such norm)"
    from ..rules import Affine, compile_pattern

    covered = [f"#{i}" for i, r in enumerate(adapter.rules) if isinstance(r, Affine)
               and any(compile_pattern(p).match(k) for p in (r.keys if isinstance(r.keys, list) else [r.keys])
                       for k in (key, _pattern(key)))]
    if covered:
        return f"{text}; adapter {adapter.name!r}'s affine rule(s) {', '.join(covered)} on it give another value"
    asked = " (the draft left it open: its DECIDE 'norm offset')" if adapter.name == "draft" else ""
    return f"{text}: norm offset undecided: adapter {adapter.name!r} has no affine rule for {_pattern(key)}{asked}; add {fix}"


def _upstream(m_name: str, r_name: str, name: str, parent: str, feeders: list[str], mods: dict[str, nn.Module],
              got: Recorded, layer: tuple[nn.Module, list[tuple[Any, dict[str, Any]]], list[torch.Tensor | None]],
              reference: nn.Module, rtol: float, full: Full, adapter: Adapter | None) -> str:
    """The message for a module whose input already differs: the feeders named, and the rotary
    hypothesis tested on them."""
    short = ", ".join([feeders[0], *(f.rpartition(".")[2] for f in feeders[1:])])
    text = (f"{m_name} (its input agrees with the reference): {name}'s output and input match nothing of the "
            f"reference's {r_name}, so its weights are not the cause; the difference arises in "
            f"{parent or 'the layer'}'s own computation from the outputs of {short}")
    found = _rotary_hypothesis(feeders, mods, got, layer, reference, rtol, full, adapter)
    if found is None:
        params = ", ".join(p for f in feeders for p in _params(f, mods[f]).split(", ") if p)
        return (text + ": a layout of those outputs that the model's code reads otherwise than the reference's (a "
                f"rotary row order, the order of fused parts) or a setting that differs (rope theta, scaling); check "
                f"the mapping of {params}")
    return text + ". " + found


def _head_sizes(reference: nn.Module, adapter: Adapter | None) -> tuple[list[int], float]:
    """Head sizes to try (rows of one head) and the rotating fraction of each head."""
    cfg = getattr(reference, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    sizes: list[int] = []
    frac = 1.0
    if cfg is not None:
        heads = getattr(cfg, "num_attention_heads", None)
        hd = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None)
                                                 else None)
        if isinstance(hd, int) and hd > 1:
            sizes.append(hd)
        f = getattr(cfg, "partial_rotary_factor", None)
        if isinstance(f, (int, float)) and 0 < f < 1:
            frac = float(f)
    for rule in getattr(adapter, "rules", []) if adapter is not None else []:
        hd = getattr(rule, "head_dim", None) if getattr(rule, "kind", "") == "rotary" else None
        if isinstance(hd, int) and hd > 1 and hd not in sizes:
            sizes.append(hd)
    return sizes, frac


def _order(width: int, hd: int, rot: int, to: str) -> torch.Tensor:
    """Indices reordering each head's first ``rot`` rows of a ``width``-row output to ``to`` order."""
    half = rot // 2
    if to == "interleaved":
        head = [j // 2 + (half if j % 2 else 0) for j in range(rot)]
    else:
        head = [2 * j for j in range(half)] + [2 * j + 1 for j in range(half)]
    head += list(range(rot, hd))
    return torch.tensor([h * hd + j for h in range(width // hd) for j in head])


def _rotary_hypothesis(feeders: list[str], mods: dict[str, nn.Module], got: Recorded,
                       layer: tuple[nn.Module, list[tuple[Any, dict[str, Any]]], list[torch.Tensor | None]],
                       reference: nn.Module, rtol: float, full: Full, adapter: Adapter | None) -> str | None:
    """Whether reordering the rows of one or two feeders between rotary orders makes the layer equal
    to the reference's; the sentence saying so, or ``None``."""
    m_mod, call, ref_out = layer
    if not call or not ref_out or ref_out[0] is None:
        return None
    want = ref_out[0]
    args, kwargs = call[0]
    sizes, frac = _head_sizes(reference, adapter)
    widths = {n: t.shape[-1] for n, t in got if n in feeders and t is not None}
    for hd in sizes:
        rot = int(hd * frac) // 2 * 2
        fits = [n for n in feeders if widths.get(n) and widths[n] % hd == 0]
        subsets = [list(s) for k in (2, 1) for s in itertools.combinations(fits, k)]
        for subset, to in itertools.product(subsets, ("interleaved", "half")):
            handles = [mods[n].register_forward_hook(_reorder(_order(widths[n], hd, rot, to))) for n in subset]
            try:
                with torch.no_grad():
                    out = full(m_mod(*args, **kwargs))
            except Exception:  # noqa: BLE001 - a hypothesis the layer cannot run is not the answer
                out = None
            finally:
                for h in handles:
                    h.remove()
            if out is not None and _close(out, want, rtol):
                return _rotary_text(subset, mods, to, hd, rot, widths, adapter)
    return None


def _reorder(index: torch.Tensor) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook putting a module's output features in ``index`` order."""

    def hook(_mod: nn.Module, _args: Any, out: Any) -> Any:
        return out[..., index.to(out.device)] if isinstance(out, torch.Tensor) else None

    return hook


def _pattern(key: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``layers.{i}.attention.wq.weight`` (the first index only)."""
    return re.sub(r"(^|\.)\d+(?=\.)", r"\1{i}", key, count=1)


def _rotary_text(subset: list[str], mods: dict[str, nn.Module], to: str, hd: int, rot: int, widths: dict[str, int],
                 adapter: Adapter | None) -> str:
    from ..rules import Rotary, compile_pattern

    short = "/".join(n.rpartition(".")[2] for n in subset)
    keys = [f"{n}.{p}" for n in subset for p, _ in mods[n].named_parameters()]
    other = "half" if to == "interleaved" else "interleaved"
    text = (f"with the rows of {short} reordered per head ({hd} rows) from {other} to {to} rotary order, the layer "
            "equals the reference's")
    extra = f", rotary_dim={rot}" if rot != hd else ""
    fix = ", ".join(f'sdadapt.rotary("{_pattern(f"{n}.weight")}", heads={widths[n] // hd}, to="{to}"{extra})'
                    for n in subset)
    if adapter is None:
        return (f"Rotary order of {short}: {text}; an adapter loading it right has {fix} (and the same for their "
                "biases and per-head norms)")
    rules = []
    for i, rule in enumerate(adapter.rules):
        if not isinstance(rule, Rotary):
            continue
        patterns = rule.keys if isinstance(rule.keys, list) else [rule.keys]
        if any(compile_pattern(p).match(k) or compile_pattern(p).match(_pattern(k)) for p in patterns for k in keys):
            rules.append(f"#{i} rotary(to={rule.to!r})")
    if not rules:
        asked = " (the draft left it open: its DECIDE 'rotary row order')" if adapter.name == "draft" else ""
        return (f"Rotary order of {short} undecided: {text}, and adapter {adapter.name!r} has no rotary rule for "
                f"{', '.join(_pattern(k) for k in keys)}{asked}; add {fix}")
    return (f"Rotary order of {short}: {text}, so adapter {adapter.name!r}'s rule(s) {', '.join(rules)} on them give "
            f"an order the model does not read; adding {fix} after them loads it right (or change those rules)")
