"""Prefill attention kernels side by side on the GPU (a developer tool, not a test): the Triton
kernel, the Gluon kernel for Hopper in several configurations, and vLLM's FlashAttention 3 and 2
where vLLM is installed. Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128),
bf16, 256-token pages scattered over a large cache. Each output is checked against the Triton
kernel's before it is timed: us per call in a CUDA graph of 10 calls; TFLOP/s count the causal
(query, key) pairs only.

    PYTHONPATH=. python3 tests/bench_prefill.py
"""
import random

import torch

from bench_kernels import D, H, PAGE, paged
from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import gluon_prefill, triton_attention

# (cached tokens, new tokens) per sequence
CASES = {
    "16 x 1024 new": [(0, 1024)] * 16,
    "29 x 100-1024 new": [(0, n) for n in random.Random(0).choices(range(100, 1025), k=29)],
    "4 x 4096 new": [(0, 4096)] * 4,
    "2 x 8192 new": [(0, 8192)] * 2,
    "1 x 16384 new": [(0, 16384)],
    "2 x (6144 cached + 2048 new)": [(6144, 2048)] * 2,
    "64 x (2048 cached + 64-256 new)": [(2048, n) for n in random.Random(1).choices(range(64, 257), k=64)],
}
GLUON_CONFIGS = {   # label: prefill_attention's keyword arguments
    "gluon 64,4,3": dict(block_n=64, num_warps=4, stages=3),
    "ws 128,2": dict(block_n=128, stages=2, warp_specialize=True),
    "ws 128,3": dict(block_n=128, stages=3, warp_specialize=True),
}


def flash_attn_varlen():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def main():
    fa = flash_attn_varlen()
    for name, seqs in CASES.items():
        seq_lens = [c + n for c, n in seqs]
        k, v, tables, seq_lens_t = paged(seq_lens, num_blocks=max(6000, 2 * sum(-(-n // PAGE) for n in seq_lens)))
        new = [n for _, n in seqs]
        qsl = torch.tensor([0] + [sum(new[:i + 1]) for i in range(len(new))], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(new), H, D, device="cuda", dtype=torch.bfloat16)
        args = (q, k, v, tables, qsl, seq_lens_t, max(new), D ** -0.5)
        flops = 4 * H * D * sum(n * c + n * (n + 1) / 2 for c, n in seqs)
        ref = triton_attention.prefill_attention(*args)
        row = [f"{name:32}", time_row("triton", lambda: triton_attention.prefill_attention(*args), ref, flops)]
        for label, config in GLUON_CONFIGS.items():
            row.append(time_row(label, lambda: gluon_prefill.prefill_attention(*args, **config), ref, flops))
        if fa is not None:
            for version in (3, 2):
                call = lambda: fa(q, k, v, max_seqlen_q=max(new), cu_seqlens_q=qsl, max_seqlen_k=max(seq_lens),
                                  seqused_k=seq_lens_t, softmax_scale=D ** -0.5, causal=True, block_table=tables,
                                  fa_version=version)
                row.append(time_row(f"FA{version}", call, ref, flops))
        print(" | ".join(row), flush=True)
        k = v = None   # (the cache freed before the next case makes its own)


def time_row(label, call, ref, flops):
    try:
        out = call()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 1e-2:      # (NaN included)
            return f"{label} WRONG err {err:.3g}"
        us = us_per_call_in_graph([call] * 10)
    except Exception as e:      # a configuration that does not compile or fit
        return f"{label} failed {type(e).__name__}: {str(e)[:80]}"
    return f"{label} {us:7.1f} us {flops / us / 1e6:4.0f} TF"


if __name__ == "__main__":
    main()
