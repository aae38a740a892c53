"""transformers models as targets: the adapter derived from transformers' own conversion mapping.

A ``transformers.PreTrainedModel`` names and lays out some weights unlike its Hub checkpoint:
transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``)
while checkpoints hold ``experts.{j}.gate_proj.weight``, renames modules
(``block_sparse_moe`` -> ``mlp``, ``embed_out`` -> ``lm_head``), adds or drops the
``base_model_prefix`` (a ``*ForCausalLM`` from a base-model checkpoint) and ties embeddings
(``lm_head.weight`` absent from the checkpoint). ``from_pretrained`` does this with the
``WeightRenaming`` / ``WeightConverter`` list of ``transformers.conversion_mapping``
(``get_model_conversion_mapping(model)``).

:func:`hf_adapter` runs that list's own key matching (``rename_source_key``: the renamings,
then at most one converter, then the base-model prefix) on the checkpoint's keys, and
translates each converter's operations into our typed rules, so the load reads each rank's
shards lazily like any other adapter:

- ``MergeModulelist(dim)`` -> :class:`~sdadapt.rules.Stack` over the index the ``*`` of the
  converter's source pattern matched;
- ``Concatenate(dim)`` -> :class:`~sdadapt.rules.Fuse`; ``Chunk(dim)`` / ``Split(dim)`` ->
  :class:`~sdadapt.rules.Split` (equal parts, or the model's sizes);
- ``Transpose(dim0, dim1)`` -> :class:`~sdadapt.rules.Transpose` (with ``check_dims``: only where the
  checkpoint's shape differs from the model's);
- ``Interleave(dim)`` -> :class:`~sdadapt.rules.Deinterleave` / :class:`~sdadapt.rules.Interleave` of two
  parts alternating row by row.

Any other operation, used by a converter that matches a checkpoint key, is an
:class:`~sdadapt.errors.AdapterError` naming the operation and the model family. Concrete key names are
folded back into patterns: every all-digit segment (layer, expert index) becomes a capture when
every checkpoint key of that shape is treated alike, else the rules stay per key.

transformers is imported only here, and only for a model that is a transformers model (it is
then imported already).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import AdapterError
from ..rules import Deinterleave, Drop, Fuse, Interleave, Rename, RuleBase, Split, Stack, Tie, Transpose
from . import hf_compat
from .adapter import Adapter
from .target import model_state_dict, schema_of

if TYPE_CHECKING:
    from ..sources import Source, TensorInfo

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"^\d+$")


def is_hf_model(model: object) -> bool:
    """``model`` is a ``transformers.PreTrainedModel`` (checked without importing transformers:
    a model of that class has imported it already)."""
    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(model, mu.PreTrainedModel)


def family(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return f"{_class_name(model)} (model_type {getattr(cfg, 'model_type', None)!r})"


def hf_adapter(
    model: nn.Module,
    src: str | os.PathLike[str] | Source | dict[str, TensorInfo] | None = None,
    *,
    subtree: str | None = None,
) -> Adapter:
    """The adapter from a transformers model's Hub checkpoint to the model itself.

    Derived from transformers' own checkpoint conversion mapping for the model
    (``transformers.conversion_mapping.get_model_conversion_mapping``): its renamings and its
    converters' operations (``MergeModulelist``, ``Concatenate``, ``Chunk``, ``Split``,
    ``Transpose``, ``Interleave``) become :func:`rename`, :func:`stack`, :func:`fuse`,
    :func:`split`, :func:`transpose` and :func:`deinterleave` rules; the ``base_model_prefix``
    is added or removed as ``from_pretrained`` would; tied weights (``lm_head.weight`` when
    ``tie_word_embeddings``) get a :func:`tie` rule, and checkpoint keys transformers ignores
    (``_keys_to_ignore_on_load_unexpected``, old ``rotary_emb.inv_freq``) a :func:`drop` rule.
    ``sdadapt.load(model, src)`` and ``sdadapt.diff(model, src)`` use it when no adapter is
    given and ``model`` is a transformers model.

    Args:
        model: a ``transformers.PreTrainedModel`` (on the meta device and parallelised is fine:
            only its state dict's names and shapes are used).
        src: the checkpoint whose keys are mapped (a path, a :class:`~sdadapt.sources.Source` or a
            schema ``{key: TensorInfo}``). ``None``: the keys ``model.save_pretrained`` would
            write (transformers' ``revert_weight_conversion`` of the model's own keys).
        subtree: as in :func:`sdadapt.sources.open_source`.

    Returns:
        An :class:`Adapter` named after the model class.

    Raises:
        AdapterError: ``model`` is no transformers model, or a converter that matches a
            checkpoint key uses an operation with no rule here (named, with the family).

    Example:
        >>> adapter = sdadapt.hf_adapter(model, "path/to/Qwen3-30B-A3B")  # doctest: +SKIP
        >>> text = adapter.describe()  # doctest: +SKIP
    """
    if not is_hf_model(model):
        raise AdapterError(
            f"hf_adapter needs a transformers PreTrainedModel, got {type(model).__name__}; "
            "pass an adapter for other models"
        )
    hf_compat.check_supported()
    target = schema_of(model_state_dict(model))
    if src is None:
        ckpt = _saved_schema(model, target)
    elif isinstance(src, dict):
        ckpt = src
    else:
        from ..sources import checkpoint_schema

        ckpt = checkpoint_schema(src, subtree)
    return _derive(model, ckpt, target)


def _saved_schema(model: nn.Module, target: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The keys and shapes ``save_pretrained`` writes: transformers' own reverse conversion
    run on meta tensors of the model's shapes."""
    from ..sources import TensorInfo

    mods = hf_compat.modules()
    if mods is None:  # transformers 4: the checkpoint holds the model's own names
        return dict(target)
    cml = mods[1]

    # transformers' own reverse, given the mapping looked up as _conversion_mapping does (it
    # would look a sharded model up under FSDP2's class name); as save_pretrained does for a
    # model not made by from_pretrained: no legacy renamings, no PrefixChange
    legacy = len(_conversion_mapping_legacy())
    conversions = _conversion_mapping(model)
    conversions = [t for t in conversions[: len(conversions) - legacy] if not hf_compat.is_prefix_change(cml, t)]
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in target.items()}
    proxy: Any = _WithConversions(model, conversions)
    saved = cml.revert_weight_conversion(proxy, meta) if conversions else meta
    return {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in saved.items()}


class _WithConversions:
    """``model`` as ``revert_weight_conversion`` sees it, with the conversions it should revert."""

    def __init__(self, model: nn.Module, conversions: list[Any]):
        self._model = model
        self._weight_conversions = conversions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _conversion_mapping_legacy() -> list[Any]:
    mods = hf_compat.modules()
    return [] if mods is None else list(mods[0].get_checkpoint_conversion_mapping("legacy"))


# -- the key mapping, as transformers computes it ------------------------------------------------


class _Group:
    """The checkpoint keys one converter gathers into one target key."""

    def __init__(self, conv: Any, target: str):
        self.conv = conv
        self.target = target
        self.members: list[tuple[str, str]] = []  # (source pattern, checkpoint key)


def _derive(model: nn.Module, ckpt: dict[str, TensorInfo], target: dict[str, TensorInfo]) -> Adapter:
    mods = hf_compat.modules()
    transforms = _conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, mods[1].WeightRenaming)] if mods else []
    converters = [t for t in transforms if isinstance(t, mods[1].WeightConverter)] if mods else []
    legacy = [(re.compile(k), v) for k, v in (getattr(model, "_checkpoint_conversion_mapping", None) or {}).items()]
    base_prefix = getattr(model, "base_model_prefix", "") or None
    present = dict.fromkeys(target, True)
    ignore = _ignored_unexpected(model)

    outcome: dict[str, tuple[Any, ...]] = {}
    groups: dict[tuple[int, str], _Group] = {}
    order = sorted(ckpt, key=_natural)
    for key in order:
        renamed = hf_compat.apply_renamings(mods[1], key, renamings) if mods else key
        for rx, repl in legacy:  # transformers 4's per-class renamings (regex -> replacement)
            renamed, n = rx.subn(repl, renamed)
            if n:
                break
        conv, matched = None, ""
        for c in converters:
            out, pattern = c.rename_source_key(renamed)
            if pattern is not None:
                conv, renamed, matched = c, out, pattern
                break
        renamed = _base_prefix(renamed, base_prefix, present)
        if conv is not None:
            g = groups.setdefault((id(conv), renamed), _Group(conv, renamed))
            g.members.append((matched, key))
        elif renamed in present:
            outcome[key] = ("keep",) if renamed == key else ("rename", renamed)
        elif ignore is not None and ignore.search(key):
            outcome[key] = ("drop",)
        else:
            outcome[key] = ("keep",)  # the plan reports it as unexpected

    fam = family(model)
    chains: dict[str, list[RuleBase]] = {}
    for g in groups.values():
        rules = _chain(g, ckpt, target, fam)
        sig = _digits(g.target)
        general = _generalise_chain(rules, sig)
        ident = _json(general) if general is not None else ""
        for _, key in g.members:
            outcome[key] = ("conv", ident, id(g))
        chains[str(id(g))] = rules
        if general is not None:
            chains[ident] = general

    rules = _fold(order, outcome, chains)
    rules += _ties(model, target)
    log.debug("derived %d rules for %s from transformers' conversion mapping", len(rules), fam)
    return Adapter(rules, name=f"hf:{_class_name(model)}", description=f"from transformers' conversion mapping for {fam}")


def _own_class(module: nn.Module) -> Any:
    """The module's own class: FSDP2's ``fully_shard`` swaps in a subclass ``FSDP<Name>``."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _natural(key: str) -> tuple[Any, ...]:
    """Keys in natural order (``layers.2`` before ``layers.10``), as transformers sorts them."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))


def _base_prefix(key: str, prefix: str | None, present: dict[str, bool]) -> str:
    """Add or remove the model's ``base_model_prefix`` as ``from_pretrained`` does: a
    ``*ForCausalLM`` from a base-model checkpoint, and the other way round."""
    if prefix is None:
        return key
    if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in present:
        return key[len(prefix) + 1 :]
    if f"{prefix}.{key}" in present:
        return f"{prefix}.{key}"
    return key


def _class_name(module: nn.Module) -> str:
    return _own_class(module).__name__


def _conversion_mapping(model: nn.Module) -> list[Any]:
    """``transformers.conversion_mapping.get_model_conversion_mapping(model)`` (legacy renamings
    included, no quantizer), looking each sub-model up by its own class name rather than the
    name of the class FSDP2 gives a sharded module."""
    mods = hf_compat.modules()
    if mods is None:
        return []
    cm = mods[0]
    out: list[Any] = []
    seen: defaultdict[str, list[str]] = defaultdict(list)

    def claimed(ident: str, name: str) -> bool:
        return any(s == "" or name.startswith(s + ".") for s in seen[ident])

    for name, sub in model.named_modules():
        if not is_hf_model(sub):
            continue
        own = _own_class(sub)
        cls, model_type = own.__name__, sub.config.model_type
        if hf_compat.skips_custom_code(cm, own, model_type):
            continue
        if claimed(cls, name):
            continue
        conversions = cm.get_checkpoint_conversion_mapping(cls)
        by_class = conversions is not None
        if not by_class:
            if model_type and claimed(model_type, name):
                continue
            if model_type is not None:
                conversions = cm.get_checkpoint_conversion_mapping(model_type)
        if conversions is None:
            continue
        if name != "":
            scope = name.removeprefix(model.base_model_prefix).removeprefix(".")
            for t in conversions:
                t.scope_prefix = scope
                t.base_model_prefix = model.base_model_prefix
        out.extend(conversions)
        seen[cls].append(name)
        if not by_class and model_type:
            seen[model_type].append(name)
    out.extend(_conversion_mapping_legacy())
    return out


def _ignored_unexpected(model: nn.Module) -> re.Pattern[str] | None:
    """The checkpoint keys ``from_pretrained`` drops without a word (its own rule set)."""
    pats = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        pats.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        pats.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(pats))) if pats else None


def _ties(model: nn.Module, target: dict[str, TensorInfo]) -> list[RuleBase]:
    tied = hf_compat.tied_weights(model)
    return [Tie(dst=dst, src=src) for dst, src in sorted(tied.items()) if dst in target and src in target]


# -- one converter's operations as rules ---------------------------------------------------------


def _star_regex(pattern: str, fam: str) -> re.Pattern[str]:
    """A converter source glob (``mlp.experts.*.gate_proj.weight``) as a regex capturing ``*``."""
    text = pattern.removeprefix("^").replace(r"\.", ".")
    if re.search(r"[()\[\]?+{}|$\\]", text):
        raise AdapterError(f"{fam}: converter source pattern {pattern!r} is a regex, not a glob; it has no rule here")
    return re.compile(r"\.".join(re.escape(p) for p in text.split(".")).replace(r"\*", r"([^.]+)"))


def _chain(g: _Group, ckpt: dict[str, TensorInfo], target: dict[str, TensorInfo], fam: str) -> list[RuleBase]:
    """The rules doing what ``g.conv``'s operations do to ``g.members``, into ``g.target``."""
    conv = g.conv
    t0 = conv.target_patterns[0]
    head, sep, tail = g.target.partition(t0)
    finals = [head + t + tail for t in conv.target_patterns] if sep else [g.target]
    ops = list(conv.operations)
    rules: list[RuleBase] = []
    # current tensors: name -> (shape, list of (index, key) still to stack, or None)
    cur: dict[str, tuple[list[int], list[tuple[int, str]] | None]] = {}
    for i, sp in enumerate(conv.source_patterns):
        keys = [k for p, k in g.members if p == sp]
        if not keys:
            continue
        if "*" in sp:
            rx = _star_regex(sp, fam)
            found = []
            for k in keys:
                m = rx.search(k)
                if m is None or not m.group(1).isdigit():
                    raise AdapterError(f"{fam}: cannot find the index '*' of {sp!r} in checkpoint key {k!r}")
                found.append((int(m.group(1)), k))
            cur[f"{g.target}@{i}"] = (list(ckpt[keys[0]].shape), sorted(found))
        elif len(keys) == 1:
            cur[keys[0]] = (list(ckpt[keys[0]].shape), None)
        else:
            raise AdapterError(f"{fam}: converter pattern {sp!r} matches several keys for {g.target!r}: {keys}")

    def fail(op: Any, why: str) -> AdapterError:
        return AdapterError(
            f"{fam}: transformers' conversion operation {type(op).__name__} ({why}) of the converter "
            f"{conv.source_patterns} -> {conv.target_patterns} has no sdadapt rule; pass an adapter of your own"
        )

    for n, op in enumerate(ops):
        last = n == len(ops) - 1
        name = type(op).__name__
        if name == "MergeModulelist":
            out: dict[str, tuple[list[int], list[tuple[int, str]] | None]] = {}
            for tmp, (shape, entries) in cur.items():
                if entries is None:
                    raise fail(op, f"{tmp!r} is no list of modules")
                k0 = entries[0][1]
                rx = _star_regex(next(p for p, k in g.members if k == k0), fam)
                m = rx.search(k0)
                assert m is not None
                pat = k0[: m.start(1)] + "{e}" + k0[m.end(1) :]
                dst = finals[0] if last and len(cur) == 1 else tmp
                rules.append(Stack(src=_literal(pat), dst=dst, over="e", dim=op.dim))
                d = op.dim % (len(shape) + 1)
                out[dst] = (shape[:d] + [len(entries)] + shape[d:], None)
            cur = out
        elif name == "Concatenate" and getattr(op, "num_shards_attribute", None) is None:
            names = list(cur)
            shapes = [cur[k][0] for k in names]
            if any(cur[k][1] is not None for k in names):
                raise fail(op, "its inputs are lists of modules")
            dst = finals[0] if last else f"{g.target}@cat{n}"
            d = op.dim % len(shapes[0])
            if len(names) == 1:
                rules.append(Rename(src=names[0], dst=dst))
            else:
                rules.append(Fuse(srcs=names, dst=dst, dim=op.dim))
            shape = list(shapes[0])
            shape[d] = sum(s[d] for s in shapes)
            cur = {dst: (shape, None)}
        elif name in ("Chunk", "Split") and getattr(op, "num_shards_attribute", None) is None:
            if len(cur) != 1 or next(iter(cur.values()))[1] is not None or not last:
                raise fail(op, "not the last operation on one tensor")
            (src, (shape, _)), = cur.items()
            d = op.dim % len(shape)
            sizes = None
            if name == "Chunk":
                if shape[d] % len(finals):
                    raise fail(op, f"{shape[d]} does not divide into {len(finals)} equal parts")
                sizes = [shape[d] // len(finals)] * len(finals)
            rules.append(Split(src=src, dsts=finals, dim=op.dim, sizes=sizes))
            cur = {f: ([], None) for f in finals}
        elif name == "Transpose" and len(cur) == 1 and next(iter(cur.values()))[1] is None:
            (src, (shape, _)), = cur.items()
            swapped = list(shape)
            swapped[op.dim0], swapped[op.dim1] = shape[op.dim1], shape[op.dim0]
            want = target.get(finals[0])
            if not hf_compat.transposes_only_when_shapes_differ(op) or want is None or list(want.shape) != shape:
                rules.append(Transpose(keys=src, dim0=op.dim0, dim1=op.dim1))
                shape = swapped
            cur = {src: (shape, None)}
        elif name == "Interleave" and len(cur) == 1 and next(iter(cur.values()))[1] is None:
            (src, (shape, _)), = cur.items()
            half = shape[op.dim] // 2
            if shape[op.dim] % 2:
                raise fail(op, f"size {shape[op.dim]} along dim {op.dim} is odd")
            kind = Interleave if op.inverse else Deinterleave
            rules.append(kind(keys=src, sizes=[half, half], tp=half, dim=op.dim))
        else:
            raise fail(op, "unsupported operation" if name not in _MAPPED else "used in a way not mapped")
    for name, (_, entries) in cur.items():
        if entries is not None:
            raise AdapterError(f"{fam}: converter {conv.source_patterns} leaves {name!r} a list of modules")
    if len(finals) == 1 and list(cur) != finals:
        (src,) = cur
        rules.append(Rename(src=src, dst=finals[0]))
    return rules


_MAPPED = ("MergeModulelist", "Concatenate", "Chunk", "Split", "Transpose", "Interleave")


# -- concrete keys folded into patterns ----------------------------------------------------------


def _literal(key: str) -> str:
    """A key as a pattern: its ``{e}`` capture (if any) stays; nothing else is special in HF keys."""
    if "*" in key or key.count("{") != key.count("{e}"):
        raise AdapterError(f"checkpoint key {key!r} holds '*' or braces; it cannot be used in a pattern")
    return key


def _digits(key: str) -> list[str]:
    return [s for s in key.split(".") if _DIGITS.match(s)]


def _general(key: str, sig: list[str], typed: bool) -> str | None:
    """``key`` with its digit segments replaced by ``{n0}``, ``{n1}``... when they are ``sig``."""
    parts = key.split(".")
    pos = [i for i, s in enumerate(parts) if _DIGITS.match(s)]
    if [parts[i] for i in pos] != sig:
        return None
    for j, i in enumerate(pos):
        parts[i] = f"{{n{j}:int}}" if typed else f"{{n{j}}}"
    return ".".join(parts)


def _rule_keys(rule: RuleBase) -> list[tuple[str, bool]]:
    """The key fields of a rule this module emits: (field, is_input)."""
    if isinstance(rule, Stack | Rename):
        return [("src", True), ("dst", False)]
    if isinstance(rule, Fuse):
        return [("srcs", True), ("dst", False)]
    if isinstance(rule, Split):
        return [("src", True), ("dsts", False)]
    return [("keys", True)]


def _generalise_chain(rules: list[RuleBase], sig: list[str]) -> list[RuleBase] | None:
    out = []
    for r in rules:
        data = r.model_dump()
        for field, is_input in _rule_keys(r):
            value = data[field]
            values = value if isinstance(value, list) else [value]
            gen = [_general(v, sig, is_input) for v in values]
            if any(x is None for x in gen):
                return None
            data[field] = gen if isinstance(value, list) else gen[0]
        out.append(type(r)(**data))
    return out


def _json(rules: list[RuleBase]) -> str:
    return "\n".join(r.model_dump_json() for r in rules)


def _fold(order: list[str], outcome: dict[str, tuple[Any, ...]], chains: dict[str, list[RuleBase]]) -> list[RuleBase]:
    """One rule (or chain) per class of checkpoint keys (``order``: all of them, sorted) that
    differ only in digit segments and are all treated alike; per key where they are not."""
    classes: dict[str, list[str]] = defaultdict(list)
    for key in order:
        classes[re.sub(r"(?<![^.])\d+(?![^.])", "#", key)].append(key)
    renames: list[RuleBase] = []
    drops: list[RuleBase] = []
    emitted: set[str] = set()
    convs: list[RuleBase] = []
    for keys in classes.values():
        outs = {_class_outcome(k, outcome[k]) for k in keys}
        general = len(outs) == 1 and None not in outs
        for k in keys:
            o = outcome[k]
            if o[0] == "rename":
                pat = _general(k, _digits(k), True) if general else None
                dst = _general(o[1], _digits(k), False) if general else None
                r = Rename(src=pat, dst=dst) if pat and dst else Rename(src=_literal(k), dst=_literal(o[1]))
                _add(r, renames, emitted)
            elif o[0] == "drop":
                pat = _general(k, _digits(k), True) if general else None
                _add(Drop(keys=pat or _literal(k)), drops, emitted)
            elif o[0] == "conv":
                ident = o[1] if general and o[1] else str(o[2])
                if ident not in emitted:
                    emitted.add(ident)
                    convs.extend(chains[ident])
    return renames + drops + convs


def _class_outcome(key: str, o: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What happens to ``key``, with its digits abstracted (None: not expressible as a pattern)."""
    if o[0] == "rename":
        dst = _general(o[1], _digits(key), False)
        return None if dst is None else ("rename", dst)
    if o[0] == "conv":
        return ("conv", o[1]) if o[1] else None
    return o


def _add(rule: RuleBase, into: list[RuleBase], emitted: set[str]) -> None:
    text = rule.model_dump_json()
    if text not in emitted:
        emitted.add(text)
        into.append(rule)
