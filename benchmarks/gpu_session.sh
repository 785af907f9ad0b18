#!/usr/bin/env bash
# The device calls that produce the committed GPU results. Run from the repo root on the GPU machine, one mode
# per device call (the device stops a command at 600 s; every step's timeout is clipped to SESSION_BUDGET):
#   bash benchmarks/gpu_session.sh tests-core    # kernel/op/API GPU tests + demo      -> tests_core.log, demo.log
#   bash benchmarks/gpu_session.sh tests-models  # real models, properties, robustness -> tests_models.log
#   bash benchmarks/gpu_session.sh tests         # both shards in one call (only if they fit together)
#   bash benchmarks/gpu_session.sh tests-parallel # every GPU test in 8 parallel pytest processes -> tests_<n>.log
#   bash benchmarks/gpu_session.sh bench         # full benchmark, max-autotune bounded to ~420 s
#                                                #   -> results.md, results.json, log.txt (+ profile demo if time left)
#   bash benchmarks/gpu_session.sh bench-quick   # benchmark without max-autotune + profile report/PNG
#                                                #   -> results.*, log.txt, profile_demo.log, docs/* (8 files)
#   bash benchmarks/gpu_session.sh training      # training steps vs eager / torch.compile -> training.md,
#                                                #   a 4-layer transformers Llama's step -> llama_training.md
#   bash benchmarks/gpu_session.sh decode-model  # greedy decode of a 4-layer Llama-3-8B-shaped transformers model:
#                                                #   eager / fxfuse / torch.compile / backend=fxfuse -> decode_model.md,
#                                                #   and with StaticCache + reduce-overhead -> decode_model_static.md;
#                                                #   model.generate() with CompileConfig(backend="fxfuse") -> generate.md
#   bash benchmarks/gpu_session.sh probe         # probe_decode/probe_tma --quick, probe.py -> probe_*.log, probe.txt
#   bash benchmarks/gpu_session.sh moe           # MoE experts kernels: GPU tests + probe_moe.py (gpt-oss, Mixtral,
#                                                #   Qwen3-MoE shapes; training steps) -> moe_*.log
#   bash benchmarks/gpu_session.sh moe-bench     # MoE experts beside eager and torch.compile, with the floor
#                                                #   (benchmarks/bench_moe.py, forward and training) -> moe*.md
#   bash benchmarks/gpu_session.sh decode-moe    # whole MoE models' prefill + decode (Mixtral, Qwen3-MoE, gpt-oss
#                                                #   shapes; MOE_FAMILIES picks; DECODE_MOE_ARGS="--compile --static":
#                                                #   the compiled variants too) -> decode_<family>.md
# Everything lands in $OUT; at most 8 files come back from the device, so each mode writes few.
# Knobs (env): SESSION_BUDGET (s, default 560), FXFUSE_HYPOTHESIS_EXAMPLES (GPU property examples per dtype,
# default 10 here), BENCH_ARGS, and a *_TIMEOUT per step (see below).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-out}; mkdir -p "$OUT"
SESSION_BUDGET=${SESSION_BUDGET:-560}
export FXFUSE_HYPOTHESIS_EXAMPLES=${FXFUSE_HYPOTHESIS_EXAMPLES:-10}
FAILED=()

# step NAME LIMIT LOG CMD...: run CMD with its output in $OUT/LOG, under a timeout clipped to what is left of
# SESSION_BUDGET (so one slow step cannot push the call past the device's limit); say how it ended.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local left=$((SESSION_BUDGET - SECONDS - 25))
  if ((left < 20)); then
    echo "$name: skipped (session budget: ${SECONDS}s of ${SESSION_BUDGET}s used)" | tee "$OUT/$log"
    FAILED+=("$name(skipped)"); return 1
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  # SIGINT first: pytest then still prints its summary and --durations, a Python script its traceback
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$log" 2>&1
  rc=$?
  local note=""; ((rc == 124 || rc == 137 || SECONDS - t0 >= limit)) && note=" TIMED OUT"
  echo "$name: rc=$rc in $((SECONDS - t0))s (limit ${limit}s)$note"
  ((rc == 0)) || FAILED+=("$name")
  return $rc
}

# existing FILE...: the files that exist (others add test and probe files while this script stays the same)
existing() { local f; for f in "$@"; do [[ -f $f ]] && printf '%s\n' "$f"; done; }

MODEL_TESTS=$(existing tests/test_real_models.py tests/test_properties.py tests/test_robustness.py)
# Core: the listed files, then any other test file with GPU tests (a new one is never silently left out).
CORE_TESTS=$(
  existing tests/test_kernels.py tests/test_ops.py tests/test_chain.py tests/test_api.py tests/test_backend.py \
    tests/test_profile.py tests/test_decode.py tests/test_tma_stage.py tests/test_cudagraphs.py
  for f in $(grep -l "mark.gpu" tests/test_*.py 2>/dev/null); do
    grep -qxF "$f" <<< "$MODEL_TESTS" || echo "$f"
  done
)
CORE_TESTS=$(awk '!seen[$0]++' <<< "$CORE_TESTS")

gpu_tests() {  # gpu_tests NAME LOG FILES
  local name=$1 log=$2 files=$3
  echo "$name: $(echo $files)"
  # shellcheck disable=SC2086  # one word per file
  step "$name" "${TEST_TIMEOUT:-480}" "$log" python3 -m pytest -q -m gpu --durations=15 $files
  grep -E "passed|failed|error" "$OUT/$log" | tail -3
}

demo() {
  step demo "${DEMO_TIMEOUT:-90}" demo.log python3 examples/demo.py
  grep -E "===|rel err|GPU median" "$OUT/demo.log"
}

bench() {  # bench ARGS...: the benchmark; its own log.txt holds the console output
  step bench "${BENCH_TIMEOUT:-500}" bench_console.log python3 benchmarks/bench_workloads.py --out "$OUT" "$@"
  local rc=$?
  ((rc == 0)) || tail -20 "$OUT/bench_console.log"
  rm -f "$OUT/bench_console.log"  # a copy of log.txt (the bench tees into it): not worth a file slot
  sed -n '/^| name | floor/,/^\*\*Verdict/p' "$OUT/results.md" 2>/dev/null
}

profile_demo() {
  local need=${PROFILE_TIMEOUT:-150}
  if ((SESSION_BUDGET - SECONDS - 25 < need)); then
    echo "profile demo: skipped (needs ${need}s, $((SESSION_BUDGET - SECONDS))s left; run bench-quick for it)"
    return
  fi
  step profile "$need" profile_demo.log python3 examples/profile_demo.py --bench "$OUT/results.json"
  sed -i '/USDT/d' "$OUT/profile_demo.log"
  grep -E "agrees|DIFFERS|end to end|wrote" "$OUT/profile_demo.log"
  mkdir -p "$OUT/docs"; cp docs/roofline*.png docs/profile_report*.html "$OUT/docs/" 2>/dev/null
  rm -rf "$OUT/profile"  # traces: too many files to bring back
}

probe() {  # probe NAME SCRIPT ARGS...: one probe script, if present, with its own log
  local name=$1 script=$2; shift 2
  if [[ ! -f $script ]]; then echo "$name: $script not present"; return; fi
  step "$name" "${PROBE_TIMEOUT:-150}" "$name.log" python3 "$script" "$@"
  tail -25 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1 || { echo "install failed"; exit 1; }
mode=${1:-tests}
case "$mode" in
  tests-core)
    gpu_tests tests-core tests_core.log "$CORE_TESTS"
    demo
    ;;
  tests-models)
    gpu_tests tests-models tests_models.log "$MODEL_TESTS"
    ;;
  tests)
    gpu_tests tests-core tests_core.log "$CORE_TESTS"
    gpu_tests tests-models tests_models.log "$MODEL_TESTS"
    demo
    ;;
  tests-parallel)
    # Every GPU test, core and models, in eight pytest processes at once (compilation is CPU-bound and the
    # machine has 16 cores): one call instead of three. Each group's log is tests_<n>.log. (Session 17: group 3
    # took 280 of 300 s with test_gemv and test_autocast, group 2 66 s: those two moved to group 2. Session 29:
    # test_moe.py in group 3 took it past 330 s; it ran beside test_chain_backward, 291-377 s together in session 31,
    # and has its own group since its training tests came. Session 52: test_ops with test_chain passed 340 s with
    # the SIREN tests: each has its own group.)
    groups=("tests/test_kernels.py" "tests/test_ops.py" "tests/test_chain.py"
            "$(existing tests/test_tma_stage.py tests/test_decode.py tests/test_planner.py tests/test_tuning_cache.py tests/test_cost.py tests/test_gemv.py tests/test_autocast.py | xargs)"
            "$(echo $CORE_TESTS | tr ' ' '\n' | grep -vE 'test_(kernels|ops|chain|chain_backward|tma_stage|decode|planner|tuning_cache|cost|gemv|autocast|moe)\.py' | xargs)"
            "$(echo $MODEL_TESTS | xargs)" "$(existing tests/test_chain_backward.py | xargs)"
            "$(existing tests/test_moe.py | xargs)")
    # On a machine of several GPUs the groups are spread over them (group i on GPU i mod n), each seeing one
    # GPU; the two-GPU tests (tests/test_devices.py) then skip here: run them on their own.
    pids=(); started=(); ngpu=$(nvidia-smi -L | wc -l); ((ngpu > 0)) || ngpu=1
    for i in "${!groups[@]}"; do
      [[ -n ${groups[$i]// /} ]] || continue  # an empty group would make pytest collect everything
      echo "group $i: ${groups[$i]}"
      gpu_env=(); ((ngpu > 1)) && gpu_env=(env CUDA_VISIBLE_DEVICES=$((i % ngpu)))
      # shellcheck disable=SC2086
      "${gpu_env[@]}" timeout -s INT -k 20 "${TEST_TIMEOUT:-480}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        ${groups[$i]} > "$OUT/tests_$i.log" 2>&1 &
      pids+=($!); started+=("$i")
    done
    for j in "${!pids[@]}"; do
      i=${started[$j]}
      wait "${pids[$j]}"; rc=$?
      echo "group $i: rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests_$i.log" | tail -1)"
      ((rc == 0)) || FAILED+=("tests_$i")
    done
    ;;
  bench)
    bench ${BENCH_ARGS:-}
    profile_demo
    ;;
  bench-quick)
    bench --skip-max-autotune ${BENCH_ARGS:-}
    profile_demo
    ;;
  training)
    step training "${TRAINING_TIMEOUT:-300}" training_console.log python3 benchmarks/bench_training.py --out "$OUT"
    tail -12 "$OUT/training_console.log"
    # A real model's step (transformers Llama, 4 layers), if transformers is installed: -> llama_training.md
    step llama-training "${LLAMA_TRAINING_TIMEOUT:-120}" llama_training_console.log \
      python3 benchmarks/bench_llama_training.py --out "$OUT" --rounds 5
    tail -6 "$OUT/llama_training_console.log"
    ;;
  decode-model)
    step decode-model "${DECODE_MODEL_TIMEOUT:-300}" decode_model_console.log \
      python3 benchmarks/bench_decode_model.py --out "$OUT" --layers 4 --steps 64 --rounds 5 --compile
    tail -12 "$OUT/decode_model_console.log"
    # transformers' fast path: StaticCache + mode="reduce-overhead" -> decode_model_static.md
    step decode-model-static "${DECODE_MODEL_TIMEOUT:-300}" decode_model_static_console.log \
      python3 benchmarks/bench_decode_model.py --out "$OUT" --layers 4 --steps 64 --rounds 5 --compile --static
    tail -12 "$OUT/decode_model_static_console.log"
    # model.generate() with CompileConfig(backend="fxfuse") -> generate.md
    step generate "${GENERATE_TIMEOUT:-200}" generate_console.log \
      python3 benchmarks/bench_generate.py --out "$OUT" --layers 4 --new-tokens 64 --prompt 128 --rounds 5
    tail -9 "$OUT/generate_console.log"
    ;;
  moe)
    # The MoE experts kernels (fxfuse.moe): GPU tests, then the probe against transformers' own forward at
    # gpt-oss-20b's, Mixtral's and Qwen3-MoE's shapes (transformers' loop and grouped_mm) -> moe*.log
    # (the tests take ~290 s on an H100, so the probes after them need a second call: MOE_SKIP_TESTS=1 skips them)
    if [[ -z ${MOE_SKIP_TESTS:-} ]]; then
      step moe-tests "${TEST_TIMEOUT:-400}" moe_tests.log python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_moe.py tests/test_real_models.py -k "moe or Moe or mixtral or gpt_oss"
      grep -E "passed|failed|error" "$OUT/moe_tests.log" | tail -3
    fi
    step moe-probe-gpt-oss "${PROBE_TIMEOUT:-170}" moe_probe_gpt_oss.log python3 benchmarks/probes/probe_moe.py \
      --family gpt_oss ${GPT_OSS_ARGS:-}
    cat "$OUT/moe_probe_gpt_oss.log"
    step moe-probe "${PROBE_TIMEOUT:-170}" moe_probe.log python3 benchmarks/probes/probe_moe.py ${MIXTRAL_ARGS:-}
    cat "$OUT/moe_probe.log"
    step moe-probe-qwen3 "${PROBE_TIMEOUT:-170}" moe_probe_qwen3.log python3 benchmarks/probes/probe_moe.py \
      --experts 128 --hidden 2048 --inter 768 --top-k 8
    cat "$OUT/moe_probe_qwen3.log"
    # Training (the experts' autograd node): forward + backward against grouped_mm under autograd
    for family in gpt_oss mixtral; do
      step "moe-train-$family" "${PROBE_TIMEOUT:-170}" "moe_train_$family.log" python3 benchmarks/probes/probe_moe.py \
        --family "$family" --train --tokens "${TRAIN_TOKENS:-16,512,4096}"
      cat "$OUT/moe_train_$family.log"
    done
    ;;
  moe-bench)
    # The MoE experts benchmark (benchmarks/bench_moe.py): Mixtral-8x7B's, Qwen3-30B-A3B's and gpt-oss-20b's experts
    # beside eager (transformers' grouped_mm) and torch.compile, with the floor: forward at 1-4096 tokens, then a
    # training step at 512 and 4096 -> moe.md, moe_train.md (+ .json); ~2 + ~3 min on an H200. benchmarks/moe.md
    # is the two tables.
    step moe-bench-forward "${BENCH_TIMEOUT:-280}" moe_bench.log python3 benchmarks/bench_moe.py --out "$OUT" \
      ${BENCH_MOE_ARGS:-}
    step moe-bench-train "${BENCH_TIMEOUT:-280}" moe_bench_train.log python3 benchmarks/bench_moe.py --out "$OUT" \
      --train ${BENCH_MOE_ARGS:-}
    grep -h "^|" "$OUT/moe.md" "$OUT/moe_train.md" | cut -d'|' -f2,3,6,8,9,10,11,14
    ;;
  decode-moe)
    # Whole MoE models (4 layers of Mixtral-8x7B's / Qwen3-30B-A3B's / gpt-oss-20b's shapes): a 512-token prefill
    # and greedy decode, eager (transformers' grouped_mm experts) against fxfuse -> decode_<family>.md
    for family in ${MOE_FAMILIES:-mixtral qwen3_moe gpt_oss}; do
      step "decode-$family" "${DECODE_MODEL_TIMEOUT:-240}" "decode_${family}_console.log" \
        python3 benchmarks/bench_decode_model.py --out "$OUT" --family "$family" --layers 4 --steps 32 --rounds 5 \
        --prompt 512 ${DECODE_MOE_ARGS:-}
      tail -10 "$OUT/decode_${family}_console.log"
    done
    ;;
  probe)
    PROBE_TIMEOUT=${PROBE_DECODE_TIMEOUT:-150} probe probe_decode benchmarks/probes/probe_decode.py --quick
    PROBE_TIMEOUT=${PROBE_TMA_TIMEOUT:-150} probe probe_tma benchmarks/probes/probe_tma.py --quick
    mkdir -p /tmp/fxfuse-probe
    PROBE_TIMEOUT=${PROBE_MAIN_TIMEOUT:-150} probe probe benchmarks/probes/probe.py --out /tmp/fxfuse-probe
    cp /tmp/fxfuse-probe/probe.txt "$OUT/" 2>/dev/null  # (also a partial one, after a timeout)
    ;;
  *)
    echo "unknown mode '$mode': tests-core | tests-models | tests | tests-parallel | bench | bench-quick | training | decode-model | probe | moe | moe-bench | decode-moe"; exit 2
    ;;
esac
n_files=$(find "$OUT" -type f | wc -l)
echo "== $mode done in ${SECONDS}s; $n_files file(s) in $OUT$( ((n_files > 8)) && echo ' (MORE THAN 8: some will not come back)')"
if ((${#FAILED[@]})); then echo "failed steps: ${FAILED[*]}"; exit 1; fi
