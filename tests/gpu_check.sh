#!/usr/bin/env bash
# The whole GPU check in one device call: GPU tests, then bench.py workloads. Logs under $OUT.
# Usage (repo root, on the GPU machine): bash tests/gpu_check.sh [bench workloads...]
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/ -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
for w in ${@:-default prefix latency}; do
  timeout 240 python3 bench.py --workload "$w" --json 2>&1 | tee "$OUT/bench_$w.log" | grep -v '^{' | tail -4
done
echo "== summary"
grep -h '^{' "$OUT"/bench_*.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['engine']:9} {r['workload']:8} {r['time_s']:8.2f}s {r['output_tok_s']:10.0f} out tok/s  startup {r['startup_s']}s\", r.get('ms_per_token', ''))
"
tail -1 "$OUT/gpu_tests.log" 2>/dev/null
