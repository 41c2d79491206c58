"""The engine loop's own host work per step, on the CPU (a developer tool, not a test): bench.py's
default workload (256 requests, or --num-seqs, its lengths divided by --scale) through LLMEngine.run_step with the
model's forward and the sampler left out (zero logits, token 0 sampled), so what is timed is the
bookkeeping a GPU run does between its launches: scheduling, the block tables, the step's host
arrays, the sampling settings, reading the sampled tokens (docs/perf_notes.md Next 6d). A run's outputs
are kept to its end, as generate() keeps them, so the garbage collector's scans of their logprob
entries are timed too.

    PYTHONPATH=. python3 tests/bench_host.py [--num-seqs 256] [--scale 4] [--runs 3] [--cprofile 30]
        [--logprobs 20 [--flat-logprobs]] [--tokenizer synthetic] [--prompt-logprobs 1] [--max-tokens 1]
        [--speculative-config JSON]

With --speculative-config (n-gram drafts, as bench.py's) every sampled token being 0, a sequence's output
soon repeats and its drafts are all accepted: `--num-seqs 1 --scale 1` times the host's part of batch 1's
drafting steps.

With --prompt-logprobs the prompt rows' scores are random too (the scoring kernels left out), so a
loglikelihood-like run (`--num-seqs 1024 --scale 1 --max-tokens 1 --prompt-logprobs 1`, bench.py's
`--prompt-logprobs 1 --num-seqs 1024 --min-output-len 1 --max-output-len 1`) times the host's part of
its 16k-token scoring steps.
"""
import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import tokenizer_options
from conftest import VOCAB_SIZE, build_model_dir, build_tokenizer
from nanovllm import LLM, SamplingParams
from nanovllm.engine import prompt_logprobs
from nanovllm.layers.sampling_metadata import SamplerOutput
from nanovllm.utils.heap import fewer_collections


def sample(rows: int, vocab_size: int, num_logprobs: int | None) -> SamplerOutput:
    """Token 0 for every row, or with logprobs random tokens, logprobs and num_logprobs best (as a
    sampler's output, on the CPU)."""
    if num_logprobs is None:
        return SamplerOutput(token_ids=torch.zeros(rows, dtype=torch.int64))
    out = SamplerOutput(token_ids=torch.randint(0, vocab_size, (rows,)), logprobs=-10 * torch.rand(rows),
                        ranks=torch.randint(1, 100, (rows,)))
    if num_logprobs:
        out.top_ids = torch.randint(0, vocab_size, (rows, num_logprobs))
        out.top_logprobs = (-10 * torch.rand(rows, num_logprobs)).sort(1, descending=True).values
    return out


def score(logits: torch.Tensor, targets: torch.Tensor, num_top: int, as_logits: bool = False) -> SamplerOutput:
    """As prompt_logprobs._score, with random logprobs (or logits) and ranks and num_top random best."""
    rows = len(targets)
    out = SamplerOutput(token_ids=targets, logprobs=-10 * torch.rand(rows), ranks=torch.randint(1, 100, (rows,)))
    if num_top:
        out.top_ids = torch.randint(0, VOCAB_SIZE, (rows, num_top))
        out.top_logprobs = (-10 * torch.rand(rows, num_top)).sort(1, descending=True).values
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--scale", type=int, default=4, help="bench.py's prompt and output lengths divided by this")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, help="the last run under cProfile: its top N functions")
    p.add_argument("--logprobs", type=int, default=None, help="SamplingParams.logprobs of every request (random "
                                                              "tokens and logprobs sampled, Qwen3's vocabulary)")
    p.add_argument("--flat-logprobs", action="store_true")
    p.add_argument("--tokenizer", default=None, help="as bench.py's: 'synthetic' detokenizes the outputs")
    p.add_argument("--prompt-logprobs", type=int, default=None, help="SamplingParams.prompt_logprobs of every "
                                                                     "request (random scores)")
    p.add_argument("--max-tokens", type=int, default=None, help="every request's, in place of bench.py's draw")
    p.add_argument("--speculative-config", type=json.loads, default=None, help="LLM(speculative_config=...), JSON")
    args = p.parse_args()
    vocab_size = 151936 if args.logprobs is not None or args.tokenizer else VOCAB_SIZE
    path = build_model_dir(tempfile.mkdtemp(), "qwen3", build_tokenizer(), max_position_embeddings=4096,
                           vocab_size=vocab_size)
    llm = LLM(path, max_model_len=4096, speculative_config=args.speculative_config,
              **tokenizer_options(args.tokenizer))
    engine = llm.llm_engine
    runner = engine.model_runner
    runner.run_step = lambda step: (torch.zeros(step.num_sampling, 1) if step.num_sampling else None,
                                    [torch.zeros(len(step.prompt_rows), 1)] if step.prompt_rows else [])
    runner.sampler = lambda logits, metadata: sample(len(logits), vocab_size, args.logprobs)
    prompt_logprobs._score = score
    options = dict(logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, flat_logprobs=args.flat_logprobs)
    random.seed(0)   # bench.py's draws, in its order
    requests = [([random.randint(0, 300) for _ in range(random.randint(100, 1024) // args.scale)],
                 random.randint(100, 1024) // args.scale) for _ in range(args.num_seqs)]
    if args.max_tokens is not None:
        requests = [(ids, args.max_tokens) for ids, _ in requests]
    output_tokens = sum(max_tokens for _, max_tokens in requests)
    for run in range(args.runs):
        for ids, max_tokens in requests:
            engine.add_tokens(None, ids, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens,
                                                        **options))
        profile = cProfile.Profile() if args.cprofile and run == args.runs - 1 else None
        steps, finished, start = 0, [], time.perf_counter()
        if profile:
            profile.enable()
        with fewer_collections():   # as generate() runs the loop, keeping the outputs to its end (with
            while engine.has_unfinished_requests():   # logprobs, the collector scans their entries meanwhile)
                finished += engine.run_step()[0]
                steps += 1
        if profile:
            profile.disable()
        seconds = time.perf_counter() - start
        print(f"run {run + 1}{' (cProfile)' if profile else ''}: {steps} steps in {seconds:.3f} s, "
              f"{seconds / steps * 1000:.3f} ms a step" + (f", {output_tokens / steps:.2f} tokens a step"
                                                           if args.speculative_config else ""))
        del finished
        llm.reset_prefix_cache()
    if args.cprofile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
    llm.close()


if __name__ == "__main__":
    main()
