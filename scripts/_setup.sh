# Sourced by scripts/demo.sh and scripts/test.sh: make .venv (Python >= 3.10) with torch and
# sdadapt installed, and set $PY to its python. Needs nothing but python3 on PATH (or
# PYTHON=/path/to/python). SDADAPT_EXTRA names the extras to install with sdadapt ("test" for
# the suite and its linters, "test,test-titan" with torchtitan too, installed without its own
# dependencies, which the suite never imports; empty for the demo). Each
# step says what it does; pip shows its own progress. sdadapt is re-installed only when pyproject.toml or the extra changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
extra="${SDADAPT_EXTRA:-}"
step() { echo "[setup] $*" >&2; }
if [ ! -x "$PY" ]; then
    step "creating .venv with ${PYTHON:-python3}"
    "${PYTHON:-python3}" -m venv .venv
fi
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar on)
if ! "$PY" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    step "installing torch 2.13.0 into .venv (first run only: about 1.5 minutes on a fast connection)"
    "${PIP[@]}" torch==2.13.0
fi
spec=.
checks="import sdadapt"
if [ -n "$extra" ]; then
    spec=".[$extra]"
    case ",$extra," in *,test,*) checks="import sdadapt, pytest, hypothesis, mypy" ;; esac
fi
TITAN=0.3.0  # the torchtitan release the bridge's tests run against (docs/compatibility.md)
case ",$extra," in *,test-titan,*) checks="$checks; import importlib.metadata as m; m.version('torchtitan')" ;; esac
stamp=".venv/.sdadapt-installed${extra:+-$extra}"
want="$("$PY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "$checks" 2>/dev/null; then
    step "installing sdadapt (editable) ${extra:+with its $extra dependencies }into .venv"
    # the constraint keeps the torch above: a dependency (torchtitan's) may not replace it
    echo "torch==2.13.0" > .venv/torch-constraint.txt
    "${PIP[@]}" -c .venv/torch-constraint.txt -e "$spec"
    case ",$extra," in *,test-titan,*)
        # without its dependencies: the test-titan extra holds what importing it needs
        step "installing torchtitan $TITAN (without wandb, tensorboard, datasets ...: not imported) into .venv"
        "${PIP[@]}" --no-deps "torchtitan==$TITAN" ;;
    esac
    echo "$want" > "$stamp"
    step "done installing"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
