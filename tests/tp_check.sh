#!/usr/bin/env bash
# Tensor-parallel benchmarks in one device call: bench.py's default workload on one model shape at
# every TP size the machine has GPUs for; nanovllm also with NCCL for every all-reduce
# (--custom-all-reduce off, instead of its default symmetric-memory all-reduce) at the sizes in
# NCCL_SIZES (default: all).
# Usage (repo root, on the GPU machine): ENGINES="nanovllm vllm" MODEL=qwen3-8b SIZES="1 2 4" bash tests/tp_check.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen3-8b}
NUM_GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SIZES=${SIZES:-$(for n in 1 2 4 8; do [ "$n" -le "$NUM_GPUS" ] && echo $n; done)}
for engine in ${ENGINES:-nanovllm}; do
  for tp in $SIZES; do
    variants=("")
    if [ "$engine" = nanovllm ] && [ "$tp" -gt 1 ] && [[ " ${NCCL_SIZES:-$SIZES} " == *" $tp "* ]]; then
      variants+=("--custom-all-reduce off")
    fi
    for flag in "${variants[@]}"; do
      log="$OUT/tp_${engine}_${MODEL}_tp${tp}${flag:+_nccl}.log"
      timeout "${BENCH_TIMEOUT:-300}" python3 bench.py --engine "$engine" --model "$MODEL" --tp "$tp" $flag --json \
        2>&1 | tee "$log" | grep -v '^{' | tail -3
    done
  done
done
echo "== summary"
python3 tests/bench_summary.py "$OUT"/tp_*.log
