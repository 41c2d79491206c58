"""Would a decode projection run faster if the kernel before it had prefetched its weight into L2?
(A developer tool, not a test.) cuBLAS takes 5-7.5 us per 0.6B projection at 32-256 rows, nearly
independent of the row count, against ~1-3 us for its weight's bytes (docs/perf_notes.md, "Where
the bf16 1.3x target stands"). Every projection of a decode layer follows one of our own Triton
kernels (a norm, the SiLU, attention), which could issue `prefetch.global.L2` for the next
weight after its own work. This times, in a CUDA graph with the weights read from HBM, pairs of
[RMSNorm of x, F.linear(normed x, W)] for the Qwen3-0.6B projection shapes:

  cold      the norm, then the projection reading W from HBM (as the engine runs today);
  after     the norm's programs prefetch W's lines after their own rows;
  before    ... before their own rows;
  hot       W already in L2 (the same copy every call): what a perfect prefetch could give.

--stream MB: a read of MB megabytes of other memory between the pair's kernels (as decode
attention runs between the q/k norm and o_proj), its loads with the default policy and with
`evict_first`, to see whether a prefetched weight survives a stream.

    PYTHONPATH=. python3 tests/bench_prefetch.py [--rows 32 64 128 256] [--stream 64 256]
"""
import argparse
import collections

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_gemm import cases, print_times     # the 0.6B projection shapes, weights beyond L2
from gpu_timing import us_per_call_in_graph
from nanovllm.kernels.pdl import prefetch_l2    # the skinny and LoRA kernels' own

LINE = 64           # bf16 values per 128-byte L2 line
PF_BLOCK = 512      # lines per prefetch iteration of a program


@triton.jit
def _prefetch_share(pf_ptr, num_lines, LINE: tl.constexpr, PF_BLOCK: tl.constexpr):
    """This program's share of the lines of pf_ptr[: num_lines * LINE], interleaved over programs."""
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    for first in range(pid * PF_BLOCK, num_lines, num_programs * PF_BLOCK):
        lines = tl.minimum(first + tl.arange(0, PF_BLOCK), num_lines - 1)
        prefetch_l2(pf_ptr + lines.to(tl.int64) * LINE)


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, eps, pf_ptr, num_lines, BLOCK: tl.constexpr,
                 PREFETCH: tl.constexpr, PF_FIRST: tl.constexpr, LINE: tl.constexpr, PF_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if PREFETCH and PF_FIRST:
        _prefetch_share(pf_ptr, num_lines, LINE, PF_BLOCK)
    if row < n_rows:
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * n_cols + offs, (x * rstd).to(w.dtype) * w, mask=mask)
    if PREFETCH and not PF_FIRST:
        _prefetch_share(pf_ptr, num_lines, LINE, PF_BLOCK)


@triton.jit
def _stream_kernel(src_ptr, out_ptr, n, EVICT_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Reads src[:n] (a stand-in for decode attention's KV reads); one partial sum per program."""
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for first in range(pid * BLOCK, n, num_programs * BLOCK):
        offs = first + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            acc += tl.load(src_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            acc += tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def norm(x, norm_w, out, pf: torch.Tensor | None, pf_first: bool = False):
    rows, cols = x.shape
    num_lines = pf.numel() // LINE if pf is not None else 0
    _norm_kernel[(max(rows, 132),)](x, norm_w, out, rows, cols, 1e-6, pf if pf is not None else x, num_lines,
                                    BLOCK=triton.next_power_of_2(cols), PREFETCH=pf is not None,
                                    PF_FIRST=pf_first, LINE=LINE, PF_BLOCK=PF_BLOCK, num_warps=4)


class Streams:
    """Reads of `mb` megabytes, each call from the next region of a buffer 4x the size of L2's
    reach (so no read is served from L2)."""

    def __init__(self, mb: int, evict_first: bool):
        self.n = mb << 19       # bf16 values
        self.regions = max(2, (512 << 20) // (mb << 20) + 1)
        self.src = torch.randn(self.regions * self.n, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(132 * 8, device="cuda", dtype=torch.float32)
        self.evict_first, self.i = evict_first, 0

    def __call__(self):
        region = self.src[(self.i % self.regions) * self.n:][: self.n]
        self.i += 1
        _stream_kernel[(132 * 8,)](region, self.out, self.n, EVICT_FIRST=self.evict_first, BLOCK=2048,
                                   num_warps=4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--stream", type=int, nargs="*", default=[], help="MB read between the pair's kernels")
    args = p.parse_args()
    print("us per [norm, projection] pair in a CUDA graph (weights from HBM unless hot)")
    totals = collections.defaultdict(float)
    for name, m, x, w0, weights in cases(args.rows):
        norm_w = torch.ones(x.shape[1], device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        variants = {
            "cold": [lambda w=w: (norm(x, norm_w, y, None), F.linear(y, w)) for w in weights],
            "after": [lambda w=w: (norm(x, norm_w, y, w), F.linear(y, w)) for w in weights],
            "before": [lambda w=w: (norm(x, norm_w, y, w, True), F.linear(y, w)) for w in weights],
            "hot": [lambda: (norm(x, norm_w, y, None), F.linear(y, w0)) for _ in weights],
        }
        for mb in args.stream:
            for evict_first in (False, True):
                s = Streams(mb, evict_first)
                tag = f"{mb}MB{'-ef' if evict_first else ''}"
                variants[f"cold+{tag}"] = [lambda w=w, s=s: (norm(x, norm_w, y, None), s(), F.linear(y, w))
                                           for w in weights]
                variants[f"after+{tag}"] = [lambda w=w, s=s: (norm(x, norm_w, y, w), s(), F.linear(y, w))
                                            for w in weights]
        times = {v: us_per_call_in_graph(calls) for v, calls in variants.items()}
        norm(x, norm_w, y, None)
        reference = y.clone()
        norm(x, norm_w, y, w0)
        assert torch.equal(y, reference)        # the prefetch changes nothing
        print_times(name, m, times, totals)
    print("sum: " + ", ".join(f"{v} {us:.1f}" for v, us in totals.items()))


if __name__ == "__main__":
    main()
