"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed with padded inputs.

Recipe: static input buffers; a bucket list covering every batch size up to the maximum
(1, 2, 4, 8, then every multiple of 16, then the maximum itself); capture largest first into
one shared memory pool. A batch of size b replays the smallest bucket >= b; the padding rows
have slot -1 (the KV-store kernel skips them) and seq_len 0 (attention returns zeros).

A large batch can be captured as two halves on two streams (NANOVLLM_OVERLAP_MIN=<batch size>):
the halves share nothing but the weights, so while one half's attention streams the KV cache,
the other's projections and norms run on the SMs it leaves free.
"""
import bisect
import contextlib
import os

import numpy as np
import torch
from torch import nn

from nanovllm.layers.attention import AttentionMetadata


def overlap_halves(batch_size: int) -> list[tuple[int, int]]:
    """The (start, end) rows run as one stream each: two halves from NANOVLLM_OVERLAP_MIN sequences
    on (unset or 0: never), else the whole batch."""
    least = int(os.environ.get("NANOVLLM_OVERLAP_MIN", "0"))
    if least <= 0 or batch_size < max(least, 2):
        return [(0, batch_size)]
    half = batch_size // 2
    return [(0, half), (half, batch_size)]


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes |= set(range(16, max_batch_size + 1, 16)) | {max_batch_size}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, decode_split_for, overlap: bool = True):
        """decode_split_for(batch_size) -> the decode kernel's split configuration for that bucket.
        overlap: whether a large bucket may run as two halves (overlap_halves); not under tensor
        parallelism, whose all-reduces must run in one order on every rank."""
        from nanovllm.kernels import pdl
        self.buckets = graph_buckets(max_batch_size)
        self.overlap = overlap
        # (only then a stream of our own: the single-stream graphs keep the stream use they were
        # tested with, the killed-worker release of custom_all_reduce.py included)
        two = overlap and len(overlap_halves(max_batch_size)) > 1
        self.side = torch.cuda.Stream(device) if two else None
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
            self._forward(model, bs, decode_split_for)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool), pdl.decode_graph(bs):
                self._forward(model, bs, decode_split_for)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _forward(self, model: nn.Module, batch_size: int, decode_split_for):
        """The model on the first batch_size rows of the static buffers, on the current stream, or
        as two halves, the second on our side stream with arrival counters of its own."""
        from nanovllm.kernels import counters
        parts = overlap_halves(batch_size) if self.overlap else [(0, batch_size)]
        main = torch.cuda.current_stream()
        if len(parts) > 1:
            self.side.wait_stream(main)
        for i, (start, end) in enumerate(parts):
            n = end - start
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[start:end], block_tables=self.block_tables[start:end],
                query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[start:end],
                query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=0,
                decode_split=decode_split_for(n))
            with torch.cuda.stream(self.side if i else main), \
                    counters.second_set() if i else contextlib.nullcontext():
                self.hidden[start:end] = model(self.input_ids[start:end], self.positions[start:end], meta)
        if len(parts) > 1:
            main.wait_stream(self.side)

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
