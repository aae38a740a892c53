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
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Any

from .._distributed import agree, is_distributed
from .._progress import show_progress
from ..errors import SourceError
from ._hf_sharded import INDEX_NAME

log = logging.getLogger(__name__)

PREFIX = "hf://"
EXTRA = "pip install 'sdadapt[hub]'"
_SIDE_FILES = ("config.json", "params.json")
_SINGLE = "model.safetensors"
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^\s@]+))?")
_resolved: dict[str, str] = {}


def is_hub_id(text: object) -> bool:
    """``text`` is a string starting with ``hf://``."""
    return isinstance(text, str) and text.startswith(PREFIX)


def parse_hub_id(text: str) -> tuple[str, str | None]:
    """``"hf://org/name@rev"`` -> ``("org/name", "rev")``; no ``@rev`` -> revision ``None`` (main)."""
    m = _ID.fullmatch(text[len(PREFIX) :]) if is_hub_id(text) else None
    if m is None:
        raise SourceError(f"not a Hub id: give hf://org/name or hf://org/name@revision (got {text!r})", path=text)
    return m.group("repo"), m.group("rev")


def hub_folder(text: str) -> str:
    """The local snapshot folder of Hub id ``text`` holding the files a load needs (downloaded
    into the Hub cache if missing). Collective when ``torch.distributed`` is initialised."""
    if text in _resolved:
        return _resolved[text]
    repo, revision = parse_hub_id(text)
    hub = _import_hub(text)
    if is_distributed():
        downloads = _downloads_here()
        folder, error = None, None
        if downloads:
            try:
                folder = _fetch(hub, text, repo, revision, local_only=False)
            except Exception as e:  # noqa: BLE001 - any failure here must reach the waiting ranks
                error = e
        agree(error)  # the others wait here until the downloads are complete (or failed)
        if folder is None:
            folder = _fetch(hub, text, repo, revision, local_only=True)
    else:
        folder = _fetch(hub, text, repo, revision, local_only=False)
    _resolved[text] = folder
    return folder


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
    """Download (or, ``local_only``, find in the cache) the files a load of ``repo`` needs."""
    folder = _snapshot(hub, text, repo, revision, [*_SIDE_FILES, INDEX_NAME], local_only)
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SourceError(f"{INDEX_NAME} of {repo} cannot be read: {e}", path=text) from None
        needed = [INDEX_NAME, *shards]
    else:
        needed = [_SINGLE]
    folder = _snapshot(hub, text, repo, revision, [*_SIDE_FILES, *needed], local_only)
    missing = [n for n in needed if not isinstance(n, str) or not os.path.isfile(os.path.join(folder, n))]
    if missing:
        where = "the local cache" if local_only or hub.constants.HF_HUB_OFFLINE else repo
        raise SourceError(
            f"{', '.join(map(str, missing[:8]))} not found in {where}; a Hub source needs {INDEX_NAME} and its "
            f"shards, or {_SINGLE}",
            path=text,
        )
    log.info("%s: %d file(s) in %s", text, len(needed), folder)
    return folder


def _snapshot(hub: Any, text: str, repo: str, revision: str | None, names: list[str], local_only: bool) -> str:
    patterns = [glob.escape(n) for n in names]
    quiet = not show_progress() and not hub.utils.are_progress_bars_disabled()
    if quiet:  # the Hub's own tqdm bars only on a terminal
        hub.utils.disable_progress_bars()
    try:
        return str(
            hub.snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=local_only)
        )
    except hub.errors.LocalEntryNotFoundError as e:
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
