#!/usr/bin/env bash
# The device calls that produce the committed GPU results. Run from the repo root on the GPU machine:
#   bash benchmarks/gpu_session.sh tests   # GPU test suite + demo           -> gpu_tests.log, demo.log
#   bash benchmarks/gpu_session.sh bench   # benchmark + profile report/PNG  -> results.*, log.txt, docs/*
# Everything lands in $OUT (at most 8 files come back from the device).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1 || { echo "install failed"; exit 1; }
case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -15 "$OUT/gpu_tests.log"
    timeout ${DEMO_TIMEOUT:-90} python3 examples/demo.py > "$OUT/demo.log" 2>&1
    echo "demo rc=$?"; grep -E "===|rel err|GPU median" "$OUT/demo.log"
    ;;
  bench)
    timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_workloads.py --out "$OUT" ${BENCH_ARGS:-} > /dev/null 2>&1
    echo "bench rc=$?"; tail -32 "$OUT/results.md"
    timeout ${PROFILE_TIMEOUT:-150} python3 examples/profile_demo.py --bench "$OUT/results.json" 2>&1 \
      | grep -v USDT > "$OUT/profile_demo.log"
    echo "profile rc=$?"; grep -E "agrees|DIFFERS|end to end|wrote" "$OUT/profile_demo.log"
    mkdir -p "$OUT/docs"; cp docs/roofline*.png docs/profile_report*.html "$OUT/docs/" 2>/dev/null
    rm -rf "$OUT/profile"  # traces: too many files to bring back
    ;;
esac
