"""An adapter module whose dependency is missing (registry tests)."""

import sdadapt_no_such_dependency  # noqa: F401

SUMMARY = "never seen"


def build():  # pragma: no cover
    raise AssertionError
