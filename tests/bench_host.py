"""The engine loop's own host work per step, on the CPU (a developer tool, not a test): bench.py's
default workload (256 requests, or --num-seqs, its lengths divided by --scale) through LLMEngine.run_step with the
model's forward and the sampler left out (zero logits, token 0 sampled), so what is timed is the
bookkeeping a GPU run does between its launches: scheduling, the block tables, the step's host
arrays, the sampling settings, reading the sampled tokens (docs/perf_notes.md Next 6d).

    PYTHONPATH=. python3 tests/bench_host.py [--num-seqs 256] [--scale 4] [--runs 3] [--cprofile 30]
"""
import argparse
import cProfile
import os
import pstats
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import build_model_dir, build_tokenizer
from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import SamplerOutput


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--scale", type=int, default=4, help="bench.py's prompt and output lengths divided by this")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, help="the last run under cProfile: its top N functions")
    args = p.parse_args()
    path = build_model_dir(tempfile.mkdtemp(), "qwen3", build_tokenizer(), max_position_embeddings=4096)
    llm = LLM(path, max_model_len=4096, skip_tokenizer_init=True)
    engine = llm.llm_engine
    runner = engine.model_runner
    runner.run_step = lambda step: (torch.zeros(step.num_sampling, 1) if step.num_sampling else None, [])
    runner.sampler = lambda logits, metadata: SamplerOutput(token_ids=torch.zeros(len(logits), dtype=torch.int64))
    random.seed(0)   # bench.py's draws, in its order
    requests = [([random.randint(0, 300) for _ in range(random.randint(100, 1024) // args.scale)],
                 random.randint(100, 1024) // args.scale) for _ in range(args.num_seqs)]
    for run in range(args.runs):
        for ids, max_tokens in requests:
            engine.add_tokens(None, ids, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens))
        profile = cProfile.Profile() if args.cprofile and run == args.runs - 1 else None
        steps, start = 0, time.perf_counter()
        if profile:
            profile.enable()
        while engine.has_unfinished_requests():
            engine.run_step()
            steps += 1
        if profile:
            profile.disable()
        seconds = time.perf_counter() - start
        print(f"run {run + 1}{' (cProfile)' if profile else ''}: {steps} steps in {seconds:.3f} s, "
              f"{seconds / steps * 1000:.3f} ms a step")
        llm.reset_prefix_cache()
    if args.cprofile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
    llm.close()


if __name__ == "__main__":
    main()
