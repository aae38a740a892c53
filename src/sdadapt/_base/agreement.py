"""The ranks agree on what they are about to do before any byte moves.

A collective operation (a load, a save, an export, a refit) is correct only if every rank does
the same thing: the same adapter, the same plan, the same library versions. Two ranks that
derive different adapters from one ``config.json`` (another transformers release), or a rank
that picked another adapter file, would each fill their own shards by their own rule and the
model would match neither. :func:`agree_on` catches that: each rank digests each part of what
it is about to do (a fixed-size hash per part), and one all-reduce of a fixed-size tensor
(the parts' hashes, their complements and a failure flag) tells every rank whether all ranks
hold the same digests and whether any rank failed. The traffic is the same at any world size
(``8 * (1 + 2 * parts)`` bytes per rank); only when the ranks differ do they exchange the parts
themselves, to name the ranks and what differs.

The same all-reduce can carry one value the ranks need not agree on (``spread``), to learn
whether every rank holds the same: a load asks so of each rank's host (:func:`host_id`), since
ranks on one host share its page cache (TP row sharing's ``"auto"``, :mod:`sdadapt._engine.share`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DisagreementError, RemoteRankError
from .distributed import brief_off_rank0, collective_device, gather_objects, is_distributed, raise_agreed
from .version import VERSION, version_of

_TOP = (1 << 62) - 1  # digests are 62-bit, so that TOP - digest is a non-negative int64 as well
_NOTHING = object()


def installed_versions() -> dict[str, str]:
    """The versions that decide what a rank does with one adapter and one checkpoint: sdadapt's,
    torch's and transformers' (``"absent"`` when not installed)."""
    return {"sdadapt": VERSION, "torch": torch.__version__, "transformers": version_of("transformers") or "absent"}


def digest(value: Any) -> int:
    """A 62-bit hash of ``value``'s canonical JSON (keys sorted; what JSON cannot hold as its text)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _TOP


def agreement_bytes(parts: int, spread: bool = False) -> int:
    """The bytes each rank contributes to one agreement over ``parts`` parts (any world size);
    ``spread``: carrying a value the ranks compare without agreeing (:func:`agree_on`)."""
    return 8 * (1 + 2 * parts + (2 if spread else 0))


def host_id() -> str:
    """What tells this rank's host from others: its hostname and the running kernel's boot id
    (``/proc/sys/kernel/random/boot_id``, new at every boot), so that two machines never look
    alike. Ranks with the same id share one page cache. ``SDADAPT_HOST_ID`` replaces it (a test
    that plays several hosts on one machine)."""
    forced = os.environ.get("SDADAPT_HOST_ID")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def spans_hosts(group: dist.ProcessGroup) -> bool:
    """Collective over ``group``: whether its members run on more than one host (:func:`host_id`);
    one all-reduce of two integers."""
    code = digest(host_id())
    t = torch.tensor([code, _TOP - code], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    high, low = t.tolist()
    return high != _TOP - low


def agree_on(
    parts: Mapping[str, Any],
    error: BaseException | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    what: str,
    mismatch: Callable[[str], BaseException] = DisagreementError,
    remote: Callable[[str], BaseException] = RemoteRankError,
    timeout: float | None = None,
    spread: Any = _NOTHING,
) -> bool:
    """Collective: every rank calls it at the same point with the same part names. If any rank
    passes ``error``, every rank raises (as :func:`~sdadapt._base.distributed.agree`: its own
    error, or ``remote(message)`` quoting the first failing rank's); else if
    the ranks' parts differ, every rank raises ``mismatch(message)``, the message naming the
    ranks that differ from rank 0 and what differs. One all-reduce of a fixed-size tensor.

    ``parts``: name -> a JSON-able description (``"adapter"``: its rules, ``"plan"``: key ->
    shape, dtype, recipe, ``"versions"``: :func:`installed_versions`). A failing rank may pass
    ``None`` values. ``what``: the operation, for the message ("load ckpt/"). ``timeout``: seconds
    to wait for the other ranks (``None``: the group's own timeout); past it, a ``RuntimeError``
    from the backend. ``spread``: a JSON-able value the ranks need not agree on, carried in the
    same all-reduce (every rank passes one or none does: :func:`agreement_bytes` with ``spread``).

    Returns:
        Whether every rank passed the same ``spread`` (``True`` where none is passed, outside
        a process group, or in a group of one: there nothing is compared, no collective runs)."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return True
    names = sorted(parts)
    codes = [0] * len(names) if error is not None else [digest(parts[n]) for n in names]
    if spread is not _NOTHING:
        codes.append(digest(spread))
    flag = 1 if error is not None else 0
    t = torch.tensor([flag, *codes, *(_TOP - c for c in codes)], dtype=torch.int64, device=collective_device(group))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=timeout is not None)
    if timeout is not None:
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    got = t.tolist()
    if got[0]:
        raise_agreed(error, group, remote)
    k = len(codes)
    differ = [n for i, n in enumerate(names) if got[1 + i] != _TOP - got[1 + k + i]]
    if not differ:
        return spread is _NOTHING or got[k] == _TOP - got[2 * k]
    every = gather_objects({n: parts[n] for n in differ}, group)
    e = mismatch(disagreement_message(every, differ, what))
    brief_off_rank0(e, group)
    raise e


# ------------------------------------------------------------------------------ the message
def disagreement_message(every: Sequence[Mapping[str, Any]], differ: Sequence[str], what: str) -> str:
    """What differs between the ranks' ``differ`` parts, each rank against rank 0."""
    lines: list[str] = []
    for name in differ:
        groups: dict[int, list[int]] = {}
        for r, parts in enumerate(every):
            groups.setdefault(digest(parts[name]), []).append(r)
        base = digest(every[0][name])
        for code, ranks in groups.items():
            if code != base:
                lines.append(_difference(name, ranks, every[0][name], every[ranks[0]][name]))
    shown = "\n".join(f"  {line}" for line in lines[:12]) + ("\n  ..." if len(lines) > 12 else "")
    return (
        f"the ranks disagree on what to do ({what}); nothing was read or written:\n{shown}\n"
        "Every rank must pass the same adapter and options and run the same sdadapt, torch and transformers "
        "(`sdadapt env` on each node lists them)."
    )


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''}"


def _short(value: Any, limit: int = 160) -> str:
    if value is _NOTHING:
        return "nothing"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        text = "[" + ", ".join(value) + "]"
    else:
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_difference(a: Any, b: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], Any, Any] | None:
    """The first place (a path of keys and indices) where ``a`` and ``b`` differ, with both
    values there (``_NOTHING`` where one side has no such key or index); ``None``: equal."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return (*path, k), a.get(k, _NOTHING), b.get(k, _NOTHING)
            found = first_difference(a[k], b[k], (*path, k))
            if found is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and not _is_leaf_list(a) and not _is_leaf_list(b):
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                return (*path, i), a[i] if i < len(a) else _NOTHING, b[i] if i < len(b) else _NOTHING
            found = first_difference(a[i], b[i], (*path, i))
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _is_leaf_list(value: Any) -> bool:
    """A list shown whole (key patterns, a shape): of strings or numbers only."""
    return all(isinstance(v, str | int | float) for v in value)


_VERBS = {"fuse": ("srcs", "fuses"), "split": ("dsts", "splits into"), "stack": ("src", "stacks")}


def _difference(name: str, ranks: list[int], base: Any, other: Any) -> str:
    """One line: how ``ranks``' part ``name`` differs from rank 0's."""
    who = _who(ranks)
    found = first_difference(base, other)
    if found is None:  # the same values, a different digest (a value JSON shows alike): say so
        return f"{who}'s {name} differs from rank 0's"
    path, a, b = found
    if name == "versions" and len(path) == 1:
        return f"{who} runs {path[0]} {_short(b)}, rank 0 {_short(a)}"
    if name == "adapter" and len(path) >= 2 and path[0] == "rules" and isinstance(path[1], int):
        i = path[1]
        rules_a, rules_b = base.get("rules", []), other.get("rules", [])
        if len(path) == 2:  # a rule only one side has
            if a is _NOTHING:
                return f"{who}'s adapter has {len(rules_b)} rules where rank 0's has {len(rules_a)} (#{i}: {_rule(b)})"
            return f"{who}'s adapter has {len(rules_b)} rules where rank 0's has {len(rules_a)} (#{i}: {_rule(a)})"
        kind_a, kind_b = rules_a[i].get("kind"), rules_b[i].get("kind")
        if kind_a != kind_b:
            return f"{who}'s adapter rule #{i} is {_rule(rules_b[i])} where rank 0's is {_rule(rules_a[i])}"
        field = path[2]
        verb = _VERBS.get(str(kind_a))
        if verb is not None and rules_a[i].get(verb[0]) != rules_b[i].get(verb[0]):  # what it takes, first
            a, b = rules_a[i].get(verb[0]), rules_b[i].get(verb[0])
            return f"{who}'s adapter (rule #{i}) {verb[1]} {_short(b)} where rank 0's {verb[1]} {_short(a)}"
        return f"{who}'s adapter rule #{i} ({kind_a}) has {field}={_short(b)} where rank 0's has {field}={_short(a)}"
    if name == "plan" and path:
        key = path[0]
        if b is _NOTHING:
            return f"{who}'s plan has no {key} where rank 0's makes it"
        if a is _NOTHING:
            return f"{who}'s plan makes {key} where rank 0's does not"
        whole_a, whole_b = base[key], other[key]
        return f"{who}'s plan makes {key} as {_short(whole_b)} where rank 0's makes it as {_short(whole_a)}"
    where = ".".join(str(p) for p in path)
    return f"{who}'s {name}{' ' + where if where else ''} is {_short(b)} where rank 0's is {_short(a)}"


def _rule(rule: Any) -> str:
    if not isinstance(rule, Mapping):
        return _short(rule)
    fields = ", ".join(f"{k}={_short(v, 60)}" for k, v in rule.items() if k != "kind" and v is not None)
    return _short(f"{rule.get('kind')}({fields})")


__all__ = ["agree_on", "agreement_bytes", "digest", "disagreement_message", "host_id", "installed_versions", "spans_hosts"]
