#!/usr/bin/env bash
# The whole GPU check in one device call: GPU tests, then bench.py workloads. Logs under $OUT.
# Usage (repo root, on the GPU machine):
#   [ENGINES="nanovllm vllm"] [KV_DTYPES="auto fp8"] [SKIP_TESTS=1] bash tests/gpu_check.sh [workloads...]
# ENGINES=none runs the tests alone.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")   # a hung test fails alone
  timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q -m gpu $per_test tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
for engine in ${ENGINES:-nanovllm}; do
  [ "$engine" = none ] && continue
  for kv in ${KV_DTYPES:-auto}; do
    for w in ${@:-default prefix latency}; do
      timeout "${BENCH_TIMEOUT:-240}" python3 bench.py --engine "$engine" --workload "$w" --kv-cache-dtype "$kv" \
        --json 2>&1 | tee "$OUT/bench_${engine}_${w}_$kv.log" | grep -v '^{' | tail -4
    done
  done
done
echo "== summary"
python3 tests/bench_summary.py "$OUT"/bench_*.log
tail -1 "$OUT/gpu_tests.log" 2>/dev/null
