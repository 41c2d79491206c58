"""The host's work for one step's logprob entries (a developer tool, not a test): OutputProcessor
appending, for each of --rows sequences, its sampled token and --top best as vLLM's per-token dicts
of Logprobs or as FlatLogprobs, with the tokens' texts (decoded_token) from the tests' byte-level
BPE tokenizer or without them (detokenize=False), under generate()'s collector thresholds. Prints
the best of --repeat steps, in ms (docs/perf_notes.md rows 96-98). Runs on the CPU.

With --prompt, a step that scores prompt tokens instead (prompt_logprobs=--top): a loglikelihood run's
16k-token step, 29 prompts of 562 tokens, read from the host copy of its scores and appended
(PromptScores.chunks, OutputProcessor.append_prompt_logprobs; docs/perf_notes.md row 104).

    PYTHONPATH=. python3 tests/bench_logprob_entries.py [--rows 256] [--top 20] [--steps 50] [--repeat 5]
    PYTHONPATH=. python3 tests/bench_logprob_entries.py --prompt [--top 1] [--repeat 9]
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import VOCAB_SIZE, build_tokenizer
from nanovllm import SamplingParams
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.prompt_logprobs import PromptScores
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampling_metadata import SamplerOutput
from nanovllm.utils.heap import fewer_collections


def step_ms(processor: OutputProcessor, rows, params: SamplingParams, steps: int, repeat: int) -> float:
    """Best of repeat: ms a step to append steps steps of rows (token, logprob, rank, top) to fresh sequences."""
    best = float("inf")
    for _ in range(repeat):
        seqs = [Sequence("r", 0, [1, 2, 3], params) for _ in rows]
        start = time.perf_counter()
        with fewer_collections():   # as in generate()
            for _ in range(steps):
                for seq, (token, logprob, rank, top) in zip(seqs, rows):
                    processor._record(seq.logprobs, (token,), (logprob,), (rank,), (top,), params.num_logprobs,
                                      processor._texts(params))
        best = min(best, (time.perf_counter() - start) / steps * 1000)
    return best


def prompt_step_ms(processor: OutputProcessor, params: SamplingParams, repeat: int,
                   num_prompts: int = 29, prompt_len: int = 562) -> float:
    """Best of repeat: ms to read one scoring step's host scores (num_prompts whole prompts) and append
    their entries to fresh sequences."""
    best, kept = float("inf"), []
    for _ in range(repeat):
        seqs = [Sequence("r", 0, random.choices(range(VOCAB_SIZE), k=prompt_len), params) for _ in range(num_prompts)]
        rows = num_prompts * (prompt_len - 1)
        k = params.prompt_logprobs
        scores = SamplerOutput(token_ids=torch.zeros(rows, dtype=torch.int64), logprobs=-10 * torch.rand(rows),
                               ranks=torch.randint(1, 100, (rows,)),
                               top_ids=torch.randint(0, VOCAB_SIZE, (rows, k)) if k else None,
                               top_logprobs=-torch.rand(rows, k).sort(1).values if k else None)
        step = PromptScores([(seq, 1, list(range(prompt_len - 1))) for seq in seqs], scores, None)
        with fewer_collections():   # as in generate()
            start = time.perf_counter()
            for chunk in step.chunks():
                processor.append_prompt_logprobs(chunk)
            best = min(best, (time.perf_counter() - start) * 1000)
        kept.append(seqs)   # (as a run keeps its outputs)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--prompt", action="store_true", help="a step of prompt tokens scored (prompt_logprobs=--top)")
    args = p.parse_args()
    if args.prompt:
        processor = OutputProcessor(None, set(), 4096)
        for flat in (False, True):
            params = SamplingParams(prompt_logprobs=args.top, flat_logprobs=flat, detokenize=False)
            print(f"{'FlatLogprobs' if flat else 'dicts':12}: {prompt_step_ms(processor, params, args.repeat):6.2f} ms "
                  f"a step (29 prompts of 562 tokens scored, top {args.top})")
        return
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = False    # as Qwen3's: decoded by the Rust tokenizer directly
    random.seed(0)
    rows = []
    for _ in range(args.rows):
        ids = random.sample(range(VOCAB_SIZE), args.top)
        values = sorted((random.uniform(-20, 0) for _ in ids), reverse=True)
        rows.append((ids[0], values[0], 1, (ids, values)))
    processor = OutputProcessor(tokenizer, set(), 4096)
    for flat in (False, True):
        for detokenize in (False, True):
            params = SamplingParams(logprobs=args.top, flat_logprobs=flat, detokenize=detokenize)
            print(f"{'FlatLogprobs' if flat else 'dicts':12} {'with texts' if detokenize else 'ids only':10}: "
                  f"{step_ms(processor, rows, params, args.steps, args.repeat):6.2f} ms a step "
                  f"({args.rows} rows, top {args.top})")


if __name__ == "__main__":
    main()
