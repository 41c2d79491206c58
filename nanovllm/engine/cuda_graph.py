"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed with padded inputs.

Recipe: static input buffers; a bucket list covering every batch size up to the maximum
(1, 2, 4, 8, then every multiple of 16, then the maximum itself); capture largest first into
one shared memory pool. A batch of size b replays the smallest bucket >= b; the padding rows
have slot -1 (the KV-store kernel skips them) and seq_len 0 (attention returns zeros).
"""
import bisect

import numpy as np
import torch
from torch import nn

from nanovllm.layers.attention import AttentionMetadata


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes |= set(range(16, max_batch_size + 1, 16)) | {max_batch_size}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, decode_split_for):
        """decode_split_for(batch_size) -> the decode kernel's split configuration for that bucket."""
        from nanovllm.kernels import pdl
        self.buckets = graph_buckets(max_batch_size)
        n = max_batch_size
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(n, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.buckets):
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
                query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=0,
                decode_split=decode_split_for(bs))
            self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool), pdl.decode_graph(bs):
                self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def reset(self):
        """Destroy the graphs (a graph still running is freed when it ends)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_tables: np.ndarray,
            patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step for len(input_ids) sequences -> hidden states [batch_size, hidden_size].
        patch: (rows, token ids on the device) overriding input_ids (tokens the host has not read)."""
        bs = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        width = block_tables.shape[1]
        self.input_ids[:bs].copy_(pinned(input_ids), non_blocking=True)
        self.positions[:bs].copy_(pinned(positions), non_blocking=True)
        self.slot_mapping[:bs].copy_(pinned(slot_mapping), non_blocking=True)
        self.seq_lens[:bs].copy_(pinned(seq_lens), non_blocking=True)
        self.block_tables[:bs, :width].copy_(pinned(block_tables), non_blocking=True)
        if patch is not None:
            self.input_ids[patch[0]] = patch[1]
        self.slot_mapping[bs:bucket].fill_(-1)
        self.seq_lens[bs:bucket].fill_(0)
        self.graphs[bucket].replay()
        return self.hidden[:bs]


def pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory()
