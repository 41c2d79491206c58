"""The LoRA products of a step's tokens, each with its own adapter slot, in two Triton kernels (vLLM's
punica shrink and expand). Their reference is lora/layers.py's plain-torch formula over all slots.

    shrink:  shrunk[t] = x[t] @ a[slot[t]].T          a: [slots, rows, in_features]    (rows = parts * rank)
    expand:  y[t]     += shrunk[t] @ b[slot[t]]        b: [slots, rows, out_features]

A token of slot -1 (the base model) gets nothing. A program owns BLOCK_M tokens and loops over the
slots, computing a slot's product only when one of its tokens uses it, so a step of one adapter costs
one slot's product, and the products of every slot are never formed or masked as in the torch formula.
The kernels take the tokens sorted by slot, as (slot, row) pairs, so that a tile mostly holds one slot
however the step mixes its adapters; the shrink gathers x's rows through them, and the expand adds
into y's rows (the shrunk rows stay in the sorted order between the two).
A decode step's few tiles would leave most SMs idle through the shrink's long loop over K, so the
shrink splits K into up to MAX_SPLITS slices, each program writing its slice's float32 partial sums, and
the expand adds the partial sums up as it loads them, all loads at once (no atomics, no zeroed buffer:
the same sums each run).
The expand also ends gate_up_proj with its activation (silu_mul: silu(gate) * up of the sums, no kernel of
its own), and serves the token embedding, whose A product is a lookup of the token's row (ids).
Over at most pdl.MAX_ROWS tokens both are PDL launches, as the base model's small-batch kernels are, so
that they do not break that chain: each asks L2 for its slots' adapter weights before it waits for the
kernel before it.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.device import num_sms
from nanovllm.kernels.triton_fused import silu_mul

BLOCK_M, BLOCK_K, BLOCK_N, MAX_BLOCK_R = 16, 128, 128, 64
MAX_SPLITS = 8   # (the expand's loads of the partial sums, all in flight at once)
# The expand's tile of tokens from PREFILL_TOKENS up: each tile reads its slots' B again, and a prefill chunk's
# thousands of tokens, sorted by slot, fill large tiles of one slot.
PREFILL_TOKENS, PREFILL_BLOCK_M = 1024, 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, tokens_ptr, out_ptr, M, K, ROWS, K_PER_SPLIT, stride_x, stride_o, stride_split,
                   NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)     # places in the order of the slots
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    m_ok, r_ok = offs_m < M, offs_r < ROWS
    slots = tl.load(tokens_ptr + 2 * offs_m, mask=m_ok, other=-1)   # (uploaded before the step's kernels)
    rows = tl.load(tokens_ptr + 2 * offs_m + 1, mask=m_ok, other=0)  # their tokens' rows of x
    if PDL:   # this program's slice of its slots' A, into L2 while the kernel before finishes
        for s in range(NUM_SLOTS):
            if tl.max((slots == s).to(tl.int32)) > 0:
                a_rows = s * ROWS + tl.minimum(offs_r, ROWS - 1)
                for k in range(k_start, k_end, BLOCK_K):
                    cols = tl.minimum(k + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
                    pdl.prefetch_l2(a_ptr + a_rows[:, None] * K + cols[None, :])
    pdl.begin(PDL)
    out = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for s in range(NUM_SLOTS):
        mine = slots == s
        if tl.max(mine.to(tl.int32)) > 0:
            for k in range(k_start, k_end, BLOCK_K):
                k_ok = offs_k < k_end - k
                x = tl.load(x_ptr + rows[:, None] * stride_x + (k + offs_k)[None, :],
                            mask=mine[:, None] & k_ok[None, :], other=0.0)       # (zero: other slots' tokens)
                a = tl.load(a_ptr + (s * ROWS + offs_r)[None, :] * K + (k + offs_k)[:, None],
                            mask=r_ok[None, :] & k_ok[:, None], other=0.0)       # [BLOCK_K, BLOCK_R]: a[s].T
                out = tl.dot(x, a, out, input_precision=PRECISION)
    out_ptrs = out_ptr + tl.program_id(2) * stride_split + offs_m[:, None] * stride_o + offs_r[None, :]
    tl.store(out_ptrs, out, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(shrunk_ptr, b_ptr, tokens_ptr, y_ptr, out_ptr, ids_ptr, M, N, ROWS, SPLITS, VOCAB, stride_s,
                   stride_split, stride_y, stride_o, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_BLOCK: tl.constexpr, SILU_MUL: tl.constexpr,
                   GATHER: tl.constexpr, PRECISION: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    # With SILU_MUL, y's columns are a gated MLP's gate | up (N / 2 each): a program adds the products to the
    # gate's columns offs_n and to the up's columns as many places on, and writes silu(gate) * up into out.
    # With GATHER, shrunk_ptr is a table [slots, VOCAB, ROWS] (the embedding's A) and a place's shrunk row is
    # its slot's row of its token (ids_ptr: each row's token id).
    n_out = N // 2 if SILU_MUL else N
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)     # places in the order of the slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < n_out
    slots = tl.load(tokens_ptr + 2 * offs_m, mask=m_ok, other=-1)   # (uploaded before the step's kernels)
    rows = tl.load(tokens_ptr + 2 * offs_m + 1, mask=m_ok, other=0)
    top = tl.max(slots)   # (the tile's last slot; at batch 1 its only one)
    if PDL:   # before waiting for the kernel before: the top slot's first B tile into registers, the rest of
        # this program's columns of its slots' B into L2
        b_top, b_top_up = _b_tiles(b_ptr, tl.maximum(top, 0), tl.arange(0, BLOCK_R), offs_n, n_ok & (top >= 0),
                                   ROWS, N, n_out, SILU_MUL)
        cols = tl.minimum(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N // LINE) * LINE, n_out - 1)
        for s in range(NUM_SLOTS):
            if tl.max((slots == s).to(tl.int32)) > 0:
                for r in range(tl.where(s == top, BLOCK_R, 0), ROWS, BLOCK_R):   # (the top's first: held)
                    b_rows = s * ROWS + tl.minimum(r + tl.arange(0, BLOCK_R), ROWS - 1)
                    pdl.prefetch_l2(b_ptr + b_rows[:, None] * N + cols[None, :])
                    if SILU_MUL:
                        pdl.prefetch_l2(b_ptr + b_rows[:, None] * N + n_out + cols[None, :])
    pdl.begin(PDL)
    # (a block of base-model tokens leaves y as it is, unless their activations are to be written: slots >= -1)
    if top >= (-1 if SILU_MUL else 0):
        y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        # (nor does a base-model token's row, unless its activation is to be written)
        y_ok = (((slots >= 0) | SILU_MUL) & m_ok)[:, None] & n_ok[None, :]
        y = tl.load(y_ptrs, mask=y_ok, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if GATHER:
            adapted = m_ok & (slots >= 0)
            ids = tl.load(ids_ptr + rows, mask=adapted, other=0)
            table_rows = tl.maximum(slots, 0).to(tl.int64) * VOCAB + ids
        for r in range(0, ROWS, BLOCK_R):
            offs_r = r + tl.arange(0, BLOCK_R)
            r_ok = offs_r < ROWS
            if GATHER:
                shrunk = tl.load(shrunk_ptr + table_rows[:, None] * ROWS + offs_r[None, :],
                                 mask=adapted[:, None] & r_ok[None, :], other=0.0)
            else:
                shrunk = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
                for split in tl.static_range(SPLITS_BLOCK):   # (the shrink's partial sums over slices of K)
                    split_ok = r_ok & (tl.full((BLOCK_R,), split, tl.int32) < SPLITS)
                    shrunk += tl.load(shrunk_ptr + split * stride_split + offs_m[:, None] * stride_s +
                                      offs_r[None, :], mask=m_ok[:, None] & split_ok[None, :], other=0.0)
            shrunk = shrunk.to(b_ptr.dtype.element_ty)
            for s in range(NUM_SLOTS):
                if tl.max((slots == s).to(tl.int32)) > 0:
                    if PDL:
                        if (s == top) & (r == 0):
                            b, b_up = b_top, b_top_up
                        else:
                            b, b_up = _b_tiles(b_ptr, s, offs_r, offs_n, n_ok, ROWS, N, n_out, SILU_MUL)
                    else:
                        b, b_up = _b_tiles(b_ptr, s, offs_r, offs_n, n_ok, ROWS, N, n_out, SILU_MUL)
                    mine = tl.where((slots == s)[:, None], shrunk, 0.0)
                    acc = tl.dot(mine, b, acc, input_precision=PRECISION)
                    if SILU_MUL:
                        acc_up = tl.dot(mine, b_up, acc_up, input_precision=PRECISION)
        y = (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty)
        if SILU_MUL:
            up = tl.load(y_ptrs + n_out, mask=y_ok, other=0.0)
            up = (up.to(tl.float32) + acc_up).to(y_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_o + offs_n[None, :], silu_mul(y, up), mask=y_ok)
        else:
            tl.store(y_ptrs, y, mask=y_ok)


@triton.jit
def _b_tiles(b_ptr, s, offs_r, offs_n, n_ok, ROWS, N, n_out, SILU_MUL: tl.constexpr):
    """Slot s's B rows offs_r, columns offs_n, and (with SILU_MUL) the up columns as many places on (else the
    same tile again)."""
    ptrs = b_ptr + (s * ROWS + offs_r)[:, None] * N + offs_n[None, :]
    ok = (offs_r < ROWS)[:, None] & n_ok[None, :]
    b = tl.load(ptrs, mask=ok, other=0.0)
    b_up = b
    if SILU_MUL:
        b_up = tl.load(ptrs + n_out, mask=ok, other=0.0)
    return b, b_up


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 products in full (as torch's by default), not in TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def rows_block(rows: int) -> int:
    """The tile of A's rows (or B's): all of them up to MAX_BLOCK_R, padded to a power of two of at least 16."""
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rows)))


def split_k(m: int, rows: int, k: int, device: torch.device) -> int:
    """Into how many slices of K the shrink splits its products: enough for about two programs per SM
    (a decode step's 256 tokens are only 16 tiles of BLOCK_M) up to MAX_SPLITS, none for a prefill's thousands
    of tokens."""
    programs = triton.cdiv(m, BLOCK_M) * triton.cdiv(rows, rows_block(rows))
    sms = num_sms(device) if device.type == "cuda" else 132
    return max(1, min(triton.cdiv(k, BLOCK_K), 2 * sms // programs, MAX_SPLITS))


def k_per_split(k: int, splits: int) -> int:
    """The K columns of one of `splits` slices, whole BLOCK_Ks (so the last slices may be fewer or none)."""
    return triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K


def shrink_output(x: torch.Tensor, a: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """The float32 [splits, M, ROWS] buffer of lora_shrink's partial sums over `splits` slices of K (split_k's
    count unless given; fewer where K has fewer whole BLOCK_K columns)."""
    (m, k), rows = x.shape, a.shape[1]
    slice_k = k_per_split(k, splits or split_k(m, rows, k, x.device))
    return torch.empty(triton.cdiv(k, slice_k), m, rows, dtype=torch.float32, device=x.device)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, splits: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], a: [S, ROWS, K] contiguous, tokens: [M, 2] int32 contiguous, (slot, row of x) pairs sorted by
    slot (lora/layers.py sorted_tokens; slot -1: none) -> float32 [splits, M, ROWS] (into out, from
    shrink_output, if given): the partial products over `splits` slices of K, whose sum's i-th row is
    x[row] @ a[slot].T for the i-th pair (zero for -1)."""
    m, k = x.shape
    num_slots, rows = a.shape[:2]
    assert a.shape[2] == k and a.is_contiguous() and x.stride(1) == 1 and tokens.shape == (m, 2)
    assert tokens.is_contiguous()
    out = shrink_output(x, a, splits) if out is None else out
    splits = out.shape[0]
    slice_k = k_per_split(k, splits)
    assert out.shape == (splits, m, rows) and triton.cdiv(k, slice_k) == splits and out.is_contiguous()
    block_r = rows_block(rows)
    launch(_shrink_kernel, (triton.cdiv(m, BLOCK_M), triton.cdiv(rows, block_r), splits), x, a, tokens, out, m, k,
           rows, slice_k, x.stride(0), out.stride(1), out.stride(0), NUM_SLOTS=num_slots, BLOCK_M=BLOCK_M,
           BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=precision(x.dtype), LINE=128 // a.element_size(),
           **pdl.launch_options(m))
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor,
                silu_mul: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
    """y[row] += shrunk's i-th row (the sum of lora_shrink's partial sums: [splits, M, ROWS]) @ b[slot]
    ([S, ROWS, N] contiguous) for the i-th (slot, row) pair of tokens, in place (y: [M, N]); returns y.
    silu_mul: y's halves are a gated MLP's gate | up; return silu(gate) * up of the sums instead ([M, N / 2],
    as layers/activation.py silu_and_mul gives it; y is left as it was).
    ids: y's rows' token ids ([M]); shrunk is then a table [S, V, ROWS] (the embedding's A, contiguous) whose
    row of the pair's slot and row's token stands for its shrunk row."""
    m, n = y.shape
    num_slots, rows = b.shape[:2]
    if ids is None:
        assert shrunk.shape[1:] == (m, rows)
    else:
        assert shrunk.shape[::2] == (num_slots, rows) and shrunk.is_contiguous() and ids.shape == (m,)
    assert b.shape[2] == n and b.is_contiguous() and y.stride(1) == 1
    assert tokens.shape == (m, 2) and tokens.is_contiguous() and not (silu_mul and n % 2)
    out = torch.empty(m, n // 2, dtype=y.dtype, device=y.device) if silu_mul else y
    block_m = PREFILL_BLOCK_M if m >= PREFILL_TOKENS else BLOCK_M
    splits = 1 if ids is not None else shrunk.shape[0]
    launch(_expand_kernel, (triton.cdiv(m, block_m), triton.cdiv(out.shape[1], BLOCK_N)), shrunk, b, tokens, y, out,
           tokens if ids is None else ids, m, n, rows, splits, 0 if ids is None else shrunk.shape[1], shrunk.stride(1),
           shrunk.stride(0), y.stride(0), out.stride(0), NUM_SLOTS=num_slots, BLOCK_M=block_m, BLOCK_R=rows_block(rows),
           BLOCK_N=BLOCK_N, SPLITS_BLOCK=triton.next_power_of_2(splits), SILU_MUL=silu_mul, GATHER=ids is not None,
           PRECISION=precision(b.dtype), LINE=128 // b.element_size(), num_warps=8 if m <= pdl.MAX_ROWS else 4,
           **pdl.launch_options(m))   # (8 warps: the B tile held through the wait, without spills)
    return out
