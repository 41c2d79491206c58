"""The host's work for one step's logprob entries (a developer tool, not a test): OutputProcessor
appending, for each of --rows sequences, its sampled token and --top best as vLLM's per-token dicts
of Logprobs or as FlatLogprobs, with the tokens' texts (decoded_token) from the tests' byte-level
BPE tokenizer or without them (detokenize=False), under generate()'s collector thresholds. Prints
the best of --repeat steps, in ms (docs/perf_notes.md rows 96-98). Runs on the CPU.

    PYTHONPATH=. python3 tests/bench_logprob_entries.py [--rows 256] [--top 20] [--steps 50] [--repeat 5]
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import VOCAB_SIZE, build_tokenizer
from nanovllm import SamplingParams
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.sequence import Sequence
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
                    processor._record(seq.logprobs, token, logprob, rank, top, params.num_logprobs, params.detokenize)
        best = min(best, (time.perf_counter() - start) / steps * 1000)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
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
