"""bench.py with every Triton compile after start-up logged, by phase (bench's warm-up, each timed
run): the kernel variants that start-up's dry passes did not queue, and that a first generate then
compiles while it runs (a developer tool, not a test; docs/perf_notes.md Next 8a).

    PYTHONPATH=. python3 tests/late_compiles.py [bench.py's arguments] 2>&1 | grep COMPILE
"""
import sys
import time

import triton.runtime.jit as jit

import bench

phase = ["start-up"]
original = jit.JITFunction._do_compile


def logged(self, key, *args, **kwargs):   # (Triton 3.6's JITFunction._do_compile: key first)
    start = time.perf_counter()
    out = original(self, key, *args, **kwargs)
    if phase[0] != "start-up":
        print(f"COMPILE in {phase[0]}: {self.fn.__name__} {time.perf_counter() - start:.2f}s key={str(key)[:400]}",
              file=sys.stderr, flush=True)
    return out


jit.JITFunction._do_compile = logged
warm_up, run_workload = bench.warm_up, bench.run_workload


def phased_warm_up(*args, **kwargs):
    phase[0] = "warm-up"
    return warm_up(*args, **kwargs)


def phased_run(llm, SamplingParams, args, on_cpu, startup, run=1):
    phase[0] = f"{args.workload} run {run}"
    return run_workload(llm, SamplingParams, args, on_cpu, startup, run)


bench.warm_up, bench.run_workload = phased_warm_up, phased_run
sys.argv = ["bench.py", *sys.argv[1:]]
bench.main()
