#!/usr/bin/env bash
# One device call (one GPU): the refit of Llama 8B into the five quantized engines (FP8 block, NVFP4,
# MXFP8, FP8 per channel, FP8 per tensor; $REPEAT runs, default 11, each format in a fresh process;
# FP8 block and NVFP4 once more under torch's profiler, their Chrome traces in $OUT, and once under
# cProfile), then the CUDA quantization tests with kvikio installed and (NOKV=1, the default) without it. Run from a copy of the tree with the wheels in $WHL: pydantic and its
# parts, compressed-tensors and loguru (the tests' reference), kvikio-cu13, libkvikio-cu13 and
# rapids-logger. Outputs under $OUT; the last lines printed are the figures and the tests' verdicts.
set -u
WHL=${WHL:-.whl}
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/base \
    "$WHL"/pydantic-*.whl "$WHL"/pydantic_core-*.whl "$WHL"/annotated_types-*.whl "$WHL"/typing_inspection-*.whl \
    "$WHL"/compressed_tensors-*.whl "$WHL"/loguru-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kv \
    "$WHL"/kvikio_cu13-*.whl "$WHL"/libkvikio_cu13-*.whl "$WHL"/rapids_logger-*.whl || echo "kvikio did not install"
export PYTHONPATH=$PWD/src:/tmp/base
# setup.py ships adapters/ as sdadapt.adapters; a copy of the tree run from src/ needs that link
[ -e src/sdadapt/adapters ] || ln -s ../../adapters src/sdadapt/adapters
nvidia-smi -L; nproc; date -u; echo "tree $(cat .tree 2>/dev/null || echo unknown)"
B="python3 bench/refit_bench.py --scenario single --device cuda --size 8b --hang-s 40 --no-baseline --repeat ${REPEAT:-11}"
for f in fp8_block nvfp4; do
    timeout ${T1:-80} $B --quant $f --profile 30 --trace "$OUT"/${f}_trace.json --cprofile 40 >"$OUT"/$f.log 2>&1
    gzip -f "$OUT"/${f}_trace.json
done
for f in mxfp8 fp8_channel fp8_tensor; do timeout ${T2:-45} $B --quant $f >"$OUT"/$f.log 2>&1; done
T="tests/transaction/test_refit_formats.py tests/recipes/test_quant_fused.py tests/rules/test_quant_export.py"
echo "== with kvikio" >"$OUT"/tests.log  # one file for both runs: at most 8 files come back from a call
PYTHONPATH=$PYTHONPATH:/tmp/kv timeout 90 python3 -m pytest -q -p no:cacheprovider -rs $T >>"$OUT"/tests.log 2>&1
tail -n 4 "$OUT"/tests.log
if [ "${NOKV:-1}" = 1 ]; then
    echo "== without kvikio" >>"$OUT"/tests.log
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rs $T >>"$OUT"/tests.log 2>&1
    tail -n 4 "$OUT"/tests.log
fi
date -u
grep -hE "^refit|^GPU:|^llama" "$OUT"/fp8_block.log "$OUT"/nvfp4.log "$OUT"/mxfp8.log "$OUT"/fp8_channel.log "$OUT"/fp8_tensor.log
