"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed with padded inputs.

Recipe: static input buffers; a bucket list covering every batch size up to the maximum
(1, 2, 4, 8, then every multiple of 16, then the maximum itself); capture largest first into
one shared memory pool. A batch of size b replays the smallest bucket >= b; the padding rows
have slot -1 (the KV-store kernel skips them) and seq_len 0 (attention returns zeros). Before
the captures, a dry pass over the buckets compiles their Triton kernels side by side
(kernels/compile_ahead.py).

With a backend that reads shared prefixes once a run (engine/shared_prefix.py), each bucket of two
or more sequences has a second graph for the steps that have a plan: its shared-prefix kernel is
captured for the most tiles a plan of that many sequences can have, and reads how many are in use.
"""
import bisect

import numpy as np
import torch
from torch import nn

from nanovllm.engine.shared_prefix import SharedPrefixPlan, max_tiles, plan_arrays
from nanovllm.engine.upload import packed_offsets, upload, views
from nanovllm.kernels import compile_ahead
from nanovllm.layers.attention import AttentionMetadata, SharedPrefixes


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes |= set(range(16, max_batch_size + 1, 16)) | {max_batch_size}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, decode_split_for, pool=None,
                 shared_prefix_tile_seqs: int | None = None, shared_prefix_splits_for=None):
        """decode_split_for(batch_size) -> the decode kernel's split configuration for that bucket.
        pool: a graph memory pool to share (the piecewise graphs'). shared_prefix_tile_seqs: the
        sequences of a shared-prefix tile, for a backend that reads shared prefixes (None: not);
        shared_prefix_splits_for(batch_size) -> the most parts a tile's prefix is read in."""
        self.buckets = graph_buckets(max_batch_size)
        self.device = device
        self.tile_seqs = shared_prefix_tile_seqs
        n = max_batch_size
        with torch.device(device):
            # Every bucket's per-row inputs are views of one buffer, so that a step uploads them in
            # one copy (engine/upload.py), the rows of its pending tokens included.
            self.staged = torch.zeros(packed_offsets(step_arrays(n, n))[1], dtype=torch.uint8)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
            if self.tile_seqs is not None:   # a plan's arrays, staged as the rows' (zeros: no prefix, no tile)
                self.staged_plan = torch.zeros(packed_offsets(self._plan_arrays(n))[1], dtype=torch.uint8)
                self.prefix_lens, self.tiles, self.tile_count = views(self.staged_plan, self._plan_arrays(n))
        self.uploaded_tables: np.ndarray | None = None   # what block_tables holds (rows, width)
        self.inputs: dict[int, list[torch.Tensor]] = {}   # bucket -> its views of staged
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}   # (bucket, with shared prefixes)
        self.decode_split_for = decode_split_for
        self.shared_prefix_splits_for = shared_prefix_splits_for
        variants = [(bs, shared) for bs in self.buckets for shared in (False, True)
                    if not shared or (self.tile_seqs is not None and bs > 1)]
        def forwards():   # those the captures below run: their Triton kernels compiled side by side first
            for bs, shared in variants:
                model(*self._bucket_inputs(bs, shared))
        self.compile_s = compile_ahead.dry_run(forwards)   # its seconds (None: no dry pass)
        for bs, shared in reversed(variants):
            input_ids, positions, meta = self._bucket_inputs(bs, shared)
            self.inputs[bs] = [input_ids, positions, meta.slot_mapping, meta.seq_lens]
            self.hidden[:bs] = model(input_ids, positions, meta)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:bs] = model(input_ids, positions, meta)
            pool = graph.pool()
            self.graphs[bs, shared] = graph
        self.pool = pool   # (the graphs', for graphs captured after these to share)
        torch.cuda.synchronize()

    def _plan_arrays(self, n: int, plan: SharedPrefixPlan | None = None) -> list[np.ndarray]:
        """plan_arrays sized for n rows and the most tiles a plan of n sequences can have."""
        return plan_arrays(plan, n, max_tiles(n, self.tile_seqs))

    def _bucket_inputs(self, bs: int, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The bucket's views of the staged inputs, set to the padding rows' values (step_arrays)
        -> input_ids, positions, metadata (shared: with the plan's arrays)."""
        input_ids, positions, slot_mapping, seq_lens, _, _ = upload(step_arrays(bs), self.device, out=self.staged)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=seq_lens,
            query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=0,
            decode_split=self.decode_split_for(bs))
        if shared:
            tiles = max_tiles(bs, self.tile_seqs)
            meta.shared_prefixes = SharedPrefixes(self.prefix_lens[:bs], self.tiles[:tiles], self.tile_count, tiles,
                                                  self.shared_prefix_splits_for(bs))
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
            sampled: torch.Tensor | None = None, shared: SharedPrefixPlan | None = None) -> torch.Tensor:
        """One decode step for len(input_ids) sequences -> hidden states [batch_size, hidden_size].
        pending: (rows, sources): input row rows[i] takes token sampled[sources[i]] (a token the
        host has not read yet) in place of its input id. shared: the step's plan of shared prefixes."""
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
        if shared is not None:
            upload(self._plan_arrays(self.max_batch_size, shared), self.device, out=self.staged_plan)
        self.graphs[bucket, shared is not None].replay()
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
