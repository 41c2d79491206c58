"""Paged attention in plain torch: the CPU path, and the reference the GPU kernels are tested against.

KV cache layout, per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block block_table[t // block_size] at offset t % block_size;
its flat slot is block_id * block_size + offset.
"""
import torch
import torch.nn.functional as F


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor):
    """k, v: [num_tokens, num_kv_heads, head_dim] -> the cache slots in slot_mapping; slot -1 is skipped.
    An fp8 cache gets the values clamped to its range, then rounded to nearest."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k.shape[1:])[slots] = to_cache_dtype(k[valid], k_cache.dtype)
    v_cache.view(-1, *v.shape[1:])[slots] = to_cache_dtype(v[valid], v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    q: [num_tokens, num_heads, head_dim], the sequences' queries back to back
    (sequence i owns rows query_start_loc[i]:query_start_loc[i+1]). Sequence i has seq_lens[i]
    tokens of context, the new ones last, so its query j sits at position
    seq_lens[i] - q_len + j and sees context positions 0..that position.
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        blocks = block_tables[i, :-(-seq_len // block_size)]
        k = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)   # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
