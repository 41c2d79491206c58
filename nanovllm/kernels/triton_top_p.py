"""Each row's top-p cut in Triton for rows without a top_k: a radix select on probability mass,
so that top-p alone (vLLM's own example: temperature 0.8, top_p 0.95) sorts no vocabulary.

The cut is the row's largest logit c whose tokens at or above it hold at least top_p of the
row's probability (softmax at the row's temperature). Those are exactly the tokens that top-p
keeps when it walks the tokens from the most likely on and stops once the tokens before it hold
top_p (ties with the last kept token included), as layers/sampling_filters.py's `top_k_top_p_cut`, the
plain-torch reference, does with a full sort.

1. Stats: each chunk of a row finds its largest logit and its mass relative to it (online, as
   softmax does); from these every later program gets the row's maximum M and total mass Z.
2. Candidates: the logits whose probability is at least (1 - top_p) / (2 V); all the others
   together hold less than (1 - top_p) / 2 of the mass, so the cut lies above them. Each chunk
   copies its candidates in their order (no atomics) and counts them. How many there are
   depends on the distribution: few for a peaked row, all of a flat one.
3. Radix select on mass over the candidates. Keys as in triton_top_k.py: a float's bits,
   reordered so that they compare as unsigned integers the way the floats do. Pass p adds up
   the candidates' unnormalised probabilities, exp2((x - M) * log2(e) / T), per value of the
   next 4-bit digit of the keys that match the digits chosen so far; the digit chosen is the
   highest whose mass, with the mass of every key above it, reaches top_p * Z. Four passes
   choose a 16-bit logit's key, eight a float32 one's.
With min-p in the row (vLLM applies it first), top-p's mass is that of the tokens min-p keeps,
p >= min_p * p_max: step 2 also adds up their mass, and takes as candidates those of them whose
probability is at least (1 - top_p) / (2 V) of the most likely token's (the kept mass is at least
that token's, so the others again hold less than (1 - top_p) / 2 of it).
Every pass's chunks write their partial results apart, and each program of the next pass adds
them up in the same order, so the cut is deterministic (atomic float sums would not be). With
16 digit values a candidate costs ~90 instructions a pass (from the H200 timings): bound by
arithmetic, which is why the passes run over the candidates only. bench_sampler.py: at 256 rows
of 151,936 bf16 logits (x 4, T 0.6) 178 us against 4.2 ms for the sort; a flat row, every logit
a candidate, 668 us.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.triton_top_k import _from_key_prefix, _load_chunk, _sort_key

BLOCK = 512            # candidates per load: a [16, BLOCK] float32 accumulator, 64 values a thread at 4 warps
PROGRAMS_WANTED = 528  # ~4 per SM of an H100/H200
CHUNK_TILE = tl.constexpr(64)   # chunks' partial results added up per step
DIGIT_BITS = tl.constexpr(4)
NUM_BINS = tl.constexpr(16)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_stats(stats_ptr, row, num_chunks, scale):
    """-> (the row's largest logit, its total mass relative to it), from the chunks' maxima and
    masses relative to them, stats[row, chunk, (max, mass)], in the same order in every program."""
    base = stats_ptr + row * num_chunks * 2
    best = tl.full((CHUNK_TILE,), float("-inf"), tl.float32)
    for first in range(0, num_chunks, CHUNK_TILE):
        chunks = first + tl.arange(0, CHUNK_TILE)
        best = tl.maximum(best, tl.load(base + chunks * 2, mask=chunks < num_chunks, other=float("-inf")))
    row_max = tl.max(best, 0)
    total = tl.zeros((CHUNK_TILE,), tl.float32)
    for first in range(0, num_chunks, CHUNK_TILE):
        chunks = first + tl.arange(0, CHUNK_TILE)
        m = tl.load(base + chunks * 2, mask=chunks < num_chunks, other=float("-inf"))
        mass = tl.load(base + chunks * 2 + 1, mask=chunks < num_chunks, other=0.0)
        total += tl.where(m > float("-inf"), mass * tl.exp2((m - row_max) * scale), 0.0)
    return row_max, tl.sum(total, 0)


@triton.jit
def _kept_mass(stats_ptr, kept_ptr, min_p_ptr, row, num_chunks, scale):
    """-> (the row's largest logit, the mass top-p takes its share of, relative to it): the row's
    total, or with min-p the mass of the tokens min-p keeps (kept[row, chunk], added up in order)."""
    row_max, total = _row_stats(stats_ptr, row, num_chunks, scale)
    if tl.load(min_p_ptr + row) > 0.0:
        kept = tl.zeros((CHUNK_TILE,), tl.float32)
        for first in range(0, num_chunks, CHUNK_TILE):
            chunks = first + tl.arange(0, CHUNK_TILE)
            kept += tl.load(kept_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0)
        total = tl.sum(kept, 0)
    return row_max, total


@triton.jit
def _chosen_digits(masses_ptr, row, num_rows, num_chunks, target, PASSES: tl.constexpr):
    """The key prefix chosen by passes 0..PASSES-1, from their masses [pass, row, chunk, digit]
    (each pass's chunks added up in the same order by every program); target: top_p of the
    row's total mass."""
    bins = tl.arange(0, NUM_BINS)
    prefix = tl.zeros((), tl.int32)
    above = tl.zeros((), tl.float32)      # mass of the keys above those matching the prefix
    for p in tl.static_range(PASSES):
        sums = tl.zeros((CHUNK_TILE, NUM_BINS), tl.float32)
        for first in range(0, num_chunks, CHUNK_TILE):
            chunks = first + tl.arange(0, CHUNK_TILE)
            offs = ((p * num_rows + row) * num_chunks + chunks)[:, None] * NUM_BINS + bins[None, :]
            sums += tl.load(masses_ptr + offs, mask=(chunks < num_chunks)[:, None], other=0.0)
        masses = tl.sum(sums, 0)
        at_or_above = above + tl.sum(masses, 0) - tl.cumsum(masses, 0) + masses    # keys with digit >= d
        # the highest digit that reaches the target; none (a rounding shortfall): the lowest, so
        # that everything matching the prefix is kept
        digit = tl.maximum(tl.sum((at_or_above >= target).to(tl.int32), 0) - 1, 0)
        above += tl.sum(tl.where(bins > digit, masses, 0.0), 0)
        prefix |= digit << (32 - DIGIT_BITS * (p + 1))
    return prefix


@triton.jit
def _stats_kernel(logits_ptr, stride, top_p_ptr, temps_ptr, stats_ptr, vocab_size, chunk_size, BLOCK: tl.constexpr):
    """Each chunk's largest logit and its mass relative to it (online, as softmax), into stats."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    if tl.load(top_p_ptr + row) < 1.0:
        scale = LOG2E / tl.load(temps_ptr + row)
        first = chunk * chunk_size
        end = tl.minimum(first + chunk_size, vocab_size)
        m = tl.full((), float("-inf"), tl.float32)
        mass = tl.zeros((), tl.float32)
        for start in range(first, end, BLOCK):
            x = _load_chunk(logits_ptr + row * stride, start, end, BLOCK)[1]
            new_max = tl.maximum(m, tl.max(x, 0))
            if new_max > float("-inf"):
                mass = mass * tl.exp2((m - new_max) * scale) + tl.sum(tl.exp2((x - new_max) * scale), 0)
                m = new_max
        tl.store(stats_ptr + (row * tl.num_programs(1) + chunk) * 2 + tl.arange(0, 2),
                 tl.where(tl.arange(0, 2) == 0, m, mass))


@triton.jit
def _gather_kernel(logits_ptr, stride, top_p_ptr, temps_ptr, min_p_ptr, stats_ptr, cand_ptr, count_ptr, kept_ptr,
                   vocab_size, chunk_size, BLOCK: tl.constexpr):
    """A chunk's candidates, in their order, to the same place in cand's row, and their count:
    the logits whose probability is at least (1 - top_p) / (2 V) of the row's mass. All of the
    others together hold less than (1 - top_p) / 2 of it, so the cut lies above them. With
    min-p: those that min-p keeps, at least (1 - top_p) / (2 V) of the most likely one's, and
    the mass of all that min-p keeps into kept."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    top_p, min_p = tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
    if top_p < 1.0:
        scale = LOG2E / tl.load(temps_ptr + row)
        row_max, total = _row_stats(stats_ptr, row, tl.num_programs(1), scale)
        min_p_floor = row_max + tl.log2(min_p) / scale
        floor = row_max + tl.log2(0.5 * (1.0 - top_p) * tl.where(min_p > 0.0, 1.0, total) / vocab_size) / scale
        floor = tl.maximum(floor, min_p_floor)
        first = chunk * chunk_size
        end = tl.minimum(first + chunk_size, vocab_size)
        count = tl.zeros((), tl.int32)
        kept = tl.zeros((), tl.float32)
        for start in range(first, end, BLOCK):
            offs, x = _load_chunk(logits_ptr + row * stride, start, end, BLOCK)
            keep = (x >= floor) & (offs < end)
            slot = first + count + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(cand_ptr + row * vocab_size + slot, x.to(cand_ptr.dtype.element_ty), mask=keep)
            count += tl.sum(keep.to(tl.int32), 0)
            if min_p > 0.0:
                kept += tl.sum(tl.where(x >= min_p_floor, tl.exp2((x - row_max) * scale), 0.0), 0)
        tl.store(count_ptr + row * tl.num_programs(1) + chunk, count)
        tl.store(kept_ptr + row * tl.num_programs(1) + chunk, kept)


@triton.jit
def _mass_kernel(cand_ptr, count_ptr, top_p_ptr, temps_ptr, min_p_ptr, stats_ptr, kept_ptr, masses_ptr, vocab_size,
                 chunk_size, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass PASS over one chunk's candidates: the mass of those whose keys match the digits
    chosen so far, by their next digit, into masses[PASS, row, chunk]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    num_rows, num_chunks = tl.num_programs(0), tl.num_programs(1)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:       # else the row keeps every token
        scale = LOG2E / tl.load(temps_ptr + row)
        row_max, total = _kept_mass(stats_ptr, kept_ptr, min_p_ptr, row, num_chunks, scale)
        prefix = _chosen_digits(masses_ptr, row, num_rows, num_chunks, top_p * total, PASS)
        shift = 32 - DIGIT_BITS * (PASS + 1)
        bins = tl.arange(0, NUM_BINS)
        # [digit, logit]: a thread's logits with all 16 digit values in the thread (as [logit,
        # digit], Triton spread the digits over 16 threads and moved every logit's weight there
        # through shared memory)
        acc = tl.zeros((NUM_BINS, BLOCK), tl.float32)
        count = tl.load(count_ptr + row * num_chunks + chunk)
        chunk_ptr = cand_ptr + row * vocab_size + chunk * chunk_size
        x_next = _load_chunk(chunk_ptr, 0, count, BLOCK)[1]
        for start in range(0, count, BLOCK):
            # the next tile's load in flight while this one is counted (Triton keeps no buffers for
            # loads that feed no dot): twice as fast on an H200
            x = x_next
            x_next = _load_chunk(chunk_ptr, start + BLOCK, count, BLOCK)[1]
            key = _sort_key(x)
            match = x > float("-inf")      # the tile's padding
            if PASS > 0:
                match &= (key >> (shift + DIGIT_BITS)) == (prefix >> (shift + DIGIT_BITS))
            w = tl.where(match, tl.exp2((x - row_max) * scale), 0.0)
            digit = (key >> shift) & (NUM_BINS - 1)
            acc += tl.where(bins[:, None] == digit[None, :], w[None, :], 0.0)
        tl.store(masses_ptr + ((PASS * num_rows + row) * num_chunks + chunk) * NUM_BINS + bins, tl.sum(acc, 1))


@triton.jit(do_not_specialize=["num_chunks"])
def _cut_kernel(top_p_ptr, temps_ptr, min_p_ptr, stats_ptr, kept_ptr, masses_ptr, cut_ptr, num_chunks,
                NUM_PASSES: tl.constexpr):
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    cut = tl.full((), float("-inf"), tl.float32)
    if top_p < 1.0:
        _, total = _kept_mass(stats_ptr, kept_ptr, min_p_ptr, row, num_chunks, LOG2E / tl.load(temps_ptr + row))
        prefix = _chosen_digits(masses_ptr, row, tl.num_programs(0), num_chunks, top_p * total, NUM_PASSES)
        cut = _from_key_prefix(prefix, DIGIT_BITS * NUM_PASSES)
        cut = tl.where(cut == cut, cut, float("-inf"))     # a row of NaN or -inf only: keep all
    tl.store(cut_ptr + row, cut)


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor, temperatures: torch.Tensor,
              min_p: torch.Tensor | None = None, block: int = BLOCK, num_warps: int = 4) -> torch.Tensor:
    """logits: [B, V] (16-bit or float32, rows contiguous); top_p: [B] float32 (1.0: off);
    temperatures: [B] float32; min_p: [B] float32 or None -> [B] float32 cuts (-inf where top_p is
    off), as layers/sampling_filters.py's top_k_top_p_cut with top_k = V on the logits that min-p keeps
    (min-p's own cut is the sampler's). The kernels specialise on no batch-dependent value: a
    batch of a new size compiles nothing."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, triton.cdiv(PROGRAMS_WANTED, batch)), block) * block
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    num_passes = (16 if logits.element_size() == 2 else 32) // DIGIT_BITS.value
    device, stride, grid = logits.device, logits.stride(0), (batch, num_chunks)
    stats = torch.empty(batch, num_chunks, 2, dtype=torch.float32, device=device)
    candidates = torch.empty(batch, vocab_size, dtype=logits.dtype, device=device)
    counts = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
    masses = torch.empty(num_passes, batch, num_chunks, NUM_BINS.value, dtype=torch.float32, device=device)
    kept = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    launch(_stats_kernel, grid, logits, stride, top_p, temperatures, stats, vocab_size, chunk_size, BLOCK=2048,
           num_warps=4)
    launch(_gather_kernel, grid, logits, stride, top_p, temperatures, min_p, stats, candidates, counts, kept,
           vocab_size, chunk_size, BLOCK=2048, num_warps=4)
    for p in range(num_passes):
        launch(_mass_kernel, grid, candidates, counts, top_p, temperatures, min_p, stats, kept, masses, vocab_size,
               chunk_size, PASS=p, BLOCK=block, num_warps=num_warps)
    cut = torch.empty(batch, dtype=torch.float32, device=device)
    launch(_cut_kernel, (batch,), top_p, temperatures, min_p, stats, kept, masses, cut, num_chunks,
           NUM_PASSES=num_passes, num_warps=4)
    return cut
