"""One object written front to back by one process, in pieces as they arrive: an every-rank
export's file at an object storage URL (:mod:`sdadapt._export.spread_remote`).

obstore's writer buffers ``part_bytes`` and uploads each full buffer as a part of a multipart
upload (S3 wants every part but the last >= 5 MiB), a few parts in flight; :meth:`finish`
completes the upload, and only then does the object exist. A writer dropped unfinished (a
failure anywhere) leaves no object: an object one process writes never appears half written.
"""

from __future__ import annotations

from typing import Any

from ._object_store import Uploader, fetch_error

PART_BYTES = 16 << 20
"""Bytes per uploaded part (S3's minimum is 5 MiB, its maximum 10,000 parts: 156 GiB a file)."""
PARTS_IN_FLIGHT = 4


class ObjectWriter:
    """The object ``name`` under ``up``'s URL, written in order (:meth:`write`), complete at
    :meth:`finish` (then recorded in ``up.done``, which :meth:`Uploader.undo` deletes)."""

    def __init__(self, up: Uploader, name: str, part_bytes: int | None = None):
        self.up = up
        self.url = f"{up.url}/{name}"
        self.dest = up.dest(name)
        try:
            size = part_bytes or PART_BYTES
            self.file: Any = up.obstore.open_writer(up.store, self.dest, buffer_size=size, max_concurrency=PARTS_IN_FLIGHT)
        except Exception as e:  # noqa: BLE001 - obstore raises its own error types
            raise fetch_error(e, self.url, "uploading") from None

    def write(self, data: Any) -> None:
        """Append ``data`` (a buffer); full parts are uploaded as they fill."""
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


__all__ = ["PART_BYTES", "ObjectWriter"]
