"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed with padded inputs.

Recipe: static input buffers; a bucket list covering every batch size up to the maximum
(1, 2, 4, 8, then every multiple of 16, then the maximum itself); capture largest first into
one shared memory pool. A batch of size b replays the smallest bucket >= b; the padding rows
have slot -1 (the KV-store kernel skips them) and seq_len 0 (attention returns zeros). Before
the captures, a dry pass over the buckets compiles their Triton kernels side by side
(kernels/compile_ahead.py).
"""
import bisect

import numpy as np
import torch
from torch import nn

from nanovllm.engine.upload import packed_offsets, upload
from nanovllm.kernels import compile_ahead
from nanovllm.layers.attention import AttentionMetadata


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes |= set(range(16, max_batch_size + 1, 16)) | {max_batch_size}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, decode_split_for, pool=None):
        """decode_split_for(batch_size) -> the decode kernel's split configuration for that bucket.
        pool: a graph memory pool to share (the piecewise graphs')."""
        self.buckets = graph_buckets(max_batch_size)
        self.device = device
        n = max_batch_size
        with torch.device(device):
            # Every bucket's per-row inputs are views of one buffer, so that a step uploads them in
            # one copy (engine/upload.py), the rows of its pending tokens included.
            self.staged = torch.zeros(packed_offsets(step_arrays(n, n))[1], dtype=torch.uint8)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
        self.uploaded_tables: np.ndarray | None = None   # what block_tables holds (rows, width)
        self.inputs: dict[int, list[torch.Tensor]] = {}   # bucket -> its views of staged
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.decode_split_for = decode_split_for
        def forwards():   # those the captures below run: their Triton kernels compiled side by side first
            for bs in self.buckets:
                model(*self._bucket_inputs(bs))
        self.compile_s = compile_ahead.dry_run(forwards)   # its seconds (None: no dry pass)
        for bs in reversed(self.buckets):
            input_ids, positions, meta = self._bucket_inputs(bs)
            self.inputs[bs] = [input_ids, positions, meta.slot_mapping, meta.seq_lens]
            self.hidden[:bs] = model(input_ids, positions, meta)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:bs] = model(input_ids, positions, meta)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _bucket_inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The bucket's views of the staged inputs, set to the padding rows' values (step_arrays)
        -> input_ids, positions, metadata."""
        input_ids, positions, slot_mapping, seq_lens, _, _ = upload(step_arrays(bs), self.device, out=self.staged)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=seq_lens,
            query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=0,
            decode_split=self.decode_split_for(bs))
        return input_ids, positions, meta

    def reset(self):
        """Destroy the graphs (a graph still running is freed when it ends)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_tables: np.ndarray, pending: tuple[list[int], list[int]] | None = None,
            sampled: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for len(input_ids) sequences -> hidden states [batch_size, hidden_size].
        pending: (rows, sources): input row rows[i] takes token sampled[sources[i]] (a token the
        host has not read yet) in place of its input id."""
        bs = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        rows, sources = pending or ([], [])
        arrays = step_arrays(bucket, len(rows))
        for array, values in zip(arrays, (input_ids, positions, slot_mapping, seq_lens, rows, sources)):
            array[:len(values)] = values
        *_, rows, sources = upload(arrays, self.device, out=self.staged)
        if pending:
            self.inputs[bucket][0].index_put_((rows,), sampled[sources])
        self._upload_tables(block_tables)
        self.graphs[bucket].replay()
        return self.hidden[:bs]

    def _upload_tables(self, block_tables: np.ndarray):
        """Copy the rows' block tables unless block_tables already holds them (at small batches
        they change once in block_size steps)."""
        if self.uploaded_tables is not None and np.array_equal(block_tables, self.uploaded_tables):
            return
        rows, width = block_tables.shape
        self.block_tables[:rows, :width].copy_(torch.from_numpy(block_tables).pin_memory(), non_blocking=True)
        self.uploaded_tables = block_tables.copy()


def step_arrays(bucket: int, num_pending: int = 0) -> list[np.ndarray]:
    """A decode step's host arrays for a bucket, set to its padding rows' values (slot -1, which
    the KV-store kernel skips; seq_len 0, which attention reads nothing for): input_ids, positions,
    slot_mapping, seq_lens, then the rows and sources of num_pending pending tokens."""
    return [np.zeros(bucket, np.int64), np.zeros(bucket, np.int64), np.full(bucket, -1, np.int64),
            np.zeros(bucket, np.int32), np.zeros(num_pending, np.int64), np.zeros(num_pending, np.int64)]
