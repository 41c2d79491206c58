"""Sampling in one pass over the logits, in Triton: temperature, noise and argmax fused.

Sampling from softmax(logits / T) is the Gumbel-max trick: argmax(logits / T + g) with
g = -log(-log(u)), u ~ U(0, 1), the same race as the torch sampler's argmax(probs / q),
q ~ Exponential(1) (-log q is the Gumbel noise), without forming probabilities. The torch
version makes ~10 float32 passes over [batch, vocab]; this kernel reads the logits once, in
their own dtype; each philox call yields four of the uniforms (philox is most of the kernel's
arithmetic). Greedy rows skip the noise and return exactly torch's argmax (first index of the
maximum). Row r's noise is a function of (seeds[r], token id) alone: a seeded request gets the
same noise whatever batch it is in. The plain-torch reference is layers/sampler.py's path.
"""
import torch
import triton
import triton.language as tl

CHUNK = 8192    # vocab entries per program: ~19 programs per row for a 152k vocab


@triton.jit
def _load(logits_ptr, offs, vocab_size):
    return tl.load(logits_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)


@triton.jit
def _group_reaches(logits_ptr, offs, vocab_size, cut, QUARTER: tl.constexpr):
    """Whether any of the 4 * QUARTER logits from offs[0] on reaches the cut."""
    x = tl.maximum(tl.maximum(_load(logits_ptr, offs, vocab_size), _load(logits_ptr, offs + QUARTER, vocab_size)),
                   tl.maximum(_load(logits_ptr, offs + 2 * QUARTER, vocab_size),
                              _load(logits_ptr, offs + 3 * QUARTER, vocab_size)))
    return tl.max(x, 0) >= cut


@triton.jit
def _noisy(x, inv_temp, u, cut):
    """x / T plus Gumbel noise where x reaches the cut, else -inf (never drawn)."""
    return tl.where(x >= cut, x * inv_temp - tl.log(-tl.log(tl.maximum(u, 1e-20))), float("-inf"))


@triton.jit
def _keep_best(best_val, best_idx, x, offs):
    better = x > best_val            # strict: each lane keeps its earliest maximum
    return tl.where(better, x, best_val), tl.where(better, offs, best_idx)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temps_ptr, greedy_ptr, seeds_ptr, cut_ptr, best_val_ptr,
                          best_idx_ptr, vocab_size, num_chunks, HAS_CUT: tl.constexpr, CHUNK: tl.constexpr,
                          QUARTER: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row * stride
    inv_temp = 1.0 / tl.load(temps_ptr + row)
    seed = tl.load(seeds_ptr + row)
    cut = tl.load(cut_ptr + row) if HAS_CUT else float("-inf")
    best_val = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_idx = tl.zeros((QUARTER,), tl.int32)
    if tl.load(greedy_ptr + row) != 0:
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, QUARTER):
            offs = start + tl.arange(0, QUARTER)
            best_val, best_idx = _keep_best(best_val, best_idx, _load(row_ptr, offs, vocab_size), offs)
    else:
        # One philox call gives four uniforms: tokens start + i + {0, 1, 2, 3} * QUARTER.
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * QUARTER):
            offs = start + tl.arange(0, QUARTER)
            # With a cut (top-k/top-p) nearly every group of 4 * QUARTER logits lies below it and has
            # no token to draw: no noise for those. Noise depends on (seed, token id) alone, so the
            # groups left out change no draw.
            if not HAS_CUT or _group_reaches(row_ptr, offs, vocab_size, cut, QUARTER):
                u0, u1, u2, u3 = tl.rand4x(seed, offs)
                best_val, best_idx = _keep_best(best_val, best_idx, _noisy(
                    _load(row_ptr, offs, vocab_size), inv_temp, u0, cut), offs)
                best_val, best_idx = _keep_best(best_val, best_idx, _noisy(
                    _load(row_ptr, offs + QUARTER, vocab_size), inv_temp, u1, cut), offs + QUARTER)
                best_val, best_idx = _keep_best(best_val, best_idx, _noisy(
                    _load(row_ptr, offs + 2 * QUARTER, vocab_size), inv_temp, u2, cut), offs + 2 * QUARTER)
                best_val, best_idx = _keep_best(best_val, best_idx, _noisy(
                    _load(row_ptr, offs + 3 * QUARTER, vocab_size), inv_temp, u3, cut), offs + 3 * QUARTER)
    top = tl.max(best_val, 0)
    top_idx = tl.min(tl.where(best_val == top, best_idx, vocab_size), 0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, top_idx)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, is_greedy: torch.Tensor,
                  seeds: torch.Tensor, cut: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float32; is_greedy: [B] bool;
    seeds: [B] int64; cut: [B] float32 or None, a sampled row's logits below its cut are never
    drawn (top-k/top-p as one value per row) -> sampled token ids [B] int64."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    best_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(batch, num_chunks)](
        logits, logits.stride(0), temperatures, is_greedy, seeds, cut if cut is not None else temperatures,
        best_val, best_idx, vocab_size, num_chunks, HAS_CUT=cut is not None, CHUNK=CHUNK, QUARTER=256, num_warps=4)
    winner = best_val.argmax(-1, keepdim=True)           # first chunk among ties: the smallest id
    return best_idx.gather(-1, winner).squeeze(-1).long()
