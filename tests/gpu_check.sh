#!/usr/bin/env bash
# The whole GPU check in one device call: GPU tests, then bench.py workloads. Logs under $OUT.
# Usage (repo root, on the GPU machine):
#   [ENGINES="nanovllm vllm"] [KV_DTYPES="auto fp8"] [REPEATS=2] [SKIP_TESTS=1] bash tests/gpu_check.sh [workloads...]
# VARIANTS="NANOVLLM_PDL=0 NANOVLLM_PDL=1" runs every benchmark once per environment setting, interleaved;
# a comma joins settings into one variant: VARIANTS="X=0 X=1,Y=1".
# FUZZ_SEEDS=a:b also runs tests/fuzz_engine.py on those seeds in bf16 (engine steps, then LLM calls).
# BENCH_ARGS are added to every bench.py command (e.g. BENCH_ARGS="--num-loras 4").
# ENGINES=none runs the tests alone. Each GPU test file runs in its own pytest under its own
# time limit (TEST_TIMEOUT, seconds), so a test blocked in a collective costs only its file;
# faulthandler prints where a test hung once it has run STACK_AFTER seconds (default 90).
# REPEATS runs every benchmark that many times, each in a new process (the first run on a fresh
# machine also compiles kernels its warm-up missed).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1   # (absolute: the fuzz runs in tests/)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  limit=${TEST_TIMEOUT:-300}
  for file in $(grep -l "pytest.mark.gpu" tests/test_*.py); do
    name=$(basename "$file" .py)
    timeout -s KILL "$limit" python3 -m pytest -q -m gpu -o faulthandler_timeout="${STACK_AFTER:-90}" "$file" \
      > "$OUT/gpu_$name.log" 2>&1
    echo "$name: $(tail -1 "$OUT/gpu_$name.log")"
  done | tee "$OUT/gpu_tests.log"
  # one symmetric-memory group per process: this test skips inside the whole file's run
  timeout -s KILL "$limit" python3 -m pytest -q -m gpu tests/test_gpu_tp.py -k graphs-custom-all-reduce \
    > "$OUT/gpu_test_gpu_tp_killed_custom.log" 2>&1
  echo "test_gpu_tp -k graphs-custom-all-reduce: $(tail -1 "$OUT/gpu_test_gpu_tp_killed_custom.log")" | tee -a "$OUT/gpu_tests.log"
fi
if [ -n "${FUZZ_SEEDS:-}" ]; then   # e.g. FUZZ_SEEDS=0:30: tests/fuzz_engine.py in bf16, engine steps then LLM calls
  for mode in "" --llm; do
    log="$OUT/fuzz${mode/--/_}.log"
    (cd tests && timeout -s KILL "${FUZZ_TIMEOUT:-300}" python3 fuzz_engine.py $mode --seeds "$FUZZ_SEEDS" \
      --dtype bfloat16) > "$log" 2>&1
    echo "fuzz_engine ${mode:-(engine steps)}: $(tail -1 "$log")"
  done | tee "$OUT/fuzz_summary.log"
fi
read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
for engine in ${ENGINES:-nanovllm}; do
  [ "$engine" = none ] && continue
  for kv in ${KV_DTYPES:-auto}; do
    for w in ${@:-default prefix latency}; do
      for i in $(seq "${REPEATS:-1}"); do
        for v in "${variants[@]}"; do      # interleaved, so that drift hits every variant alike
          tag=${v:+_${v//[^A-Za-z0-9]/}}
          env ${v//,/ } timeout "${BENCH_TIMEOUT:-240}" python3 bench.py --engine "$engine" --workload "$w" \
            --kv-cache-dtype "$kv" ${BENCH_ARGS:-} --json 2>&1 \
            | tee "$OUT/bench_${engine}_${w}_${kv}${tag}_$i.log" | grep -v '^{' | tail -4
        done
      done
    done
  done
done
echo "== summary"
logs=$(ls "$OUT"/bench_*.log 2>/dev/null)
[ -n "$logs" ] && python3 tests/bench_summary.py $logs
cat "$OUT/gpu_tests.log" "$OUT/fuzz_summary.log" 2>/dev/null
# The device tool returns at most 8 files from $OUT: pack the logs into one (PACK=0 keeps them loose).
if [ "${PACK:-1}" = 1 ]; then
  (cd "$OUT" && tar czf logs.tgz --exclude logs.tgz ./*.log && rm -f ./*.log)
fi
