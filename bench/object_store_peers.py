"""The small venv that holds the object storage peers for bench/object_store_bench.py: the
Run:ai Model Streamer with its S3 backend and s3torchconnector with its DCP reader.

    python bench/object_store_peers.py            # make it (once) and print its python
    python bench/object_store_peers.py --check    # exit 0 only if both peers import there

A small venv of ``scripts/small_venv.py`` (under ``${TMPDIR:-/tmp}/sdadapt-compat``, seeing the
base venv's packages): only the peers are installed into it, torch held at the base's version.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from small_venv import main, make_venv  # noqa: E402

PACKAGES = ["runai-model-streamer==0.17.1", "runai-model-streamer-s3==0.17.1", "s3torchconnector[dcp]==1.5.0"]
NAME = "object-store-peers-1"
CHECK = "import runai_model_streamer, s3torchconnector.dcp"


def venv_python(root: str | None = None) -> str:
    """Make the venv (once; reused while the peers import there) and return its python."""
    return make_venv(NAME, PACKAGES, CHECK, root)


if __name__ == "__main__":
    raise SystemExit(main(__doc__ or "", NAME, CHECK, venv_python))
