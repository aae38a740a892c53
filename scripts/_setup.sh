# Sourced by scripts/demo.sh and scripts/test.sh: make .venv (Python >= 3.10) with torch and
# sdadapt[test] installed, and set $PY to its python. Needs nothing but python3 on PATH
# (or PYTHON=/path/to/python). Re-installs sdadapt only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "creating .venv" >&2
    "${PYTHON:-python3}" -m venv .venv
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "installing torch 2.13.0 into .venv" >&2
    "${PIP[@]}" torch==2.13.0
fi
stamp=.venv/.sdadapt-installed
want="$("$PY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c 'import sdadapt, pytest, hypothesis' 2>/dev/null; then
    echo "installing sdadapt (editable) with its test dependencies into .venv" >&2
    "${PIP[@]}" -e '.[test]'
    echo "$want" > "$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
