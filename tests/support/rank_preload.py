"""Every sdadapt module, imported once in the launcher's fork server (tests/support/dist_helper.py)
so that a rank forked from it does not import them again. sdadapt reads its environment variables
when called, never at import; its optional third-party packages (vLLM, torchtitan, obstore...) are
imported where used, so this imports none of them."""

from __future__ import annotations

import importlib
import pkgutil

import sdadapt

for _module in pkgutil.walk_packages(sdadapt.__path__, "sdadapt."):
    if not _module.name.endswith("__main__"):  # `python -m sdadapt` runs the command line
        importlib.import_module(_module.name)
