#!/usr/bin/env bash
# Install what is missing into .venv, then run the test suite (extra arguments go to pytest):
#   bash scripts/test.sh                     # everything
#   bash scripts/test.sh tests/test_cli.py   # one file
source "$(dirname "$0")/_setup.sh"
set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
