"""One object written front to back by one process, in pieces as they arrive: an every-rank
export's file at an object storage URL (:mod:`sdadapt._export.spread_remote`).

obstore's writer collects ``part_bytes`` and uploads each full part as a part of a multipart
upload (S3 wants every part but the last >= 5 MiB), a few parts in flight; :meth:`finish`
completes the upload, and only then does the object exist. A writer dropped unfinished (a
failure anywhere) leaves no object: an object one process writes never appears half written.

obstore does not copy what it is given: a part refers to the caller's buffers, which stay
alive, and must stay unchanged, until that part is uploaded (the buffer's export is released
then). Its ``flush`` does not wait for the parts in flight; a caller that wants to know when a
buffer is free watches for that release (:mod:`sdadapt._export.spread_remote` does).
"""

from __future__ import annotations

from typing import Any

from ._object_store import Uploader, fetch_error

PART_BYTES = 8 << 20
"""Bytes per uploaded part (S3's minimum is 5 MiB): a larger file's parts are a multiple of
this, so that no file has more than :data:`MAX_PARTS`."""
PARTS_IN_FLIGHT = 4
MAX_PARTS = 10_000
"""S3's limit of parts per multipart upload."""


class ObjectWriter:
    """The object ``name`` under ``up``'s URL, written in order (:meth:`write`), complete at
    :meth:`finish` (then recorded in ``up.done``, which :meth:`Uploader.undo` deletes). Its parts
    are ``part_bytes`` long (default: :meth:`part_size` of ``size``)."""

    def __init__(self, up: Uploader, name: str, part_bytes: int | None = None, size: int = 0):
        self.up = up
        self.url = f"{up.url}/{name}"
        self.dest = up.dest(name)
        self.part_bytes = part_bytes or self.part_size(size)
        try:
            self.file: Any = up.obstore.open_writer(up.store, self.dest, buffer_size=self.part_bytes, max_concurrency=PARTS_IN_FLIGHT)
        except Exception as e:  # noqa: BLE001 - obstore raises its own error types
            raise fetch_error(e, self.url, "uploading") from None

    @staticmethod
    def part_size(size: int) -> int:
        """The part size for an object of ``size`` bytes: :data:`PART_BYTES`, or the smallest
        multiple of it that keeps the object within :data:`MAX_PARTS` parts."""
        return PART_BYTES * max(1, -(-size // (PART_BYTES * MAX_PARTS)))

    def write(self, data: Any) -> None:
        """Append ``data`` (a buffer, referred to until its part is uploaded: left unchanged by
        the caller); full parts are uploaded as they fill, at most :data:`PARTS_IN_FLIGHT` at once."""
        try:
            self.file.write(data)
        except Exception as e:  # noqa: BLE001
            raise fetch_error(e, self.url, "uploading") from None

    def finish(self) -> None:
        """Upload what is buffered and complete the object."""
        try:
            self.file.close()
        except Exception as e:  # noqa: BLE001
            raise fetch_error(e, self.url, "uploading") from None
        self.up.done.append(self.dest)


__all__ = ["MAX_PARTS", "PART_BYTES", "ObjectWriter"]
