"""Print one table row per bench.py --json result found in the given log files (device scripts)."""
import json
import os
import sys


def main(paths: list[str]):
    width = max([len(os.path.basename(p)) - len(".log") for p in paths] + [3])   # whole names: variants differ at the end
    print(f"{'log':{width}} {'engine':9} {'model':10} {'workload':28} {'tp':>2} {'allreduce':9} {'kv':8} {'time':>8} {'out tok/s':>10} "
          f"{'start-up':>8}  ms/token")
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                allreduce = "-" if r.get("tp", 1) == 1 else r.get("custom_all_reduce", "default")
                name = os.path.basename(path).removesuffix(".log")
                workload = r["workload"] + (f" #{r['run']}" if r.get("run", 1) > 1 else "")   # bench.py --repeat
                print(f"{name:{width}} {r['engine']:9} {r['model']:10} {workload:28} {r.get('tp', 1):2} {allreduce:9} "
                      f"{r.get('kv_cache_dtype', 'auto'):8} {r['time_s']:7.2f}s {r['output_tok_s']:10.0f} {r['startup_s']:7.1f}s  {r.get('ms_per_token', '')}")


if __name__ == "__main__":
    main(sys.argv[1:])
