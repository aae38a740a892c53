"""The public rule constructors (``sdadapt.rename(...)``, ``sdadapt.fuse(...)``...): typed
functions that build the rule models of :mod:`sdadapt.rules`. The quantized formats' ones
(``sdadapt.dequant_fp8(...)``...) are in :mod:`._quant_functions`, imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from ._keys import Rename

if TYPE_CHECKING:
    from ._key_moves import AddPrefix, Drop, Fuse, Split, StripPrefix, Tie
    from ._stacking import Stack, Unstack
    from ._tensor_parallel import Deinterleave, Interleave
    from ._values import Affine, Cast, Pad, Rotary, Transpose, Trim


def rename(src: str, dst: str) -> Rename:
    """``src`` keys become ``dst`` keys; ``{name}`` captures carry over (``layers.{i}.wq``).

    Args:
        src: the checkpoint's key pattern (``{name}`` captures one dot-free part, ``**`` any run).
        dst: the new key pattern, using ``src``'s captures.

    Returns:
        The :class:`~sdadapt.rules.Rename` rule.

    Example::

        sdadapt.rename("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight")
    """
    return Rename(src=src, dst=dst)


def fuse(srcs: list[str], dst: str, dim: int = 0, sizes: list[int] | None = None, *, heads: int | None = None) -> Fuse:
    """Concatenate ``srcs`` along ``dim`` into ``dst`` (q, k, v -> qkv). ``heads=H``: the fused
    tensor is laid out per head, ``[H, parts, rows]`` (GPT-NeoX's ``query_key_value``).

    Args:
        srcs: the key patterns of the parts, in order.
        dst: the fused key pattern.
        dim: the dim to concatenate along.
        sizes: the parts' sizes along ``dim``; parts of different sizes (GQA) need them, so that
            the inverse split (an export) cuts them back where they were.
        heads: lay the fused tensor out per head, ``[H, parts, rows]``.

    Returns:
        The :class:`~sdadapt.rules.Fuse` rule.

    Example::

        qkv = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
        sdadapt.fuse(qkv, "layers.{i}.attention.wqkv.weight")
    """
    from ._key_moves import Fuse  # noqa: PLC0415 - its module is imported on first use

    return Fuse(srcs=srcs, dst=dst, dim=dim, sizes=sizes, heads=heads)


def split(src: str, dsts: list[str], dim: int = 0, sizes: list[int] | None = None, *, heads: int | None = None) -> Split:
    """Cut ``src`` along ``dim`` into ``dsts`` (qkv -> q, k, v); the inverse of :func:`fuse`.

    Args:
        src: the fused key pattern.
        dsts: the key patterns of the parts, in order.
        dim: the dim to cut along.
        sizes: the parts' sizes along ``dim``; default: the target's, else equal parts.
        heads: ``src`` is laid out per head, ``[H, parts, rows]``: each part is taken from
            every head's block (GPT-NeoX's ``query_key_value`` -> q, k, v).

    Returns:
        The :class:`~sdadapt.rules.Split` rule.

    Example::

        qkv = ["h.{i}.q.weight", "h.{i}.k.weight", "h.{i}.v.weight"]
        sdadapt.split("h.{i}.attn.query_key_value.weight", qkv, heads=8)
    """
    from ._key_moves import Split  # noqa: PLC0415 - its module is imported on first use

    return Split(src=src, dsts=dsts, dim=dim, sizes=sizes, heads=heads)


def cast(keys: str, dtype: str | torch.dtype, from_dtype: str | torch.dtype | None = None) -> Cast:
    """Convert tensors matching ``keys`` to ``dtype`` (only those stored as ``from_dtype``, if given);
    ``dtype="model"``: to the dtype the model holds for each tensor.

    Args:
        keys: the key pattern.
        dtype: the dtype to convert to (``"bfloat16"``, ``torch.float32``), or ``"model"``: the
            dtype the model holds for each key.
        from_dtype: the dtype the inverse (export) converts back to.

    Returns:
        The :class:`~sdadapt.rules.Cast` rule.

    Example::

        sdadapt.cast("**", "model")
    """
    from ._values import Cast  # noqa: PLC0415 - its module is imported on first use

    return Cast(keys=keys, dtype=dtype, from_dtype=from_dtype)  # type: ignore[arg-type]


def drop(keys: str, *, shadows: bool = False) -> Drop:
    """Ignore source keys matching ``keys`` on purpose. ``shadows=True``: the drop takes its
    keys before later rules that match them too, on purpose (a whole layer dropped first,
    whatever it holds: ``drop("model.layers.61.**", shadows=True)``), so those rules are not
    reported as ambiguous.

    Args:
        keys: the key pattern of the source keys to ignore.
        shadows: take the keys before later rules that match them too.

    Returns:
        The :class:`~sdadapt.rules.Drop` rule.

    Example::

        sdadapt.drop("**.rotary_emb.inv_freq")
    """
    from ._key_moves import Drop  # noqa: PLC0415 - its module is imported on first use

    return Drop(keys=keys, shadows=shadows or None)


def tie(dst: str, src: str) -> Tie:
    """Fill ``dst`` from ``src`` when the checkpoint lacks ``dst`` (tied embeddings).

    Args:
        dst: the key to fill (``output.weight``).
        src: the key it is filled from (``tok_embeddings.weight``).

    Returns:
        The :class:`~sdadapt.rules.Tie` rule.

    Example::

        sdadapt.tie("output.weight", "tok_embeddings.weight")
    """
    from ._key_moves import Tie  # noqa: PLC0415 - its module is imported on first use

    return Tie(dst=dst, src=src)


def transpose(keys: str, dim0: int = 0, dim1: int = 1) -> Transpose:
    """Swap dims ``dim0`` and ``dim1`` of tensors matching ``keys`` (GPT-2 ``Conv1D`` <-> ``nn.Linear``).

    Args:
        keys: the key pattern.
        dim0: one dim to swap.
        dim1: the other.

    Returns:
        The :class:`~sdadapt.rules.Transpose` rule.

    Example::

        sdadapt.transpose("h.{i}.attn.c_attn.weight")
    """
    from ._values import Transpose  # noqa: PLC0415 - its module is imported on first use

    return Transpose(keys=keys, dim0=dim0, dim1=dim1)


def rotary(
    keys: str | list[str],
    heads: int | None = None,
    to: Literal["interleaved", "half"] = "interleaved",
    dim: int = 0,
    *,
    head_dim: int | None = None,
    rotary_dim: int | float | None = None,
) -> Rotary:
    """Reorder the rows inside each head between rotary layouts: ``to="interleaved"`` from HF
    transformers' half split to Meta's pairs, ``to="half"`` the other way.

    Args:
        keys: one pattern or several (weight, bias, per-head norm weight).
        heads: the head count; a head is the rows divided by ``heads`` (GQA: one rule for k
            with the kv head count).
        to: ``"interleaved"`` (Meta's pairs) or ``"half"`` (HF's halves).
        dim: the dim that holds the heads' rows.
        head_dim: the rows of one head, instead of ``heads``; per-head norm weights
            ``[head_dim]`` need it.
        rotary_dim: partial rotary: the rows of each head that rotate (an int, or a fraction of
            the head such as config.json's ``partial_rotary_factor``); only they are reordered.

    Returns:
        The :class:`~sdadapt.rules.Rotary` rule.

    Example::

        sdadapt.rotary("layers.{i}.attention.wq.weight", heads=32, rotary_dim=0.25)
    """
    from ._values import Rotary  # noqa: PLC0415 - its module is imported on first use

    return Rotary(keys=keys, heads=heads, to=to, dim=dim, head_dim=head_dim, rotary_dim=rotary_dim)


def affine(keys: str | list[str], scale: float = 1.0, shift: float = 0.0) -> Affine:
    """``w * scale + shift`` for tensors matching ``keys`` (Gemma's ``1 + w`` norms:
    ``affine("**norm.weight", shift=1.0)``); the inverse computes ``(w - shift) / scale``.

    Args:
        keys: one key pattern or several.
        scale: the factor.
        shift: the offset added after scaling.

    Returns:
        The :class:`~sdadapt.rules.Affine` rule.

    Example::

        sdadapt.affine("**norm.weight", shift=1.0)
    """
    from ._values import Affine  # noqa: PLC0415 - its module is imported on first use

    return Affine(keys=keys, scale=scale, shift=shift)


def stack(src: str, dst: str, over: str = "e", dim: int = 0, count: int | None = None) -> Stack:
    """Keys matching ``src`` that differ in capture ``over`` (0..E-1) become one ``[E, ...]`` tensor ``dst``.

    Args:
        src: the per-entry key pattern, with capture ``over`` (``experts.{e}.w1.weight``).
        dst: the stacked key pattern.
        over: the capture that numbers the entries.
        dim: the new dim the entries are stacked along.
        count: how many entries (default: as many as the checkpoint holds, 0..E-1).

    Returns:
        The :class:`~sdadapt.rules.Stack` rule.

    Example::

        sdadapt.stack("layers.{i}.experts.{e}.w1.weight", "layers.{i}.moe.experts.w1")
    """
    from ._stacking import Stack  # noqa: PLC0415 - its module is imported on first use

    return Stack(src=src, dst=dst, over=over, dim=dim, count=count)


def unstack(src: str, dst: str, over: str = "e", dim: int = 0, count: int | None = None) -> Unstack:
    """One tensor ``src`` becomes one key ``dst`` per entry along ``dim`` (``dst`` captures ``over``).

    Args:
        src: the stacked key pattern.
        dst: the per-entry key pattern, with capture ``over``.
        over: the capture that numbers the entries.
        dim: the dim the entries lie along.
        count: how many entries (default: the size of ``dim``).

    Returns:
        The :class:`~sdadapt.rules.Unstack` rule.

    Example::

        sdadapt.unstack("layers.{i}.moe.experts.w1", "layers.{i}.experts.{e}.w1.weight")
    """
    from ._stacking import Unstack  # noqa: PLC0415 - its module is imported on first use

    return Unstack(src=src, dst=dst, over=over, dim=dim, count=count)


def pad(
    keys: str, dim: int = 0, size: int | None = None, multiple_of: int | None = None, value: float = 0.0
) -> Pad:
    """Extend along ``dim`` with ``value`` to ``size``, the next multiple of ``multiple_of``, or the model's size.

    Args:
        keys: the key pattern.
        dim: the dim to extend.
        size: the size to reach.
        multiple_of: reach the next multiple of this instead.
        value: the fill value.

    Returns:
        The :class:`~sdadapt.rules.Pad` rule.

    Example::

        sdadapt.pad("embed_tokens.weight", multiple_of=64)
    """
    from ._values import Pad  # noqa: PLC0415 - its module is imported on first use

    return Pad(keys=keys, dim=dim, size=size, multiple_of=multiple_of, value=value)


def trim(keys: str, dim: int = 0, size: int | None = None) -> Trim:
    """Keep the first ``size`` entries along ``dim`` (``size`` omitted: the model's size for that key).

    Args:
        keys: the key pattern.
        dim: the dim to cut.
        size: the entries to keep (default: the model's size for that key).

    Returns:
        The :class:`~sdadapt.rules.Trim` rule.

    Example::

        sdadapt.trim("embed_tokens.weight", size=32000)
    """
    from ._values import Trim  # noqa: PLC0415 - its module is imported on first use

    return Trim(keys=keys, dim=dim, size=size)


def interleave(
    keys: str | list[str], sizes: list[int], tp: int | None = None, dim: int = 0, *, replicas: list[int] | None = None
) -> Interleave:
    """Lay fused ``[p0; p1; ...]`` (``sizes``) out per TP rank so each ``ColwiseParallel`` shard holds
    ``[p0_r; p1_r; ...]``; ``tp`` omitted: the model's TP degree for that key.

    Args:
        keys: one key pattern or several (weight and bias).
        sizes: the fused parts' sizes along ``dim``.
        tp: the TP degree (default: the model's for that key).
        dim: the fused dim.
        replicas: per part, how many consecutive ranks share each of its blocks (default all 1);
            vLLM's KV heads fewer than its TP degree: ``[1, tp // n_kv, tp // n_kv]`` for q, k, v.

    Returns:
        The :class:`~sdadapt.rules.Interleave` rule.

    Example::

        sdadapt.interleave("layers.{i}.feed_forward.w13.weight", sizes=[hidden, hidden])
    """
    from ._tensor_parallel import Interleave  # noqa: PLC0415 - its module is imported on first use

    return Interleave(keys=keys, sizes=sizes, tp=tp, dim=dim, replicas=replicas)


def deinterleave(
    keys: str | list[str], sizes: list[int], tp: int | None = None, dim: int = 0, *, replicas: list[int] | None = None
) -> Deinterleave:
    """The inverse of :func:`interleave` (``tp`` omitted: the source's TP degree for that key).

    Args:
        keys: one key pattern or several.
        sizes: the fused parts' sizes along ``dim`` (without the copies).
        tp: the TP degree the source was laid out for (default: the source's for that key).
        dim: the fused dim.
        replicas: as for :func:`interleave`; each block is read from the first rank holding it.

    Returns:
        The :class:`~sdadapt.rules.Deinterleave` rule.

    Example::

        sdadapt.deinterleave("layers.{i}.feed_forward.w13.weight", sizes=[hidden, hidden], tp=4)
    """
    from ._tensor_parallel import Deinterleave  # noqa: PLC0415 - its module is imported on first use

    return Deinterleave(keys=keys, sizes=sizes, tp=tp, dim=dim, replicas=replicas)


def strip_prefix(prefix: str, optional: bool = False) -> StripPrefix:
    """Remove ``prefix`` (e.g. ``"model."``) from keys that start with it. ``_orig_mod.``,
    ``_checkpoint_wrapped_module.`` and ``_fsdp_wrapped_module.`` need no rule: planning removes them.

    Args:
        prefix: the prefix to remove.
        optional: keys without it are fine (else they are reported).

    Returns:
        The :class:`~sdadapt.rules.StripPrefix` rule.

    Example::

        sdadapt.strip_prefix("model.")
    """
    from ._key_moves import StripPrefix  # noqa: PLC0415 - its module is imported on first use

    return StripPrefix(prefix=prefix, optional=optional)


def add_prefix(prefix: str, keys: str = "**") -> AddPrefix:
    """Put ``prefix`` in front of keys matching ``keys`` (the inverse of :func:`strip_prefix`).

    Args:
        prefix: the prefix to add.
        keys: the key pattern of the keys that get it.

    Returns:
        The :class:`~sdadapt.rules.AddPrefix` rule.

    Example::

        sdadapt.add_prefix("model.")
    """
    from ._key_moves import AddPrefix  # noqa: PLC0415 - its module is imported on first use

    return AddPrefix(prefix=prefix, keys=keys)
