"""Other decode-attention kernels on the engine's paged cache, against ours (a developer tool, not
a test; bf16 cache, Qwen3-0.6B attention shape, pages of 256 tokens scattered over the cache,
contexts randint(100, 2048), us per call in CUDA graphs of 20 calls):

  gluon   our split kernel rewritten in Gluon (Triton 3.6's lower-level language) so that each
          operand's next tile is copied while the current tile is computed: K's copy is issued
          as soon as the QK product has read K's buffer, V's after the PV product, each waited
          for on its own. Same registers, shared memory and programs per SM as ours, where the
          Triton kernel waits for K and V together and copies the next tile only after both
          products. The merge of splits is the separate kernel (compare with "ours, unfused").
  FA2/FA3 vLLM's FlashAttention 2 and 3 (`vllm.vllm_flash_attn.flash_attn_varlen_func` with one
          query per sequence and the block table), when vLLM is installed (../shared/peers
          README); FA3 also on pages of 16 tokens, vLLM's own block size.

    PYTHONPATH=. python3 tests/bench_decode_alternatives.py

Measured on the H200 (docs/benchmarks.md, 2026-12-01, sixth session): neither is faster than ours
where the default workload spends its attention time.
"""
import random

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from bench_kernels import D, H, KV, PAGE, paged
from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import triton_attention as ta


_split_len = gluon.jit(ta._split_len.fn)     # the Triton kernel's split rule, compiled as Gluon


@gluon.jit
def _tile_ptrs(cache_ptr, page, n_start, offs_n, offs_d, kv_off, stride_cb, stride_cr, PAGE: gl.constexpr):
    rows = page.to(gl.int64) * stride_cb + ((n_start + offs_n) % PAGE) * stride_cr + kv_off
    return cache_ptr + rows[:, None] + offs_d[None, :]


@gluon.jit
def _gluon_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                         out_ptr, o_part_ptr, lse_part_ptr, scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cr, stride_ch,
                         NUM_SPLITS: gl.constexpr, MIN_SPLIT: gl.constexpr, GROUP: gl.constexpr,
                         BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
                         BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    load_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # The products run in chunks of 32 (head dim for QK, tokens for PV) through shared memory, so
    # that no whole operand sits in registers: 96 registers, five programs per SM, as the Triton
    # kernel. (Chunks of 16 tokens gave wrong sums: p's slices then cut a 128-byte swizzle atom.)
    CHUNK: gl.constexpr = 32

    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    num_heads = gl.num_programs(1) * GROUP
    seq_len = gl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    num_used = gl.cdiv(seq_len, split_len)
    if split >= gl.maximum(num_used, 1):
        return
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)

    table = block_tables_ptr + seq * stride_bt
    kv_off = kv_head * stride_ch
    offs_n_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_l))
    offs_d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_l))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], smem_l)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], smem_l)

    # first tile: K, then V, each its own group
    page = gl.load(table + start // PAGE)
    ok = (start + offs_n_ld < end)[:, None]
    async_copy.async_copy_global_to_shared(
        k_smem, _tile_ptrs(k_cache_ptr, page, start, offs_n_ld, offs_d_ld, kv_off, stride_cb, stride_cr, PAGE), mask=ok)
    async_copy.commit_group()
    async_copy.async_copy_global_to_shared(
        v_smem, _tile_ptrs(v_cache_ptr, page, start, offs_n_ld, offs_d_ld, kv_off, stride_cb, stride_cr, PAGE), mask=ok)
    async_copy.commit_group()

    # q: this KV head's query heads, padded to BLOCK_G rows
    offs_g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, load_l))
    q_ptrs = q_ptr + seq * stride_qt + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d_ld[None, :]
    q = gl.load(q_ptrs, mask=(offs_g < GROUP)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_G, HEAD_DIM], smem_l, q)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_G, BLOCK_N], smem_l)

    m_i = gl.full([BLOCK_G], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.full([BLOCK_G], 0.0, gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([BLOCK_G, HEAD_DIM], gl.float32, layout=mma)
    qk_scale = scale * 1.4426950408889634
    offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))

    for n_start in range(start, end, BLOCK_N):
        nxt = n_start + BLOCK_N
        page = gl.load(table + nxt // PAGE, mask=nxt < end, other=0)

        async_copy.wait_group(1)              # this tile's K (its V may still be in flight)
        gl.thread_barrier()
        s = gl.zeros([BLOCK_G, BLOCK_N], gl.float32, layout=mma)
        for d in gl.static_range(0, HEAD_DIM, CHUNK):
            s = mma_v2(q_smem.slice(d, CHUNK, dim=1).load(dot_a),
                       k_smem.slice(d, CHUNK, dim=1).permute((1, 0)).load(dot_b), s)
        gl.thread_barrier()                   # every warp has read K: the next K may land
        async_copy.async_copy_global_to_shared(
            k_smem, _tile_ptrs(k_cache_ptr, page, nxt, offs_n_ld, offs_d_ld, kv_off, stride_cb, stride_cr, PAGE),
            mask=(nxt + offs_n_ld < end)[:, None])
        async_copy.commit_group()

        s = gl.where((n_start + offs_n_s < end)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))

        async_copy.wait_group(1)              # this tile's V (the next K may still be in flight)
        gl.thread_barrier()
        acc = acc * alpha[:, None]
        for n in gl.static_range(0, BLOCK_N, CHUNK):
            acc = mma_v2(p_smem.slice(n, CHUNK, dim=1).load(dot_a), v_smem.slice(n, CHUNK, dim=0).load(dot_b), acc)
        gl.thread_barrier()                   # every warp has read V
        async_copy.async_copy_global_to_shared(
            v_smem, _tile_ptrs(v_cache_ptr, page, nxt, offs_n_ld, offs_d_ld, kv_off, stride_cb, stride_cr, PAGE),
            mask=(nxt + offs_n_ld < end)[:, None])
        async_copy.commit_group()
    async_copy.wait_group(0)

    out = acc / gl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_g_o = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, mma))
    offs_d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    heads = kv_head * GROUP + offs_g_o
    g_mask = (offs_g_o < GROUP)[:, None]
    if num_used <= 1:
        gl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d_o[None, :],
                 out.to(gl.bfloat16), mask=g_mask)
    else:
        first = (seq * num_heads + heads) * NUM_SPLITS
        gl.store(o_part_ptr + (first + split)[:, None] * HEAD_DIM + offs_d_o[None, :], out, mask=g_mask)
        gl.store(lse_part_ptr + first + split, m_i + gl.log2(l_i), mask=offs_g_o < GROUP)


def gluon_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, min_split, block_n=64):
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    o_part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _gluon_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse_part, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_SPLITS=num_splits, MIN_SPLIT=min_split, GROUP=num_heads // num_kv_heads, BLOCK_G=16,
        HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n, NUM_WARPS=4, num_warps=4)
    if num_splits > 1:
        ta._decode_merge_kernel[(num_seqs, num_heads)](
            o_part, lse_part, seq_lens, out, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            MIN_SPLIT=min_split, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, PDL=False)
    return out


def main():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
        print("vLLM not installed: FA2/FA3 left out")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    random.seed(1)
    for batch in (256, 128, 64, 16):
        lens = [random.randint(100, 2048) for _ in range(batch)]
        kv_bytes = 2 * sum(lens) * KV * D * 2
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        first_rows = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        splits = ta.decode_split_config(batch, KV, num_sms, 4096)
        row = []

        def timed(label, call, reference=None):
            err = f" (max |diff| {(call().float() - reference.float()).abs().max().item():.2g})" if reference is not None else ""
            us = us_per_call_in_graph([call] * 20)
            row.append(f"{label} {us:6.1f} us {kv_bytes / us / 1e3:5.0f} GB/s{err}")

        for page in (PAGE, 16):
            k, v, tables, seq_lens = paged(lens, num_blocks=6000 * PAGE // page, page=page)
            if page == PAGE:
                ours = ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *splits)
                timed("ours", lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *splits))
                timed("ours, unfused", lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *splits,
                                                                   fuse_merge=False), ours)
                timed("gluon", lambda: gluon_decode(q, k, v, tables, seq_lens, D ** -0.5, *splits), ours)
            for version in (2, 3) if flash_attn_varlen_func is not None else ():
                if version == 2 and page % 256:
                    continue        # FA2's paged path needs pages of a multiple of 256 tokens
                timed(f"FA{version} (pages of {page})", lambda: flash_attn_varlen_func(
                    q, k, v, max_seqlen_q=1, cu_seqlens_q=first_rows, max_seqlen_k=max(lens), seqused_k=seq_lens,
                    softmax_scale=D ** -0.5, causal=True, block_table=tables, fa_version=version),
                    ours if page == PAGE else None)
            k = v = None   # (the cache freed before the next one is made)
        print(f"{batch:3} mixed {splits}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
