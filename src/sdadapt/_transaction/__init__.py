"""Floor 6, the machinery every operation shares: argument checks, the plan steps (open a
checkpoint, derive its adapter, plan it against a model), the load transaction (plan on every
rank, agree, read, check, then commit or roll back), materialising a meta model, and the public
functions' tidy errors. The operations themselves live one floor up, in rooms named for what a
user does: :mod:`sdadapt._load`, :mod:`sdadapt._state`, :mod:`sdadapt._export`,
:mod:`sdadapt._refit`, :mod:`sdadapt._dry_run` and :mod:`sdadapt._tools`."""

from .args import check_model_and_path, check_not_a_model, renamed_keywords
from .headers import SharedHeaders, share_headers
from .materialize import (
    InitFn,
    MissingInitFn,
    Reservation,
    check_buffers,
    choose_device,
    has_meta,
    meta_non_persistent_buffers,
    missing_values,
)
from .options import Options
from .steps import derive_adapter, judge, open_checkpoint, plan_model, plan_schema
from .tidy import call_started, public, single_process_quiet
from .transaction import ATOMIC_WHY, PARTLY_LOADED, Part, Transaction, foreign_error, is_marked

__all__ = [
    "ATOMIC_WHY",
    "PARTLY_LOADED",
    "InitFn",
    "MissingInitFn",
    "Options",
    "Part",
    "Reservation",
    "SharedHeaders",
    "Transaction",
    "call_started",
    "check_buffers",
    "check_model_and_path",
    "check_not_a_model",
    "choose_device",
    "derive_adapter",
    "foreign_error",
    "has_meta",
    "is_marked",
    "judge",
    "meta_non_persistent_buffers",
    "missing_values",
    "open_checkpoint",
    "plan_model",
    "plan_schema",
    "public",
    "renamed_keywords",
    "share_headers",
    "single_process_quiet",
]
