#!/usr/bin/env bash
# Install what is missing into .venv (sdadapt[test,test-titan]: pytest, hypothesis, reference
# models, ruff, mypy; torchtitan for the bridge's tests), check lint and types, then run the test
# suite (extra arguments go to pytest):
#   bash scripts/test.sh                     # lint, types, everything
#   bash scripts/test.sh tests/cli/test_cli.py   # lint, types, one file
SDADAPT_EXTRA=test,test-titan source "$(dirname "$0")/_setup.sh"
echo "[test] ruff check (lint and import order)" >&2
"$PY" -m ruff check .
echo "[test] mypy (types, configured in pyproject.toml)" >&2
"$PY" -m mypy
set +e
# the live-vLLM tests (marker vllm_live) build a venv of their own: .ci/run runs them separately;
# --durations: every log ends with the 30 slowest tests, so a run shows where its time went
"$PY" -m pytest -q -m "not vllm_live" --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
