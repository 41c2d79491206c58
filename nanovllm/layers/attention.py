"""Attention over the paged KV cache, and the per-step metadata every attention layer reads."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels import torch_attention


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to. Built once per step by the model runner.

    The batch is the scheduled sequences' new tokens back to back: sequence i owns token rows
    query_start_loc[i]:query_start_loc[i+1] and, after this step, has seq_lens[i] tokens of KV.
    """
    slot_mapping: torch.Tensor      # [num_tokens] int64, cache slot of each new token; -1: padding
    block_tables: torch.Tensor      # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Views into the model runner's KV-cache allocation, set by it before the first step.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        torch_attention.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return torch_attention.paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc_cpu,
            meta.seq_lens_cpu, self.scale)
