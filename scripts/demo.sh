#!/usr/bin/env bash
# Install what is missing into .venv (the first run installs torch: about 1.5 minutes, with
# pip's progress shown), then run the demo (examples/demo.py): sdadapt diff without and with
# an adapter, then 4 CPU processes loading a checkpoint into a 2x2 FSDP2 x TP model and
# training a few steps. Extra arguments go to examples/demo.py.
SDADAPT_EXTRA="" source "$(dirname "$0")/_setup.sh"
exec "$PY" examples/demo.py "$@"
