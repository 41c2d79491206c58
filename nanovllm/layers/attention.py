"""Attention over the paged KV cache, the per-step metadata every attention layer reads, and
the backends that compute it: plain torch (CPU, reference), our Triton kernels, flash-attn."""
import contextlib
import functools
import importlib.util
from collections.abc import Callable
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
    seq_lens: torch.Tensor          # [num_seqs] int32; 0 for a CUDA-graph padding row
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Set when every sequence has exactly one new token: the decode kernel's (most context
    # splits, fewest tokens per split).
    decode_split: tuple[int, int] | None = None
    cu_seqlens_k: torch.Tensor | None = None   # [num_seqs + 1] int32, flash-attn only
    # A step with prompt tokens in which some sequences have one new token (decodes beside prefill
    # chunks), for a backend that sends those to its decode kernel (splits_mixed_steps).
    decodes: "MixedDecodes | None" = None
    # A decode step whose sequences come in runs that begin with the same pages, for a backend
    # that reads those once a run (supports_shared_prefixes; engine/shared_prefix.py plans them).
    shared_prefixes: "SharedPrefixes | None" = None


@dataclass
class SharedPrefixes:
    """engine/shared_prefix.py's plan on the device."""
    prefix_lens: torch.Tensor       # [num_seqs] int32: each sequence's tokens read by its run's tiles (0: none)
    tiles: torch.Tensor             # [num_tiles, 3] int32: (first sequence, sequences, shared tokens)
    tile_count: torch.Tensor        # [1] int32: the tiles in use (a CUDA graph's plan may use fewer)
    num_tiles: int
    splits: int = 1                 # the most parts a tile's prefix is read in (a program each)


@dataclass
class MixedDecodes:
    """The one-token sequences of a step that also computes prompt tokens. A prefill kernel would
    give each of them a whole query tile (64-128 rows of products for one) and read its context
    once per query head; the decode kernel reads it once per KV head, at the memory's pace."""
    # Their token rows in the batch: [n] int64, or slice(0, n) where they are its first n rows and
    # sequences (the usual case: running sequences are scheduled before new ones), which q and out
    # are sliced by; the prefill kernel is then launched from the last multiple of 4 sequences at or before n.
    rows: torch.Tensor | slice
    block_tables: torch.Tensor      # [n, max_num_blocks] int32
    seq_lens: torch.Tensor          # [n] int32
    split: tuple[int, int]          # the decode kernel's split configuration for n sequences
    max_prefill_seq_len: int        # the longest of the step's other sequences (the prefill kernel's)


class TorchBackend:
    """Plain torch, one sequence at a time: the CPU path and the reference."""
    supports_cuda_graphs = False   # loops over host-side lists
    needs_cu_seqlens_k = False
    splits_mixed_steps = False
    supports_shared_prefixes = False

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None):
        if k is not None:
            torch_attention.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return _into(out, torch_attention.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                                          meta.query_start_loc_cpu, meta.seq_lens_cpu, scale))


class TritonBackend:
    """Our Triton kernels; prefill on Hopper GPUs through the Gluon kernels where they serve the
    inputs (kernels/gluon_prefill.py: a 16-bit cache). In a step that mixes prompt chunks with
    decodes, the decodes go to the decode kernel (MixedDecodes)."""
    supports_cuda_graphs = True
    needs_cu_seqlens_k = False
    splits_mixed_steps = True
    supports_shared_prefixes = True

    def __init__(self):
        from nanovllm.kernels import triton_attention
        self.kernels = triton_attention
        try:
            from nanovllm.kernels import gluon_prefill
        except ImportError:     # a Triton without Gluon's Hopper API
            gluon_prefill = None
        self.gluon_prefill = gluon_prefill

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None):
        if k is not None:
            self.kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_split is not None:
            return self.kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                 scale, *meta.decode_split, out=out,
                                                 shared_prefixes=meta.shared_prefixes)
        prefill = self.kernels.prefill_attention
        d = meta.decodes
        if self.gluon_prefill is not None and self.gluon_prefill.supports(q, k_cache):
            longest = meta.max_seq_len if d is None else d.max_prefill_seq_len
            prefill = functools.partial(self.gluon_prefill.prefill_attention, **self.gluon_prefill.config_for(longest))
        tables, starts, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
        front = d is not None and isinstance(d.rows, slice)
        if front:
            # The decodes are the first sequences: the prefill kernel's grid covers only the others (over
            # all of them, ~700 decodes gave ~180k programs that return at once: docs/perf_notes.md row 118).
            # Cut at a multiple of 4 sequences, so that these int32 views keep the 16-byte alignment they
            # were uploaded with: Triton compiles a kernel variant per pointer alignment, which start-up
            # would not have met. The up to 3 decodes left in the grid return at once.
            first = d.rows.stop - d.rows.stop % 4
            tables, starts, lens = tables[first:], starts[first:], lens[first:]
        out = prefill(q, k_cache, v_cache, tables, starts, lens, meta.max_query_len, scale,
                      skip_decodes=d is not None, out=out)
        if d is not None:       # front: views of q and out, no gather, no scatter
            decoded = self.kernels.decode_attention(q[d.rows], k_cache, v_cache, d.block_tables, d.seq_lens,
                                                    scale, *d.split, out=out[d.rows] if front else None)
            if not front:
                out.index_copy_(0, d.rows, decoded)
        return out


class FlashAttnBackend:
    """flash-attn 2's paged kernels (they need block_size to be a multiple of 256)."""
    supports_cuda_graphs = True
    needs_cu_seqlens_k = True
    splits_mixed_steps = False     # (its varlen kernel takes one-token sequences as they are)
    supports_shared_prefixes = False

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        from nanovllm.kernels import triton_attention
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        self.store = triton_attention.store_kvcache

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None):
        if k is not None:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_split is not None:
            return _into(out, self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                                block_table=meta.block_tables, softmax_scale=scale,
                                                causal=True).squeeze(1))
        return _into(out, self.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                                      cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                                      max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                                      block_table=meta.block_tables))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """A backend's result where the caller asked for it: `out` (the caller's buffer), or where it is."""
    return result if out is None else out.copy_(result)


def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_backend(name: str, device: torch.device, block_size: int, fp8_cache: bool = False):
    """'auto': flash-attn when installed (and block_size and the cache dtype fit it), else Triton on
    CUDA, else torch."""
    if name == "auto":
        if device.type != "cuda":
            return TorchBackend()
        fits_flash_attn = has_flash_attn() and block_size % 256 == 0 and not fp8_cache
        return FlashAttnBackend() if fits_flash_attn else TritonBackend()
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'torch' or 'auto' on the CPU.")
    if name == "flash_attn":
        if not has_flash_attn():
            raise ValueError("attention_backend 'flash_attn' needs the flash-attn package "
                             "(pip install 'nanovllm[flash-attn]').")
        if block_size % 256:
            raise ValueError(f"attention_backend 'flash_attn' needs block_size to be a multiple of 256, "
                             f"got {block_size}.")
        if fp8_cache:
            raise ValueError("attention_backend 'flash_attn' does not read an fp8 KV cache; use "
                             "attention_backend 'triton' or 'auto' with kv_cache_dtype fp8.")
        return FlashAttnBackend()
    return TritonBackend() if name == "triton" else TorchBackend()


# Set while engine/piecewise_graphs.py captures a forward in pieces: cut(layer, q) stands in for
# every attention layer's computation, and the query is written into _query_buffer (see split_at_attention).
_cut: "Callable[[Attention, torch.Tensor], torch.Tensor] | None" = None
_query_buffer: torch.Tensor | None = None


@contextlib.contextmanager
def split_at_attention(cut: "Callable[[Attention, torch.Tensor], torch.Tensor]", query_buffer: torch.Tensor):
    """Inside: each attention layer's forward computes nothing and returns cut(layer, q), q being
    [num_tokens, num_heads, head_dim] with its k and v already in the cache (CUDA's fused RoPE
    kernel stores them). query_buffer: [max tokens, num_heads * head_dim], where the layers'
    callers write q (Attention.query_out), so that the cut need not copy it there."""
    global _cut, _query_buffer
    _cut, _query_buffer = cut, query_buffer
    try:
        yield
    finally:
        _cut = _query_buffer = None


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Set by the model runner before the first step: views into its KV-cache allocation,
        # and the backend that computes attention.
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TorchBackend()

    def query_out(self, num_tokens: int) -> torch.Tensor | None:
        """Where the caller should write this layer's query [num_tokens, num_heads, head_dim]: the
        static buffer of split_at_attention while a forward is cut there, else None (anywhere)."""
        if _query_buffer is None:
            return None
        return _query_buffer[:num_tokens].view(num_tokens, self.num_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], stored into
        the cache at meta.slot_mapping first; None when the caller already stored them (CUDA's
        fused RoPE kernel does). Every backend reads K/V from the cache only."""
        if _cut is not None:
            assert k is None, "a forward is cut at attention only where its k and v are already stored"
            return _cut(self, q)
        return self.backend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
