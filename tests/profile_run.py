"""Where a whole bench.py run's time goes (a developer tool, not a test).

1. Every engine step timed on the host, by kind: steps with prompt tokens, and decode steps by
   batch size (the tail of small batches shows up here), and how much of it was the host's own
   work rather than waiting for the GPU's sampled tokens (where that nears the step's time, the
   host sets the pace).
2. The same run under the profiler (CUDA activity only): GPU time per kernel, and the time the
   GPU sat idle (wall time minus kernel time: one stream, so kernels do not overlap).
3. With --tp > 1: the spread of rank 0's all-reduce times.

    PYTHONPATH=. python3 tests/profile_run.py [--model qwen3-0.6b] [--workload default] [--tp 2] [--profile-steps 200]
        [--max-num-seqs 512] [--top-k 20 --top-p 0.95] [--presence-penalty 0.5 ...] [--runs 2] [--no-profile] [--pause 5]
        [--n 8] [--logprobs 20 [--flat-logprobs]] [--prompt-logprobs 1] [--tokenizer synthetic]
        [--cprofile | --cprofile-steps 3 8] [--speculative-config JSON]
        [--num-loras 4 [--lora-rank 16] [--lora-target-modules qkv_proj o_proj]]
        (bench.py's workload, request and LoRA flags, and this tool's own)
        [--num-seqs 128 --min-input-len 6000 --max-input-len 8000 --min-output-len 16 --max-output-len 64
         --max-model-len 8192]     (the long-prompt workload; the default workload's lengths otherwise)
"""
import argparse
import collections
import cProfile
import gc
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import (add_lora_arguments, add_request_arguments, add_workload_arguments, lora_engine_args, lora_plan,
                   lora_requests, make_workload, preset_dir, request_options, sampling_filters, tokenizer_options,
                   warm_up)
from nanovllm import LLM, SamplingParams
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.heap import fewer_collections

DECODE_BUCKETS = (1, 8, 32, 64, 128, 192, 256, 512, 768, 1024)


class EventWaits:
    """Seconds the host spends in torch.cuda.Event.synchronize (the engine waiting for a step's
    sampled tokens) while installed: a step's time minus its wait is the host's own work."""

    def __init__(self):
        self.seconds = 0.0
        self.original = torch.cuda.Event.synchronize

    def __enter__(self):
        def timed(event):
            start = time.perf_counter()
            self.original(event)
            self.seconds += time.perf_counter() - start
        torch.cuda.Event.synchronize = timed
        return self

    def __exit__(self, *exc):
        torch.cuda.Event.synchronize = self.original


def run_steps(llm, prompts, settings, on_step=None, host_profile_steps=(), dump_dir=None, loras=None,
              **params) -> tuple[list[tuple[str, float, float]], list]:
    """Run the workload step by step -> (kind, seconds, seconds of host work) per step, and the
    finished outputs (kept to the end, as generate() keeps them): the host's work is the step's
    time less its wait for the GPU. on_step() after each; the steps numbered in
    host_profile_steps under cProfile, their top functions printed (and their stats saved as
    dump_dir/step<N>.prof, for pstats, when dump_dir is given). params: more SamplingParams
    fields of every request (top_k, top_p, the penalties, logprobs). loras: each prompt's LoRARequest, or None."""
    engine = llm.llm_engine
    loras = engine.lora_requests(loras, len(prompts))
    for ids, (max_tokens, temperature), lora in zip(prompts, settings, loras):
        engine.add_tokens(None, ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                                     **params), lora_request=lora)
    steps, finished = [], []   # under generate()'s collector thresholds
    waits = EventWaits()
    with fewer_collections():
        while engine.has_unfinished_requests():
            steps.append(timed_step(engine, waits, finished, len(steps), host_profile_steps, dump_dir))
            if on_step is not None:
                on_step()
    if torch.cuda.is_available():   # (run_steps also runs on the CPU, in tests/test_bench.py)
        torch.cuda.synchronize()
    return steps, finished


def timed_step(engine, waits, finished, index, host_profile_steps, dump_dir) -> tuple[str, float, float]:
    """Step number index -> (kind, seconds, seconds of host work); its finished outputs added to finished."""
    host_profile = cProfile.Profile() if index in host_profile_steps else None
    start, waited = time.perf_counter(), waits.seconds
    with waits:
        if host_profile:
            host_profile.enable()
        outputs, stats = engine.run_step()
        if host_profile:
            host_profile.disable()
    elapsed = time.perf_counter() - start
    finished += outputs
    if host_profile:
        print(f"step #{index} under cProfile ({elapsed * 1000:.1f} ms):")
        pstats.Stats(host_profile).sort_stats("tottime").print_stats(14)
        if dump_dir:
            host_profile.dump_stats(os.path.join(dump_dir, f"step{index}.prof"))
    bucket = next((b for b in DECODE_BUCKETS if stats.num_decode_tokens <= b), None)
    decodes = f"<= {bucket:4}" if bucket else f"> {DECODE_BUCKETS[-1]}"
    if not stats.num_prefill_tokens:
        kind = f"decode, batch {decodes}"
    elif stats.num_decode_tokens:   # a prompt chunk beside running sequences' decodes
        kind = f"prompt + {decodes} decodes"
    else:
        kind = "prompt tokens only"
    return kind, elapsed, elapsed - (waits.seconds - waited)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--workload", default="default")
    add_workload_arguments(p)
    add_request_arguments(p)
    add_lora_arguments(p)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile only this many engine steps, from --profile-start on (0: the whole run). "
                        "Gathering the events of a whole Qwen3-8B TP=2 run took longer than 4 minutes")
    p.add_argument("--profile-start", type=int, default=10, help="the first profiled step with --profile-steps")
    p.add_argument("--runs", type=int, default=1, help="host-view runs before the profiled one, each with its "
                                                       "slowest steps")
    p.add_argument("--no-profile", action="store_true", help="the host-view runs only")
    host_profile_choice = p.add_mutually_exclusive_group()
    host_profile_choice.add_argument("--cprofile-steps", type=int, nargs="+", default=(),
                                     help="these steps of each host-view run under cProfile")
    host_profile_choice.add_argument("--cprofile", action="store_true",
                                     help="each host-view run under cProfile: its top functions by own time "
                                          "(where a first run's host time goes)")
    p.add_argument("--cprofile-dump", metavar="DIR", help="save the --cprofile-steps' stats here (step<N>.prof)")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help="LLM(speculative_config=...), JSON, as bench.py's")
    p.add_argument("--pause", type=float, default=0.0, help="seconds the GPU sits idle before each host-view run "
                                                            "after the first (as before a process's first run)")
    args = p.parse_args(argv)
    args.seed = 0
    return args


def main():
    args = parse_args()
    params = sampling_filters(args) | request_options(args)
    engine_options = {} if args.logprobs_mode is None else dict(logprobs_mode=args.logprobs_mode)
    if args.speculative_config is not None:
        engine_options["speculative_config"] = args.speculative_config
    engine_options |= lora_engine_args(args)
    args.loras = lora_requests(LoRARequest, preset_dir(args.model), args)
    llm = LLM(preset_dir(args.model), load_format="dummy", max_model_len=args.max_model_len,
              tensor_parallel_size=args.tp, max_num_seqs=args.max_num_seqs, **tokenizer_options(args.tokenizer),
              **engine_options)
    prompts, settings = make_workload(args, on_cpu=False)
    warm_up(llm, SamplingParams, args)

    for run in range(args.runs):
        if run and args.pause:
            time.sleep(args.pause)
        mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        collections_before = [g["collections"] for g in gc.get_stats()]
        host_profile = cProfile.Profile() if args.cprofile else None
        start = time.perf_counter()
        if host_profile:
            host_profile.enable()
        steps, finished = run_steps(llm, prompts, settings, host_profile_steps=args.cprofile_steps,
                                    dump_dir=args.cprofile_dump, loras=lora_plan(args, len(prompts)), **params)
        if host_profile:
            host_profile.disable()
        wall = time.perf_counter() - start
        start = time.perf_counter()
        del finished
        freed = time.perf_counter() - start
        mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
        by_kind = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for kind, seconds, host in steps:
            by_kind[kind][0] += 1
            by_kind[kind][1] += seconds
            by_kind[kind][2] += host
        gcs = [g["collections"] - n for g, n in zip(gc.get_stats(), collections_before)]
        print(f"host view: {len(steps)} steps in {wall:.2f} s, {mallocs} cudaMalloc calls by torch's allocator, "
              f"garbage collections by generation {gcs}, outputs freed in {freed:.2f} s")
        for kind, (n, seconds, host) in sorted(by_kind.items()):
            print(f"  {kind:22} {n:5} steps {seconds:7.3f} s  {seconds / n * 1000:7.3f} ms/step, "
                  f"host work {host / n * 1000:7.3f} ms/step")
        slowest = sorted(range(len(steps)), key=lambda i: -steps[i][1])[:6]
        print("  slowest steps: " + ", ".join(f"#{i} {steps[i][0]} {steps[i][1] * 1000:.1f} ms" for i in slowest))
        busiest = sorted(range(len(steps)), key=lambda i: -steps[i][2])[:6]
        print("  most host work: " + ", ".join(f"#{i} {steps[i][0]} {steps[i][2] * 1000:.1f} ms" for i in busiest))
        if host_profile:
            pstats.Stats(host_profile).sort_stats("tottime").print_stats(18)
        llm.reset_prefix_cache()      # the same prompts again: without this they would all be cache hits
    if args.no_profile:
        return llm.close()
    window = (torch.profiler.schedule(wait=args.profile_start - 1, warmup=1, active=args.profile_steps,
                                         repeat=1)
              if args.profile_steps else None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=window) as prof:
        start = time.perf_counter()
        steps, _ = run_steps(llm, prompts, settings, prof.step if window else None,
                             loras=lora_plan(args, len(prompts)), **params)
        wall = time.perf_counter() - start
    if window:   # wall time of the profiled steps only
        wall = sum(seconds for _, seconds, _ in steps[args.profile_start:args.profile_start + args.profile_steps])
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    scope = f"steps {args.profile_start}-{args.profile_start + args.profile_steps - 1}" if window else "run"
    print(f"profiled {scope}: {wall:.2f} s wall, GPU busy {busy:.2f} s, idle {wall - busy:.2f} s")
    kernels.sort(key=lambda e: -e.self_device_time_total)
    for e in kernels[:25]:
        print(f"  {e.self_device_time_total / 1e6:7.3f} s {e.count:8} calls  {e.key[:90]}")
    print_classes(kernels)
    print_gaps(prof)
    if args.tp > 1:
        print_all_reduce_spread(prof)
    llm.close()


KERNEL_CLASSES = (("decode attention", ("_decode_split", "_decode_merge")), ("prefill attention", ("_prefill",)),
                  ("cuBLAS GEMMs", ("gemm", "nvjet", "xmma", "cutlass", "splitK")),
                  ("small-batch projections", ("_skinny",)),
                  ("sampler", ("_group_stats", "_draw_kernel", "top_k", "top_p", "argmax")))


def print_classes(kernels):
    """GPU time by kind of kernel (names matched by substring, first class wins)."""
    seconds = collections.defaultdict(float)
    for e in kernels:
        name = e.key.lower()
        kind = next((kind for kind, keys in KERNEL_CLASSES if any(key.lower() in name for key in keys)), "other")
        seconds[kind] += e.self_device_time_total / 1e6
    print("GPU time by kind: " + ", ".join(f"{kind} {s:.3f} s" for kind, s in sorted(seconds.items(),
                                                                                     key=lambda kv: -kv[1])))


def print_gaps(prof):
    """Where the GPU sat idle: the gaps between one device activity (kernel, copy, memset) and the
    next on the timeline, by length, and the activities that followed the longest ones and the
    most idle time in all (the kernels of a CUDA graph have launch gaps of their own)."""
    device = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == device and e.time_range.end > e.time_range.start)
    buckets = [(2, "< 2 us"), (5, "2-5 us"), (20, "5-20 us"), (100, "20-100 us"), (1000, "0.1-1 ms"),
               (float("inf"), ">= 1 ms")]
    by_bucket = collections.defaultdict(lambda: [0, 0.0])
    before = collections.defaultdict(float)
    longest = []
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        gap = start - end
        if gap > 0:
            label = next(label for limit, label in buckets if gap < limit)
            by_bucket[label][0] += 1
            by_bucket[label][1] += gap / 1e6
            before[name[:60]] += gap / 1e6
            longest.append((gap, last[:40], name[:40]))
        if stop > end:
            end, last = stop, name
    print("GPU idle gaps by length: " + ", ".join(f"{label} {by_bucket[label][0]} ({by_bucket[label][1]:.3f} s)"
                                                   for _, label in buckets))
    print("  idle before: " + "; ".join(f"{name} {seconds:.3f} s"
                                        for name, seconds in sorted(before.items(), key=lambda kv: -kv[1])[:8]))
    longest.sort(reverse=True)
    print("  longest: " + "; ".join(f"{gap / 1000:.2f} ms {a} -> {b}" for gap, a, b in longest[:6]))


def print_all_reduce_spread(prof):
    """An all-reduce's time on rank 0 is the transfer plus any wait for a rank that starts the step
    later. A rough split: the time above the median call is mostly waiting, but also the larger
    messages of big batches and prefill steps (tests/bench_allreduce.py times the transfer alone
    per size)."""
    times = sorted(e.time_range.elapsed_us() for e in prof.events() if "AllReduce" in e.name)
    if not times:
        return
    median = times[len(times) // 2]
    excess = sum(t - median for t in times if t > median)
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    print(f"all-reduce calls: {len(times)}, us p10 {pick(0.1):.1f} p50 {median:.1f} p90 {pick(0.9):.1f} "
          f"p99 {pick(0.99):.1f} max {times[-1]:.1f}; total {sum(times) / 1e6:.3f} s, of which above the "
          f"median {excess / 1e6:.3f} s")


if __name__ == "__main__":
    main()
