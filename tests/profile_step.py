"""Where a decode step's time goes, on the GPU (a developer tool, not a test):
GPU time of one captured decode step per batch size, and the host time of a whole engine step.

    PYTHONPATH=. python3 tests/profile_step.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import preset_dir
from nanovllm import LLM, SamplingParams


def main():
    llm = LLM(preset_dir("qwen3-0.6b"), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    runner = llm.llm_engine.model_runner
    graphs = runner.graphs
    print(f"start-up timings: { {k: round(v, 2) for k, v in runner.timings.items()} }")
    for bs in (1, 64, 256):
        graph = graphs.graphs[bs, False]
        graphs.seq_lens[:bs].fill_(1024)
        graphs.slot_mapping[:bs].fill_(-1)
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"decode graph, batch {bs:3}, context 1024: {start.elapsed_time(end) / 20:.3f} ms")
    graphs.seq_lens.zero_()
    # Whole engine steps at batch 256 (prompts of 512, 64 decode steps each).
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 10000 for j in range(512)]} for i in range(256)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_tokens(None, p["prompt_token_ids"], SamplingParams(max_tokens=64, ignore_eos=True))
    engine.run_step()                                     # the prefill steps
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.run_step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.run_step()
            n += 1
    print(f"engine decode step, batch 256: {(time.perf_counter() - t) / n * 1000:.3f} ms (under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    while engine.has_unfinished_requests():
        engine.run_step()
    # Host time of a step without the profiler: the same decode loop, timed.
    for p in prompts:
        engine.add_tokens(None, p["prompt_token_ids"], SamplingParams(max_tokens=64, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.run_step()
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 0
    while engine.has_unfinished_requests() and n < 40:
        engine.run_step()
        n += 1
    print(f"engine decode step, batch 256: {(time.perf_counter() - t) / n * 1000:.3f} ms (no profiler)")


if __name__ == "__main__":
    main()
