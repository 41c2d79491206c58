"""How long do a projection's LoRA products take, through the Triton kernels (kernels/triton_lora.py) and
through the torch formula (lora/layers.py)? (A developer tool, not a test; docs/perf_notes.md rows 139-142.)
For the Qwen3-0.6B projections with 4 adapters of rank 16, tokens' adapters mixed at random, at decode
and prefill sizes, in microseconds (`triton.testing.do_bench`):

    PYTHONPATH=. python3 tests/bench_lora.py [--rows 1 16 64 256 8192] [--cudagraph]

shrink1: the shrink in one slice of K; shrink: split as split_k chooses; expand; pair: shrink then expand;
torch3: the torch formula's three operations (shrink product, mask, expand product with the add). With
--cudagraph each is timed as replays of a CUDA graph of it (triton.testing.do_bench_cudagraph), as the engine's
decode steps run it, rather than as back-to-back launches.
"""
import argparse

import numpy as np
import torch
from triton.testing import do_bench, do_bench_cudagraph

from nanovllm.kernels.triton_lora import lora_expand, lora_shrink, split_k
from nanovllm.lora.layers import sorted_tokens, torch_formula

SHAPES = {"qkv": (1024, 3, 4096), "o": (2048, 1, 1024), "gate_up": (1024, 2, 6144), "down": (3072, 1, 1024)}


def main(row_counts: list[int], cudagraph: bool, slots: int = 4, rank: int = 16):
    torch.manual_seed(0)
    timer = do_bench_cudagraph if cudagraph else do_bench
    print(f"{'proj':8} {'rows':>5} {'splits':>6} {'shrink1':>8} {'shrink':>8} {'expand':>8} {'pair':>8} {'torch3':>8}")
    for name, (k, parts, n) in SHAPES.items():
        r = parts * rank
        a = torch.randn(slots, r, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(slots, r, n, device="cuda", dtype=torch.bfloat16)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ids = np.random.randint(0, slots, m)
            tokens = torch.from_numpy(sorted_tokens(ids, m)).cuda()
            mask = torch.nn.functional.one_hot(torch.from_numpy(ids).cuda(), slots).to(torch.bfloat16)[:, :, None]
            shrunk = lora_shrink(x, a, tokens)
            us = [timer(f) * 1e3 for f in (lambda: lora_shrink(x, a, tokens, 1), lambda: lora_shrink(x, a, tokens),
                                            lambda: lora_expand(y, shrunk, b, tokens),
                                            lambda: lora_expand(y, lora_shrink(x, a, tokens), b, tokens),
                                            lambda: torch_formula(y, x, a, b, mask))]
            print(f"{name:8} {m:5} {split_k(m, r, k, x.device):6} " + " ".join(f"{t:8.1f}" for t in us))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 8192])
    p.add_argument("--cudagraph", action="store_true", help="time replays of a CUDA graph of each")
    args = p.parse_args()
    main(args.rows, args.cudagraph)
