"""Floor 7, the tools: ``sdadapt.diff()`` (the report only), ``sdadapt.verify()`` (a loaded
model's logits against a reference model's, the first layer that differs localised) and
``sdadapt.shrink()`` (the first N layers of an HF checkpoint, streamed)."""

from .diffing import Target, diff, family_suggestion, target_schema
from .shrinking import ShrinkReport, shrink
from .verifying import VerifyReport, reference_from_checkpoint, verify

__all__ = [
    "ShrinkReport",
    "Target",
    "VerifyReport",
    "diff",
    "family_suggestion",
    "reference_from_checkpoint",
    "shrink",
    "target_schema",
    "verify",
]
