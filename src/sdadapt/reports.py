"""What sdadapt's functions return: reports, the plan, the draft of an adapter.

Each is a plain object to read, print (``str(report)``) or serialise (the pydantic ones:
``report.model_dump_json()``); import them from here to annotate code that keeps one:

- :class:`LoadReport` from :func:`sdadapt.load`; its ``report`` field is the plan's :class:`Report`;
- :class:`Plan` (with its :class:`Report`) from :func:`sdadapt.plan_load`, and the :class:`Report`
  alone from :func:`sdadapt.diff`;
- :class:`StateLoadReport` from :func:`sdadapt.load_state`;
- :class:`SaveReport` from :func:`sdadapt.save_state` (it also stands for the folder's path), and
  the :class:`SaveHandle` of a save in the background (``async_=True``) whose ``wait()`` gives it;
- :class:`ExportReport` from :func:`sdadapt.export` and :func:`sdadapt.convert`;
- :class:`VerifyReport` from :func:`sdadapt.verify`;
- :class:`ShrinkReport` from :func:`sdadapt.shrink`;
- :class:`Refit` from :func:`sdadapt.refit_plan`, and the :class:`RefitReport` of each of its runs;
- :class:`Draft` from :func:`sdadapt.draft`;
- :class:`DryRunReport` (one :class:`DryRunRank` per planned rank) from :func:`sdadapt.dry_run`;
- :class:`EnvReport` (its :class:`Feature` list) from :func:`sdadapt.env`.

Imported lazily from the modules that build them, from one table (:data:`_PUBLIC`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._base.lazy import attach

if TYPE_CHECKING:
    from ._base.env import EnvReport as EnvReport
    from ._base.env import Feature as Feature
    from ._draft import Draft as Draft
    from ._dry_run import DryRunRank as DryRunRank
    from ._dry_run import DryRunReport as DryRunReport
    from ._export import ExportReport as ExportReport
    from ._load import LoadReport as LoadReport
    from ._plan.plan import Plan as Plan
    from ._plan.report import Report as Report
    from ._refit import Refit as Refit
    from ._refit import RefitReport as RefitReport
    from ._state import SaveHandle as SaveHandle
    from ._state import SaveReport as SaveReport
    from ._state import StateLoadReport as StateLoadReport
    from ._tools import ShrinkReport as ShrinkReport
    from ._tools import VerifyReport as VerifyReport

_PUBLIC: dict[str, str] = {
    "Report": "sdadapt._plan.report",
    "Plan": "sdadapt._plan.plan",
    "LoadReport": "sdadapt._load",
    "StateLoadReport": "sdadapt._state",
    "SaveReport": "sdadapt._state",
    "SaveHandle": "sdadapt._state",
    "ExportReport": "sdadapt._export",
    "VerifyReport": "sdadapt._tools",
    "ShrinkReport": "sdadapt._tools",
    "Refit": "sdadapt._refit",
    "RefitReport": "sdadapt._refit",
    "Draft": "sdadapt._draft",
    "DryRunReport": "sdadapt._dry_run",
    "DryRunRank": "sdadapt._dry_run",
    "EnvReport": "sdadapt._base.env",
    "Feature": "sdadapt._base.env",
}

__getattr__, __dir__, __all__ = attach(__name__, _PUBLIC)
