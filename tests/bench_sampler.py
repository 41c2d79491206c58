"""Sampler kernel timings on the GPU at decode batch sizes (a developer tool, not a test):
the top-k/top-p cut by torch.topk (layers/sampling_filters.py's reference) against ours
(kernels/triton_top_k.py), and the fused Gumbel kernel with and without a cut; then top-p
without top-k: the sort of every row (what the sampler did before kernels/triton_top_p.py)
against our cut, in a few configurations.
Qwen3's vocabulary (151,936), bf16 logits, several logits buffers in turn (each is larger than
the L2 at 256 rows, so reads come from HBM); calls inside a CUDA graph, as in the engine.

    PYTHONPATH=. python3 tests/bench_sampler.py [--top-p-only]
"""
import sys

import torch

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import triton_top_k
from nanovllm.kernels.triton_sampler import gumbel_argmax
from nanovllm.kernels.triton_top_p import top_p_cut
from nanovllm.layers.sampling_filters import apply_top_k_top_p, top_k_top_p_cut

VOCAB = 151936


def main():
    if "--top-p-only" not in sys.argv:
        top_k_table()
    top_p_table()


def top_k_table():
    print(f"{'rows':>5} {'top_k':>5} {'top_p':>5}  {'topk alone':>10} {'torch cut':>10} {'triton cut':>10} "
          f"{'gumbel':>8} {'gumbel+cut':>10}  equal")
    for rows in (1, 16, 64, 128, 256):
        for max_top_k, top_p in ((20, 0.95), (20, None), (1024, 0.95)):
            buffers = [torch.randn(rows, VOCAB, device="cuda").mul_(4).bfloat16() for _ in range(4)]
            top_k = torch.full((rows,), max_top_k, device="cuda")
            p = None if top_p is None else torch.full((rows,), top_p, device="cuda")
            temps = torch.full((rows,), 0.6, device="cuda")
            greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
            seeds = torch.arange(rows, device="cuda")
            cut = triton_top_k.top_k_top_p_cut(buffers[0], top_k, p, max_top_k, temps)
            equal = torch.equal(cut, top_k_top_p_cut(buffers[0], top_k, p, max_top_k, temps).squeeze(-1))
            calls = [lambda b: b.topk(max_top_k, -1),
                     lambda b: top_k_top_p_cut(b, top_k, p, max_top_k, temps),
                     lambda b: triton_top_k.top_k_top_p_cut(b, top_k, p, max_top_k, temps),
                     lambda b: gumbel_argmax(b, temps, greedy, seeds),
                     lambda b: gumbel_argmax(b, temps, greedy, seeds, cut)]
            times = [us_per_call_in_graph([lambda b=b, call=call: call(b) for b in buffers]) for call in calls]
            print(f"{rows:5d} {max_top_k:5d} {str(top_p):>5}  " + " ".join(f"{t:10.1f}" for t in times[:3])
                  + f" {times[3]:8.1f} {times[4]:10.1f}  {equal}", flush=True)


def top_p_table():
    print("top-p 0.95 without top-k, us per call: the sort path (filtered float32 logits) against our cut "
          "(block, warps); 'differ': tokens our cut keeps or drops unlike the sort (ties at the cut)")
    configs = [(512, 8), (256, 4), (1024, 8), (512, 4), (256, 8)]
    print(f"{'rows':>5} {'spread':>6}  {'sort':>8} " + " ".join(f"{str(c):>10}" for c in configs) + "  differ")
    # logits * 4 at temperature 0.6, and a flat row (logits * 0.1: nearly every token a candidate)
    for rows, spread in ((1, 4), (16, 4), (64, 4), (128, 4), (256, 4), (256, 0.1)):
        buffers = [torch.randn(rows, VOCAB, device="cuda").mul_(spread).bfloat16() for _ in range(4)]
        p = torch.full((rows,), 0.95, device="cuda")
        temps = torch.full((rows,), 0.6, device="cuda")
        kept = buffers[0] >= top_p_cut(buffers[0], p, temps)[:, None]
        differ = (kept != apply_top_k_top_p(buffers[0].float() / temps[:, None], None, p).isfinite()).sum().item()
        calls = [lambda b: apply_top_k_top_p(b.float() / temps[:, None], None, p)]
        calls += [lambda b, c=c: top_p_cut(b, p, temps, None, *c) for c in configs]
        times = [us_per_call_in_graph([lambda b=b, call=call: call(b) for b in buffers]) for call in calls]
        print(f"{rows:5d} {spread:6} {times[0]:8.1f} " + " ".join(f"{t:10.1f}" for t in times[1:]) + f"  {differ}",
              flush=True)


if __name__ == "__main__":
    main()
