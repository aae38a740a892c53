"""The small venv where transformers loads GPTQ and AWQ releases itself: the other side of the
GPTQ bench (``bench/gptq_bench.py transformers``).

    python scripts/gptqmodel_venv.py            # make it (once) and print its python
    python scripts/gptqmodel_venv.py --check    # exit 0 only if transformers can load GPTQ there

transformers 5 loads a GPTQ or AWQ release only through optimum and GPTQModel. GPTQModel 7.x
needs torch >= 2.14; 6.0.3 is the last release that builds against torch 2.13 on CPU (no CUDA
extensions: ``BUILD_CUDA_EXT=0``, its torch kernels ``TorchFusedQuantLinear`` /
``TorchFusedAwqQuantLinear``). Its setup imports torch and ``pcre``, so it is built without
build isolation, after its dependencies. What 6.0.3 runs with: ``transformers==5.5.4`` (5.24
lacks ``transformers.utils.hub.create_repo``, which it imports), ``kernels==0.12.2`` (0.19
refuses transformers 5.5's hub-kernel table), ``optimum==2.2.0`` (2.3 wants GPTQModel >= 7).
Like the other small venvs it lives under ``${TMPDIR:-/tmp}/sdadapt-compat`` and sees the base
venv's packages through a ``.pth`` file; torch stays at the base's version.
"""

from __future__ import annotations

import os

from small_venv import main, make_venv

NAME = "gptqmodel-6.0.3"
PINS = ("transformers==5.5.4", "kernels==0.12.2", "optimum==2.2.0", "numpy==2.2.6")
PACKAGES = [*PINS, "pypcre==0.6.4", "setuptools>=78.1.1", "ninja", "defuser==0.0.28", "device-smi==0.5.7",
            "logbar==0.4.15", "tokenicer==0.0.14", "threadpoolctl", "torchao==0.18.0", "maturin"]  # fmt: skip
NO_DEPS = ("gptqmodel==6.0.3",)
CHECK = ("import warnings; warnings.simplefilter('ignore'); import gptqmodel, optimum.gptq, transformers; "
         "assert gptqmodel.__version__ == '6.0.3' and transformers.__version__ == '5.5.4'")  # fmt: skip


def venv_python(root: str | None = None, base_site: str | None = None) -> str:
    """Make the venv once (reused while GPTQModel imports there) and return its python; ``root``
    and ``base_site`` as :func:`small_venv.make_venv` takes them."""
    os.environ["BUILD_CUDA_EXT"] = "0"  # GPTQModel's setup: no CUDA extensions (torch is CPU here)
    os.environ["PIP_NO_BUILD_ISOLATION"] = "0"  # its setup imports the torch it builds against
    return make_venv(NAME, PACKAGES, CHECK, root, base_site, pins=PINS, no_deps=NO_DEPS)


if __name__ == "__main__":
    raise SystemExit(main(__doc__ or "", NAME, CHECK, venv_python))
