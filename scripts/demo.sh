#!/usr/bin/env bash
# Install what is missing into .venv, then run the demo (examples/demo.py): sdadapt diff
# without and with an adapter, then 4 CPU processes loading a checkpoint into a 2x2
# FSDP2 x TP model and training a few steps. Extra arguments go to examples/demo.py.
source "$(dirname "$0")/_setup.sh"
exec "$PY" examples/demo.py "$@"
