"""Would a plain Triton GEMM beat cuBLAS for the decode projections at 32-256 rows? (A developer
tool, not a test.) The decode steps' cuBLAS GEMMs take ~0.85 s of the default workload against
~0.35 s for their bytes and FLOPs (docs/perf_notes.md, "Next" item 3), and Inductor's autotuning,
in its own harness, ranked its Triton templates above cuBLAS at 128 rows. This times, in a CUDA
graph with the weights read from HBM (as the decode graphs see them), a tiled GEMM with each
configuration of a small grid against `F.linear`, for the Qwen3-0.6B projection shapes.

    PYTHONPATH=. python3 tests/bench_gemm.py [--rows 32 64 128 192 256] [--quick | --libraries | --layouts | --buckets]

--layouts: instead of the Triton sweep, the same product through cuBLAS three ways: F.linear(x, W)
(W [N, K], the engine's), x @ W^T with W^T stored [K, N], and W @ x^T (the output [N, M]
transposed: cuBLAS then sees M as the wide side).

--buckets: instead of the Triton sweep, the products as the engine runs them (F.linear for qkv and
gate_up, split_k_before_norm's partial products for o and down) at every given row count, and for
each the fastest count at least as large (docs/perf_notes.md Next 18: the decode graphs pad a step's
sequences to multiples of 16, so a slow bucket could borrow a larger one's product).

--libraries: instead of the Triton sweep, F.linear through torch's cuBLAS and cuBLASLt paths
(`torch.backends.cuda.preferred_blas_library`) and with TunableOp's choice (`torch.cuda.tunable`,
tuned outside the graph first).

The kernel: one program per (BLOCK_M rows, BLOCK_N output features) tile, the programs of one
weight tile next to each other (so that its M tiles read it from HBM once, then from L2), the
K loop pipelined by Triton.
"""
import argparse
import collections
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_timing import copies_beyond_l2, us_per_call_in_graph

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}   # (K, N)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_x, stride_w, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split, M, N] = x[M, split's K range] @ w[N, split's K range]^T (program axis 1 the
    split; one split: out[M, N]); k_per_split a multiple of BLOCK_K."""
    pid, split = tl.program_id(0), tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * k_per_split + tl.arange(0, BLOCK_K)
    x = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    w = w_ptr + offs_n[:, None] * stride_w + offs_k[None, :]
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(x, mask=m_ok[:, None], other=0.0)
        b = tl.load(w, mask=n_ok[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b))
        x += BLOCK_K
        w += BLOCK_K
    out = out_ptr + split * M * N + offs_m[:, None] * stride_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int, num_stages: int,
         num_warps: int, split_k: int = 1) -> torch.Tensor:
    """x @ w^T; with split_k > 1 the float32 partial products [split_k, M, N] instead."""
    m, k = x.shape
    n = w.shape[0]
    assert k % (block_k * split_k) == 0
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split_k)
    _gemm_kernel[grid](x, w, out, m, n, k, k // split_k, x.stride(0), w.stride(0), n, BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, num_stages=num_stages, num_warps=num_warps)
    return out


def cases(rows):
    """-> (shape name, row count, x, the weight, it and its copies beyond L2) for every 0.6B
    projection shape and row count; each shape's weights are freed before the next."""
    for name, (k, n) in SHAPES.items():
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = copies_beyond_l2(w0)
        for m in rows:
            yield name, m, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w0, weights
        del weights, w0
        torch.cuda.empty_cache()


def libraries(rows):
    """F.linear's time per library choice, in a graph, weights from HBM."""
    import torch.cuda.tunable as tunable
    print("us per call in a CUDA graph (weights from HBM): F.linear through cuBLAS, cuBLASLt, TunableOp's choice")
    total = collections.defaultdict(float)
    for name, m, x, w0, weights in cases(rows):
        reference = F.linear(x, w0).float()
        times = {}
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            times[library] = us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])
        torch.backends.cuda.preferred_blas_library("cublas")
        tunable.enable(True)
        tunable.tuning_enable(True)
        diff = (F.linear(x, w0).float() - reference).abs().max().item()    # tunes this shape
        tunable.tuning_enable(False)
        try:
            times["tunable"] = us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])
        except RuntimeError as e:
            print(f"  TunableOp in a graph: {e}"[:200])
        tunable.enable(False)
        print_times(name, m, times, total, f"  (TunableOp max |diff| {diff:.3g})")
    print("sum: " + ", ".join(f"{lib} {us:.1f} us" for lib, us in total.items()))
    print("TunableOp's choices:", *(f"{op} {params} -> {solution}" for op, params, solution, *_ in
                                    tunable.get_results()), sep="\n  ")


def layouts(rows):
    """F.linear against the other two layouts of the same product, in a graph, weights from HBM."""
    print("us per call in a CUDA graph (weights from HBM): F.linear(x, W), x @ W^T stored [K, N], W @ x^T")
    total = collections.defaultdict(float)
    for name, m, x, w0, weights in cases(rows):
        transposed = [w.t().contiguous() for w in weights]
        reference = F.linear(x, w0).float()
        assert torch.allclose(torch.mm(x, transposed[0]).float(), reference, atol=1e-2, rtol=1e-2)
        assert torch.allclose(torch.mm(w0, x.t()).t().float(), reference, atol=1e-2, rtol=1e-2)
        times = {"linear": us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights]),
                 "x@Wt": us_per_call_in_graph([lambda w=w: torch.mm(x, w) for w in transposed]),
                 "W@xT": us_per_call_in_graph([lambda w=w: torch.mm(w, x.t()) for w in weights])}
        del transposed
        print_times(name, m, times, total)
    print("sum: " + ", ".join(f"{lay} {us:.1f} us" for lay, us in total.items()))


def split(rows):
    """Split-K: each projection as 2-8 float32 partial products (strided-batched cuBLAS, and the
    best of a Triton grid for o and down) against F.linear; for o and down, whose output goes to
    the add + RMSNorm, also the pair of kernels: F.linear + the engine's add + RMSNorm against
    the partial products + the same norm summing them (what layers/linear.py chooses since
    perf_notes row 50)."""
    from nanovllm.kernels.triton_fused import rms_norm
    from nanovllm.layers.linear import split_k_partials
    grid = list(itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4), (4,)))
    print("us per call in a CUDA graph (weights from HBM); bmmS: torch.bmm(out_dtype=float32) over S "
          "splits of K; triS: the best Triton configuration (block_m, block_n, block_k, stages, warps) "
          "at S splits; +norm: followed by the add + RMSNorm")
    total = collections.defaultdict(float)
    for name, m, x, w0, weights in cases(rows):
        n = w0.shape[0]
        reference = F.linear(x, w0).float()
        times = {"cuBLAS": us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])}
        for s in (2, 4, 8):
            assert torch.allclose(split_k_partials(x, w0, s).parts.sum(0), reference, atol=2e-2, rtol=2e-2)
            times[f"bmm{s}"] = us_per_call_in_graph([lambda w=w: split_k_partials(x, w, s).parts for w in weights])
        best = {}
        if name in ("o", "down"):
            for s in (2, 4, 8):
                results = []
                for config in grid:
                    try:
                        parts = gemm(x, w0, *config, split_k=s)
                        assert torch.allclose(parts.sum(0), reference, atol=2e-2, rtol=2e-2)
                        results.append((us_per_call_in_graph(
                            [lambda w=w: gemm(x, w, *config, split_k=s) for w in weights]), config))
                    except Exception as e:   # e.g. out of shared memory
                        print(f"  {config} split {s} failed: {type(e).__name__}")
                times[f"tri{s}"], best[s] = min(results)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            norm_w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
            y, r = rms_norm(F.linear(x, w0), norm_w, 1e-6, residual)
            for s in (2, 4, 8):
                y2, r2 = rms_norm(split_k_partials(x, w0, s).parts, norm_w, 1e-6, residual)
                assert torch.allclose(r2.float(), r.float(), atol=5e-2)
                assert torch.allclose(y2.float(), y.float(), atol=5e-2)
            times["cuBLAS+norm"] = us_per_call_in_graph(
                [lambda w=w: rms_norm(F.linear(x, w), norm_w, 1e-6, residual) for w in weights])
            s = min((2, 4, 8), key=lambda s: times[f"bmm{s}"])
            times[f"bmm{s}+norm"] = us_per_call_in_graph(
                [lambda w=w: rms_norm(split_k_partials(x, w, s).parts, norm_w, 1e-6, residual) for w in weights])
            s = min((2, 4, 8), key=lambda s: times[f"tri{s}"])
            times[f"tri{s}+norm"] = us_per_call_in_graph(
                [lambda w=w: rms_norm(gemm(x, w, *best[s], split_k=s), norm_w, 1e-6, residual) for w in weights])
        print_times(name, m, times, total, "  " + " ".join(f"tri{s}: {c}" for s, c in best.items()))


def buckets(rows):
    """The engine's own products at each row count, best of three timings, then per row count the
    fastest row count at least as large, per shape and for the four together."""
    from nanovllm.layers.linear import split_k_before_norm, split_k_partials
    table = {}
    for name, m, x, w0, weights in cases(rows):
        splits = split_k_before_norm(m, *w0.shape[::-1]) if name in ("o", "down") else 1
        if splits > 1:
            calls = [lambda w=w: split_k_partials(x, w, splits).parts for w in weights]
        else:
            calls = [lambda w=w: F.linear(x, w) for w in weights]
        table[name, m] = min(us_per_call_in_graph(calls) for _ in range(3))
        if m == rows[-1]:
            print(name, " ".join(f"{r}:{table[name, r]:.2f}" for r in rows), flush=True)
    print("bucket: us a layer (sum of the four), best larger bucket")
    for m in rows:
        larger = [r for r in rows if r >= m]
        best = min((sum(table[s, r] for s in SHAPES), r) for r in larger)
        per_shape = " ".join(f"{s} {min(table[s, r] for r in larger) - table[s, m]:+.2f}" for s in SHAPES)
        print(f"{m:4} {sum(table[s, m] for s in SHAPES):6.2f} us  best >= it: {best[0]:6.2f} at {best[1]}   "
              f"per shape (best larger - own): {per_shape}")


def print_times(name: str, m: int, times: dict, total: dict, note: str = ""):
    """One table row of microseconds per variant; each also added to total."""
    for variant, us in times.items():
        total[variant] += us
    print(f"{name:8} {m:4} rows  " + "  ".join(f"{v} {us:6.2f}" for v, us in times.items()) + note, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 192, 256])
    p.add_argument("--quick", action="store_true", help="a 24-configuration grid instead of 108")
    p.add_argument("--libraries", action="store_true", help="cuBLAS, cuBLASLt and TunableOp instead of Triton")
    p.add_argument("--layouts", action="store_true", help="three operand layouts through cuBLAS instead of Triton")
    p.add_argument("--split", action="store_true", help="split-K partial products, with the add + RMSNorm after them")
    p.add_argument("--buckets", action="store_true", help="the engine's own products at each row count (e.g. "
                   "--rows 32 48 ... 256), against larger row counts")
    args = p.parse_args()
    if args.buckets:
        return buckets(args.rows)
    if args.split:
        return split(args.rows)
    if args.libraries:
        return libraries(args.rows)
    if args.layouts:
        return layouts(args.rows)
    if args.quick:
        grid = list(itertools.product((32, 64), (64, 128), (128,), (4, 5), (4, 8)))[:24]
    else:
        grid = list(itertools.product((32, 64, 128), (32, 64, 128), (64, 128), (3, 4, 5), (4, 8)))
    print("us per call in a CUDA graph (weights from HBM): cuBLAS, the best Triton configurations "
          "(block_m, block_n, block_k, stages, warps)")
    total = collections.defaultdict(float)
    for name, m, x, w0, weights in cases(args.rows):
        reference = F.linear(x, w0).float()
        theirs = us_per_call_in_graph([lambda w=w: F.linear(x, w) for w in weights])
        results = []
        for config in grid:
            try:
                diff = (gemm(x, w0, *config).float() - reference).abs().max().item()
                us = us_per_call_in_graph([lambda w=w: gemm(x, w, *config) for w in weights])
            except Exception as e:   # e.g. out of shared memory
                print(f"  {config} failed: {type(e).__name__}")
                continue
            results.append((us, config, diff))
        results.sort()
        best = results[0]
        print_times(name, m, {"cuBLAS": theirs, "best": best[0]}, total,
                    f" {best[1]} (max |diff| {best[2]:.3g}); next: "
                    + ", ".join(f"{us:.2f} {c}" for us, c, _ in results[1:3]))
    print(f"sum over shapes and rows: cuBLAS {total['cuBLAS']:.1f} us, best Triton {total['best']:.1f} us")


if __name__ == "__main__":
    main()
