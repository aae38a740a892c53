"""What an object store's (or the OS's) failure means to a user: :func:`fetch_error`, a
:class:`SourceError` naming the URL, what failed and what to do."""

from __future__ import annotations

import re

from ..errors import SourceError

_NO_ROOM = ("507 Insufficient Storage", "QuotaExceeded", "XMinioStorageFull", "InsufficientStorage", "no free volumes",
            "No writable volumes", "no space left")  # fmt: skip
"""What S3-compatible servers answer when they refuse bytes for space (HTTP 507, Ceph's and
Wasabi's ``QuotaExceeded``, MinIO's ``XMinioStorageFull``, SeaweedFS's volume allocation)."""
_SERVER_ERROR = re.compile(r"\b5\d\d [A-Z][A-Za-z ]+?(?=:)")  # obstore's "500 Internal Server Error: <body>"


def short_error(e: BaseException) -> str:
    """obstore's message without its debug dump (which repeats it)."""
    return str(e).split("\n\nDebug source:", 1)[0].strip().splitlines()[0] if str(e).strip() else type(e).__name__


def fetch_error(e: BaseException, url: str, what: str) -> SourceError:
    """An obstore / OS error while ``what`` as a SourceError naming ``url`` and what to do."""
    name = type(e).__name__
    text = str(e)
    said = next((code for code in _NO_ROOM if code in text), None)
    if said is not None:
        why = (
            f"the object store has no room for it (it answered {said}): free space in the bucket or raise its quota, or "
            "write to another bucket; nothing that looks complete was left (no index or .metadata was written)"
        )
    elif isinstance(e, FileNotFoundError) or name == "NotFoundError" or "404 Not Found" in text or "NoSuchBucket" in text:
        why = "no such object or bucket (check the URL, and the endpoint in AWS_ENDPOINT_URL)"
    elif name in ("PermissionDeniedError", "UnauthenticatedError") or isinstance(e, PermissionError) or "403 Forbidden" in text:
        why = "access denied (403): check the credentials (AWS_ACCESS_KEY_ID..., GOOGLE_APPLICATION_CREDENTIALS) and the bucket's policy"
    elif "EntityTooLarge" in text:
        why = "the object is larger than the store accepts (it answered EntityTooLarge): pass a smaller max_shard_size"
    elif what == "uploading" and (status := _SERVER_ERROR.search(text)) is not None:
        why = (
            f"the object store kept failing it ({status.group(0)}, after retries): read the store's log; a store out of "
            "space answers so too (SeaweedFS: no writable volumes), then free space or write elsewhere; nothing that "
            "looks complete was left (no index or .metadata was written)"
        )
    elif name == "PreconditionError":
        why = (
            "the object changed while it was read (its ETag differs from the one listed when the checkpoint "
            "was opened); load again once the upload is complete"
        )
    else:
        why = f"{name}: {short_error(e)}"
    return SourceError(f"{what}: {why}", path=url)


__all__ = ["fetch_error", "short_error"]
