"""The sampled tokens' logprobs (vLLM's raw_logprobs) in one pass over the logits, without a
[B, V] float32 log_softmax: each sampled token's logprob and rank, and each row's num_top best.

Each program reads one chunk of a row, in the logits' own dtype, and writes
- its largest logit and its mass relative to it, sum(exp(x - max)), as softmax does online;
- how many of its logits are above the row's sampled token's logit;
- its num_top largest logits and their ids, found by num_top rounds of a max (each round takes
  the one it found out; ties go to the lower id).
torch then combines a row's chunks: the log-sum-exp from the maxima and masses, the rank from
the counts (1 + the logits above the token's), the num_top best of the chunks' candidates. The
plain-torch reference is layers/sampler.py's `token_logprobs`: log_softmax in float32, a gather,
a comparison over the row and torch.topk, which was the CUDA path before (perf_notes row 93).
"""
import torch
import triton
import triton.language as tl

BLOCK = 2048
MAX_TOP = 64   # more of a row's best (logprobs up to -1: the whole vocabulary) go through torch.topk


@triton.jit(do_not_specialize=["num_top"])
def _chunk_kernel(logits_ptr, row_stride, token_ids_ptr, vocab_size, num_top,
                  stats_ptr, above_ptr, top_values_ptr, top_ids_ptr, BLOCK: tl.constexpr):
    """stats[row, chunk] = (largest logit, mass relative to it); above[row, chunk]: logits above
    the sampled token's; top_values / top_ids[row, chunk, :num_top]: the chunk's best, best first
    (-inf and id -1 past its last logit)."""
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offsets = tl.arange(0, BLOCK)
    ids = chunk * BLOCK + offsets
    x = tl.load(row_ptr + ids, mask=ids < vocab_size, other=float("-inf")).to(tl.float32)
    chosen = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    largest = tl.max(x, 0)
    mass = tl.sum(tl.exp(x - tl.where(largest > float("-inf"), largest, 0.0)), 0)
    out = row * num_chunks + chunk
    tl.store(stats_ptr + out * 2, largest)
    tl.store(stats_ptr + out * 2 + 1, mass)
    tl.store(above_ptr + out, tl.sum((x > chosen).to(tl.int32), 0))
    # A round is one max over 64-bit keys: the logit's bits ordered as signed integers (negative
    # floats' magnitude bits flipped) above the offset reversed (ties to the lower id); taken
    # ones, and those past the vocabulary, the smallest key.
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - offsets).to(tl.int64)
    gone = tl.full((BLOCK,), -(2**63), tl.int64)
    keys = tl.where(ids < vocab_size, keys, gone)
    for i in range(num_top):
        best = tl.max(keys, 0)
        found = best != -(2**63)
        best_bits = (best >> 32).to(tl.int32)
        value = (best_bits ^ ((best_bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        at = BLOCK - 1 - (best & (BLOCK - 1)).to(tl.int32)
        tl.store(top_values_ptr + out * num_top + i, tl.where(found, value, float("-inf")))
        tl.store(top_ids_ptr + out * num_top + i, tl.where(found, chunk * BLOCK + at, -1))
        keys = tl.where(keys == best, gone, keys)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """logits: [B, V] raw, on CUDA, num_top <= MAX_TOP -> ([B] logprobs of token_ids, [B] their
    ranks, and with num_top > 0 the [B, num_top] best logprobs and their ids, best first), as
    sampler.token_logprobs computes them from the log_softmax."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and num_top <= MAX_TOP
    num_chunks = triton.cdiv(vocab_size, BLOCK)
    stats = torch.empty(rows, num_chunks, 2, dtype=torch.float32, device=logits.device)
    above = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    top_values = torch.empty(rows, num_chunks, num_top, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty(rows, num_chunks, num_top, dtype=torch.int64, device=logits.device)
    _chunk_kernel[(rows, num_chunks)](logits, logits.stride(0), token_ids, vocab_size, num_top,
                                      stats, above, top_values, top_ids, BLOCK=BLOCK, num_warps=4)
    largest, mass = stats.unbind(-1)
    row_max = largest.max(1, keepdim=True).values
    log_mass = (mass * (largest - row_max).exp()).sum(1, keepdim=True).log()
    logprobs = (logits.gather(1, token_ids[:, None]).float() - row_max - log_mass).squeeze(1)
    ranks = above.sum(1) + 1
    if num_top == 0:
        return logprobs, ranks, None, None
    # Past a chunk's last logit the candidates are id -1: ranked below every logit, -inf ones included
    top_values, top_ids = top_values.view(rows, -1), top_ids.view(rows, -1)
    keys = torch.where(top_ids < 0, float("-inf"), top_values.clamp_min(torch.finfo(torch.float32).min))
    best = keys.topk(num_top, dim=1).indices
    return logprobs, ranks, top_values.gather(1, best) - row_max - log_mass, top_ids.gather(1, best)
