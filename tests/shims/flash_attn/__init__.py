"""flash-attn 2's two paged-attention functions, built on the FlashAttention kernels that vLLM
ships (`vllm.vllm_flash_attn`), so that the engine's flash_attn backend can run its GPU tests and
benchmarks on a machine where the flash-attn package itself cannot be installed.

vLLM's build has only the variable-length function; it takes the keys' lengths per sequence
(`seqused_k`) where flash-attn takes their offsets (`cu_seqlens_k`) for a paged cache, and the
decode function is the variable-length one with one query token a sequence.

Usage (on the GPU machine, with vLLM installed): put tests/shims on PYTHONPATH; "auto" then picks
the flash_attn backend. FLASH_ATTN_SHIM_VERSION picks the kernels: 2 (the default, what the
flash-attn package is) or 3 (FlashAttention 3, Hopper).
"""
import os

import torch
from vllm.vllm_flash_attn import flash_attn_varlen_func as _varlen

FA_VERSION = int(os.environ.get("FLASH_ATTN_SHIM_VERSION", "2"))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, block_table=None):
    paged = block_table is not None
    return _varlen(q, k, v, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q, max_seqlen_k=max_seqlen_k,
                   cu_seqlens_k=None if paged else cu_seqlens_k,
                   seqused_k=cu_seqlens_k.diff() if paged else None,
                   softmax_scale=softmax_scale, causal=causal, block_table=block_table, fa_version=FA_VERSION)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False):
    """q: [batch, new tokens, heads, head_dim] against a paged cache that already holds them."""
    batch, new = q.shape[:2]
    cu_seqlens_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=q.device)
    out = _varlen(q.flatten(0, 1), k_cache, v_cache, max_seqlen_q=new, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_k=block_table.shape[1] * k_cache.shape[1], seqused_k=cache_seqlens,
                  softmax_scale=softmax_scale, causal=causal, block_table=block_table, fa_version=FA_VERSION)
    return out.unflatten(0, (batch, new))
