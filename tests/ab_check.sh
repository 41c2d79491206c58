#!/usr/bin/env bash
# A/B of two versions of the engine in one device call, runs interleaved (new, old, new, old, ...)
# so that drift on the machine falls on both. OLD is a copy of the other version's tree, e.g.
#   git archive <commit> | tar -x -C .old     (here; then carry .old to the device)
# Usage (repo root, on the GPU machine): OLD=.old REPEATS=2 bash tests/ab_check.sh [workloads...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.old}
for w in ${@:-default latency}; do
  for i in $(seq "${REPEATS:-2}"); do
    for side in new old; do
      dir=.; [ "$side" = old ] && dir=$OLD
      (cd "$dir" && PYTHONPATH=. timeout "${BENCH_TIMEOUT:-120}" python3 bench.py --workload "$w" --json 2>&1) \
        > "$OUT/ab_${w}_${side}_$i.log"
      grep -h '^Total:' "$OUT/ab_${w}_${side}_$i.log" | sed "s/^/$side $w #$i: /"
    done
  done
done
echo "== summary"
python3 tests/bench_summary.py "$OUT"/ab_*.log
