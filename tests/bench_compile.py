"""Does torch.compile pay for the decoder layer's work between two attentions? (A developer tool,
not a test.) Qwen3-0.6B shape, bf16, on the GPU: o_proj, residual add + RMSNorm, gate_up_proj,
SiLU * up, down_proj, residual add + RMSNorm, qkv_proj, q/k RMSNorm + RoPE and the K/V store into
a paged cache, that is every kernel of a decode layer but the attention. Three ways:

- ours: cuBLAS GEMMs (F.linear) and our fused Triton kernels, as the engine runs them;
- compiled: the same math in plain torch under torch.compile (Inductor's fusion, cuBLAS GEMMs);
- "default, no K/V store": compiled without the store (how much of it the scatter is);
- max-autotune: torch.compile's "max-autotune-no-cudagraphs" (also Triton GEMM templates, each
  shape tuned; Inductor prints its AUTOTUNE tables, cuBLAS's `mm` among them).

Each is timed as 20 segments back to back in one CUDA graph, as in a decode step.

    PYTHONPATH=. python3 tests/bench_compile.py [--rows 1 32 128 256] [--modes default max-autotune-no-cudagraphs]
"""
import argparse
import functools
import time

import torch
import torch.nn.functional as F

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels.triton_fused import qk_norm_rope_store, rms_norm, silu_and_mul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, PAGE, EPS = 1024, 16, 8, 128, 3072, 256, 1e-6


def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = lambda *shape: (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    def norm(n: int) -> RMSNorm:
        module = RMSNorm(n, EPS).cuda()
        module.weight.data = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
        return module
    qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return dict(o=w(HIDDEN, HEADS * HEAD_DIM), gate_up=w(2 * INTERMEDIATE, HIDDEN), down=w(HIDDEN, INTERMEDIATE),
                qkv=w(qkv_out, HIDDEN), post_norm=norm(HIDDEN), in_norm=norm(HIDDEN), q_norm=norm(HEAD_DIM),
                k_norm=norm(HEAD_DIM))


def inputs(rows: int):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    attn = torch.randn(rows, HEADS * HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
    slots = torch.randperm(64 * PAGE, device="cuda", generator=gen)[:rows]
    return attn, residual, positions, slots


def ours(w, cos_sin, k_cache, v_cache, attn, residual, positions, slots):
    x, residual = rms_norm(F.linear(attn, w["o"]), w["post_norm"].weight, EPS, residual)
    x = F.linear(silu_and_mul(F.linear(x, w["gate_up"])), w["down"])
    x, residual = rms_norm(x, w["in_norm"].weight, EPS, residual)
    q = qk_norm_rope_store(F.linear(x, w["qkv"]), positions, cos_sin, HEADS, KV_HEADS, HEAD_DIM,
                           w["q_norm"].weight, w["k_norm"].weight, EPS, k_cache, v_cache, slots)
    return q, residual


def plain(w, cos_sin, k_cache, v_cache, attn, residual, positions, slots, store=True):
    """ours in plain torch (the layers' CPU paths), for torch.compile. The caches come as [slots,
    KV heads, dim]: with the paged shape, the store through a view made Inductor copy whole caches."""
    residual = F.linear(attn, w["o"]) + residual
    gate, up = F.linear(w["post_norm"]._norm(residual), w["gate_up"]).chunk(2, -1)
    residual = F.linear(F.silu(gate.float()).to(gate.dtype) * up, w["down"]) + residual
    q, k, v = F.linear(w["in_norm"]._norm(residual), w["qkv"]).split(
        [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q = w["q_norm"]._norm(q.view(-1, HEADS, HEAD_DIM))
    k = w["k_norm"]._norm(k.view(-1, KV_HEADS, HEAD_DIM))
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, -1)
    q, k = RotaryEmbedding._rotate(q, cos, sin), RotaryEmbedding._rotate(k, cos, sin)
    if store:
        k_cache[slots] = k
        v_cache[slots] = v.view(-1, KV_HEADS, HEAD_DIM)
    return q, residual


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256])
    p.add_argument("--modes", nargs="+", default=["default", "max-autotune-no-cudagraphs"])
    args = p.parse_args()
    torch.set_grad_enabled(False)
    w, cos_sin = weights(), RotaryEmbedding(HEAD_DIM, 4096, 1e6).cos_sin_cache.cuda()
    caches = [torch.zeros(64, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    variants = {"ours": ours}
    for mode in args.modes:
        variants[mode] = torch.compile(plain, mode=mode, dynamic=False, fullgraph=True)
    if "default" in args.modes:   # the store's share of the compiled segment
        variants["default, no K/V store"] = torch.compile(functools.partial(plain, store=False), dynamic=False,
                                                          fullgraph=True)
    table = []
    for rows in args.rows:
        x = inputs(rows)
        reference = None
        for name, fn in variants.items():
            shape = (lambda c: c) if name == "ours" else (lambda c: c.view(-1, KV_HEADS, HEAD_DIM))
            c = [shape(cache) for cache in caches]
            start = time.perf_counter()
            q, residual = fn(w, cos_sin, c[0], c[1], *x)     # compiles (timed), checks
            compile_s = time.perf_counter() - start
            if reference is None:
                reference = (q, residual, caches[0].clone())
            diff = max((q - reference[0]).abs().max().item(), (residual - reference[1]).abs().max().item(),
                       (caches[0] - reference[2]).abs().max().item())
            us = us_per_call_in_graph([lambda: fn(w, cos_sin, c[2], c[3], *x)] * 20)
            table.append((rows, name, us, compile_s, diff))
            print(f"rows {rows:4} {name:28} {us:7.1f} us  (first call {compile_s:6.1f} s, max diff to ours {diff:.3g})",
                  flush=True)
    print("\nrows  variant                       us/segment  vs ours")
    base = {rows: us for rows, name, us, _, _ in table if name == "ours"}
    for rows, name, us, _, _ in table:
        print(f"{rows:4}  {name:28} {us:10.1f}  {base[rows] / us:6.2f}x")


if __name__ == "__main__":
    main()
