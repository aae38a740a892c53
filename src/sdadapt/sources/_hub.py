"""Hugging Face Hub ids as sources: ``hf://org/name[@revision]`` -> a local snapshot folder.

The files come from ``huggingface_hub``'s cache (the optional extra ``sdadapt[hub]``), which
honours ``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``. Only what a load needs is
fetched: ``config.json`` (and ``params.json``, which shipped adapters read options from), the
``model.safetensors.index.json`` and the shards it names, or a single ``model.safetensors``.

With several processes (``torch.distributed`` initialised), the process of local rank 0 on
each node (``LOCAL_RANK``; without it, global rank 0) downloads while the others wait; then
the others resolve the same files with ``local_files_only=True``. The Hub cache writes each
file under a temporary name and moves it into place when complete, so no process reads a
half-written file. A download error on any rank is every rank's error (no rank is left
waiting). Every process of the default process group must open the same Hub source.

Each id is resolved once per process: later opens reuse the folder (the load, then the adapter's
options, then the read all name the same files).

Nothing is read before the id is checked: the repository id by the Hub's rules, the revision as
a git ref name or a 40-hex commit (so ``@../../x`` cannot walk out of the cache). Every file a
load reads from the snapshot (config, index, shards) must resolve, symlinks followed, inside
the repository's folder of the cache. Whatever the Hub client raises becomes a
:class:`~sdadapt.errors.SourceError` naming the id.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

from .._base.distributed import agree, is_distributed
from .._base.progress import show_progress
from ..errors import SdadaptError, SourceError
from ._base import HUB_PREFIX, is_hub_id
from ._formats import HUB_MARKERS, HUB_SINGLE, hub_files

log = logging.getLogger(__name__)
T = TypeVar("T")

EXTRA = "pip install 'sdadapt[hub]'"
_SIDE_FILES = ("config.json", "params.json")
_ID = re.compile(r"(?P<repo>[^@]*)(?:@(?P<rev>.*))?", re.DOTALL)
# huggingface_hub's repo id rules (validate_repo_id), ASCII only and with the namespace required:
# 1-96 characters of letters, digits, "-", "_", "."; starting and ending with a letter or digit
# (or "_"); no "--" or ".."; not ending in ".git"
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO = re.compile(rf"{_PART}/{_PART}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_MAX_REVISION = 256
_resolved: dict[str, str] = {}


def check_repo_id(repo: str, text: str) -> None:
    """A :class:`SourceError` unless ``repo`` is ``namespace/name`` by the Hub's rules."""
    bad = _REPO.fullmatch(repo) is None or "--" in repo or ".." in repo or repo.endswith(".git")
    if bad:
        raise SourceError(
            f"{repo!r} is not a Hub repository id: give namespace/name, each part 1-96 letters, digits, '-', '_' "
            "or '.', starting and ending with a letter or digit, with no '--' or '..' and no '.git' ending",
            path=text,
        )


def check_revision(revision: str, text: str) -> None:
    """A :class:`SourceError` unless ``revision`` is a 40-hex commit or a git ref name
    (``git check-ref-format``'s rules: no ``..``, no component starting with ``.`` or ending in
    ``.lock``, no ``//``, no leading or trailing ``/``, no ``@{``, no control characters, spaces
    or ``~^:?*[\\``, not ``@``). Such a name never leaves the cache's ``refs`` and ``snapshots``."""
    if _COMMIT.fullmatch(revision):
        return
    parts = revision.split("/")
    why = None
    if not revision or len(revision) > _MAX_REVISION:
        why = f"it must be 1-{_MAX_REVISION} characters"
    elif ".." in revision:
        why = "a ref name cannot contain '..'"
    elif _REF_FORBIDDEN.search(revision):
        why = "a ref name cannot contain spaces, control characters or any of ~^:?*[\\"
    elif "@{" in revision or revision == "@":
        why = "a ref name cannot contain '@{' or be '@'"
    elif any(not p for p in parts):
        why = "a ref name cannot start or end with '/' or contain '//'"
    elif any(p.startswith(".") or p.endswith(".lock") for p in parts) or revision.endswith("."):
        why = "no part of a ref name can start with '.' or end with '.lock' or '.'"
    if why is not None:
        raise SourceError(
            f"revision {revision!r} is neither a 40-hex commit nor a git ref name ({why}); give a branch, a tag or a "
            "commit",
            path=text,
        )


def parse_hub_id(text: str) -> tuple[str, str | None]:
    """``"hf://org/name@rev"`` -> ``("org/name", "rev")``; no ``@rev`` -> revision ``None`` (main).
    Both are checked (:func:`check_repo_id`, :func:`check_revision`) before anything is read."""
    m = _ID.fullmatch(text[len(HUB_PREFIX) :]) if is_hub_id(text) else None
    if m is None or "/" not in m.group("repo"):
        raise SourceError(f"not a Hub id: give hf://org/name or hf://org/name@revision (got {text!r})", path=text)
    repo, rev = m.group("repo"), m.group("rev")
    check_repo_id(repo, text)
    if rev is not None:
        check_revision(rev, text)
    return repo, rev


def hub_folder(text: str, agree_fn: Callable[[BaseException | None], None] | None = None) -> str:
    """The local snapshot folder of Hub id ``text`` holding the files a load needs (downloaded
    into the Hub cache if missing).

    Collective when ``torch.distributed`` is initialised: every rank calls ``agree_fn`` (default
    :func:`sdadapt._base.distributed.agree`) exactly twice, whatever fails where: after the
    downloading process fetched (the others wait there), then after every process found the
    files in its cache. Any failure on any rank becomes every rank's error (a
    :class:`SourceError` naming the id on the failing rank), so no rank is left waiting."""
    agree_fn = agree_fn or agree
    if not is_distributed():
        folder = _resolved.get(text)
        if folder is None:
            folder = _guarded(text, lambda: _resolve(text, local_only=False))
            _resolved[text] = folder
        return folder
    error: BaseException | None = None
    try:
        parse_hub_id(text)  # on every rank: a malformed id is every rank's own error, not a remote one
        if text not in _resolved and _guarded(text, _downloads_here):
            _resolved[text] = _guarded(text, lambda: _resolve(text, local_only=False))
    except SourceError as e:
        error = e
    agree_fn(error)  # the others wait here until the downloads are complete (or failed)
    folder, error = _resolved.get(text), None
    if folder is None:
        try:
            folder = _resolved[text] = _guarded(text, lambda: _resolve(text, local_only=True))
        except SourceError as e:
            error = e
    agree_fn(error)
    assert folder is not None
    return folder


def _guarded(text: str, step: Callable[[], T]) -> T:
    """``step()``, any exception of it turned into a :class:`SourceError` naming ``text``."""
    try:
        return step()
    except SdadaptError:
        raise
    except Exception as e:  # noqa: BLE001 - the Hub client raises many kinds; all become ours
        raise SourceError(f"resolving the Hub id failed: {type(e).__name__}: {e}", path=text) from e


def _resolve(text: str, *, local_only: bool) -> str:
    repo, revision = parse_hub_id(text)
    hub = _import_hub(text)
    return _fetch(hub, text, repo, revision, local_only=local_only)


def _downloads_here() -> bool:
    import torch.distributed as dist

    local = os.environ.get("LOCAL_RANK")
    return int(local) == 0 if local is not None else dist.get_rank() == 0


def _import_hub(text: str) -> Any:
    try:  # the package loads its submodules lazily: name the ones used here
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError:
        raise SourceError(
            f"Hub ids need the huggingface_hub package: {EXTRA} (or download the files and pass the folder)",
            path=text,
        ) from None
    return huggingface_hub


def _fetch(hub: Any, text: str, repo: str, revision: str | None, *, local_only: bool) -> str:
    """Download (or, ``local_only``, find in the cache) the files a load of ``repo`` needs; every
    file must resolve inside the repository's cache folder (symlinks followed)."""
    folder = _snapshot(hub, text, repo, revision, [*_SIDE_FILES, *HUB_MARKERS], local_only)
    root = _inside_cache(hub, text, repo, folder)

    def fetched(name: str) -> str | None:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        _contained(root, path, text)
        return path

    listed = hub_files(fetched)  # an index and the shards it names (checked to be plain names inside)
    needed = [listed[0], *listed[1]] if listed is not None else [HUB_SINGLE]
    folder = _snapshot(hub, text, repo, revision, [*_SIDE_FILES, *needed], local_only)
    root = _inside_cache(hub, text, repo, folder)
    missing = [n for n in needed if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        where = "the local cache" if local_only or hub.constants.HF_HUB_OFFLINE else repo
        raise SourceError(
            f"{', '.join(map(str, missing[:8]))} not found in {where}; a Hub source needs {' or '.join(HUB_MARKERS)} "
            f"and its shards, or {HUB_SINGLE}",
            path=text,
        )
    for name in [*needed, *_SIDE_FILES]:
        full = os.path.join(folder, name)
        if os.path.lexists(full):
            _contained(root, full, text)
    log.info("%s: %d file(s) in %s", text, len(needed), folder)
    return folder


def _inside_cache(hub: Any, text: str, repo: str, folder: str) -> str:
    """The real path of ``repo``'s folder in the Hub cache, after checking that the snapshot
    ``folder`` lies inside it (symlinks resolved)."""
    root = os.path.realpath(os.path.join(str(hub.constants.HF_HUB_CACHE), "models--" + repo.replace("/", "--")))
    _contained(root, folder, text, what="the snapshot folder ")
    return root


def _contained(root: str, path: str, text: str, what: str = "") -> None:
    """A :class:`SourceError` unless ``path`` (symlinks resolved) lies inside ``root``."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise SourceError(
            f"{what}{path} resolves to {real}, outside the repository's cache folder {root} (a symlink leading out); "
            "refusing to read it",
            path=text,
        )


def _not_cached(hub: Any) -> tuple[type[BaseException], ...]:
    """The Hub client's errors for "not in the cache and not to be downloaded": 1.x raises
    ``OfflineModeIsEnabled`` where an offline lookup of a revision needs the network."""
    offline = getattr(hub.errors, "OfflineModeIsEnabled", None)
    return (hub.errors.LocalEntryNotFoundError, *((offline,) if isinstance(offline, type) else ()))


def _snapshot(hub: Any, text: str, repo: str, revision: str | None, names: list[str], local_only: bool) -> str:
    patterns = [glob.escape(n) for n in names]
    quiet = not show_progress() and not hub.utils.are_progress_bars_disabled()
    if quiet:  # the Hub's own tqdm bars only on a terminal
        hub.utils.disable_progress_bars()
    try:
        # offline, ask for the cache alone: some Hub clients (1.x) still list a commit's files online
        local_only = local_only or bool(hub.constants.HF_HUB_OFFLINE)
        return str(
            hub.snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=local_only)
        )
    except _not_cached(hub) as e:
        offline = " (HF_HUB_OFFLINE is set)" if hub.constants.HF_HUB_OFFLINE else ""
        raise SourceError(
            f"{repo}{'@' + revision if revision else ''} is not in the local Hub cache "
            f"({hub.constants.HF_HUB_CACHE}){offline}: download it once online, or set HF_HUB_CACHE / HF_HOME "
            f"to the cache that holds it ({e})",
            path=text,
        ) from None
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
        raise SourceError(f"no such Hub repository or revision: {e}", path=text) from None
    except hub.errors.HfHubHTTPError as e:
        raise SourceError(f"Hub download failed: {e}", path=text) from None
    finally:
        if quiet:
            hub.utils.enable_progress_bars()
