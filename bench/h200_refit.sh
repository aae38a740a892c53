#!/usr/bin/env bash
# One call on an H200 (the device tool): the refit benchmark's one-GPU rows, colocated world 1,
# FSDP2-placed trainer (float32) -> vLLM TP 1 Llama 8B, bf16 and FP8 (block 128x128) engines.
# Run from a copy of the tree with pydantic's wheels in $WHL. Outputs under $OUT.
set -u
WHL=${WHL:-../../.whl}
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/base \
    "$WHL"/pydantic-*.whl "$WHL"/pydantic_core-*.whl "$WHL"/annotated_types-*.whl "$WHL"/typing_inspection-*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/base
nvidia-smi -L; nproc; date -u
git_hash=$(cat .tree 2>/dev/null || echo unknown); echo "tree $git_hash"
B="python3 -X faulthandler bench/refit_bench.py --scenario single --device cuda --size 8b --hang-s 90"
# ONLY=bf16 or ONLY=fp8: one of the two
[ "${ONLY:-bf16}" = bf16 ] && timeout ${T1:-150} $B --repeat 3 --baseline-repeat 1 2>&1 | tee "$OUT"/refit_8b_bf16.log
[ "${ONLY:-fp8}" = fp8 ] && timeout ${T2:-120} $B --repeat 3 --fp8 --no-baseline 2>&1 | tee "$OUT"/refit_8b_fp8.log
true
