"""The sampled tokens' logprobs (vLLM's raw_logprobs) from two passes over the logits, without a
[B, V] float32 log_softmax: each sampled token's logprob and rank, and each row's num_top best.

1. Stats: each program reads one chunk of a row, in the logits' own dtype, and writes its largest
   logit, its mass relative to it (sum(exp(x - max)), as softmax does online) and how many of its
   logits are above the row's sampled token's.
2. Best: a row's num_top best logits are all at or above its floor, the num_top-th largest of its
   chunks' maxima (num_top chunks hold a logit at least that large). Only chunks whose maximum
   reaches the floor read their logits again; each finds its best at or above the floor, up to
   num_top, by rounds of a max (each takes the one it found out; ties go to the lower id). On
   random logits a row's best lie in about num_top of its ~75 chunks, so most programs end early.
torch combines the chunks: the log-sum-exp from the maxima and masses, the rank from the counts
(1 + the logits above the token's), the num_top best of the chunks' candidates. The plain-torch
reference is layers/logprobs.py's `token_logprobs`: log_softmax in float32, a gather, a
comparison over the row and torch.topk, the CUDA path before perf_notes row 93.

The other logprobs modes (config.py's LOGPROBS_MODES) read the same passes differently: "*_logits"
reports the values themselves (no log-sum-exp), and "processed_*" reads each row's logits as the
sampler draws from them, those below the fused sampler's cut at -inf and the rest divided by the
row's temperature (perf_notes row 124), as layers/logprobs.py's `processed_scores` does in torch.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.triton_top_k import _from_sort_key, _sort_key

BLOCK = 2048
MAX_TOP = 64   # more of a row's best (logprobs up to -1: the whole vocabulary) go through torch.topk
GONE = tl.constexpr(-(2**63))   # the key of a logit taken, below the floor or past the vocabulary


@triton.jit
def _read(row_ptr, ids, mask, row, cuts_ptr, temperatures_ptr, PROCESSED: tl.constexpr):
    """A row's logits at ids as float32 (-inf where masked); PROCESSED: those below the row's cut at
    -inf, the rest divided by its temperature."""
    x = tl.load(row_ptr + ids, mask=mask, other=float("-inf")).to(tl.float32)
    if PROCESSED:
        x = tl.where(x >= tl.load(cuts_ptr + row), tl.math.div_rn(x, tl.load(temperatures_ptr + row)), float("-inf"))
    return x


@triton.jit
def _store_stats(x, stats_ptr, out):
    """stats[out] = (the largest of x, x's mass relative to it: sum(exp(x - largest)))."""
    largest = tl.max(x, 0)
    tl.store(stats_ptr + out * 2, largest)
    tl.store(stats_ptr + out * 2 + 1, tl.sum(tl.exp(x - tl.where(largest > float("-inf"), largest, 0.0)), 0))


@triton.jit
def _stats_kernel(logits_ptr, row_stride, token_ids_ptr, vocab_size, cuts_ptr, temperatures_ptr, stats_ptr,
                  above_ptr, chosen_ptr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """stats[row, chunk] = (largest logit, mass relative to it); above[row, chunk]: its logits
    above the sampled token's; chosen[row]: the sampled token's logit (written by chunk 0)."""
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    x = _read(row_ptr, ids, ids < vocab_size, row, cuts_ptr, temperatures_ptr, PROCESSED)
    chosen = _read(row_ptr, tl.load(token_ids_ptr + row), True, row, cuts_ptr, temperatures_ptr, PROCESSED)
    out = row * num_chunks + chunk
    _store_stats(x, stats_ptr, out)
    tl.store(above_ptr + out, tl.sum((x > chosen).to(tl.int32), 0))
    if chunk == 0:
        tl.store(chosen_ptr + row, chosen)


@triton.jit(do_not_specialize=["num_ids"])
def _ids_kernel(logits_ptr, row_stride, rows_ptr, ids_ptr, num_ids, vocab_size, cuts_ptr, temperatures_ptr,
                stats_ptr, above_ptr, values_ptr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """For rows[i] and its ids ids[i, :num_ids]: stats[i, chunk] as _stats_kernel's; above[i, chunk, j]:
    the chunk's logits above id j's; values[i, j]: id j's logit (written by chunk 0)."""
    i, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    row = tl.load(rows_ptr + i)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    x = _read(row_ptr, ids, ids < vocab_size, row, cuts_ptr, temperatures_ptr, PROCESSED)
    out = i * num_chunks + chunk
    _store_stats(x, stats_ptr, out)
    for j in range(num_ids):
        value = _read(row_ptr, tl.load(ids_ptr + i * num_ids + j), True, row, cuts_ptr, temperatures_ptr, PROCESSED)
        tl.store(above_ptr + out * num_ids + j, tl.sum((x > value).to(tl.int32), 0))
        if chunk == 0:
            tl.store(values_ptr + i * num_ids + j, value)


def _log_norms(stats: torch.Tensor) -> torch.Tensor:
    """stats: [R, chunks, 2] (_store_stats') -> [R, 1]: each row's log-sum-exp."""
    largest, mass = stats.unbind(-1)
    row_max = largest.max(1, keepdim=True).values
    return row_max + (mass * (largest - row_max).exp()).sum(1, keepdim=True).log()


@triton.jit(do_not_specialize=["num_top"])
def _best_kernel(logits_ptr, row_stride, vocab_size, num_top, cuts_ptr, temperatures_ptr, stats_ptr, floors_ptr,
                 top_values_ptr, top_ids_ptr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """top_values / top_ids[row, chunk, :]: the chunk's best logits at or above the row's floor,
    best first, as many as there are up to num_top (the rest left as they were: -inf and -1)."""
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    out = row * num_chunks + chunk
    floor = tl.load(floors_ptr + row)
    if tl.load(stats_ptr + out * 2) >= floor:
        offsets = tl.arange(0, BLOCK)
        ids = chunk * BLOCK + offsets
        x = _read(logits_ptr + row.to(tl.int64) * row_stride, ids, ids < vocab_size, row, cuts_ptr, temperatures_ptr,
                  PROCESSED)
        wanted = (ids < vocab_size) & (x >= floor)
        # A round is one max over 64-bit keys: the logit's sort key, made to order as a signed
        # integer (top bit flipped), above the offset reversed (ties to the lower id)
        ordered = _sort_key(x) ^ -2147483648
        keys = tl.where(wanted, (ordered.to(tl.int64) << 32) | (BLOCK - 1 - offsets).to(tl.int64), GONE)
        for i in range(tl.minimum(tl.sum(wanted.to(tl.int32), 0), num_top)):
            best = tl.max(keys, 0)
            tl.store(top_values_ptr + out * num_top + i, _from_sort_key((best >> 32).to(tl.int32) ^ -2147483648))
            tl.store(top_ids_ptr + out * num_top + i, chunk * BLOCK + BLOCK - 1 - (best & (BLOCK - 1)).to(tl.int32))
            keys = tl.where(keys == best, GONE, keys)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logits: bool = False,
                   cuts: torch.Tensor | None = None, temperatures: torch.Tensor | None = None):
    """logits: [B, V] (raw, or edited as the sampler drew from them), on CUDA, num_top <= MAX_TOP ->
    ([B] logprobs of token_ids, [B] their ranks, and with num_top > 0 the [B, num_top] best logprobs
    and their ids, best first), as layers/logprobs.py's token_logprobs computes them from the log_softmax.
    as_logits: the logits' values in place of logprobs. cuts and temperatures ([B] float32, both or
    neither): the logits of the processed distribution, -inf below a row's cut and divided by its
    temperature above it."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and num_top <= MAX_TOP and (cuts is None) == (temperatures is None)
    num_chunks = triton.cdiv(vocab_size, BLOCK)
    stats = torch.empty(rows, num_chunks, 2, dtype=torch.float32, device=logits.device)
    above = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)
    launch(_stats_kernel, (rows, num_chunks), logits, logits.stride(0), token_ids, vocab_size, cuts, temperatures,
           stats, above, chosen, BLOCK=BLOCK, PROCESSED=cuts is not None, num_warps=4)
    ranks = above.sum(1) + 1
    log_norm = 0.0
    if not as_logits:   # the rows' log-sum-exp, from the chunks' maxima and masses
        log_norm = _log_norms(stats)
        chosen = chosen - log_norm[:, 0]
    if num_top == 0:
        return chosen, ranks, None, None
    largest = stats[..., 0]
    floors = (largest.topk(num_top, dim=1).values[:, -1].contiguous() if num_top <= num_chunks else
              torch.full((rows,), float("-inf"), device=logits.device))
    top_values = torch.full((rows, num_chunks, num_top), float("-inf"), device=logits.device)
    top_ids = torch.full((rows, num_chunks, num_top), -1, dtype=torch.int64, device=logits.device)
    launch(_best_kernel, (rows, num_chunks), logits, logits.stride(0), vocab_size, num_top, cuts, temperatures,
           stats, floors, top_values, top_ids, BLOCK=BLOCK, PROCESSED=cuts is not None, num_warps=4)
    # The slots left empty are id -1: ranked below every logit, -inf ones included
    top_values, top_ids = top_values.view(rows, -1), top_ids.view(rows, -1)
    keys = torch.where(top_ids < 0, float("-inf"), top_values.clamp_min(torch.finfo(torch.float32).min))
    best = keys.topk(num_top, dim=1).indices
    return chosen, ranks, top_values.gather(1, best) - log_norm, top_ids.gather(1, best)


def ids_logprobs(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, as_logits: bool = False,
                 cuts: torch.Tensor | None = None, temperatures: torch.Tensor | None = None):
    """The logprobs and ranks of chosen ids (SamplingParams.logprob_token_ids), in one pass over their
    rows: logits [B, V] on CUDA, rows [L], ids [L, K] -> ([L, K] logprobs of each row's ids, [L, K]
    their ranks), as layers/logprobs.py's chosen_logprobs computes them from the log_softmax.
    as_logits, cuts and temperatures as token_logprobs' (cuts and temperatures by row of logits)."""
    vocab_size = logits.shape[1]
    (num_rows, num_ids), num_chunks = ids.shape, triton.cdiv(vocab_size, BLOCK)
    assert logits.stride(1) == 1 and ids.is_contiguous() and (cuts is None) == (temperatures is None)
    stats = torch.empty(num_rows, num_chunks, 2, dtype=torch.float32, device=logits.device)
    above = torch.empty(num_rows, num_chunks, num_ids, dtype=torch.int32, device=logits.device)
    values = torch.empty(num_rows, num_ids, dtype=torch.float32, device=logits.device)
    launch(_ids_kernel, (num_rows, num_chunks), logits, logits.stride(0), rows, ids, num_ids, vocab_size, cuts,
           temperatures, stats, above, values, BLOCK=BLOCK, PROCESSED=cuts is not None, num_warps=4)
    return (values if as_logits else values - _log_norms(stats)), above.sum(1) + 1
