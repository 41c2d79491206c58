"""Sampling in one pass over the logits, in Triton: temperature, noise and argmax fused.

Sampling from softmax(logits / T) is the Gumbel-max trick: argmax(logits / T + g) with
g = -log(-log(u)), u ~ U(0, 1), the same race as the torch sampler's argmax(probs / q),
q ~ Exponential(1) (-log q is the Gumbel noise), without forming probabilities. The torch
version makes ~10 float32 passes over [batch, vocab]; this kernel reads the logits once, in
their own dtype. Greedy rows skip the noise and return exactly torch's argmax (first index
of the maximum). The noise of row r is philox(seeds[r], token id): a seeded request gets the
same noise whatever batch it is in. The plain-torch reference is layers/sampler.py's path.
"""
import torch
import triton
import triton.language as tl

CHUNK = 8192    # vocab entries per program: ~19 programs per row for a 152k vocab


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temps_ptr, greedy_ptr, seeds_ptr, best_val_ptr, best_idx_ptr,
                          vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    sample = tl.load(greedy_ptr + row) == 0
    inv_temp = 1.0 / tl.load(temps_ptr + row)
    seed = tl.load(seeds_ptr + row)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if sample:
            u = tl.maximum(tl.rand(seed, offs), 1e-20)
            x = x * inv_temp - tl.log(-tl.log(u))
        better = x > best_val            # strict: each lane keeps its earliest maximum
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, 0)
    top_idx = tl.min(tl.where(best_val == top, best_idx, vocab_size), 0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, top_idx)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, is_greedy: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float32; is_greedy: [B] bool;
    seeds: [B] int64 -> sampled token ids [B] int64."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    best_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(batch, num_chunks)](
        logits, logits.stride(0), temperatures, is_greedy, seeds, best_val, best_idx, vocab_size, num_chunks,
        CHUNK=CHUNK, BLOCK=1024, num_warps=4)
    winner = best_val.argmax(-1, keepdim=True)           # first chunk among ties: the smallest id
    return best_idx.gather(-1, winner).squeeze(-1).long()
