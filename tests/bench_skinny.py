"""Projection time at small batch sizes on the GPU: kernels/triton_skinny.py against cuBLAS
(`F.linear`), for the Qwen3-0.6B shapes and the Qwen3-8B shapes at TP=2, and cuBLAS alone at the
larger decode batches (a developer tool, not a test).

Each figure is the time per call inside a CUDA graph (as in the decode graphs), the calls cycling
through enough copies of the weight that it is read from HBM, not L2.

    PYTHONPATH=. python3 tests/bench_skinny.py [--sweep] [--silu-mul] [--fp8 [--sweep]]
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from gpu_timing import copies_beyond_l2, us_per_call_in_graph
from nanovllm.kernels.triton_skinny import skinny_linear, split_k_for
from nanovllm.layers.linear import fp8_linear, quantize_rows_fp8

SHAPES = {   # name: (K, N)
    "0.6b qkv": (1024, 4096), "0.6b o": (2048, 1024), "0.6b gate_up": (1024, 6144), "0.6b down": (3072, 1024),
    "0.6b lm_head": (1024, 151936),
    "8b gate_up": (4096, 24576),
    "8b/2 qkv": (4096, 3072), "8b/2 o": (2048, 4096), "8b/2 gate_up": (4096, 12288), "8b/2 down": (6144, 4096),
}
# gate_up with silu_mul=True: (block_n, block_k, stages); 64 rows a program (the default) make two 32-row dots,
# which Triton gives to mma.sync, 128 rows two 64-row dots on wgmma (perf_notes rows 79 and 81: faster alone, not
# in the engine)
SILU_MUL_TILES = ((64, 256, 4), (128, 128, 4), (128, 128, 3), (128, 64, 4), (128, 256, 3), (64, 128, 6))
FP8_SHAPES = {   # quantization="fp8": the decoder's projections at TP=1
    "0.6b qkv": (1024, 4096), "0.6b o": (2048, 1024), "0.6b gate_up": (1024, 6144), "0.6b down": (3072, 1024),
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 24576), "8b down": (12288, 4096),
}
FP8_TILES = ((64, 512, 4), (64, 256, 6), (128, 256, 4))   # (--sweep)
ROWS = (1, 2, 4, 8, 16)
LARGER_ROWS = (32, 64, 128, 256)   # cuBLAS alone: how far its decode-batch GEMMs are from the weights' floor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="at batch 1, time every (split_k, block_n, block_k, stages)")
    p.add_argument("--silu-mul", action="store_true", help="only the gate_up shapes, plain and with silu_mul=True "
                   "over SILU_MUL_TILES")
    p.add_argument("--fp8", action="store_true", help="fp8 weights (quantization='fp8'): bf16 ours, then fp8_linear "
                   "(the input's quantizing kernel, then ours or torch._scaled_mm); --sweep: fp8 tiles at 1 row")
    args = p.parse_args()
    if args.fp8:
        return time_fp8(args.sweep)
    if args.silu_mul:
        return time_silu_mul()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("us per call in a CUDA graph (weights from HBM); GB/s of weight; ours with the default config")
    print(f"{'shape':14} {'rows':>4} {'cuBLAS':>8} {'ours':>8} {'GB/s cuBLAS':>12} {'GB/s ours':>10}  max |diff|")
    for name, (k, n) in SHAPES.items():
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = copies_beyond_l2(w0)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            diff = (skinny_linear(x, w0).float() - F.linear(x, w0).float()).abs().max().item()
            theirs = us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])
            ours = us_per_call_in_graph([lambda w=w: skinny_linear(x, w) for w in weights])
            print(f"{name:14} {m:4} {theirs:8.2f} {ours:8.2f} {w0.nbytes / theirs / 1e3:12.0f} "
                  f"{w0.nbytes / ours / 1e3:10.0f}  {diff:.3g}")
        for m in LARGER_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            theirs = us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])
            print(f"{name:14} {m:4} {theirs:8.2f} {'-':>8} {w0.nbytes / theirs / 1e3:12.0f} {'-':>10}  "
                  f"({2 * m * n * k / theirs / 1e6:.0f} TFLOP/s)")
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            results = []
            for split_k, block_n, block_k, stages in itertools.product((1, 2, 4, 8), (32, 64), (128, 256), (3, 4)):
                fn = lambda x, w: skinny_linear(x, w, split_k=split_k, block_n=block_n, block_k=block_k,
                                                num_stages=stages)
                try:
                    us = us_per_call_in_graph([lambda w=w: fn(x, w) for w in weights])
                    results.append((round(us, 2), split_k, block_n, block_k, stages))
                except Exception as e:   # e.g. out of shared memory
                    print(f"  ({split_k}, {block_n}, {block_k}, {stages}) failed: {type(e).__name__}")
            results.sort()
            print(f"  sweep at 1 row, default split_k {split_k_for(n, k, num_sms)}; best (us, split_k, block_n, "
                  f"block_k, stages): {results[:4]}")
        del weights, w0
        torch.cuda.empty_cache()


def time_silu_mul():
    print("us per call in a CUDA graph (weights from HBM): gate_up plain, then with silu_mul=True per (block_n, "
          "block_k, stages)")
    for name, (k, n) in SHAPES.items():
        if not name.endswith("gate_up"):
            continue
        weights = copies_beyond_l2(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = [f"plain {us_per_call_in_graph([lambda w=w: skinny_linear(x, w) for w in weights]):7.2f}"]
            for bn, bk, stages in SILU_MUL_TILES:
                try:
                    us = us_per_call_in_graph([lambda w=w: skinny_linear(x, w, silu_mul=True, block_n=bn, block_k=bk,
                                                                         num_stages=stages) for w in weights])
                    row.append(f"{(bn, bk, stages)} {us:7.2f}")
                except Exception as e:   # e.g. out of shared memory
                    row.append(f"{(bn, bk, stages)} {type(e).__name__}")
            print(f"{name:14} {m:4}  " + "  ".join(row))
        del weights
        torch.cuda.empty_cache()


def time_fp8(sweep: bool):
    print("us per call in a CUDA graph (weights from HBM); fp8 calls include the input's quantizing kernel")
    print(f"{'shape':14} {'rows':>4} {'bf16 ours':>10} {'fp8 ours':>9} {'fp8 torch':>10} {'GB/s fp8 ours':>14}  "
          "max |diff| ours - torch")
    for name, (k, n) in FP8_SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = quantize_rows_fp8(w16)
        scale = scale.view(-1)
        weights16, weights8 = copies_beyond_l2(w16), copies_beyond_l2(q)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows_fp8(x)
            theirs = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
            diff = (fp8_linear(x, q, scale, None).float() - theirs.float()).abs().max().item()
            bf16 = us_per_call_in_graph([lambda w=w: skinny_linear(x, w) for w in weights16])
            ours = us_per_call_in_graph([lambda w=w: fp8_linear(x, w, scale, None) for w in weights8])
            torch_us = us_per_call_in_graph([lambda w=w: torch._scaled_mm(
                quantize_rows_fp8(x)[0], w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
                for w in weights8])
            print(f"{name:14} {m:4} {bf16:10.2f} {ours:9.2f} {torch_us:10.2f} {q.nbytes / ours / 1e3:14.0f}  {diff:.3g}")
        if sweep:
            xq, xs = quantize_rows_fp8(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
            silu = (False, True) if name.endswith("gate_up") else (False,)
            for silu_mul, split_k in itertools.product(silu, (1, 2, 4, 8)):
                if silu_mul and split_k > 1:
                    continue
                results = []
                for block_n, block_k, stages in FP8_TILES:
                    fn = lambda w: skinny_linear(xq, w, x_scale=xs, weight_scale=scale, out_dtype=torch.bfloat16,
                                                 split_k=split_k, block_n=block_n, block_k=block_k,
                                                 num_stages=stages, silu_mul=silu_mul)
                    try:
                        us = us_per_call_in_graph([lambda w=w: fn(w) for w in weights8])
                        results.append((round(us, 2), block_n, block_k, stages))
                    except Exception as e:   # e.g. out of shared memory
                        print(f"  ({block_n}, {block_k}, {stages}) failed: {type(e).__name__}")
                results.sort()
                print(f"  fp8 at 1 row, the kernel alone, split_k {split_k}{', silu_mul' if silu_mul else ''}; "
                      f"best (us, block_n, block_k, stages): {results[:3]}")
        del weights16, weights8, w16, q
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
