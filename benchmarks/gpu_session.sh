#!/usr/bin/env bash
# One device call: install, GPU tests, demo, benchmark. Everything lands in $OUT.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -x tests > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
tail -15 "$OUT/gpu_tests.log"
timeout ${DEMO_TIMEOUT:-90} python3 examples/demo.py > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; grep -E "===|rel err|GPU median" "$OUT/demo.log"
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_workloads.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench_stdout.log" 2>&1; echo "bench rc=$?"
tail -40 "$OUT/bench_stdout.log"
