"""Object storage URLs (``s3://bucket/prefix``, ``gs://bucket/prefix``) read lazily into a
local sparse mirror.

A :class:`Remote` lists the objects directly under a URL's prefix and gives each one a local
file of the object's size in a private temporary folder (a *mirror*: sparse, so unfetched
bytes take no disk space). The checkpoint's headers are fetched into it when it is opened
(:mod:`._remote`), so every local source class reads its schema unchanged; tensor bytes are
fetched only when asked for (:meth:`Remote.fetch`): the byte ranges a rank's plan needs,
adjacent ranges less than ``gap_bytes`` apart coalesced into one request, requests cut at
``request_bytes`` and ``concurrency`` of them in flight on a thread pool (obstore releases the
interpreter lock while it waits). Each request carries the object's ETag (``If-Match``), so an
object replaced while it is read is an error, never a mix of two versions.

The client is `obstore <https://developmental-seed.github.io/obstore/>`_ (Rust ``object_store``),
the optional extra ``sdadapt[s3]`` / ``sdadapt[gcs]``, imported only for a URL. It reads the
standard variables itself (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``;
``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT``); ``storage_options`` passes
anything else through. It retries 5xx answers, dropped connections and timeouts with
exponential backoff (bounded: :data:`RETRY`); a body cut short is retried here too. Nothing
here logs or prints an option's value (credentials may be among them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import SourceError
from ._base import SCHEMES
from ._base import is_url as is_url  # where it was first defined; the face imports it from _base
from ._object_errors import fetch_error, short_error

log = logging.getLogger(__name__)

RETRY: dict[str, Any] = {
    "max_retries": 5,
    "retry_timeout": timedelta(seconds=60),
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2},
}
"""obstore's retry settings unless ``storage_options["retry_config"]`` replaces them."""
_MTIME_NS = 1_000_000_000 * 86400  # every mirror file's modification time
_BODY_ATTEMPTS = 3  # a response body cut short is fetched again up to this many times in all


def split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ``("s3", "bucket", "a/b")``; a SourceError for a URL without a bucket."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not bucket or "\x00" in url or any(p in (".", "..") for p in key.split("/")):
        raise SourceError(f"not an object storage URL: write {scheme}://BUCKET/PREFIX", path=url)
    return scheme, bucket, key.strip("/")


def env_int(name: str, default: int, minimum: int = 1) -> int:
    """An integer of at least ``minimum`` from the environment variable ``name`` (``default`` when unset)."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise SourceError(f"{name}={text!r}: give a whole number of at least {minimum}")
    return value


@dataclass
class FetchSettings:
    """How ranges are fetched: see the module docstring and ``docs/object-storage.md``."""

    gap_bytes: int = field(default_factory=lambda: env_int("SDADAPT_REMOTE_GAP_BYTES", 64 << 10, minimum=0))
    request_bytes: int = field(default_factory=lambda: env_int("SDADAPT_REMOTE_REQUEST_BYTES", 8 << 20))
    concurrency: int = field(default_factory=lambda: env_int("SDADAPT_REMOTE_CONCURRENCY", 32))


def make_store(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """The obstore store of ``url``'s bucket. ``storage_options``: obstore's configuration keys
    (``endpoint``, ``region``, ``skip_signature``...) and, as two nested dicts,
    ``client_options`` and ``retry_config``."""
    scheme, bucket, _ = split_url(url)
    from_url = _client(url).store.from_url
    opts = dict(storage_options or {})
    client = dict(opts.pop("client_options", None) or {})
    retry = opts.pop("retry_config", None) or RETRY
    if (
        scheme == "s3"
        and "allow_http" not in client
        and (opts.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL", "")).startswith("http://")
    ):
        client.setdefault("allow_http", os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"))
    opts.update(_profile_keys(scheme, opts))
    try:
        return from_url(
            f"{scheme}://{bucket}",
            client_options=client or None,
            retry_config=retry,
            **opts,
        )
    except Exception as e:  # noqa: BLE001 - obstore's configuration errors have many types
        keys = ", ".join(sorted(opts)) or "none"
        why = f"{type(e).__name__}; storage_options keys: {keys}"
        raise SourceError(f"cannot configure the object store client ({why}): {short_error(e)}", path=url) from None


def _profile_keys(scheme: str, opts: dict[str, Any]) -> dict[str, str]:
    """With ``AWS_PROFILE`` set and no keys in the environment or ``opts``: the profile's static
    keys and region from ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
    ``AWS_CONFIG_FILE``), which object_store does not read itself. Profiles that get keys another
    way (SSO, assumed roles) need a ``credential_provider`` in ``storage_options``."""
    profile = os.environ.get("AWS_PROFILE")
    if scheme != "s3" or not profile or os.environ.get("AWS_ACCESS_KEY_ID") or "access_key_id" in opts:
        return {}
    import configparser  # noqa: PLC0415 - only for AWS_PROFILE

    out: dict[str, str] = {}
    files = [
        (os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), profile),
        (os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"), profile if profile == "default" else f"profile {profile}"),
    ]
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(os.path.expanduser(path))
        except configparser.Error:
            continue
        if parser.has_section(section):
            for ours, theirs in (("access_key_id", "aws_access_key_id"), ("secret_access_key", "aws_secret_access_key"),
                                 ("token", "aws_session_token"), ("region", "region")):  # fmt: skip
                if parser.has_option(section, theirs) and ours not in out and ours not in opts:
                    out[ours] = parser.get(section, theirs)
    if "access_key_id" not in out:
        log.warning("AWS_PROFILE=%s holds no static keys sdadapt can read; pass storage_options={'credential_provider': ...}", profile)
    return out


def _client(url: str) -> Any:
    """The obstore module, or a SourceError naming ``url`` and the extra to install."""
    try:
        import obstore  # type: ignore[import-not-found, unused-ignore]  # noqa: PLC0415 - the optional extra, only for URLs
        import obstore.store  # type: ignore[import-not-found, unused-ignore]  # noqa: PLC0415
    except ImportError:
        scheme = url.split("://", 1)[0]
        raise SourceError(f"{scheme}:// URLs need the obstore client: pip install 'sdadapt[{SCHEMES[scheme]}]'", path=url) from None
    module: Any = obstore
    return module


class Remote:
    """One URL's objects and their local sparse mirror (see the module docstring).

    Attributes:
        url: the URL as given (``s3://bucket/prefix``).
        root: the local folder mirroring the prefix (or holding the one object).
        objects: relative name -> (size, ETag) of the objects mirrored.
        fetched_bytes, requests: what :meth:`fetch` fetched so far, in all.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, settings: FetchSettings | None = None):
        self.url = url.rstrip("/")
        self.scheme, self.bucket, self.key = split_url(url)
        self.settings = settings or FetchSettings()
        self.store = make_store(url, storage_options)
        self.objects: dict[str, tuple[int, str | None]] = {}
        self.single: str | None = None  # the object's name when the URL names one object
        self.fetched_bytes = 0
        self.requests = 0
        # (bytes, seconds to the answer's first byte, seconds of its body) of each request
        self.timings: list[tuple[int, float, float]] = []
        self._kept: dict[str, list[tuple[int, int, Any]]] = {}  # name -> the probes' (start, stop, body)
        self._have: dict[str, list[tuple[int, int]]] = {}  # name -> fetched (start, stop), sorted, merged
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._list()
        from ._mirrors import MIRROR, new_mirror  # noqa: PLC0415 - object storage loads only

        self.root = new_mirror(f"{MIRROR}{self.scheme}-{self.bucket}-")
        for name, (size, _) in self.objects.items():
            path = self.local(name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
            os.utime(path, ns=(_MTIME_NS, _MTIME_NS))

    def _list(self) -> None:
        obstore = _client(self.url)

        try:
            if self.key and not self.key.endswith("/"):
                try:
                    meta = obstore.head(self.store, self.key)
                except FileNotFoundError:
                    meta = None
                if meta is not None:
                    self.single = self.key.rsplit("/", 1)[-1]
                    self.objects[self.single] = (int(meta["size"]), meta.get("e_tag"))
                    return
            prefix = f"{self.key}/" if self.key else ""
            listed = obstore.list_with_delimiter(self.store, prefix or None)
        except Exception as e:  # noqa: BLE001 - obstore raises its own error types
            raise fetch_error(e, self.url, "listing the objects") from None
        for meta in listed["objects"]:
            name = meta["path"][len(prefix) :]
            if name and "/" not in name:
                self.objects[name] = (int(meta["size"]), meta.get("e_tag"))
        if not self.objects:
            folders = [p[len(prefix) :].rstrip("/") for p in listed["common_prefixes"]][:8]
            hint = f"; it holds the folders {folders}" if folders else ""
            raise SourceError(f"no such object, and no objects under this prefix{hint}", path=self.url)

    # -- names --------------------------------------------------------------------------
    def local(self, name: str) -> str:
        """The mirror file of object ``name``."""
        return os.path.join(self.root, name)

    @property
    def local_root(self) -> str:
        """What stands for the URL locally: the mirror folder, or the one object's file."""
        return self.local(self.single) if self.single is not None else self.root

    def url_of(self, local_path: str) -> str:
        """The URL of a mirror file (for messages)."""
        rel = os.path.relpath(local_path, self.root)
        return self.url if self.single is not None else f"{self.url}/{rel}"

    def name_of(self, local_path: str) -> str | None:
        """The object name of a mirror file, ``None`` for a path outside the mirror."""
        rel = os.path.relpath(os.path.realpath(local_path), os.path.realpath(self.root))
        return rel if rel in self.objects else None

    def _object_key(self, name: str) -> str:
        if self.single is not None:
            return self.key
        return f"{self.key}/{name}" if self.key else name

    # -- fetching -----------------------------------------------------------------------
    def fetch_whole(self, names: Iterable[str]) -> None:
        """Fetch whole objects (configs, indexes, DCP metadata)."""
        self.fetch([(n, 0, self.objects[n][0]) for n in names])

    def fetch(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Make bytes ``[start, stop)`` of each object ``name`` present in its mirror file:
        what is missing, coalesced within ``gap_bytes``, cut at ``request_bytes``, fetched
        ``concurrency`` requests at a time. Raises a SourceError naming the object's URL."""
        todo = self._missing(ranges)
        if not todo:
            return
        if len(todo) == 1:
            self._get(*todo[0])
            return
        self._each(self._get, todo)

    def _each(self, fn: Callable[[str, int, int], None], jobs: list[tuple[str, int, int]]) -> None:
        """``fn(*job)`` for every job, ``concurrency`` at a time; the first error raised."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="sdadapt-fetch")
        errors = [f.exception() for f in [self._pool.submit(fn, *j) for j in jobs]]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _missing(self, ranges: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """The requests to make: ``ranges`` less what is present, coalesced and cut."""
        by_name: dict[str, list[tuple[int, int]]] = {}
        ranges = list(ranges)
        self.check_ranges(ranges)
        for name, start, stop in ranges:
            if stop > start:
                by_name.setdefault(name, []).append((start, stop))
        gap, cut = self.settings.gap_bytes, self.settings.request_bytes
        out: list[tuple[str, int, int]] = []
        with self._lock:
            for name, spans in by_name.items():
                need = _subtract(_merge(spans, 0), self._have.get(name, []))
                for start, stop in _merge(need, gap):
                    out += [(name, s, min(s + cut, stop)) for s in range(start, stop, cut)]
        return out

    def get_range(self, name: str, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` of object ``name`` (a buffer), checked against its ETag and
        length, a body cut short fetched again; counted and timed. Raises a SourceError naming
        the object's URL."""
        obstore = _client(self.url)

        etag = self.objects[name][1]
        options: dict[str, Any] = {"range": (start, stop)}
        if etag:
            options["if_match"] = etag
        url = self.url_of(self.local(name))
        data = None
        for attempt in range(_BODY_ATTEMPTS):
            try:
                began = time.perf_counter()
                answer = obstore.get(self.store, self._object_key(name), options=options)
                answered = time.perf_counter()
                data = answer.bytes()
                break
            except Exception as e:  # noqa: BLE001 - obstore raises its own error types
                transient = type(e).__name__ == "GenericError" or isinstance(e, (ConnectionError, TimeoutError))
                if not transient or attempt == _BODY_ATTEMPTS - 1:
                    raise fetch_error(e, url, f"fetching bytes {start}-{stop}") from None
                log.debug("fetching %s bytes %d-%d failed (%s); again", url, start, stop, type(e).__name__)
        assert data is not None
        if len(data) != stop - start:
            raise SourceError(
                f"the object is shorter than listed: asked for bytes {start}-{stop}, got {len(data)}; "
                "it was truncated or replaced while read",
                path=url,
            )
        body = time.perf_counter() - answered
        with self._lock:
            self.timings.append((stop - start, answered - began, body))
            self.fetched_bytes += stop - start
            self.requests += 1
        return data

    def _get(self, name: str, start: int, stop: int) -> None:
        data = self.get_range(name, start, stop)
        fd = os.open(self.local(name), os.O_WRONLY)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], start + done)
        finally:
            os.close(fd)
        # a mirror file's bytes only ever become present, never change: it keeps one mtime, so
        # the check that files did not change while a load read them still holds
        os.utime(self.local(name), ns=(_MTIME_NS, _MTIME_NS))
        with self._lock:
            self._have[name] = _merge([*self._have.get(name, []), (start, stop)], 0)

    def check_ranges(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """A SourceError naming the object when a range ends past its listed size (a truncated
        or partial upload), before anything is fetched."""
        for name, _, stop in ranges:
            size = self.objects[name][0]
            if stop > size:
                raise SourceError(
                    f"the object is shorter ({size} bytes) than its header says (bytes up to {stop}): "
                    "a truncated or partial upload; upload it again",
                    path=self.url_of(self.local(name)),
                )

    def probe(self, ranges: Iterable[tuple[str, int, int]], most: int) -> None:
        """Before a load writes: fetch the first ``most`` bytes of the lowest range of each
        object, concurrently (their timings measure a stream's rate: :func:`._fetching.measured`),
        keeping the bytes for the engine (:meth:`kept_blocks`), so that a refused or replaced
        object fails here. An object whose first range is kept already is not probed again."""
        first: dict[str, tuple[int, int]] = {}
        for name, start, stop in ranges:
            if stop > start and (name not in first or start < first[name][0]):
                first[name] = (start, stop)
        with self._lock:
            first = {n: r for n, r in first.items() if not any(k[0] == r[0] for k in self._kept.get(n, ()))}
        if not first:
            return

        def one(name: str, start: int, stop: int) -> None:
            data = self.get_range(name, start, stop)
            with self._lock:
                self._kept.setdefault(name, []).append((start, stop, data))

        self._each(one, [(n, a, min(b, a + most)) for n, (a, b) in sorted(first.items())])

    def drop_kept(self) -> None:
        """Forget the probes' bytes (the load that made them has read)."""
        with self._lock:
            self._kept = {}

    def kept_blocks(self, name: str, start: int, stop: int) -> list[tuple[int, int, Any]]:
        """The probes' blocks (start, stop, body) of object ``name`` that overlap ``[start, stop)``."""
        with self._lock:
            return [k for k in self._kept.get(name, ()) if k[0] < stop and k[1] > start]

    def close(self) -> None:
        """Stop the fetch threads and delete the mirror."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        from ._mirrors import drop_mirror  # noqa: PLC0415 - imported with the mirror's making

        drop_mirror(self.root)


def _merge(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ``spans`` with those less than ``gap`` bytes apart (or touching) joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _subtract(spans: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted disjoint ``spans`` not covered by sorted disjoint ``have``."""
    out = []
    for start, stop in spans:
        pos = start
        for a, b in have:
            if b <= pos or a >= stop:
                continue
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
            if pos >= stop:
                break
        if pos < stop:
            out.append((pos, stop))
    return out


# -- writing ----------------------------------------------------------------------------
COMMIT_NAMES = (".metadata", "model.safetensors.index.json", "sdadapt.json", "sdadapt.checksums.json")
"""Objects uploaded last: a reader that finds them finds every file they name."""


def _names_under(store: Any, key: str) -> list[str]:
    """The object keys directly under ``key/`` plus ``key`` itself when it is an object."""
    obstore = _client(key)
    out = [m["path"] for m in obstore.list_with_delimiter(store, f"{key}/" if key else None)["objects"]]
    try:
        obstore.head(store, key)
        out.append(key)
    except FileNotFoundError:
        pass
    return out


def check_writable(url: str, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> None:
    """A SourceError unless ``url`` can be written: the bucket answers, and nothing is there
    yet unless ``overwrite``."""
    _, _, key = split_url(url)
    store = make_store(url, storage_options)
    try:
        present = _names_under(store, key)
    except Exception as e:  # noqa: BLE001 - obstore raises its own error types
        raise fetch_error(e, url, "checking the destination") from None
    if present and not overwrite:
        why = f"holds {len(present)} object(s) already; pass overwrite=True (--overwrite) or choose another destination"
        raise SourceError(why, path=url)


class Uploader:
    """Writes objects under ``url`` in the order that keeps a reader from seeing a half-written
    checkpoint (see :func:`upload`); a checkpoint several processes write (DCP) uses the steps
    one by one: :meth:`retire` on one process, :meth:`put` of each process's data files on each,
    then :meth:`put` of the commit objects and :meth:`sweep` on one."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        _, _, self.key = split_url(url)
        self.obstore = _client(url)
        self.store = make_store(url, storage_options)
        self.done: list[str] = []

    def dest(self, name: str) -> str:
        return f"{self.key}/{name}" if self.key else name

    def object_url(self, dest: str) -> str:
        """The URL of the object at key ``dest`` (for messages)."""
        bucket_url = self.url[: len(self.url) - len(self.key)] if self.key else f"{self.url}/"
        return f"{bucket_url}{dest}"

    def retire(self, overwrite: bool) -> list[str]:
        """Refuse a destination that holds objects unless ``overwrite``; else delete its commit
        objects first (the old checkpoint stops looking complete). Returns the old object keys."""
        try:
            old = _names_under(self.store, self.key)
            if old and not overwrite:
                raise SourceError(f"holds {len(old)} object(s) already; pass overwrite=True", path=self.url)
            for path in old:
                if path.rsplit("/", 1)[-1] in COMMIT_NAMES:
                    self.obstore.delete(self.store, path)
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001 - obstore raises its own error types
            raise fetch_error(e, self.url, "preparing the upload") from None
        return old

    def put(self, files: list[tuple[str, str]]) -> None:
        """Upload ``(local path, object key)`` pairs, data first (8 at a time, multipart for large
        files), the commit objects last, in :data:`COMMIT_NAMES`' reverse order."""
        data = [f for f in files if f[1].rsplit("/", 1)[-1] not in COMMIT_NAMES]
        commit = sorted((f for f in files if f not in data), key=lambda f: COMMIT_NAMES.index(f[1].rsplit("/", 1)[-1]), reverse=True)

        def one(pair: tuple[str, str]) -> None:
            try:
                self.obstore.put(self.store, pair[1], Path(pair[0]))
            except Exception as e:  # noqa: BLE001 - obstore raises its own error types
                raise fetch_error(e, self.object_url(pair[1]), "uploading") from None
            self.done.append(pair[1])

        with ThreadPoolExecutor(min(8, max(1, len(data)))) as pool:
            for f in [pool.submit(one, p) for p in data]:
                f.result()
        for p in commit:
            one(p)

    def undo(self) -> None:
        """Delete what this uploader wrote (after a failure: the commit objects were never written)."""
        for dest in self.done:
            try:
                self.obstore.delete(self.store, dest)
            except Exception:  # noqa: BLE001, S110 - best effort; nothing that looks complete is left
                pass

    def sweep(self, old: list[str], keep: set[str]) -> None:
        """Delete the old objects the new checkpoint does not have."""
        for path in sorted(set(old) - keep):
            try:
                self.obstore.delete(self.store, path)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is complete; say what is left over
                log.warning("%s: could not delete the old object %s (%s)", self.url, path, type(e).__name__)


def upload(local: str, url: str, *, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Upload the file or folder ``local`` to ``url`` so that no reader sees a half-written
    checkpoint: with ``overwrite``, the old commit objects (index, DCP ``.metadata``) are
    deleted first; the data objects are uploaded, then the commit objects; then old objects
    the new checkpoint does not have are deleted. A failure deletes what this call uploaded.
    Returns the names uploaded."""
    up = Uploader(url, storage_options)
    if os.path.isdir(local):
        names = sorted(os.listdir(local))
        files = [(os.path.join(local, n), up.dest(n)) for n in names]
    else:
        names = [up.key.rsplit("/", 1)[-1]]
        files = [(local, up.key)]
    old = up.retire(overwrite)
    try:
        up.put(files)
    except BaseException:
        up.undo()
        raise
    up.sweep(old, {dest for _, dest in files})
    return names
