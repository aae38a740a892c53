"""Numerical drafting: settle what names and shapes cannot by experiment against a reference.

Given a reference (the transformers class named by the checkpoint's ``config.json``, or a
user's ``module:function`` building the checkpoint's own model from that config), the draft's
open choices are tried on a shrunken copy of both models:

- the reference is built from the config with its first ``layers`` layers (two by default),
  in float32, with random weights (matrices at ``1/sqrt(fan_in)``, norms and biases perturbed
  around their initial values, so that a norm under the wrong name or a missing ``1 + w``
  shows), and saved as a checkpoint in its own format (``save_pretrained``);
- the target model is copied with the same layers (its layer list cut), materialised on CPU
  in float32, its non-persistent buffers filled (:mod:`.buffers`: a copy whose buffers get no
  values is never compared);
- each candidate adapter loads that checkpoint into the copy; both run on the same random
  tokens, and each decoder layer's output and the logits are compared at the float32
  tolerance of :func:`sdadapt.verify`.

The choices: every question with rules (rotary row order, with the config's partial rotary;
Gemma's norm offset) is on or off, and renames among same-shaped tensors of one block (norms,
most often) may be permuted. A search changes one choice at a time while the agreement grows
(the number of leading layers that agree, then the size of the first difference), then, if no
candidate matched, tries every combination when there are few. A candidate whose logits and
layers agree is the answer; each of its choices is then flipped alone: a choice whose
alternative agrees as well is not settled by the experiment and stays uncertain.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._plan.adapter import Adapter
from .._tools.verifying import _forward, _layer_list, _recording, _rel, default_rtol, random_tokens
from .._transaction import has_meta, meta_non_persistent_buffers
from ..errors import SdadaptError
from ..rules import Fuse, Rename, Rotary, Split, compile_pattern
from .buffers import Check, fill_buffers
from .config import Facts
from .names import canon_tokens
from .proposals import Proposals, Proposed
from .questions import Question

log = logging.getLogger(__name__)

MAX_COMBINATIONS = 256
"""Every combination of the choices is tried only below this many (the search comes first)."""
MAX_COMBINATIONS_BY_DEFAULT = 32
"""The same bound when the check runs by default rather than asked for: each combination is a
load of the copy, and a default should not turn a draft into minutes of loads."""
MAX_PERMUTED = 5
"""Renames of one shape in one block permuted at most (5! = 120 orders)."""

Reference = Callable[[dict[str, Any]], nn.Module]
"""Builds the checkpoint's own model from a config dict (``config.json``, layers cut)."""


@dataclass
class Choice:
    """One open choice: its alternatives, each a function of the proposals giving the rules."""

    label: str
    options: list[str]  # what each alternative is, for the report
    question: Question | None = None
    renames: list[Proposed] = field(default_factory=list)  # a permutation group
    perms: list[tuple[int, ...]] = field(default_factory=list)
    split: Proposed | None = None  # a split whose source may be fused per head
    layouts: list[list[Any]] = field(default_factory=list)  # its rules per option


@dataclass
class Outcome:
    """What the experiment settled: the choice per :class:`Choice`, and how well it agreed."""

    ok: bool
    picks: list[int]
    detail: str
    unsettled: list[str] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' (and the Hub client's) progress bars off for the block, as they were after."""
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:
        yield
        return
    enabled = getattr(tf_logging, "is_progress_bar_enabled", lambda: False)()
    # transformers' enable_progress_bar() turns the Hub client's bars on too: where they were
    # off before, the same function turns them off again after the block
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    except ImportError:
        restore_hub = None
    else:
        restore_hub = disable_progress_bars if are_progress_bars_disabled() else None
    if enabled:
        tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            tf_logging.enable_progress_bar()
            if restore_hub is not None:
                restore_hub()


def _hf_reference(config: dict[str, Any]) -> nn.Module:
    """The transformers class named by ``architectures`` in ``config``, built from it (random)."""
    try:
        import transformers
    except ImportError:
        raise SdadaptError(
            "reference='config' builds the checkpoint's model with transformers, which is not installed: "
            "pip install 'sdadapt[models]', or give reference= a function building the model"
        ) from None

    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise SdadaptError(f"transformers {transformers.__version__} has no class {names[:1]} named by config.json; "
                           "give reference= a function building the checkpoint's model from its config")
    cfg_cls = transformers.AutoConfig.for_model(config["model_type"])
    cfg = cfg_cls.from_dict({k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    return cls._from_config(cfg, attn_implementation="eager")


def shrink_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """``config`` with its first ``layers`` layers (per-layer lists cut as well)."""
    out = dict(config)
    n = out.get("num_hidden_layers")
    if isinstance(n, int) and n > layers:
        out["num_hidden_layers"] = layers
        for key, value in config.items():
            if isinstance(value, list) and len(value) == n:
                out[key] = value[:layers]
    return out


def _perturb(model: nn.Module, seed: int) -> None:
    """Weights that make every layout mistake visible: matrices random at ``1/sqrt(fan_in)``,
    1-D tensors (norms, biases, sinks) their initial values plus noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(max(1, p.shape[-1])))
            else:
                p.add_(0.2 * noise)


def _cut_layers(model: nn.Module, check: Check) -> tuple[nn.Module, str]:
    """A float32 CPU copy of ``model`` with its first ``check.layers`` decoder layers, its
    non-persistent buffers filled (:mod:`.buffers`); also says how they were filled."""
    layers = check.layers
    found = _layer_list(model)
    if found is None:
        raise SdadaptError("cannot find the model's layer list (a ModuleList of blocks) to shrink it")
    name, _ = found
    parent = model.get_submodule(name) if name else model
    kept = [m for _, m in list(parent.named_children())[:layers]]
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    cut: nn.Module
    if isinstance(parent, nn.ModuleDict):
        cut = nn.ModuleDict(dict(list(parent.items())[:layers]))
    else:
        cut = nn.ModuleList(kept)
    setattr(owner, attr, cut)
    try:
        small = copy.deepcopy(model)
    finally:
        setattr(owner, attr, parent)
    how = ""
    if has_meta(small):
        pending = meta_non_persistent_buffers(small)
        small = small.to_empty(device="cpu")
        how = fill_buffers(small, pending, check)
    elif check.init_buffers is not None:
        with torch.no_grad():
            check.init_buffers(small)
    return small.float().eval(), how


class Experiment:
    """A shrunken reference, its checkpoint, and a shrunken target to load candidates into."""

    def __init__(self, target: nn.Module, facts: Facts, reference: Reference | None, check: Check, seed: int):
        if facts.config is None:
            raise SdadaptError("no config.json beside the checkpoint to build a reference from")
        cfg = shrink_config(facts.config, check.layers)
        self.model, self.buffers = _cut_layers(target, check)
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(seed)
            self.reference = (reference or _hf_reference)(cfg).float().eval()
        _perturb(self.reference, seed)
        self.folder = tempfile.mkdtemp(prefix="sdadapt-draft-")
        save = getattr(self.reference, "save_pretrained", None)
        if callable(save):
            with quiet_transformers():  # its "Writing model shards" bar is about a temporary folder
                save(self.folder)
        else:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise SdadaptError(
                    "a reference model without save_pretrained is written with safetensors, which is not "
                    "installed: pip install safetensors"
                ) from None

            state = {k: v.contiguous() for k, v in self.reference.state_dict().items()}
            save_file(state, os.path.join(self.folder, "model.safetensors"))
            with open(os.path.join(self.folder, "config.json"), "w", encoding="utf-8") as f:
                json.dump(cfg, f)
        vocab = cfg.get("vocab_size") or 64
        self.tokens = random_tokens(int(vocab), 2, 12, seed)
        self.rtol = default_rtol(torch.float32)
        self.ref_layers: list[tuple[str, torch.Tensor | None]] = []
        ref_found = _layer_list(self.reference)
        with _recording(ref_found[1] if ref_found else [], self.ref_layers):
            self.ref_logits = _forward(self.reference, self.tokens)
        if not bool(torch.isfinite(self.ref_logits).all()):
            self.close()
            raise SdadaptError("the reference's logits are not finite (NaN or Inf) on random weights: "
                               "nothing can be compared with them")
        self.runs = 0

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)

    def score(self, adapter: Adapter) -> tuple[int, float, str]:
        """``(layers that agree, -log10 of the first difference, what differs)``; all layers and
        the logits agreeing gives ``(layers + 1, 0, "")``."""
        from .._load import load

        self.runs += 1
        try:
            load(self.model, self.folder, adapter)
        except SdadaptError as e:
            return (-1, -99.0, f"does not load: {str(e).splitlines()[0]}")
        got: list[tuple[str, torch.Tensor | None]] = []
        found = _layer_list(self.model)
        with _recording(found[1] if found else [], got):
            logits = _forward(self.model, self.tokens)
        n = 0
        for (name, g), (_, w) in zip(got, self.ref_layers, strict=False):
            if g is None or w is None or g.shape != w.shape:
                break
            if not bool(torch.isfinite(g).all()):
                return (n, -99.0, f"layer {name}'s output is not finite (NaN or Inf) in the model's copy")
            rel = _rel(g, w)[1]
            if not rel <= self.rtol:
                return (n, -math.log10(max(rel, 1e-30)), f"layer {name} differs by {rel:.1e} of its scale")
            n += 1
        if logits.shape != self.ref_logits.shape:
            return (n, -99.0, f"logits {list(logits.shape)} vs {list(self.ref_logits.shape)}")
        if not bool(torch.isfinite(logits).all()):
            return (n, -99.0, "the copy's logits are not finite (NaN or Inf)")
        rel = _rel(logits, self.ref_logits)[1]
        if not rel <= self.rtol:
            return (n, -math.log10(max(rel, 1e-30)), f"logits differ by {rel:.1e} of their scale")
        return (n + 1, 0.0, f"{n} layer(s) and the logits equal to {max(rel, 1e-12):.0e} of their scale")


def choices_of(props: Proposals, facts: Facts) -> list[Choice]:
    """The open choices of a draft: questions with rules (on/off), renames of one shape in one
    block that the names may have assigned wrongly (orders), and splits of a fused tensor that
    may be laid out per head or per kv group (``split(..., heads=)``)."""
    out: list[Choice] = []
    groups_of = sorted({n for n in (facts.kv_heads, facts.heads) if n and n > 1})
    for p in props.items:
        fused = _fused_rename_choice(p, facts, groups_of)
        if fused is not None:
            out.append(fused)
            continue
        if p.kind != "split" or not p.rules or not isinstance(p.rules[0], Split) or p.rules[0].heads is not None:
            continue
        split, rest = p.rules[0], p.rules[1:]
        layouts = [list(p.rules)] + [[split.model_copy(update={"heads": n}), *rest] for n in groups_of]
        out.append(Choice(label=f"layout of {p.sources[0]}", options=["parts one after the other"]
                          + [f"fused per head group ({n} groups: [{n}, parts, rows])" for n in groups_of],
                          split=p, layouts=layouts))
    by_topic: dict[str, list[Question]] = {}
    for q in props.questions:
        if q.rules and q.topic:
            by_topic.setdefault(q.topic, []).append(q)
    for topic, qs in by_topic.items():
        for q in qs:
            out.append(Choice(label=f"{topic}: {', '.join(q.about[:3])}", options=["no", "yes"], question=q))
    groups: dict[tuple[Any, ...], list[Proposed]] = {}
    for p in props.items:
        m = p.match
        if p.kind != "rename" or m is None or len(p.rules) != 1 or not isinstance(p.rules[0], Rename):
            continue
        if m.transpose or len(m.srcs) != 1 or len(m.tgts) != 1 or m.srcs[0].stacked is not None:
            continue
        s = m.srcs[0]
        caps = (tuple(sorted(compile_pattern(p.sources[0]).names)), tuple(sorted(compile_pattern(p.targets[0]).names)))
        groups.setdefault((p.section, tuple(s.shape), str(s.dtype), s.is_bias, caps), []).append(p)
    for (section, shape, _dtype, _bias, _caps), ps in groups.items():
        if len(ps) < 2 or len(ps) > MAX_PERMUTED:
            continue
        perms = list(itertools.permutations(range(len(ps))))
        out.append(Choice(label=f"which of {len(ps)} tensors of shape {list(shape)} in {section} is which",
                          options=[", ".join(f"{ps[i].sources[0]} -> {ps[j].targets[0]}" for i, j in enumerate(pm))
                                   for pm in perms],
                          renames=ps, perms=perms))
    return out


def _fused_rename_choice(p: Proposed, facts: Facts, groups_of: list[int]) -> Choice | None:
    """A fused q/k/v tensor renamed into a fused target: the source may be fused per head group
    and the target may want Meta's rotary on its q and k rows. The alternatives cut it (as laid
    out), reorder the q and k parts' rows, and fuse the parts back in the target's order."""
    m = p.match
    if p.kind != "rename" or m is None or len(p.rules) != 1 or not isinstance(p.rules[0], Rename) or m.transpose:
        return None
    if not ({"#qkv"} <= canon_tokens(m.srcs[0].rel) and {"#qkv"} <= canon_tokens(m.tgts[0].rel)):
        return None
    hd, heads, kv = facts.head_rows, facts.heads, facts.kv_heads or facts.heads
    if not hd or not heads or not kv or m.srcs[0].shape[0] != (heads + 2 * kv) * hd:
        return None
    src, dst = p.sources[0], p.targets[0]
    sizes = [heads * hd, kv * hd, kv * hd]
    parts = [f"{dst}.__{x}" for x in "qkv"]
    options, layouts = ["renamed as it is"], [list(p.rules)]
    for n in [None, *groups_of]:
        for rotate in (False, True):
            if n is None and not rotate:
                continue
            rules: list[Any] = [Split(src=src, dsts=parts, sizes=sizes, heads=n)]
            if rotate:
                rules += [Rotary(keys=parts[0], heads=heads, rotary_dim=facts.rotary_fraction),
                          Rotary(keys=parts[1], heads=kv, rotary_dim=facts.rotary_fraction)]
            rules.append(Fuse(srcs=parts, dst=dst))
            layout = f"fused per head group ({n} groups)" if n else "parts one after the other"
            options.append(f"{layout}, {'rows of q and k reordered to interleaved rotary' if rotate else 'rows kept'}")
            layouts.append(rules)
    return Choice(label=f"layout of {src} -> {dst}", options=options, split=p, layouts=layouts)


Base = Callable[[dict[int, list[Any]], list[Any], list[Any]], Adapter]
"""Assembles the draft's adapter: (rules replacing a proposal's, by ``id``; rules to run first;
rules to run last)."""


def adapter_for(base: Base, choices: list[Choice], picks: list[int]) -> Adapter:
    """The adapter with ``picks`` applied: renames re-targeted, questions' rules added."""
    replaced: dict[int, list[Any]] = {}
    first: list[Any] = []
    last: list[Any] = []
    for c, k in zip(choices, picks, strict=True):
        if c.split is not None:
            replaced[id(c.split)] = c.layouts[k]
        elif c.question is not None:
            if k == 1:
                (first if c.question.before else last).extend(c.question.rules or [])
        else:
            for i, j in enumerate(c.perms[k]):
                src = c.renames[i]
                tgt = c.renames[j]
                replaced[id(src)] = [Rename(src=src.sources[0], dst=tgt.targets[0])]
    return base(replaced, first, last)


def search(exp: Experiment, base: Base, choices: list[Choice], max_combinations: int = MAX_COMBINATIONS) -> Outcome:
    """The candidate that agrees with the reference, found as the module docstring says."""
    picks = [0] * len(choices)
    best = exp.score(adapter_for(base, choices, picks))
    full = best[0] > len(exp.ref_layers)
    for _sweep in range(3):
        if full:
            break
        improved = False
        for ci, c in enumerate(choices):
            for k in range(len(c.options)):
                if k == picks[ci]:
                    continue
                trial = list(picks)
                trial[ci] = k
                sc = exp.score(adapter_for(base, choices, trial))
                if sc[:2] > best[:2]:
                    best, picks, improved = sc, trial, True
                    full = best[0] > len(exp.ref_layers)
                    if full:
                        break
            if full:
                break
        if not improved:
            break
    if not full:
        sizes = [len(c.options) for c in choices]
        if 1 < math.prod(sizes) <= max_combinations:
            for combo in itertools.product(*[range(n) for n in sizes]):
                sc = exp.score(adapter_for(base, choices, list(combo)))
                if sc[:2] > best[:2]:
                    best, picks = sc, list(combo)
                if sc[0] > len(exp.ref_layers):
                    full = True
                    break
    if not full:
        return Outcome(ok=False, picks=picks, detail=best[2], choices=choices)
    unsettled = []
    for ci, c in enumerate(choices):  # a choice whose alternative agrees too is not settled here
        for k in range(len(c.options)):
            if k == picks[ci]:
                continue
            trial = list(picks)
            trial[ci] = k
            if exp.score(adapter_for(base, choices, trial))[0] > len(exp.ref_layers):
                unsettled.append(f"{c.label}: '{c.options[picks[ci]]}' and '{c.options[k]}' agree alike")
                break
    return Outcome(ok=True, picks=picks, detail=best[2], unsettled=unsettled, choices=choices)


def apply_outcome(props: Proposals, out: Outcome) -> list[str]:
    """Write the experiment's answers into the proposals: questions answered yes become rules of
    their proposals, answered no disappear, permuted renames are re-targeted; every proposal
    says how it was decided. Returns summary lines."""
    lines: list[str] = []
    unsettled_labels = {u.split(": '")[0] for u in out.unsettled}
    moved: dict[str, str] = {}  # a re-targeted rename's old target -> new (its question's rules follow it)
    how = f"checked numerically: {out.detail}"
    answered: dict[str, bool] = {}
    for c, k in zip(out.choices, out.picks, strict=True):
        if c.label in unsettled_labels:
            continue
        if c.split is not None:
            if k:
                c.split.rules = c.layouts[k]
                c.split.evidence.append(f"{c.options[k]}, by experiment")
            if c.split.kind == "rename":  # a fused rename's layout settles the rotary of its q and k rows too
                c.split.questions = [q for q in c.split.questions if q.topic != "rotary" or q.rules]
        elif c.question is not None:
            answered[c.question.question] = k == 1
            lines.append(f"{c.label.split(':')[0]}: {'needed' if k == 1 else 'not needed'} ({how})")
        else:
            for i, j in enumerate(c.perms[k]):
                p, t = c.renames[i], c.renames[j]
                if i != j:
                    p.evidence.append(f"the names pointed to {p.targets[0]}; the experiment put it at {t.targets[0]}")
            targets = [c.renames[j].targets[0] for j in c.perms[k]]
            rules = [[Rename(src=c.renames[i].sources[0], dst=targets[i])] for i in range(len(c.renames))]
            for i, p in enumerate(c.renames):
                if p.targets[0] != targets[i]:
                    moved[p.targets[0]] = targets[i]
                p.rules, p.targets = rules[i], [targets[i]]
    for p in props.items:
        kept = []
        for q in p.questions:
            yes = answered.get(q.question)
            if yes is None:
                kept.append(q)
            elif yes:
                add = [r.model_copy(update={"keys": moved[r.keys]}) if isinstance(getattr(r, "keys", None), str)
                       and r.keys in moved else r for r in q.rules or []]
                p.rules = add + p.rules if q.before else p.rules + add
                p.evidence.append(f"{q.question.split(':')[0]}: enabled by experiment")
        p.questions = kept
    held = {q.question for p in props.items for q in p.questions}
    owned = {q.question for q in props.questions if q.topic}  # questions that belong to proposals
    props.questions = [q for q in props.questions if q.question not in answered and (q.question in held or
                                                                                      q.question not in owned)]
    unsettled_props = {id(p) for c in out.choices if c.label in unsettled_labels
                       for p in [*c.renames, *([c.split] if c.split else [])]}
    for p in props.items:
        if id(p) in unsettled_props:
            p.confidence = min(p.confidence, 0.5)
            p.evidence.append("the experiment cannot tell this mapping from its alternative (both agree)")
        else:
            p.confidence = 1.0
            if not any(e.startswith(how) for e in p.evidence):
                p.evidence.append(how)
    lines += [f"not settled by the experiment: {u}" for u in out.unsettled]
    if out.unsettled and len(out.unsettled) == len(out.choices) > 1:
        lines.append("the experiment cannot tell any candidate from another: the copy's outputs do not change with "
                     "the mapping, so its forward does not use the loaded tensors as the reference does (buffers "
                     "without values, a forward that skips its layers?); every choice stays flagged")
    elif out.unsettled:
        lines.append("a choice is unsettled when its alternatives give equal outputs: the tensors involved hold "
                     "equal values, or the experiment's layers and tokens do not reach them")
    return lines
