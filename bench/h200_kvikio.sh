#!/usr/bin/env bash
# One call on an H200 (the device tool): carried wheels installed, the CUDA-only tests with kvikio
# installed and without it, then the 8B bench (sdadapt with kvikio and, as @nokv, without it;
# InstantTensor buffered and mmap; kvikio's raw row). Run from a copy of the tree with the wheels
# in $WHL (kvikio-cu13, libkvikio-cu13, rapids-logger, instanttensor, pydantic and its parts,
# compressed-tensors, loguru). Outputs under $OUT; BENCH_EXTRA: more load_bench arguments (variants);
# RAW: the raw rows (default instanttensor,instanttensor-mmap,kvikio). `probe`: kvikio's start-up
# and the page-cache checks (bench/probes/kvikio_start_probe.py) on the bench's kept checkpoint;
# `cold`: the cold-cache rows (the page cache dropped before every load; COLD_EXTRA, COLD_RAW,
# COLD_REPEAT); `imports`: bench/probes/import_probe.py (IMPORT_RUNS; IMPORT_EXTRA: more of its
# arguments, such as `--profile 25`); `cpu2`: two of the CPUs (`taskset -c 0,1`), 2 gloo ranks,
# meta and materialised flows against DCP's HF reader, in CPU2_ROUNDS interleaved rounds;
# `cpu16`: 16 gloo ranks on the CPUs against DCP's HF reader.
# `steady`: the steady 8B load's split and kvikio's settings in one run: sdadapt, @nokv, @k12
# (12 kvikio threads), @b4 (4 MiB bounce buffers), @k12b4, @hd2g / @hd1g (a head start of 2 / 1 GiB:
# SDADAPT_IO_HEAD_MB; its first steady load may still pin it), STEADY_EXTRA (more --variant), against
# InstantTensor buffered and raw kvikio (STEADY_RAW), STEADY_REPEAT steady loads (default 4; the
# phases of every load are in kv8b_steady.json), then bench/probes/steady_overhead_probe.py on the GPU.
# `firstgc`: the first load with imports, sdadapt against InstantTensor buffered, as the headline runs it, then
# the same with --collect-after-build (a gc.collect() after each model build: the first load without the
# full collection a model build leaves due; labelled, not the headline), FIRSTGC_ROUNDS interleaved rounds.
# FORMATS_EXTRA: more arguments of the formats run. Each step prints the time it ends.
# Usage: bash bench/h200_kvikio.sh [tests] [bench] [formats] [probe] [cold] [imports] [cpu2] [cpu16] [steady] [firstgc]
set -u
WHL=${WHL:-../../.whl}
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
pipi /tmp/base "$WHL"/pydantic-*.whl "$WHL"/pydantic_core-*.whl "$WHL"/annotated_types-*.whl "$WHL"/typing_inspection-*.whl \
    "$WHL"/compressed_tensors-*.whl "$WHL"/loguru-*.whl || exit 1
pipi /tmp/kv "$WHL"/kvikio_cu13-*.whl "$WHL"/libkvikio_cu13-*.whl "$WHL"/rapids_logger-*.whl || exit 1
pipi /tmp/it "$WHL"/instanttensor-*.whl || exit 1
python3 -m compileall -q src /tmp/base /tmp/kv /tmp/it >/dev/null
BASE=$PWD/src:/tmp/base:/tmp/it
RAW=${RAW:-instanttensor,instanttensor-mmap,kvikio}
export PYTHONPATH=$BASE:/tmp/kv
nvidia-smi -L; df -hT /tmp | tail -1; nproc
python3 -c "import torch, kvikio, kvikio.defaults as d; print('torch', torch.__version__, 'kvikio', kvikio.__version__, 'compat', d.get('compat_mode'), 'compat preferred', d.is_compat_mode_preferred(), 'threads', d.get('num_threads'))" 2>&1 | tee "$OUT"/kvikio_probe.log
for what in "$@"; do
  case $what in
    tests)
      T="tests/engine/test_devread.py tests/engine/test_head_start.py tests/engine/test_compute_device.py tests/engine/test_pinned.py tests/rules/test_quant_export.py"
      PYTHONPATH=$BASE:/tmp/kv timeout 240 python3 -m pytest -q -p no:cacheprovider $T 2>&1 | tail -25 | tee "$OUT"/tests_kvikio.log
      PYTHONPATH=$BASE timeout 150 python3 -m pytest -q -p no:cacheprovider $T 2>&1 | tail -12 | tee "$OUT"/tests_no_kvikio.log
      PYTHONPATH=$BASE:/tmp/kv timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_scenario.py 2>&1 | tail -8 | tee "$OUT"/gpu_scenario_kvikio.log
      ;;
    bench)
      timeout 420 python3 bench/load_bench.py --preset 8b --nproc 1 --backend nccl --dir /tmp/ck --keep --tp-paths '' --hsdp-paths '' \
        --materialized-paths '' --discussion '' --timeout 120 --import-in-load --repeat 3 --no-verify --paths sdadapt \
        --raw-paths "$RAW" --by-variant --variant nokv:SDADAPT_IO_KVIKIO=0 ${BENCH_EXTRA:-} \
        --out "$OUT"/kv8b 2>&1 | tail -40
      ;;
    formats)
      timeout 540 python3 bench/load_bench.py --preset 8b --nproc 1 --backend nccl --dir /tmp/ck --keep --tp-paths '' --hsdp-paths '' \
        --materialized-paths '' --discussion '' --timeout 120 --import-in-load --repeat 3 --no-verify \
        --paths sdadapt,sdadapt-nvfp4,sdadapt-fp8ch --raw-paths instanttensor,instanttensor-mmap,kvikio \
        --by-variant --variant nokv:SDADAPT_IO_KVIKIO=0 ${FORMATS_EXTRA:-} --out "$OUT"/kv8b_formats 2>&1 | tail -40
      ;;
    probe)
      HF=$(ls -d /tmp/ck/sdadapt-bench-*/hf | head -1)
      timeout 200 python3 bench/probes/kvikio_start_probe.py start --folder "$HF" --bounce-mb ${BOUNCES:-16,4,1} 2>&1 | tee "$OUT"/probe_start.jsonl
      timeout 150 python3 bench/probes/kvikio_start_probe.py cold --folder "$HF" 2>&1 | tee "$OUT"/probe_cold.jsonl
      ;;
    cold)
      timeout ${COLD_TIMEOUT:-300} python3 bench/load_bench.py --preset ${COLD_PRESET:-8b} --nproc 1 --backend nccl --dir /tmp/ck --keep --tp-paths '' \
        --hsdp-paths '' --materialized-paths '' --discussion '' --timeout 120 --import-in-load --repeat ${COLD_REPEAT:-1} --no-verify \
        --paths sdadapt --raw-paths ${COLD_RAW:-instanttensor,instanttensor-direct,kvikio} --cold --by-variant \
        ${COLD_EXTRA:---variant nokv:SDADAPT_IO_KVIKIO=0} --out "$OUT"/kv8b_cold 2>&1 | tail -30
      ;;
    imports)
      # the import tax of a first local load: -X importtime between the probe's markers, and its
      # process CPU (what -X importtime misses: modules imported through importlib, module bodies)
      timeout 120 python3 bench/probes/import_probe.py --runs ${IMPORT_RUNS:-3} --top 12 ${IMPORT_EXTRA:-} --out "$OUT"/imports.json 2>&1 | tee "$OUT"/imports.log
      ;;
    cpu2)
      # the device's CPUs, two of them (quiet, unlike a shared 2-core box): 2 gloo ranks, meta and
      # materialised flows against DCP's HF reader, interleaved rounds in fresh processes
      CUDA_VISIBLE_DEVICES= timeout ${CPU2_TIMEOUT:-240} taskset -c 0,1 python3 bench/load_bench.py --preset 1.9g --shard-gb 0.5 \
        --nproc 2 --backend gloo --dir /tmp/ckc2 --keep --rounds ${CPU2_ROUNDS:-5} --repeat 1 --no-references --discussion '' \
        --timeout 150 --paths sdadapt,hf-reader --tp-paths '' --hsdp-paths '' --materialized-paths sdadapt,hf-reader \
        --out "$OUT"/cpu2 2>&1 | tail -14
      ;;
    steady)
      timeout ${STEADY_TIMEOUT:-300} python3 bench/load_bench.py --preset 8b --nproc 1 --backend nccl --dir /tmp/ck --keep --tp-paths '' \
        --hsdp-paths '' --materialized-paths '' --discussion '' --timeout 120 --import-in-load --repeat ${STEADY_REPEAT:-4} --no-verify \
        --paths sdadapt --raw-paths ${STEADY_RAW:-instanttensor,kvikio} --by-variant --variant nokv:SDADAPT_IO_KVIKIO=0 \
        --variant k12:SDADAPT_IO_KVIKIO_THREADS=12 --variant b4:SDADAPT_IO_KVIKIO_BOUNCE_MB=4 \
        --variant k12b4:SDADAPT_IO_KVIKIO_THREADS=12,SDADAPT_IO_KVIKIO_BOUNCE_MB=4 --variant hd2g:SDADAPT_IO_HEAD_MB=2048 \
        --variant hd1g:SDADAPT_IO_HEAD_MB=1024 ${STEADY_EXTRA:-} \
        --out "$OUT"/kv8b_steady 2>&1 | tail -40
      timeout 120 python3 bench/probes/steady_overhead_probe.py --device cuda --loads 9 --json "$OUT"/steady_overhead.json 2>&1 | tail -3
      ;;
    firstgc)
      for gcflag in "" --collect-after-build; do
        timeout ${FIRSTGC_TIMEOUT:-200} python3 bench/load_bench.py --preset 8b --nproc 1 --backend nccl --dir /tmp/ck --keep \
          --tp-paths '' --hsdp-paths '' --materialized-paths '' --discussion '' --timeout 120 --import-in-load --repeat 1 \
          --no-verify --no-references --paths sdadapt --raw-paths instanttensor --rounds ${FIRSTGC_ROUNDS:-3} $gcflag \
          --out "$OUT"/kv8b_firstgc${gcflag:+_collected} 2>&1 | tail -8
      done
      ;;
    cpu16)
      CUDA_VISIBLE_DEVICES= timeout ${CPU_TIMEOUT:-200} python3 bench/load_bench.py --preset 1.9g --shard-gb 0.5 --nproc 16 --backend gloo \
        --dir /tmp/ckc --keep --repeat 3 --discussion '' --timeout 150 --paths sdadapt,hf-reader --tp-paths '' --hsdp-paths '' \
        --materialized-paths sdadapt,hf-reader --out "$OUT"/cpu16 2>&1 | tail -12
      ;;
  esac
  echo "== $what done $(date +%T)"
done
