"""CUDA graphs of the steps that the decode graphs do not take, in pieces between attention layers.

A step with prompt tokens cannot replay a decode graph: its attention depends on how its tokens
fall into sequences, which no graph fixes ahead. Run eagerly, its forward launches ~300 kernels
from Python, ~25-30 ms of host work on the H200's host whatever the step's size, where the GPU
needs ~12 ms for the step that follows every finished request once more requests wait than
max_num_seqs admits (a few hundred decodes and one new prompt; docs/perf_notes.md row 90).

So the forward is also captured in pieces, as vLLM does: from one attention layer's query to the
next one's (o_proj, the norms, the MLP, the next qkv_proj with its q/k norm, RoPE and KV store),
one graph per piece and token-count bucket. The attention layers run eagerly between the pieces,
on the step's real rows and metadata; a piece hands its query over in a static buffer and takes
the attention's output from another. The cut is made while capturing: the model's forward runs
once per bucket, and each attention layer ends the graph being captured and begins the next one
(layers/attention.py's split_at_attention). A step of T tokens replays the smallest bucket >= T;
its padding rows have slot -1 (the KV-store kernel skips them) and no attention reads them.
"""
import bisect

import torch
from torch import nn

from nanovllm.layers.attention import Attention, AttentionMetadata, split_at_attention

# vLLM's step size on a large GPU (max_num_batched_tokens 16,384). Steps above 8,192 tokens once ran
# eagerly, their GPU work (~40 ms at 16k tokens on the H200) outlasting the launches; but a step
# that also scores its prompt tokens (prompt_logprobs) has more host work and was host-bound there
# (docs/perf_notes.md row 106).
MAX_TOKENS = 16384


def piecewise_buckets(max_tokens: int) -> list[int]:
    """16 to 256 tokens by powers of two, then steps of 128 up to 1,024, 256 up to 2,048, 512 up to
    4,096, 1,024 up to 8,192 and 2,048 up to 16,384 (a step above 512 tokens padded by at most a
    quarter, where the products begin to cost by the row), cut at max_tokens, which is always the last."""
    sizes = [16, 32, 64, 128, 256]
    for step, top in ((128, 1024), (256, 2048), (512, 4096), (1024, 8192), (2048, MAX_TOKENS)):
        sizes += range(sizes[-1] + step, top + 1, step)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class PiecewiseGraphs:
    def __init__(self, model: nn.Module, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, pool=None):
        """max_tokens: the largest step (<= MAX_TOKENS); pool: a graph memory pool to share (the
        decode graphs', captured after these)."""
        self.buckets = piecewise_buckets(max_tokens)
        n = self.buckets[-1]
        first = next(m for m in model.modules() if isinstance(m, Attention))
        q_width = first.num_heads * first.head_dim
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.q = torch.zeros(n, q_width, dtype=dtype)       # a piece's query for the attention after it
            self.o = torch.zeros(n, q_width, dtype=dtype)       # that attention's output for the next piece
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
        self.layers: list[Attention] = []   # the attention layers, in the order the forward meets them
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self._recording = False
        self.replays = 0   # steps run through the pieces
        stream = torch.cuda.Stream(device)
        for tokens in reversed(self.buckets):
            ids, positions = self.input_ids[:tokens], self.positions[:tokens]
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:tokens], block_tables=torch.zeros(0, 0), query_start_loc=None,
                seq_lens=None, query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=0, max_seq_len=0)
            with split_at_attention(self._cut, self.q):
                self._recording = not self.pieces
                self.hidden[:tokens] = model(ids, positions, meta)     # warm-up, eager
                self._recording = False
                torch.cuda.synchronize(device)
                self._capturing = graphs = [torch.cuda.CUDAGraph()]
                with torch.cuda.stream(stream):
                    graphs[0].capture_begin(self.pool)
                    self.hidden[:tokens] = model(ids, positions, meta)
                    graphs[-1].capture_end()
                torch.cuda.current_stream(device).wait_stream(stream)
                self._capturing = None
            assert len(graphs) == len(self.layers) + 1
            self.pieces[tokens] = graphs
        torch.cuda.synchronize(device)

    def _cut(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        """An attention layer met in the forward: its query into self.q (where the fused RoPE kernel
        has written it: Attention.query_out) and, while capturing, the piece's graph ended and the
        next one begun -> the attention's output as the next piece will read it, a view of self.o."""
        tokens = len(q)
        if self._recording:
            self.layers.append(layer)
        if q.data_ptr() != self.q.data_ptr():
            self.q[:tokens].copy_(q.flatten(1))
        if self._capturing is not None:
            self._capturing[-1].capture_end()
            self._capturing.append(torch.cuda.CUDAGraph())
            self._capturing[-1].capture_begin(self.pool)
        return self.o[:tokens].view_as(q)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of a step of len(input_ids) <= max_tokens tokens (its inputs on the device, as
        the eager forward takes them) -> hidden states [num_tokens, hidden_size], in a buffer that
        the next run overwrites."""
        tokens = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, tokens)]
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        self.slot_mapping[tokens:bucket].fill_(-1)
        layer = self.layers[0]
        q = self.q[:tokens].view(tokens, layer.num_heads, layer.head_dim)
        o = self.o[:tokens].view_as(q)
        first, *rest = self.pieces[bucket]
        first.replay()
        for layer, piece in zip(self.layers, rest):
            layer.backend(q, None, None, layer.k_cache, layer.v_cache, meta, layer.scale, out=o)
            piece.replay()
        self.replays += 1
        return self.hidden[:tokens]
