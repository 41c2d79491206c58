"""Prefill attention for Hopper GPUs (sm_90) in Gluon, Triton's lower-level language: the same
function as `triton_attention.prefill_attention`, which stays the kernel everywhere else.

Why a second kernel: the Triton kernel reaches ~430 TFLOP/s on long prompts on an H200, where
FlashAttention 3 reaches ~640 (docs/perf_notes.md, "Long prompts"). Gluon lets a kernel say what
Triton 3.6 would not do by itself, in FA3's manner:
- K/V tiles come by TMA (one bulk copy per tile, no per-thread address arithmetic) into a ring of
  STAGES slots, each with an mbarrier that says when its copy has landed. A paged tile is a box of
  the cache seen as a [num_blocks * page, num_kv_heads * head_dim] matrix: BLOCK_N rows of one
  page, head_dim columns of one KV head.
- Inside each iteration the tensor cores work while the softmax runs: the product S_j = Q K_j^T
  and the previous tile's O += P_(j-1) V_(j-1) are issued together, asynchronously; the softmax of
  S_j then runs while P_(j-1) V_(j-1) is still on the tensor cores. Only then is O rescaled.

Two kernels, chosen by `config_for`: `_prefill_kernel`, one warpgroup on 64 query rows that
issues its own copies (two programs per SM; best on prompts of up to ~1-2k tokens), and, for long
contexts, `_prefill_ws_kernel` in FA3's shape: 128 query rows split between two consumer
warpgroups that share each K/V tile, which a loader warp copies (`gl.warp_specialize`), so that
the copies and their waits leave the consumers' path (1.2x the first on 16k-token prompts).

A tile reads its BLOCK_N cache rows whole, including rows past the sequence's length in its last
page. Those keys are masked like future ones, and their probabilities are exactly 0; their values
must still be finite (0 * NaN is NaN), which is why the engine's KV cache starts zeroed.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.triton_attention import tile_size

GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel serves these inputs: an sm_90 GPU, a 16-bit cache in q's dtype, a
    power-of-two head_dim of 16-128, rows TMA can address (16-byte aligned, heads contiguous)."""
    head_dim = k_cache.shape[-1]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in GL_DTYPE and k_cache.dtype == q.dtype and head_dim in (16, 32, 64, 128)
            and q.stride(-1) == 1 and q.stride(1) == head_dim and q.stride(0) % 8 == 0 and q.data_ptr() % 16 == 0
            and k_cache.is_contiguous() and k_cache.data_ptr() % 16 == 0)


WARP_SPECIALIZE_FROM = 2048   # tokens in a step's longest sequence


def config_for(max_seq_len: int) -> dict:
    """prefill_attention's settings for a step whose longest sequence has max_seq_len tokens. On
    the H200 (docs/perf_notes.md row 60): 128-row tiles for two consumer warpgroups and a loader
    warp from 2,048 tokens on, 1.15-1.25x the one-warpgroup kernel on 4k-16k-token prompts; below,
    64-row tiles of one warpgroup, up to 8% faster on prompts of a few hundred tokens."""
    if max_seq_len >= WARP_SPECIALIZE_FROM:
        return dict(block_n=128, stages=2, warp_specialize=True)
    return dict(block_n=64, num_warps=4, stages=3)


@gluon.constexpr_function
def _mma_layout(num_warps, n):
    """The register layout of a [rows, n] warpgroup MMA result, num_warps warps down the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _page_of(table, i, num_tiles, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The cache page holding context tile i (0 past the last tile: never copied)."""
    return gl.load(table + (i * BLOCK_N) // PAGE, mask=i < num_tiles, other=0)


@gluon.jit
def _load_page_tile(desc, bars, ring, i, page, kv_col, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, pred):
    """Start the TMA copy of context tile i (in cache page `page`) into ring slot i % STAGES."""
    slot = i % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [page * PAGE + (i * BLOCK_N) % PAGE, kv_col], bar, ring.index(slot),
                                    pred=pred)


@gluon.jit
def _softmax_tile(s, m_i, l_i, n_start, q_pos, first_masked, qk_scale, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Online softmax of one tile of scores s: [BLOCK_M, BLOCK_N] -> (p, new max, new sum, alpha, the
    factor the output so far must be scaled by). Tiles from first_masked on are causally masked
    (and past the context's end: those keys sit after every query that matters)."""
    if n_start >= first_masked:
        offs_n = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    # (every query sees key 0, in the first tile: no row's maximum stays -inf)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


# One warpgroup's walk over a query tile's keys, in three parts: the first tile, each next tile,
# the last P V. A ring slot's `read` barrier (None: the caller refills the slot itself) is
# arrived on as soon as the product that reads it is done.
@gluon.jit
def _first_tile(q_smem, k_tile, k_ready, k_read, q_pos, first_masked, qk_scale,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """S_0 = Q K_0^T and its softmax -> (p, m_i, l_i)."""
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(k_ready, 0)
    s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    if k_read is not None:
        mbarrier.arrive(k_read)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, q_pos, first_masked, qk_scale, s_layout, BLOCK_N)
    return p, m_i, l_i


@gluon.jit
def _next_tile(q_smem, k_tile, k_ready, k_phase, k_read, v_prev, v_ready, v_phase, v_read, p, acc, m_i, l_i,
               n_start, q_pos, first_masked, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
               o_layout: gl.constexpr):
    """S_j = Q K_j^T and O += P_(j-1) V_(j-1), issued together; the softmax of S_j runs while the
    second product is still on the tensor cores; then O is rescaled -> (p, acc, m_i, l_i)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    mbarrier.wait(k_ready, k_phase)
    s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), gl.zeros(p.shape, gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    mbarrier.wait(v_ready, v_phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_layout), v_prev, acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))             # S_j done; P_(j-1) V_(j-1) may still run
    if k_read is not None:
        mbarrier.arrive(k_read)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, n_start, q_pos, first_masked, qk_scale, s_layout, BLOCK_N)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if v_read is not None:
        mbarrier.arrive(v_read)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, acc, m_i, l_i


@gluon.jit
def _last_pv(p, acc, v_tile, v_ready, v_phase, v_read, o_layout: gl.constexpr):
    """O += P V of the last tile -> acc."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    mbarrier.wait(v_ready, v_phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(v_tile.dtype), p_layout), v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if v_read is not None:
        mbarrier.arrive(v_read)
    return acc


@gluon.jit
def _store_rows(acc, l_i, out_ptr, q_start, row0, q_len, head, stride_ot, stride_oh,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """Normalise and store query rows [row0, row0 + BLOCK_M) of the chunk (those below q_len)."""
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


@gluon.jit(do_not_specialize=["stride_bt", "min_q_len"])
def _prefill_kernel(q_desc, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                    qk_scale, stride_ot, stride_oh, stride_bt, min_q_len,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # Query tiles longest first: the GPU starts programs in order, and the kernel ends on short ones.
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    head, seq = gl.program_id(1), gl.program_id(2)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    if (tile * BLOCK_M < q_len) & (q_len >= min_q_len):
        seq_len = gl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len                                 # cached tokens before this chunk
        kv_col = (head // GROUP) * HEAD_DIM
        end = gl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_M)  # no key past the tile's last query
        num_tiles = gl.cdiv(end, BLOCK_N)
        first_masked = (ctx_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N   # keys before: seen by all
        table = block_tables_ptr + seq * stride_bt
        # S = Q K^T and O = P V as warpgroup MMAs; P goes from S's registers to the second product.
        s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N)
        o_layout: gl.constexpr = _mma_layout(num_warps, HEAD_DIM)
        dtype: gl.constexpr = q_desc.dtype

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        # Rows past this sequence's queries are read too (the next sequence's, or zeros past the
        # batch) and never stored.
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + tile * BLOCK_M, head * HEAD_DIM], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            page = _page_of(table, i, num_tiles, PAGE, BLOCK_N)
            _load_page_tile(k_desc, k_bars, k_ring, i, page, kv_col, PAGE, BLOCK_N, STAGES, i < num_tiles)
            _load_page_tile(v_desc, v_bars, v_ring, i, page, kv_col, PAGE, BLOCK_N, STAGES, i < num_tiles)

        q_pos = ctx_len + tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)

        # Tile 0: its scores and probabilities (its P V is issued in the next iteration).
        next_page = _page_of(table, STAGES, num_tiles, PAGE, BLOCK_N)
        p, m_i, l_i = _first_tile(q_smem, k_ring.index(0), k_bars.index(0), None, q_pos, first_masked, qk_scale,
                                  BLOCK_M, BLOCK_N, s_layout)
        _load_page_tile(k_desc, k_bars, k_ring, STAGES, next_page, kv_col, PAGE, BLOCK_N, STAGES,
                        STAGES < num_tiles)
        page_v = next_page      # the page of the V tile to copy next (it trails K's by one)

        for j in range(1, num_tiles):
            slot, prev = j % STAGES, (j - 1) % STAGES
            next_page = _page_of(table, j + STAGES, num_tiles, PAGE, BLOCK_N)   # (its latency hidden below)
            p, acc, m_i, l_i = _next_tile(q_smem, k_ring.index(slot), k_bars.index(slot), (j // STAGES) & 1, None,
                                          v_ring.index(prev), v_bars.index(prev), ((j - 1) // STAGES) & 1, None,
                                          p, acc, m_i, l_i, j * BLOCK_N, q_pos, first_masked, qk_scale,
                                          BLOCK_N, s_layout, o_layout)
            # K's slot of tile j and V's of tile j - 1 are read: refill them.
            _load_page_tile(k_desc, k_bars, k_ring, j + STAGES, next_page, kv_col, PAGE, BLOCK_N, STAGES,
                            j + STAGES < num_tiles)
            _load_page_tile(v_desc, v_bars, v_ring, j - 1 + STAGES, page_v, kv_col, PAGE, BLOCK_N, STAGES,
                            j - 1 + STAGES < num_tiles)
            page_v = next_page

        last = num_tiles - 1
        acc = _last_pv(p, acc, v_ring.index(last % STAGES), v_bars.index(last % STAGES), (last // STAGES) & 1,
                       None, o_layout)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        _store_rows(acc, l_i, out_ptr, q_start, tile * BLOCK_M, q_len, head, stride_ot, stride_oh,
                    BLOCK_M, HEAD_DIM, o_layout)


# ---- two consumer warpgroups and a loader warp (FA3's shape) ------------------------------------
@gluon.jit
def _ws_loader(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_free, v_free, block_tables_ptr, seq,
               stride_bt, num_tiles, kv_col, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: copies the query tile's K/V tiles into the ring, each into a slot both consumers
    have freed."""
    table = block_tables_ptr + seq * stride_bt
    for i in range(num_tiles):
        slot, phase = i % STAGES, (i // STAGES) & 1
        page = _page_of(table, i, num_tiles, PAGE, BLOCK_N)
        mbarrier.wait(k_free.index(slot), phase ^ 1)
        _load_page_tile(k_desc, k_ready, k_ring, i, page, kv_col, PAGE, BLOCK_N, STAGES, True)
        mbarrier.wait(v_free.index(slot), phase ^ 1)
        _load_page_tile(v_desc, v_ready, v_ring, i, page, kv_col, PAGE, BLOCK_N, STAGES, True)


@gluon.jit
def _ws_consumer(q_desc, q_smem, q_bar, k_ring, v_ring, k_ready, v_ready, k_free, v_free, out_ptr,
                 q_start, q_len, ctx_len, seq_len, tile, head, qk_scale, stride_ot, stride_oh,
                 C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: query rows [C * 64, C * 64 + 64) of the 128-row tile, with `_prefill_kernel`'s
    steps over the shared ring; it frees each slot once its product has read it."""
    BLOCK_M: gl.constexpr = 64
    row0 = tile * 2 * BLOCK_M + C * BLOCK_M
    all_tiles = gl.cdiv(gl.minimum(seq_len, ctx_len + (tile + 1) * 2 * BLOCK_M), BLOCK_N)
    num_tiles = gl.where(row0 < q_len, gl.cdiv(gl.minimum(seq_len, ctx_len + row0 + BLOCK_M), BLOCK_N), 0)

    if num_tiles > 0:
        s_layout: gl.constexpr = _mma_layout(4, BLOCK_N)
        o_layout: gl.constexpr = _mma_layout(4, HEAD_DIM)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + row0, head * HEAD_DIM], q_bar, q_smem)
        first_masked = (ctx_len + row0 + 1) // BLOCK_N * BLOCK_N
        q_pos = ctx_len + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)

        p, m_i, l_i = _first_tile(q_smem, k_ring.index(0), k_ready.index(0), k_free.index(0), q_pos, first_masked,
                                  qk_scale, BLOCK_M, BLOCK_N, s_layout)
        for j in range(1, num_tiles):
            slot, prev = j % STAGES, (j - 1) % STAGES
            p, acc, m_i, l_i = _next_tile(q_smem, k_ring.index(slot), k_ready.index(slot), (j // STAGES) & 1,
                                          k_free.index(slot), v_ring.index(prev), v_ready.index(prev),
                                          ((j - 1) // STAGES) & 1, v_free.index(prev), p, acc, m_i, l_i,
                                          j * BLOCK_N, q_pos, first_masked, qk_scale, BLOCK_N, s_layout, o_layout)
        last = num_tiles - 1
        acc = _last_pv(p, acc, v_ring.index(last % STAGES), v_ready.index(last % STAGES), (last // STAGES) & 1,
                       v_free.index(last % STAGES), o_layout)
        _store_rows(acc, l_i, out_ptr, q_start, row0, q_len, head, stride_ot, stride_oh, BLOCK_M, HEAD_DIM, o_layout)

    # Tiles the other consumer needs and this one does not (the diagonal's last, or all of them
    # when the chunk ends before this consumer's rows): free each once it has landed.
    for j in range(num_tiles, all_tiles):
        slot, phase = j % STAGES, (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_free.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_free.index(slot))


@gluon.jit(do_not_specialize=["stride_bt", "min_q_len"])
def _prefill_ws_kernel(q_desc, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                       qk_scale, stride_ot, stride_oh, stride_bt, min_q_len,
                       GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    tile = gl.num_programs(0) - 1 - gl.program_id(0)     # longest first, as in _prefill_kernel
    head, seq = gl.program_id(1), gl.program_id(2)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    if (tile * 128 < q_len) & (q_len >= min_q_len):
        seq_len = gl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len
        num_tiles = gl.cdiv(gl.minimum(seq_len, ctx_len + (tile + 1) * 128), BLOCK_N)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_free.index(i), count=2)
            mbarrier.init(v_free.index(i), count=2)
        gl.warp_specialize([
            (_ws_consumer, (q_desc, q_smem.index(0), q_bars.index(0), k_ring, v_ring, k_ready, v_ready, k_free,
                            v_free, out_ptr, q_start, q_len, ctx_len, seq_len, tile, head, qk_scale,
                            stride_ot, stride_oh, 0, HEAD_DIM, BLOCK_N, STAGES)),
            (_ws_consumer, (q_desc, q_smem.index(1), q_bars.index(1), k_ring, v_ring, k_ready, v_ready, k_free,
                            v_free, out_ptr, q_start, q_len, ctx_len, seq_len, tile, head, qk_scale,
                            stride_ot, stride_oh, 1, HEAD_DIM, BLOCK_N, STAGES)),
            (_ws_loader, (k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_free, v_free, block_tables_ptr, seq,
                          stride_bt, num_tiles, (head // GROUP) * HEAD_DIM, PAGE, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, scale: float, block_n: int = 64, num_warps: int = 4,
                      stages: int = 3, warp_specialize: bool = False, skip_decodes: bool = False,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """triton_attention.prefill_attention's contract, for inputs `supports` accepts. Each warpgroup
    (four warps) takes 64 query rows of a tile; stages: the K/V tiles a program keeps in flight.
    warp_specialize: 128-row tiles, two consumer warpgroups and a loader warp (num_warps unused)."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    block_m, block_n = (128 if warp_specialize else 16 * num_warps), tile_size(block_n, page)
    q_rows = 64 if warp_specialize else block_m
    dtype = GL_DTYPE[q.dtype]
    q_desc = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1], [q_rows, head_dim],
                              gl.NVMMASharedLayout.get_default_for([q_rows, head_dim], dtype))
    # The cache as a matrix of token rows; a tile is block_n rows of one page, one KV head's columns.
    rows, row = [num_blocks * page, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1]
    tile_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], dtype)
    k_desc = TensorDescriptor(k_cache, rows, row, [block_n, head_dim], tile_layout)
    v_desc = TensorDescriptor(v_cache, rows, row, [block_n, head_dim], tile_layout)
    if out is None:
        out = torch.empty_like(q)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, seq_lens.shape[0])
    args = (q_desc, k_desc, v_desc, block_tables, query_start_loc, seq_lens, out, scale * 1.4426950408889634,
            out.stride(0), out.stride(1), block_tables.stride(0), 2 if skip_decodes else 1)
    group = num_heads // num_kv_heads
    if warp_specialize:
        # 12 warps (the loader's warpgroup mostly idle) at 168 registers; the consumers then take 240.
        launch(_prefill_ws_kernel, grid, *args, GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n,
               STAGES=stages, CONSUMER_REGS=240, num_warps=4, maxnreg=168)
    else:
        launch(_prefill_kernel, grid, *args, GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=block_m,
               BLOCK_N=block_n, STAGES=stages, num_warps=num_warps)
    return out
