"""Shared by every test module: tests/ on ``sys.path`` so that ``support`` (the builders,
checkpoint writers, reference models and the gloo launcher in tests/support/) imports the same way
in pytest, in the ranks ``support.dist_helper`` launches and in scripts run alone."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
