"""One exception hierarchy for everything sdadapt raises on purpose.

Every error names what it is about (the file, the key, the rule) and says what to do.
All derive from :class:`SdadaptError`, an ordinary ``Exception`` (unlike DCP's
``CheckpointException``, which derives from ``BaseException``).
"""

from __future__ import annotations

from typing import Any


class SdadaptError(Exception):
    """Base class of all sdadapt errors.

    Every error sdadapt raises is one of its subclasses in :mod:`sdadapt.errors`
    (``PlanError``, ``SourceError``, ``LoadError`` ...), each naming the key or file and what to
    do; catch this one to handle them all.

    Args:
        *args: the message, as for ``Exception``.

    Example::

        try:
            sdadapt.load(model, "ckpt/", "llama")
        except sdadapt.errors.PlanError as e:
            raise SystemExit(e.report.format())  # what does not line up, key by key
        except sdadapt.SdadaptError as e:
            raise SystemExit(f"not loaded: {e}")
    """


class SourceError(SdadaptError):
    """A checkpoint cannot be opened or read: missing path, corrupt header, unsafe index..."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        self.path = path
        self.key = key
        where = []
        if path is not None:
            where.append(f"file {path}")
        if key is not None:
            where.append(f"key {key!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class AdapterError(SdadaptError):
    """An adapter or rule is malformed (bad pattern, bad arguments, bad JSON)."""


class PlanError(SdadaptError):
    """The source does not line up with the target; ``.report`` (a :class:`sdadapt.reports.Report`) says
    how. Nothing was read. (This module is the lowest layer of the package, so it names the
    report's type in words rather than importing it.)"""

    report: Any

    def __init__(self, report: Any):
        self.report = report
        advice = getattr(report, "advice", None)
        closing = advice() if callable(advice) else "Fix the adapter, or relax with allow_missing=/allow_unexpected= patterns."
        try:  # the rows it leaves out are listed by the report this error holds
            text = report.format(held_as="err.report")
        except TypeError:  # a report of another kind
            text = report.format()
        super().__init__("checkpoint does not match the model; nothing was loaded.\n" + text + "\n" + closing)


class ModelError(SdadaptError):
    """The model cannot be loaded as it is (e.g. buffers nothing would initialise)."""


class LoadError(SdadaptError):
    """Reading or copying tensor data failed during the load (after planning succeeded)."""


class RemoteRankError(SdadaptError):
    """Another rank failed; this rank stops too instead of hanging in a collective."""


class DisagreementError(SdadaptError):
    """The ranks of a group are not about to do the same thing: different adapters, plans or
    sdadapt / torch / transformers versions. Raised on every rank before anything is read or
    written; the message names the ranks that differ from rank 0 and what differs."""


class StateError(SdadaptError):
    """Saving or restoring training state is not possible as asked (nothing was changed)."""


class ExportError(SdadaptError):
    """Writing the output failed or is not possible as asked; nothing is left at ``dst``."""


class RefitError(SdadaptError):
    """A refit (:func:`sdadapt.refit_plan`) cannot be planned or did not complete: shapes that do
    not line up, a bucket too small for one row, a rank that left or timed out. Raised on every
    rank. ``updated`` / ``not_updated``: this rank's engine tensors that a failed run did and
    did not finish writing (empty when planning failed: nothing was written)."""

    def __init__(self, message: str, *, updated: list[str] | None = None, not_updated: list[str] | None = None):
        self.updated = list(updated or [])
        self.not_updated = list(not_updated or [])
        super().__init__(message)


class ResolveError(SdadaptError):
    """A ``module:attr`` / ``file.py:attr`` / adapter-name spec cannot be imported or used."""


class ShrinkError(SdadaptError):
    """The checkpoint cannot be shrunk as asked (too few layers, no layer keys, a split scale)."""


class VerifyError(SdadaptError):
    """A verification cannot run (no reference class, no vocabulary size, outputs of different shapes)."""


class VersionError(SdadaptError):
    """An installed package (transformers, torch, torchtitan...) lacks what sdadapt calls: a
    release outside the supported range, or one whose API changed. The message names the package,
    its version and the supported range; ``sdadapt env`` lists what is installed."""


class UsageError(SdadaptError, TypeError):
    """A public function was called with arguments it cannot take as given (a model and a path
    swapped, for instance); the message shows the call's signature. Also a ``TypeError``."""
