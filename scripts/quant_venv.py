"""The small venv that holds the GPTQ and AWQ tools: the oracles of the GPTQ / AWQ tests and bench.

    python scripts/quant_venv.py            # make it (once) and print its python
    python scripts/quant_venv.py --check    # exit 0 only if both tools import there

Like scripts/megatron_venv.py's, it lives under ``${TMPDIR:-/tmp}/sdadapt-compat`` and sees the
base venv's packages (torch 2.13.0, safetensors, numpy) through a ``.pth`` file. Installed into
it: ``auto-gptq==0.7.1`` (its ``QuantLinear.pack`` writes GPTQ layers; the torch path of its
forward is the reference dequantisation; its CUDA extensions do not load on torch 2.13 and are
not used) and ``autoawq==0.2.9`` (pure Python: ``WQLinear_GEMM.from_linear`` packs,
``awq.utils.packing_utils.dequantize_gemm`` dequantises). Both import only with a transformers
of their time: ``transformers==4.51.3`` (AutoAWQ's last tested release; auto-gptq imports
``no_init_weights``, gone in 5.x) with its ``tokenizers`` and ``peft==0.10.0`` (auto-gptq
imports ``PEFT_TYPE_TO_MODEL_MAPPING``) are installed into this venv over the base's.
GPTQModel (the tool transformers 5 loads GPTQ and AWQ with) needs torch >= 2.14 from 7.x on,
and builds extensions: it does not install here.
"""

from __future__ import annotations

from small_venv import main, make_venv

NAME = "quant-oracles-1"
PACKAGES = ["transformers==4.51.3", "tokenizers>=0.21,<0.22", "peft==0.10.0", "auto-gptq==0.7.1", "gekko", "rouge",
            "sentencepiece"]  # fmt: skip
NO_DEPS = ("autoawq==0.2.9", "zstandard")
CHECK = ("import warnings; warnings.simplefilter('ignore'); "
         "from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear; "
         "from awq.modules.linear.gemm import WQLinear_GEMM; from awq.utils.packing_utils import dequantize_gemm")  # fmt: skip


def venv_python(root: str | None = None, base_site: str | None = None) -> str:
    """Make the venv (once; reused while both tools import there) and return its python.

    Args:
        root: where the small venvs live (default ``${TMPDIR:-/tmp}/sdadapt-compat``).
        base_site: the site-packages it sees (default this interpreter's).

    Returns:
        The path of the venv's python.
    """
    return make_venv(NAME, PACKAGES, CHECK, root, base_site, pins=("transformers==4.51.3",), no_deps=NO_DEPS)


if __name__ == "__main__":
    raise SystemExit(main(__doc__ or "", NAME, CHECK, venv_python))
