"""bench.py with the KV-cache sizing's memory peak taken apart: during ModelRunner._profile_kv_budget,
each call of the model, the LM head, the sampler and the sampler's [rows, V] steps prints its own
peak over what was allocated at its entry, nested calls indented; then cuda_budget's terms (a
developer tool, not a test; docs/perf_notes.md rows 121-122). Each call resets torch's peak counter,
so the cache this run sizes is not the engine's: read the engine's from a plain bench.py run.

    PYTHONPATH=. python3 tests/sizing_peak.py --num-seqs 16 --max-output-len 16 2>&1 | grep MEM
"""
import sys

import torch

import bench
from nanovllm.engine import kv_cache, model_runner
from nanovllm.layers import sampler
from nanovllm.model import qwen3

GIB = 2 ** 30
open_calls = []            # [allocated at entry, peak so far] of each call in progress, outermost first
sizing = [False]


def fold_peak():
    peak = torch.cuda.max_memory_allocated()
    for call in open_calls:
        call[1] = max(call[1], peak)


def probe(owner, name: str):
    fn = getattr(owner, name)

    def probed(*args, **kwargs):
        if not sizing[0]:
            return fn(*args, **kwargs)
        torch.cuda.synchronize()
        fold_peak()                             # (the counter is reset below: the open calls keep theirs)
        base = torch.cuda.memory_allocated()
        open_calls.append([base, base])
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        fold_peak()
        peak = open_calls.pop()[1]
        if peak - base > 0.02 * GIB:
            print(f"MEM {'  ' * len(open_calls)}{name}: at entry {base / GIB:.2f} GiB, "
                  f"peak +{(peak - base) / GIB:.3f} GiB (abs {peak / GIB:.2f})", flush=True)
        return out
    setattr(owner, name, probed)


def during_sizing(profile):
    def sized(self):
        sizing[0] = True
        try:
            return profile(self)
        finally:
            sizing[0] = False
    return sized


def reporting(cuda_budget):
    def budget(device, gpu_memory_utilization, peak):
        out = cuda_budget(device, gpu_memory_utilization, peak)
        free, total = torch.cuda.mem_get_info(device)
        print(f"MEM budget: {total / GIB:.2f} GiB x {gpu_memory_utilization} = "
              f"{total * gpu_memory_utilization / GIB:.2f}, peak since the last probe {peak / GIB:.2f}, outside torch "
              f"{(total - free - torch.cuda.memory_reserved(device)) / GIB:.2f}: {out / GIB:.2f} GiB", flush=True)
        return out
    return budget


model_runner.ModelRunner._profile_kv_budget = during_sizing(model_runner.ModelRunner._profile_kv_budget)
kv_cache.cuda_budget = reporting(kv_cache.cuda_budget)
probe(qwen3.QwenForCausalLM, "forward")
probe(qwen3.QwenForCausalLM, "compute_logits")
probe(sampler.Sampler, "__call__")
probe(sampler.Sampler, "_sample_fused")
for name in ("filter_logits", "token_logprobs", "chosen_logprobs", "restrict_and_bias", "apply_penalties"):
    probe(sampler, name)
sys.argv = ["bench.py", *sys.argv[1:]]
bench.main()
