"""sdadapt: load checkpoints of any layout into models parallelised with torch-native tools.

    report = sdadapt.load(model, "ckpt.pt", sdadapt.Adapter([sdadapt.fuse([...], "...")]))

Data flow: source headers -> source schema; model -> target schema; Adapter + schemas -> plan +
report (strict: raise on every rank, nothing read); then each rank's shards, as boxes in global
coordinates (the read items DCP's planner would make), are read by the engine: per shard, only
the source regions the recipe needs (``dcp.load`` serves only targets DCP alone can read).

The top level holds what a user calls: the functions that load, plan, check, export and trim
checkpoints, the adapter and its registry, one function per built-in rule, the engine's
settings and the root of the errors. The rest lives in public modules, one idea each:
:mod:`sdadapt.rules` (the rule classes, for ``isinstance`` and JSON, and what a rule of one's
own is built from), :mod:`sdadapt.sources` (opening checkpoints, their schema),
:mod:`sdadapt.reports` (what the functions return), :mod:`sdadapt.errors` (every error),
:mod:`sdadapt.torchtitan` (torchtitan's state-dict adapter bridge).

:data:`_PUBLIC` is the one table of the top level: ``__all__`` is its names, and a name's
module is imported when the name is first used, so that ``import sdadapt`` (and with it the
command line's ``--help``) does not import torch. :data:`_MOVED` says where each name that left
the top level went; using one raises an :class:`AttributeError` naming the new spelling. Type
checkers see the names through the ``TYPE_CHECKING`` imports, which a test keeps equal to the
table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._base.lazy import attach
from ._base.rule_kinds import QUANTIZED, RULE_KINDS

if TYPE_CHECKING:
    from . import errors as errors
    from . import reports as reports
    from . import rules as rules
    from . import sources as sources
    from . import torchtitan as torchtitan
    from ._base.env import env as env
    from ._draft import draft as draft
    from ._dry_run import dry_run as dry_run
    from ._engine import (
        EngineConfig as EngineConfig,
    )
    from ._engine import (
        release_pinned_memory as release_pinned_memory,
    )
    from ._export import (
        convert as convert,
    )
    from ._export import (
        export as export,
    )
    from ._export import (
        export_iter as export_iter,
    )
    from ._load import (
        load as load,
    )
    from ._load import (
        plan_load as plan_load,
    )
    from ._plan.adapter import Adapter as Adapter
    from ._plan.hf_models import hf_adapter as hf_adapter
    from ._plan.plan import KeyPatterns as KeyPatterns
    from ._plan.registry import (
        get_adapter as get_adapter,
    )
    from ._plan.registry import (
        list_adapters as list_adapters,
    )
    from ._refit import refit_plan as refit_plan
    from ._state import (
        Checkpointer as Checkpointer,
    )
    from ._state import (
        load_state as load_state,
    )
    from ._state import (
        save_state as save_state,
    )
    from ._tools import diff as diff
    from ._tools import shrink as shrink
    from ._tools import verify as verify
    from .errors import SdadaptError as SdadaptError
    from .rules._functions import (
        add_prefix as add_prefix,
    )
    from .rules._functions import (
        affine as affine,
    )
    from .rules._functions import (
        cast as cast,
    )
    from .rules._functions import (
        deinterleave as deinterleave,
    )
    from .rules._functions import (
        drop as drop,
    )
    from .rules._functions import (
        fuse as fuse,
    )
    from .rules._functions import (
        interleave as interleave,
    )
    from .rules._functions import (
        pad as pad,
    )
    from .rules._functions import (
        rename as rename,
    )
    from .rules._functions import (
        rotary as rotary,
    )
    from .rules._functions import (
        split as split,
    )
    from .rules._functions import (
        stack as stack,
    )
    from .rules._functions import (
        strip_prefix as strip_prefix,
    )
    from .rules._functions import (
        tie as tie,
    )
    from .rules._functions import (
        transpose as transpose,
    )
    from .rules._functions import (
        trim as trim,
    )
    from .rules._functions import (
        unstack as unstack,
    )
    from .rules._quant_detect import dequant_rules as dequant_rules
    from .rules._quant_functions import (
        dequant_fp8 as dequant_fp8,
    )
    from .rules._quant_functions import (
        dequant_mxfp4 as dequant_mxfp4,
    )
    from .rules._quant_functions import (
        dequant_scaled as dequant_scaled,
    )
    from .sources._integrity import write_checksums as write_checksums

from ._base.version import VERSION as __version__  # noqa: E402,F401 - the package version

_PUBLIC: dict[str, str] = {
    # loading and planning
    "load": "._load",
    "plan_load": "._load",
    "diff": "._tools",
    "dry_run": "._dry_run",
    # training state, export, integrity
    "load_state": "._state",
    "save_state": "._state",
    "Checkpointer": "._state",
    "export": "._export",
    "export_iter": "._export",
    "convert": "._export",
    "refit_plan": "._refit",
    "write_checksums": ".sources._integrity",
    # checking and trimming checkpoints
    "verify": "._tools",
    "shrink": "._tools",
    # the versions and optional features at hand (for bug reports)
    "env": "._base.env",
    # adapters: the class, the registry, drafting one
    "Adapter": "._plan.adapter",
    "get_adapter": "._plan.registry",
    "list_adapters": "._plan.registry",
    "hf_adapter": "._plan.hf_models",
    "draft": "._draft",
    # the key patterns a plan tolerates, typed once (the **patterns of plan_load, diff, dry_run)
    "KeyPatterns": "._plan.plan",
    # rules, one function each (their classes: sdadapt.rules), from the one table of rule kinds; the
    # quantized formats' in their own module, so that a plain adapter never imports their kernels
    **{fn: ".rules._quant_functions" if module in QUANTIZED else ".rules._functions" for _, module, fn in RULE_KINDS},
    "dequant_rules": ".rules._quant_detect",
    # the engine's settings
    "EngineConfig": "._engine",
    "release_pinned_memory": "._engine",
    # the root of every error sdadapt raises (all of them: sdadapt.errors)
    "SdadaptError": ".errors",
}

_RULE_FUNCTION = {cls: fn for cls, _, fn in RULE_KINDS}
_MOVED: dict[str, str] = {
    **{cls: f"sdadapt.{fn}(...) (the class: sdadapt.rules.{cls})" for cls, fn in _RULE_FUNCTION.items()},
    **{
        n: f"sdadapt.rules.{n}"
        for n in "QuantizeFP8 QuantizeMXFP4 QuantizeScaled Rule RuleBase ValueRule register_rule Node Compute emit".split()
    },
    **{
        n: f"sdadapt.errors.{n}"
        for n in (
            "AdapterError ExportError LoadError ModelError PlanError RemoteRankError ResolveError ShrinkError "
            "SourceError StateError UsageError VerifyError"
        ).split()
    },
    **{n: f"sdadapt.sources.{n}" for n in ("Source", "TensorInfo", "open_source")},
    **{
        n: f"sdadapt.reports.{n}"
        for n in "Report LoadReport StateLoadReport ExportReport VerifyReport ShrinkReport Plan Draft DryRunReport".split()
    },
    "build_plan": "sdadapt.plan_load(model, src, adapter) (plans against a model, headers only; returns the source and the plan)",
    "resolve_adapter": "sdadapt.get_adapter(name, **options) for a shipped adapter, or the spec string itself passed "
    "as adapter= to sdadapt.load / export / diff (it is resolved there)",
    "resolve_target": "the model built in Python and passed to sdadapt.load (the CLI resolves 'file.py:ATTR' specs itself)",
}
"""Names that left the top level -> how they are spelled now (the error an old name raises says it)."""

_SUBMODULES = ("errors", "reports", "rules", "sources", "torchtitan")
"""The public modules, reachable as ``sdadapt.rules`` ... after a plain ``import sdadapt``."""

__getattr__, __dir__, __all__ = attach(__name__, _PUBLIC, _MOVED, _SUBMODULES)
