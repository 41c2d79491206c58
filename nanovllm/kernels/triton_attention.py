"""Paged-attention kernels in Triton; `torch_attention.py` beside this is their reference.

KV cache layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's token t
lives in page block_table[t // block_size] at row t % block_size.

- store_kvcache: writes this step's k, v into their slots (slot -1, CUDA-graph padding, is skipped).
  The cache may be fp8 (kv_cache_dtype): values are stored unscaled, clamped to the format's
  range, and the attention kernels convert each tile back to the queries' dtype after loading it.
- decode_attention: one new query per sequence. Each program owns one (sequence, KV head,
  context split) and loads every K/V row once for all query heads of its group (GQA); the splits
  are merged (flash-decoding), so a few long sequences still fill the GPU: by a second small kernel
  at small batches, above FUSED_MERGE_ABOVE sequences by the split program of each (sequence, KV
  head) that finishes last. A context that fits in one split is written out by its program, and
  the merge skips it.
  With shared prefixes (cascade attention): where consecutive sequences begin with the same pages
  (a system prompt shared by many requests, the n completions of one), a first kernel reads those
  pages once for a tile of their queries and leaves each query's partial result; each sequence's
  split programs then read only the rest of its context and merge that partial in.
- prefill_attention: causal, variable-length queries over the cached prefix plus themselves;
  serves prefill, chunked prefill and prefix-cache hits alike.
"""
import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from nanovllm.kernels import device as device_info, pdl
from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.counters import NUM_COUNTERS, counters as arrival_counters

if TYPE_CHECKING:
    from nanovllm.layers.attention import SharedPrefixes

FUSED_MERGE_ABOVE = 16   # sequences
SHARED_PREFIX_ROWS = 64  # query rows a _shared_prefix_kernel program (sequences x their query heads)
# A tile's prefix in parts (shared_prefix_splits): the kernel fits two programs an SM on sm_90 (for a
# bf16 cache 80 KB of shared memory each; tests/compile_kernels.py)
SHARED_PREFIX_PROGRAMS_PER_SM = 2
MAX_PREFIX_SPLITS = 16
MIN_PREFIX_SPLIT = 256   # tokens


# ---- store ------------------------------------------------------------------------------------
@triton.jit
def to_cache_dtype(x, cache_ptr):
    """x in the cache's element type; for fp8, clamped to the format's largest value first."""
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif dtype == tl.float8e5:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(dtype)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, to_cache_dtype(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, to_cache_dtype(v, v_cache_ptr), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor):
    """k, v: [num_tokens, num_kv_heads, head_dim], rows may be strided (views into the qkv output)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(-1) == 1 and v.stride(1) == head_dim
    row = num_kv_heads * head_dim
    launch(_store_kvcache_kernel, (num_tokens,), k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
           ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _in_compute_dtype(q, cache_ptr):
    """q in the dtype the kernels' products run in: fp16 for bf16 queries over an fp8 cache (one
    exact conversion per two fp8 values, where bf16 takes three instructions, and fp16 keeps more
    of q and of the probabilities), else q's own dtype."""
    if cache_ptr.dtype.element_ty.primitive_bitwidth == 8 and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


# ---- paged tiles ------------------------------------------------------------------------------
# The attention kernels walk a context in tiles of BLOCK_N tokens, BLOCK_N dividing the page size,
# so a tile lies in one page. Each iteration loads the page of the next tile: the K/V loads then
# depend on a value carried from the previous iteration, not on a load in their own, and Triton's
# pipeliner keeps num_stages - 1 tiles in flight (with the page looked up in the same iteration
# it kept one, and a program waited for each tile in turn).
@triton.jit
def _next_page(table, n_start, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page holding the tile after the one at n_start (0 past the end, never read)."""
    nxt = n_start + BLOCK_N
    return tl.load(table + nxt // PAGE, mask=nxt < end, other=0)


@triton.jit
def _tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE: tl.constexpr):
    """The cache offsets of context tokens offs_n (all in one page) for one KV head."""
    return page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cr + kv_head * stride_ch


@triton.jit
def _load_tile(cache_ptr, rows, offs_d, n_mask, MASKED: tl.constexpr):
    """The [tile, head_dim] values at rows; MASKED: only the tokens in n_mask (the others 0)."""
    if MASKED:
        return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :])


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, rows, n_mask, visible, offs_d, m_i, l_i, acc, qk_scale,
                 MASKED: tl.constexpr):
    """One tile of online softmax. rows: the cache offsets of the tile's tokens for this KV head
    (n_mask: which exist); visible: [queries, tile], which query sees which token; m_i, l_i,
    acc: running max (log2 units), sum and weighted values per query. -> them updated.
    MASKED False: every token of the tile exists and every query sees it (no masks)."""
    k = _load_tile(k_cache_ptr, rows, offs_d, n_mask, MASKED).to(q.dtype)
    s = tl.dot(q, tl.trans(k))                                 # scaled below, in one FMA with the max
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)    # a query that sees nothing yet
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = _load_tile(v_cache_ptr, rows, offs_d, n_mask, MASKED).to(q.dtype)
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])      # accumulated in the MMA itself
    return m_new, l_i * alpha + tl.sum(p, 1), acc


def tile_size(block_n: int, page: int) -> int:
    """block_n (a power of two) shrunk until it divides the page size (a multiple of 16)."""
    return math.gcd(block_n, page)


# ---- decode -----------------------------------------------------------------------------------
# stride_bt, the block-table width, changes from step to step: not specialised on (Triton would
# otherwise compile a kernel for width 1 and for multiples of 16, in the middle of a run).
@triton.jit(do_not_specialize=["stride_bt", "prefix_splits"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, prefix_lens_ptr,
                         out_ptr, o_part_ptr, lse_part_ptr, count_ptr, scale, prefix_splits,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cr, stride_ch,
                         NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                         FUSE_MERGE: tl.constexpr, SHARED_PREFIX: tl.constexpr, MIN_PREFIX_SPLIT: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.begin(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    # SHARED_PREFIX: the first prefix_len tokens were read by _shared_prefix_kernel in prefix_used
    # parts, whose partial results wait in the slots after the splits'; the splits cover the rest
    if SHARED_PREFIX:
        prefix_len = tl.load(prefix_lens_ptr + seq)
        prefix_used = tl.cdiv(prefix_len, _split_len(prefix_len, prefix_splits, MIN_PREFIX_SPLIT, BLOCK_N))
        slots = NUM_SPLITS + prefix_splits
    else:
        prefix_len, prefix_used, slots = 0, 0, NUM_SPLITS
    split_len = _split_len(seq_len - prefix_len, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    num_used = tl.cdiv(seq_len - prefix_len, split_len)      # 0 for a padding row
    if split >= tl.maximum(num_used, 1):
        return          # an unused split: the merge reads only the first num_used
    start = prefix_len + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    # q: [BLOCK_G, HEAD_DIM], this KV head's query heads (padded to BLOCK_G rows)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)
    q = _in_compute_dtype(q, k_cache_ptr)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634   # log2(e): exp2 below

    table = block_tables_ptr + seq * stride_bt
    page = tl.load(table + start // PAGE, mask=start < end, other=0)
    for n_start in range(start, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        rows = _tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE)
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, rows, n_mask, n_mask[None, :], offs_d,
                                     m_i, l_i, acc, qk_scale, MASKED=True)
        page = _next_page(table, n_start, end, PAGE, BLOCK_N)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]       # a padding row: zeros
    # o_part [num_seqs, num_heads, slots, HEAD_DIM], lse_part [.., slots]: a slot a split, then
    # (SHARED_PREFIX) a slot a part of the shared prefix
    first = (seq * num_heads + heads) * slots
    # The output written here: a context read by this one program (num_used 1), a padding row's zeros (0).
    # With shared prefixes only the zeros: a one-split context's partial goes through the merge below as
    # several splits' do (merged here instead, the kernel took 128 registers, not 96: 4 programs an SM, not 5).
    if num_used <= 1 - SHARED_PREFIX:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        tl.store(o_part_ptr + (first + split)[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(lse_part_ptr + first + split, m_i + tl.log2(l_i), mask=g_mask)
        if FUSE_MERGE:  # the last split of this (sequence, KV head) to finish merges them all
            tl.debug_barrier()                                       # every thread's partials written ...
            counter = count_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_used - 1:   # ... before counting in
                out = _merge_splits(o_part_ptr, lse_part_ptr, first, num_used, NUM_SPLITS, prefix_used, g_mask,
                                    offs_d, BLOCK_G, HEAD_DIM)
                tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits(o_part_ptr, lse_part_ptr, first, num_used, prefix_first, prefix_used, g_mask, offs_d,
                  BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The output of BLOCK_G query heads from their first num_used splits' partials (first: each
    head's first slot) and the shared prefix's prefix_used partials from slot prefix_first on."""
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc, m, l_sum = _merge_partials(acc, m, l_sum, o_part_ptr, lse_part_ptr, first, num_used, g_mask, offs_d,
                                    HEAD_DIM)
    acc, m, l_sum = _merge_partials(acc, m, l_sum, o_part_ptr, lse_part_ptr, first + prefix_first, prefix_used,
                                    g_mask, offs_d, HEAD_DIM)
    return acc / l_sum[:, None]


@triton.jit
def _merge_partials(acc, m, l_sum, o_part_ptr, lse_part_ptr, first, count, g_mask, offs_d, HEAD_DIM: tl.constexpr):
    """A result so far (acc: its values weighted by 2^(score - m), m: the largest score in log2 units,
    l_sum: the weights' sum; per query head) merged with the partials in count slots from first (per
    head), as online softmax merges tiles. Loads bypass L1: the partials were written by other programs."""
    for i in range(count):
        lse = tl.load(lse_part_ptr + first + i, mask=g_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(o_part_ptr + (first + i)[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_sum = l_sum * alpha + w
        m = m_new
    return acc, m, l_sum


@triton.jit
def _split_len(seq_len, num_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Context tokens per split: seq_len over num_splits, at least MIN_SPLIT, a multiple of BLOCK_N."""
    return tl.cdiv(tl.maximum(tl.cdiv(seq_len, num_splits), MIN_SPLIT), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_merge_kernel(o_part_ptr, lse_part_ptr, seq_lens_ptr, out_ptr, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, MIN_SPLIT, BLOCK_N))
    if num_used <= 1:
        return          # written by the split kernel
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    used = offs_s < num_used
    base = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(lse_part_ptr + base + offs_s, mask=used, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(o_part_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=used[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# (do_not_specialize: as the split kernel's)
@triton.jit(do_not_specialize=["stride_bt", "splits", "slots"])
def _shared_prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, tiles_ptr, tile_count_ptr, o_part_ptr,
                          lse_part_ptr, scale, splits, slots, stride_qt, stride_qh, stride_bt, stride_cb, stride_cr,
                          stride_ch, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tiles of consecutive sequences that begin with the same prefix_len tokens (tiles_ptr: rows of
    (first sequence, sequences, prefix_len), the first tile_count in use): each prefix read once for
    its tile's queries (rows: sequence by sequence, GROUP query heads each). The work items, one
    (tile, KV head, part of the prefix) each, are taken in turn by a fixed number of programs, so a
    CUDA graph captured for the most tiles a plan may have launches no program for the tiles it does
    not use. A prefix is cut into at most `splits` parts as the split kernel cuts a context
    (_split_len); each query's partial result for part i goes to slot slots - splits + i."""
    num_heads = NUM_KV_HEADS * GROUP
    items = tl.load(tile_count_ptr) * NUM_KV_HEADS * splits
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qk_scale = scale * 1.4426950408889634
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        part = item % splits
        kv_head = (item // splits) % NUM_KV_HEADS
        tile = item // (splits * NUM_KV_HEADS)
        prefix_len = tl.load(tiles_ptr + tile * 3 + 2)
        part_len = _split_len(prefix_len, splits, MIN_SPLIT, BLOCK_N)
        start = part * part_len
        end = tl.minimum(start + part_len, prefix_len)
        first_seq = tl.load(tiles_ptr + tile * 3)
        num_rows = tl.load(tiles_ptr + tile * 3 + 1) * GROUP
        m_mask = (offs_m < num_rows) & (start < prefix_len)    # an unused part loads and stores nothing
        seqs = first_seq + offs_m // GROUP
        heads = kv_head * GROUP + offs_m % GROUP
        q = tl.load(q_ptr + seqs[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        q = _in_compute_dtype(q, k_cache_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        table = block_tables_ptr + first_seq * stride_bt      # (the tile's sequences share these pages)
        page = tl.load(table + start // PAGE, mask=start < end, other=0)
        for n_start in range(start, end, BLOCK_N):            # whole pages, parts of whole tiles: no masks
            offs_n = n_start + tl.arange(0, BLOCK_N)
            rows = _tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE)
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, rows, None, None, offs_d, m_i, l_i, acc,
                                         qk_scale, MASKED=False)
            page = _next_page(table, n_start, end, PAGE, BLOCK_N)

        slot = (seqs * num_heads + heads) * slots + slots - splits + part
        tl.store(o_part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=m_mask[:, None])
        tl.store(lse_part_ptr + slot, m_i + tl.log2(l_i), mask=m_mask)


def shared_prefix_tile_rows(num_heads: int, num_kv_heads: int) -> int:
    """Sequences in one tile of _shared_prefix_kernel: SHARED_PREFIX_ROWS query rows."""
    return max(1, SHARED_PREFIX_ROWS // (num_heads // num_kv_heads))


def shared_prefix_splits(num_tiles: int, num_kv_heads: int, num_sms: int) -> int:
    """The most parts _shared_prefix_kernel cuts a tile's prefix into (a program each): enough for
    SHARED_PREFIX_PROGRAMS_PER_SM programs an SM, at most MAX_PREFIX_SPLITS. A part is at least
    MIN_PREFIX_SPLIT tokens, so a short prefix takes fewer."""
    programs = max(1, num_tiles * num_kv_heads)
    return max(1, min(MAX_PREFIX_SPLITS, SHARED_PREFIX_PROGRAMS_PER_SM * num_sms // programs))


def decode_split_config(num_seqs: int, num_kv_heads: int, num_sms: int, max_model_len: int) -> tuple[int, int]:
    """-> (most splits, fewest tokens per split). Few sequences: split finely to fill the GPU.
    Many: splits of at least 1,024 tokens, so most contexts take one program that writes the
    output itself (no merge), and a long one still spreads over several. In between, 512: on
    the H200 (docs/perf_notes.md row 42) 1-6% faster than 256 or 1,024 at 32-192 sequences of
    mixed lengths, and 1,024 faster from ~12 programs per SM on.
    No more splits than the longest context needs: an unused split is still a program to launch."""
    programs = num_seqs * num_kv_heads
    min_split = 64 if programs < num_sms else 512 if programs < 12 * num_sms else 1024
    return max(1, min(16, -(-max_model_len // min_split))), min_split


def fused_merge_for(num_seqs: int) -> bool:
    """Whether the decode kernel merges its splits itself: above FUSED_MERGE_ABOVE sequences. On the
    H200 (docs/perf_notes.md row 20) the fused merge was faster at 16 and 256 sequences (22.6 -> 21.9
    and 283.5 -> 277.6 us) and slower at 1 (5.6 -> 8.6 us: its last program merges alone, after the
    others). Up to 16 the decode graphs run under PDL (kernels/pdl.py), where the separate merge
    kernel's launch overlaps the split kernel, and batch-1 latency was better with it."""
    return num_seqs > FUSED_MERGE_ABOVE


def decode_variant_sizes(max_num_seqs: int, split_for) -> list[int]:
    """The fewest sequences of each decode-kernel variant that steps of 1 to max_num_seqs sequences
    launch (a step's size chooses its split configuration, split_for(num_seqs), the fused merge and
    PDL), so that start-up compiles them all: an eager engine's decode steps meet them nowhere else."""
    first = {}
    for n in range(1, max_num_seqs + 1):
        first.setdefault((split_for(n), fused_merge_for(n), pdl.launch_options(n)["PDL"]), n)
    return list(first.values())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int = 16, min_split: int = 64, block_n: int = 64, num_stages: int | None = None,
                     num_warps: int = 4, max_registers: int | None = None,
                     fuse_merge: bool | None = None, out: torch.Tensor | None = None,
                     shared_prefixes: "SharedPrefixes | None" = None,
                     min_prefix_split: int = MIN_PREFIX_SPLIT) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_lens - 1.
    A context is split into ceil(seq_len / split_len) parts, split_len = max(seq_len / num_splits,
    min_split) rounded up to block_n. A sequence with seq_len 0 (padding) gets zeros.
    fuse_merge: the last split of each (sequence, KV head) merges them (kernels/counters.py), instead
    of a second kernel; None: fused_merge_for's choice. out: where to write (q's shape, rows and heads at
    any stride); a new tensor when None. shared_prefixes: runs of sequences whose contexts begin with
    the same pages, read once a tile of them (engine/shared_prefix.py) in up to shared_prefixes.splits
    parts of at least min_prefix_split tokens; the splits cover the rest."""
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_n = tile_size(block_n, page)
    if num_stages is None:
        # Fastest on the H200 (docs/perf_notes.md rows 13-14): a 16-bit cache with one tile in flight
        # per program and five programs per SM; an fp8 cache (converted tiles, more registers)
        # with two tiles in flight and registers capped so that four programs fit on an SM.
        num_stages, max_registers = (3, 128) if k_cache.element_size() == 1 else (2, max_registers)
    if out is None:
        out = torch.empty_like(q)
    shared = shared_prefixes
    prefix_splits = 0 if shared is None else shared.splits
    slots = num_splits + prefix_splits    # a partial slot a split, then one a part of the shared prefix
    o_part = lse_part = count = out    # (not touched by the kernel unless there are partials / a fused merge)
    if slots > 1:
        o_part = torch.empty(num_seqs, num_heads, slots, head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(num_seqs, num_heads, slots, dtype=torch.float32, device=q.device)
    if shared is not None:      # the prefixes' partials first; the split programs merge them in (fused)
        assert num_seqs * num_kv_heads <= NUM_COUNTERS
        fuse_merge = True
        items = shared.num_tiles * num_kv_heads * prefix_splits     # (at most: tile_count <= num_tiles)
        # (the CPU's Triton interpreter: as if on 2 SMs, so that the tests' programs each walk several items)
        sms = device_info.num_sms(q.device) if q.is_cuda else 2
        launch(_shared_prefix_kernel, (min(items, SHARED_PREFIX_PROGRAMS_PER_SM * sms),),
            q, k_cache, v_cache, block_tables, shared.tiles, shared.tile_count, o_part, lse_part, scale,
            prefix_splits, slots, q.stride(0), q.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, GROUP=group,
            HEAD_DIM=head_dim, PAGE=page, BLOCK_M=SHARED_PREFIX_ROWS, BLOCK_N=block_n, MIN_SPLIT=min_prefix_split,
            num_warps=4, num_stages=num_stages)
    else:
        if fuse_merge is None:
            fuse_merge = fused_merge_for(num_seqs)
        fuse_merge = fuse_merge and num_splits > 1 and num_seqs * num_kv_heads <= NUM_COUNTERS
    if fuse_merge:
        count = arrival_counters(q.device)
    launch(_decode_split_kernel, (num_seqs, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if shared is None else shared.prefix_lens,
        out, o_part, lse_part, count, scale, prefix_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_SPLITS=num_splits, MIN_SPLIT=min_split, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n, FUSE_MERGE=fuse_merge, SHARED_PREFIX=shared is not None,
        MIN_PREFIX_SPLIT=min_prefix_split, num_warps=num_warps, num_stages=num_stages, maxnreg=max_registers,
        **pdl.launch_options(num_seqs))
    if num_splits == 1 or fuse_merge:
        return out
    launch(_decode_merge_kernel, (num_seqs, num_heads),
        o_part, lse_part, seq_lens, out, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, MIN_SPLIT=min_split, BLOCK_N=block_n,
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, **pdl.launch_options(num_seqs))
    return out


# ---- prefill ----------------------------------------------------------------------------------
# min_q_len (1, or 2 to skip one-token sequences) is not specialised on either: one variant for both.
@triton.jit(do_not_specialize=["stride_bt", "min_q_len"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
                    out_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_cr, stride_ch, min_q_len,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (tile * BLOCK_M >= q_len) | (q_len < min_q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len                                   # cached tokens before this chunk
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_pos = ctx_len + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)
    q = _in_compute_dtype(q, k_cache_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634

    end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_M)  # causal: no key past the tile's last query
    # Tiles of keys at or before the tile's first query are seen whole by every query: no masks
    # there; only the tiles on the diagonal (and a partial last one) are masked.
    full_end = (ctx_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    table = block_tables_ptr + seq * stride_bt
    page = tl.load(table)
    for n_start in range(0, full_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        rows = _tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE)
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, rows, None, None, offs_d, m_i, l_i, acc, qk_scale,
                                     MASKED=False)
        page = _next_page(table, n_start, end, PAGE, BLOCK_N)
    for n_start in range(full_end, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        rows = _tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, rows, n_mask, visible, offs_d,
                                     m_i, l_i, acc, qk_scale, MASKED=True)
        page = _next_page(table, n_start, end, PAGE, BLOCK_N)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, scale: float, block_m: int = 64, block_n: int = 64,
                      num_warps: int = 4, num_stages: int = 3, skip_decodes: bool = False,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], sequences back to back; the new tokens' K/V are
    already in the cache, after the sequence's seq_len - q_len cached ones. skip_decodes: the rows
    of one-token sequences are left unwritten (a mixed step's decodes, which decode_attention takes).
    out: where to write (as decode_attention's)."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    block_n = tile_size(block_n, page)
    if out is None:
        out = torch.empty_like(q)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    launch(_prefill_kernel, grid,
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 2 if skip_decodes else 1,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages)
    return out
