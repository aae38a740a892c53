"""The versions sdadapt runs with: what is installed, what is supported, what is available.

- :data:`SUPPORTED`: the declared ranges (the floors are the oldest releases the compatibility
  matrix passed; ``docs/compatibility.md`` has the table and ``scripts/compat_matrix.py`` makes it).
- :func:`env`: ``sdadapt.env()`` / ``sdadapt env``: the versions of sdadapt, Python and the
  packages it works with, and which optional features are available (and why not).
- :func:`transformers_supported`: ``None`` where the installed transformers is in the range,
  else the message of the up-front error.
- :func:`dependency_of`: the installed package (transformers, torch, torchtitan...) whose API an
  exception comes from, so that a version mismatch is reported as one.

Nothing here imports torch or transformers at module level; versions come from the installed
distributions' metadata, so that ``sdadapt env`` works where importing torch fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import re
import sys
import types
from typing import Any

from .summary import Summarized
from .version import VERSION, version_of

# package -> (oldest supported, newest tested): the matrix in docs/compatibility.md
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.8", "2.13"),
    "transformers": ("4.57", "5.25"),
    "torchtitan": ("0.2", "0.3"),
}
# the distributions `sdadapt env` reports (distribution name, import name)
PACKAGES: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("torchtitan", "torchtitan"),
    ("safetensors", "safetensors"),
    ("pydantic", "pydantic"),
    ("huggingface_hub", "huggingface_hub"),
    ("compressed-tensors", "compressed_tensors"),
    ("obstore", "obstore"),
    ("kvikio-cu13", "kvikio"),
    ("kvikio-cu12", "kvikio"),
    ("tqdm", "tqdm"),
    ("numpy", "numpy"),
)
# packages whose API sdadapt calls into: an AttributeError / ImportError / TypeError from one of
# them is a version mismatch, not bad input
API_PACKAGES = ("transformers", "torch", "torchtitan", "huggingface_hub", "safetensors", "compressed_tensors")


def parse(version: str) -> tuple[int, ...]:
    """``"5.13.1"`` -> ``(5, 13, 1)``; ``"2.13.0+cpu"`` -> ``(2, 13, 0)``; a pre-release counts as its release."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def in_range(package: str, version: str) -> bool:
    """``version`` of ``package`` is at least its supported floor (newer than tested is allowed)."""
    return parse(version) >= parse(SUPPORTED[package][0])


def supported_text(package: str) -> str:
    low, high = SUPPORTED[package]
    return f"{package} >= {low} (tested up to {high})"


def transformers_supported() -> str | None:
    """``None`` where the installed transformers is in :data:`SUPPORTED`; else what to say up front."""
    have = version_of("transformers")
    if have is None or in_range("transformers", have):
        return None
    return (
        f"transformers {have} is installed; deriving an adapter from a transformers model needs "
        f"{supported_text('transformers')}: older releases name and tie weights in ways that were never "
        f"checked. Upgrade it (pip install 'transformers>={SUPPORTED['transformers'][0]}'), or pass an "
        "adapter (a shipped one by name, e.g. load(model, src, 'llama'), or your own)"
    )


def _package_of_module(name: str | None) -> str | None:
    top = (name or "").split(".")[0]
    return top if top in API_PACKAGES else None


def dependency_of(e: BaseException) -> tuple[str, str] | None:
    """``(package, version)`` when ``e`` (an ``AttributeError``, ``ImportError`` or ``TypeError``) is
    about a dependency's API: raised inside one of :data:`API_PACKAGES`, an attribute missing on
    one of their modules, classes or objects, or a name that cannot be imported from one. ``None``
    otherwise (a bug of sdadapt's, or input it does not check)."""
    if not isinstance(e, AttributeError | ImportError | TypeError):
        return None
    found: str | None = None
    if isinstance(e, ImportError):
        found = _package_of_module(e.name)
    if found is None and isinstance(e, AttributeError):
        obj = getattr(e, "obj", None)
        if isinstance(obj, types.ModuleType):
            found = _package_of_module(obj.__name__)
        elif obj is not None:
            cls = obj if isinstance(obj, type) else type(obj)
            found = _package_of_module(cls.__module__)
    if found is None:
        tb = e.__traceback__
        while tb is not None:  # the innermost frame inside a dependency
            pkg = _package_of_module(tb.tb_frame.f_globals.get("__name__"))
            if pkg is not None:
                found = pkg
            tb = tb.tb_next
    if found is None:
        return None
    dist = {"compressed_tensors": "compressed-tensors"}.get(found, found)
    return found, version_of(dist) or "(version unknown)"


def version_problem(e: BaseException, doing: str) -> str | None:
    """The message for ``e`` when :func:`dependency_of` finds it is a dependency's API mismatch."""
    dep = dependency_of(e)
    if dep is None:
        return None
    pkg, ver = dep
    ranges = f"; sdadapt supports {supported_text(pkg)}" if pkg in SUPPORTED else ""
    return (
        f"{doing} failed inside {pkg} {ver}: {type(e).__name__}: {e}. This is most likely a version mismatch between "
        f"sdadapt {VERSION} and {pkg} {ver}{ranges}. Install a supported {pkg}, or report it with the output of "
        "`sdadapt env`"
    )


@dataclasses.dataclass(frozen=True)
class Feature:
    """One optional feature: whether it can be used here, and why not.

    Attributes:
        name: what the feature is (``"Hub ids as sources (hf://org/name)"``).
        available: whether it can be used with what is installed.
        detail: what it uses (package and version) where available, else why not and how to get it.

    Example:
        >>> missing = [f.name for f in sdadapt.env().features if not f.available]
    """

    name: str
    available: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class EnvReport(Summarized):
    """What :func:`sdadapt.env` finds.

    Attributes:
        versions: package (and ``"sdadapt"``, ``"python"``) -> installed version, ``None`` where it
            is not installed; torch's says its CUDA build (``"2.13.0+cpu (CPU build)"``).
        features: the optional features, each a :class:`Feature`.

    Example:
        >>> report = sdadapt.env()
        >>> text = str(report)  # what `sdadapt env` prints
        >>> data = report.as_dict()  # what `sdadapt env --json` prints
    """

    versions: dict[str, str | None]
    features: list[Feature]

    def as_dict(self) -> dict[str, Any]:
        """``{"versions": {...}, "features": [{"name", "available", "detail"}, ...]}`` (JSON-ready)."""
        return {"versions": dict(self.versions), "features": [dataclasses.asdict(f) for f in self.features]}

    def format(self) -> str:
        """One line per package, then one per feature (``[x]`` available, ``[ ]`` not, and why)."""
        width = max(len(k) for k in self.versions)
        lines = [f"{k:<{width}}  {v if v is not None else '(not installed)'}" for k, v in self.versions.items()]
        lines.append("")
        lines.append("features:")
        lines += [f"  [{'x' if f.available else ' '}] {f.name}: {f.detail}" for f in self.features]
        return "\n".join(lines)


def _torch_facts() -> tuple[str | None, str]:
    """torch's version with its CUDA build, and what its devices are (``None``: it does not import)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a torch that does not import is what env must report
        return None, f"torch does not import: {type(e).__name__}: {e}"
    cuda = torch.version.cuda
    if cuda is None:
        return f"{torch.__version__} (CPU build)", "torch is a CPU build"
    if not torch.cuda.is_available():
        return f"{torch.__version__} (CUDA {cuda})", f"torch is built for CUDA {cuda} but sees no GPU"
    return f"{torch.__version__} (CUDA {cuda})", f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"


def _feature(name: str, dist: str, module: str, what: str, install: str) -> Feature:
    have = version_of(dist)
    if have is None or importlib.util.find_spec(module) is None:
        return Feature(name, False, f"{dist} is not installed ({install})")
    if dist in SUPPORTED and not in_range(dist, have):
        return Feature(name, False, f"{dist} {have} is older than supported: needs {supported_text(dist)}")
    return Feature(name, True, f"{what} ({dist} {have})")


def _kvikio() -> Feature:
    name = "GPU direct reads (kvikio)"
    for dist in ("kvikio-cu13", "kvikio-cu12"):
        have = version_of(dist)
        if have is not None and importlib.util.find_spec("kvikio") is not None:
            return Feature(name, True, f"file reads straight into GPU memory ({dist} {have})")
    return Feature(name, False, "kvikio is not installed (pip install 'sdadapt[cuda]', or kvikio-cu12 on CUDA 12)")


def env() -> EnvReport:
    """The versions sdadapt runs with and the optional features available, for bug reports.

    Reads installed packages' metadata (nothing is imported but torch, to name its CUDA build
    and see its GPUs; a torch that fails to import is reported, not raised).

    Returns:
        An :class:`EnvReport`: ``versions`` (sdadapt, Python, torch with its CUDA build,
        transformers, torchtitan, safetensors, pydantic, huggingface_hub, compressed-tensors,
        tqdm, numpy; ``None`` where not installed) and ``features`` (each
        :class:`Feature` with ``available`` and, where not, why); ``str(report)`` is what
        ``sdadapt env`` prints.

    Example:
        >>> report = sdadapt.env()
        >>> report.versions["sdadapt"] == sdadapt.__version__
        True
    """
    torch_version, devices = _torch_facts()
    versions: dict[str, str | None] = {
        "sdadapt": VERSION,
        "python": f"{platform.python_version()} ({sys.platform})",
        "torch": torch_version,
    }
    versions.update({dist: version_of(dist) for dist, _ in PACKAGES if dist != "torch"})
    for dist in ("kvikio-cu13", "kvikio-cu12"):  # one of the two, where either is installed
        if versions[dist] is None:
            del versions[dist]
    features = [
        _feature("transformers models without an adapter (hf_adapter)", "transformers", "transformers",
                 "load/diff/export of a PreTrainedModel derive the adapter", "pip install 'sdadapt[models]'"),
        _feature("Hub ids as sources (hf://org/name)", "huggingface_hub", "huggingface_hub", "downloads into the Hub cache",
                 "pip install 'sdadapt[hub]'"),
        _feature("torchtitan bridge (sdadapt.torchtitan)", "torchtitan", "torchtitan",
                 "torchtitan models' names and its state-dict-adapter protocol", "pip install torchtitan"),
        _feature("object storage URLs (s3://, gs://)", "obstore", "obstore", "sources and destinations in object storage",
                 "pip install 'sdadapt[s3]'"),
        _kvikio(),
        Feature("GPU loads", torch_version is not None and "CUDA" in (torch_version or "") and "GPU(s)" in devices, devices),
    ]
    torch_ok = version_of("torch")
    if torch_ok is not None and not in_range("torch", torch_ok):
        features.append(Feature("torch in the supported range", False, f"torch {torch_ok}: needs {supported_text('torch')}"))
    return EnvReport(versions=versions, features=features)


def versions_line() -> str:
    """One line of the versions that matter for a bug report (for the CLI's unexpected errors)."""
    names = ("torch", "transformers", "torchtitan")
    got = ", ".join(f"{n} {version_of(n)}" for n in names if version_of(n) is not None)
    return f"sdadapt {VERSION}, Python {platform.python_version()}" + (f", {got}" if got else "")
