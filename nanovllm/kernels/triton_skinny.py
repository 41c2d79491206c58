"""y = x @ weight.T (+ bias) for a few rows of x, in Triton: the decode step's projections at
small batch sizes. Its reference is `F.linear` (layers/linear.py's CPU path).

With a handful of rows a projection only streams its weight. Each program owns BLOCK_N output
features and a slice of the input features, and streams its part of the weight through Triton's
software pipeline: the product is a `tl.dot` of the weight tile with x padded to 16 rows (the
"swapped" GEMM, weight as the left operand), so the loads are the asynchronous, multi-stage kind.
A projection with few output features (o_proj and down_proj of the 0.6B shape: 16 blocks of 64)
would leave most SMs idle, so its input features are split SPLIT_K ways: every program writes
its partial sums to a workspace and counts itself in on a per-block counter (kernels/counters.py);
the last one of a block adds the partials up in split order (deterministic), writes y and zeroes
the counter again. Measured against cuBLAS in docs/perf_notes.md row 18
(tests/bench_skinny.py).

With quantization="fp8" the weight and x come in fp8 (x quantized a row at a time just before), each
with a float32 scale a row: the dot takes the fp8 tiles as they are (Hopper's fp8 MMA, both operands
K-major in shared memory, so the loads stay asynchronous), and the float32 sums are scaled by both
rows' scales before the bias and the store (perf_notes row 157).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import device as device_info, pdl
from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.counters import counters as arrival_counters
from nanovllm.kernels.triton_fused import silu_mul

MAX_ROWS = 16           # x's rows padded to this: the MMA's smallest width
BLOCK_N, BLOCK_K, NUM_STAGES = 64, 256, 4   # the best at 1 row for every shape tried (tests/bench_skinny.py)
FP8_BLOCK_K, FP8_NUM_STAGES = 512, 4         # fp8 weights: the same bytes a tile
LINE_BYTES = 128        # prefetch granularity (an L2 cache line)
INTERPRETER_SMS, INTERPRETER_L2 = 132, 50 << 20   # (TRITON_INTERPRET=1 on the CPU: as on an H200)


@functools.cache
def enabled() -> bool:
    """On unless NANOVLLM_SKINNY=0 (for A/B runs against cuBLAS)."""
    return os.environ.get("NANOVLLM_SKINNY") != "0"


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, xs_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                          stride_x, stride_w, stride_o, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                          SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, LINE: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                          PDL: tl.constexpr):
    block, split = tl.program_id(0), tl.program_id(1)
    # N output features; with SILU_MUL the weight has 2 N rows (gate | up), a program reads
    # BLOCK_N of them (the gate rows and the up rows of OUT_N features) and writes silu(gate) * up.
    OUT_N: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    offs_n = block * OUT_N + tl.arange(0, OUT_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_start = split * k_per_split                                     # k_per_split: a multiple of BLOCK_K
    if PDL and PREFETCH_LINES > 0:
        # The weight does not depend on the kernel before this one (x does): start pulling this
        # program's slice (its first PREFETCH_LINES lines a row) into L2 while that kernel finishes,
        # then wait for it.
        r = tl.arange(0, BLOCK_N)   # the program's weight rows: its features' (gate rows, then up rows)
        rows = tl.minimum(block * OUT_N + r % OUT_N + (r // OUT_N) * N, (2 * N if SILU_MUL else N) - 1)
        cols = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
        pdl.prefetch_l2(w_ptr + rows[:, None] * stride_w + cols[None, :])
    pdl.begin(PDL)
    w_ptrs = w_ptr + offs_n[:, None] * stride_w + (k_start + offs_k)[None, :]   # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + (k_start + offs_k)[None, :]   # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((OUT_N, BLOCK_M), tl.float32)                     # y transposed
    acc_up = tl.zeros((OUT_N, BLOCK_M), tl.float32)
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if EVEN_K:
            k_ok = (offs_k < BLOCK_K)[None, :]
        else:
            k_ok = (offs_k < K - k)[None, :]
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if SILU_MUL:
            up = tl.load(w_ptrs + N * stride_w, mask=n_ok[:, None] & k_ok, other=0.0)
            acc_up = tl.dot(up, tl.trans(x), acc_up)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if FP8 and SPLIT_K == 1:   # (a split product's partial sums are scaled once summed, below)
        acc = _scaled(acc, xs_ptr, ws_ptr, offs_n, offs_m, n_ok, m_ok)
        if SILU_MUL:
            acc_up = _scaled(acc_up, xs_ptr, ws_ptr + N, offs_n, offs_m, n_ok, m_ok)
    if SPLIT_K > 1:
        # part: [SPLIT_K, N, BLOCK_M] float32
        parts = part_ptr + offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(parts + split * N * BLOCK_M, acc, mask=n_ok[:, None])
        tl.debug_barrier()                                            # every thread's partials written ...
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")   # ... before we count in
        if arrived == SPLIT_K - 1:                                    # the last of its block: sum in split order
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(parts + s * N * BLOCK_M, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            if FP8:
                acc = _scaled(acc, xs_ptr, ws_ptr, offs_n, offs_m, n_ok, m_ok)
            _store(acc, b_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_o, HAS_BIAS)
            tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")
    else:
        if SILU_MUL:   # each product rounded first, as silu_and_mul after the product rounds them
            acc = silu_mul(acc.to(out_ptr.dtype.element_ty), acc_up.to(out_ptr.dtype.element_ty))
        _store(acc, b_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_o, HAS_BIAS)


@triton.jit
def _scaled(acc, xs_ptr, ws_ptr, offs_n, offs_m, n_ok, m_ok):
    """A product of fp8 operands (acc: y transposed) times the weight rows' and the input rows' scales."""
    ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    return acc * ws[:, None] * xs[None, :]


@triton.jit
def _store(acc, b_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok, stride_o, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_o + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def split_k_for(n: int, k: int, num_sms: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> int:
    """Input-feature splits. Only a projection whose blocks would occupy under a quarter of the SMs
    is split (at 48-64 blocks on an H200 splitting measured slower): the most splits, a power of
    two, that keep the programs within one wave and every split at least one BLOCK_K step long."""
    blocks, split = triton.cdiv(n, block_n), 1
    if blocks * 4 >= num_sms:
        return 1
    while blocks * split * 2 <= num_sms and k >= split * 2 * block_k:
        split *= 2
    return split


def prefetch_lines(programs: int, rows: int, lines: int, num_sms: int, l2_bytes: int) -> int:
    """The cache lines of each of its weight rows a program asks L2 for before it waits (PDL): all
    `lines` of its slice, unless one wave of programs would ask for more than half of L2 in all,
    which evicts lines before their use, so that they are read twice (Qwen3-8B's projections asked
    for 34-100 MB each: batch 1 took 5.48 ms/token, 4.70 without PDL; perf_notes row 86); then the
    most lines, a power of two, that fit, or none."""
    fit = l2_bytes // 2 // (min(programs, num_sms) * rows * LINE_BYTES)
    return lines if lines <= fit else 1 << (fit.bit_length() - 1) if fit else 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  split_k: int | None = None, block_n: int = BLOCK_N, block_k: int | None = None,
                  num_stages: int | None = None, num_warps: int = 4, silu_mul: bool = False) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS, weight: [N, K], bias: [N] or None -> [M, N] in x's dtype
    (written to out if given). silu_mul: weight's rows hold gate | up (a gated MLP's gate_up_proj,
    no bias), and the result is silu(gate) * up, [M, N / 2] (the activation applied to the
    products in registers, no kernel of its own; never split).
    fp8 operands (quantization="fp8"): x and weight in float8_e4m3fn with float32 scales a row, x_scale
    [M, 1] and weight_scale [N]; the product of the fp8 values is scaled by both, and the result is in
    out_dtype. The keyword arguments from split_k to num_warps are tuning knobs (tests/bench_skinny.py
    sweeps them); None: split_k_for's choice, the best tile for the weight's dtype."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert m <= MAX_ROWS and x.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert x.dtype == weight.dtype and (x_scale is not None) == (weight_scale is not None) == fp8
    default_k, default_stages = (FP8_BLOCK_K, FP8_NUM_STAGES) if fp8 else (BLOCK_K, NUM_STAGES)
    block_k, num_stages = block_k or default_k, num_stages or default_stages
    if silu_mul:
        assert bias is None and n % 2 == 0 and split_k in (None, 1)
        n, split_k = n // 2, 1
    num_sms, l2_bytes = ((device_info.num_sms(x.device), device_info.l2_bytes(x.device)) if x.is_cuda
                         else (INTERPRETER_SMS, INTERPRETER_L2))
    if split_k is None:
        split_k = split_k_for(n, k, num_sms, block_n, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)          # (no empty split)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    blocks = triton.cdiv(n, block_n // 2 if silu_mul else block_n)
    parts = counters = out
    if split_k > 1:
        parts = torch.empty(split_k, n, MAX_ROWS, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device)
        assert blocks <= counters.numel()
    launch(_skinny_linear_kernel, (blocks, split_k),
        x, weight, bias if bias is not None else weight, x_scale if fp8 else out, weight_scale if fp8 else out,
        out, parts, counters, m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, SILU_MUL=silu_mul, EVEN_K=k % block_k == 0, SPLIT_K=split_k,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, LINE=LINE_BYTES // weight.element_size(),
        PREFETCH_LINES=prefetch_lines(blocks * split_k, block_n, triton.next_power_of_2(
            triton.cdiv(k_per_split * weight.element_size(), LINE_BYTES)), num_sms, l2_bytes),
        num_stages=num_stages, num_warps=num_warps, **pdl.launch_options(m))
    return out
