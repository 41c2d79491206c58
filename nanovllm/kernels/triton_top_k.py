"""Each row's top-k/top-p cut in Triton, from a few candidates instead of torch.topk's selection.

The cut is the smallest logit that top-k, then top-p keep (a token survives if its logit reaches
it); the fused sampler (triton_sampler.py) then never draws below it. The plain-torch reference
is layers/sampling_filters.py's `top_k_top_p_cut`.

1. Candidates. The row is cut into sub-blocks of SUB logits and each sub-block's maximum is
   taken; t0, the k-th largest of those maxima, is at most the row's k-th largest logit (k
   sub-blocks have a logit >= t0), so the logits >= t0 hold the row's k best. They are gathered
   (on random or trained logits, tens of them), sorted, and the k-th is the top-k value.
2. A row with more candidates than 4 x top_k (at least 256, at most 4,096: many equal logits,
   or a row mostly -inf) takes the exact fallback, radix select. A float's bits, with the
   magnitude bits flipped for negative values and the sign bit flipped for all, order as
   unsigned integers the way the floats do; pass p histograms the next 8 bits of the keys that
   match the bits chosen before it, and the k-th largest lies in the byte where the counts from
   the top reach k (2 passes for 16-bit logits, whose float32 keys end in 16 zero bits; 4 for
   float32). The logits above it (fewer than k) are gathered, and the slots up to k filled with
   it: the row's k best values.
3. Top-p's softmax over the k best (at the row's temperature; those that min-p keeps, as vLLM
   applies min-p first) keeps the shortest prefix whose more likely tokens hold less than top_p;
   the cut is the last kept value.
The kernels of a pass over the logits split each row into chunks (PROGRAMS_WANTED programs in
all); the small kernels run one program per row. A batch of few rows skips step 1 (its launches
cost more than they save there). On an H200 (tests/bench_sampler.py, 151,936 bf16 logits a row,
top_k 20, top_p 0.95) radix select alone took 20 us at 1 row against torch's 60, the candidate
path 98 against 265 us at 128 rows and 171 against 419 at 256.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.compile_ahead import launch

BLOCK = 4096           # logits per load
SUB = 128              # logits per sub-block maximum
MAX_CAP = 4096         # the most candidates a row keeps (4 x top_k, at least 256); more: radix fallback
PROGRAMS_WANTED = 528  # ~4 per SM of an H100/H200: a row is split into chunks until there are as many
# Below this many rows the candidate path's four extra launches cost more than its passes save
# (H200, top_k 20: 37 against 20 us at 1 row, 45 against 44 at 16, 70 against 112 at 64).
MIN_ROWS_FOR_CANDIDATES = 17
# Key bits the radix fallback chooses per pass. tl.histogram spends a warp ballot per key bit on
# every 32 logits, which bounds the passes: on an H200, 4 bits a pass (twice the passes, 16 bins)
# took as long as 8 bits (256 bins), and 8 bits launch fewer kernels.
DIGIT_BITS = tl.constexpr(8)
NUM_BINS = tl.constexpr(256)


@triton.jit
def _load_chunk(row_ptr, start, end, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    return offs, tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)


@triton.jit
def _append(x, keep, row_buffer, count_ptr, CAP: tl.constexpr):
    """Append the kept x to a row's buffer at slots reserved atomically (beyond CAP: counted only)."""
    count = tl.sum(keep.to(tl.int32))
    if count > 0:
        slot = tl.atomic_add(count_ptr, count) + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(row_buffer + slot, x, mask=keep & (slot < CAP))


@triton.jit
def _value_at(values, ranks, rank):
    return tl.sum(tl.where(ranks == rank, values, 0.0))


@triton.jit
def _top_p_cut(best, ranks, k, t, temp, top_p, min_p):
    """best: a row's values in descending order, its k best first; t: its k-th largest. Top-p's
    mass is that of the tokens min-p also keeps (vLLM's order; min_p 0 keeps every one)."""
    scaled = tl.where(ranks < k, best / temp, float("-inf"))
    top = tl.max(scaled, 0)
    scaled = tl.where(scaled >= top + tl.log(min_p), scaled, float("-inf"))
    probs = tl.exp(scaled - top)
    probs = probs / tl.sum(probs, 0)
    ahead = tl.cumsum(probs, 0) - probs                 # mass of the more likely tokens
    kept = tl.sum((ahead < top_p).to(tl.int32))
    return tl.maximum(t, _value_at(best, ranks, kept - 1))


# ---- 1. candidates ----------------------------------------------------------------------------
@triton.jit
def _sub_block_maxima_kernel(logits_ptr, stride, maxima_ptr, vocab_size, chunk_size, NUM_SUB_PAD: tl.constexpr,
                             BLOCK: tl.constexpr, SUB: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    end = tl.minimum(chunk * chunk_size + chunk_size, vocab_size)
    for start in range(chunk * chunk_size, end, BLOCK):
        # x: [BLOCK // SUB, SUB], one sub-block a row
        offs = start + tl.arange(0, BLOCK // SUB)[:, None] * SUB + tl.arange(0, SUB)[None, :]
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < end, other=float("-inf"))
        sub = start // SUB + tl.arange(0, BLOCK // SUB)
        tl.store(maxima_ptr + row * NUM_SUB_PAD + sub, tl.max(x.to(tl.float32), 1), mask=sub * SUB < end)


@triton.jit
def _candidate_floor_kernel(maxima_ptr, top_k_ptr, floor_ptr, num_sub, NUM_SUB_PAD: tl.constexpr):
    """t0: the k-th largest sub-block maximum."""
    row = tl.program_id(0)
    subs = tl.arange(0, NUM_SUB_PAD)
    maxima = tl.load(maxima_ptr + row * NUM_SUB_PAD + subs, mask=subs < num_sub, other=float("-inf"))
    maxima = tl.sort(maxima, descending=True)
    tl.store(floor_ptr + row, _value_at(maxima, subs, tl.load(top_k_ptr + row).to(tl.int32) - 1))


@triton.jit
def _gather_candidates_kernel(logits_ptr, stride, floor_ptr, candidates_ptr, num_candidates_ptr, vocab_size,
                              chunk_size, CAP: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    floor = tl.load(floor_ptr + row)
    end = tl.minimum(chunk * chunk_size + chunk_size, vocab_size)
    for start in range(chunk * chunk_size, end, BLOCK):
        offs, x = _load_chunk(logits_ptr + row * stride, start, end, BLOCK)
        _append(x, (x >= floor) & (offs < end), candidates_ptr + row * CAP, num_candidates_ptr + row, CAP)


@triton.jit
def _cut_from_candidates_kernel(top_k_ptr, top_p_ptr, temps_ptr, min_p_ptr, candidates_ptr, num_candidates_ptr,
                                cut_ptr, HAS_TOP_P: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0)
    num_candidates = tl.load(num_candidates_ptr + row)
    if num_candidates <= CAP:
        ranks = tl.arange(0, CAP)
        best = tl.load(candidates_ptr + row * CAP + ranks, mask=ranks < num_candidates, other=float("-inf"))
        best = tl.sort(best, descending=True)
        k = tl.load(top_k_ptr + row).to(tl.int32)
        t = _value_at(best, ranks, k - 1)
        if HAS_TOP_P:
            t = _top_p_cut(best, ranks, k, t, tl.load(temps_ptr + row), tl.load(top_p_ptr + row),
                           tl.load(min_p_ptr + row))
        tl.store(cut_ptr + row, t)


# ---- 2. radix select, for the rows with more than CAP candidates ------------------------------
@triton.jit
def _sort_key(x):
    """float32 -> int32 whose bits, read as unsigned, order as the floats do."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF) ^ -2147483648


@triton.jit
def _from_sort_key(key):
    signed = key ^ -2147483648
    return (signed ^ ((signed >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _chosen_bits(counts_ptr, row, k, num_rows, PASSES: tl.constexpr):
    """The key bits of the row's k-th largest logit chosen by passes 0..PASSES-1 from their
    histograms ([pass, row, NUM_BINS] counts of the next digit of the keys that matched so far)."""
    bins = tl.arange(0, NUM_BINS)
    prefix = tl.zeros((), tl.int32)
    remaining = k      # how many of the keys that match the chosen bits are not below the k-th
    for p in tl.static_range(PASSES):
        counts = tl.load(counts_ptr + (p * num_rows + row) * NUM_BINS + bins)
        at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts     # matching keys with digit >= d
        digit = tl.sum((at_or_above >= remaining).to(tl.int32)) - 1
        remaining -= tl.sum(tl.where(bins > digit, counts, 0))
        prefix |= digit << (32 - DIGIT_BITS * (p + 1))
    return prefix


@triton.jit
def _kth_largest(counts_ptr, row, k, num_rows, NUM_PASSES: tl.constexpr):
    return _from_key_prefix(_chosen_bits(counts_ptr, row, k, num_rows, NUM_PASSES), DIGIT_BITS * NUM_PASSES)


@triton.jit
def _from_key_prefix(prefix, CHOSEN_BITS: tl.constexpr):
    """The float whose key starts with prefix's first CHOSEN_BITS bits (16: a 16-bit float's, whose
    key ends in 16 bits no pass chose: 0, or all ones if negative)."""
    if CHOSEN_BITS == 16:
        prefix |= tl.where(prefix >= 0, 0xFFFF, 0)
    return _from_sort_key(prefix)


@triton.jit
def _histogram_kernel(logits_ptr, stride, top_k_ptr, num_candidates_ptr, counts_ptr, vocab_size, chunk_size,
                      PASS: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Pass PASS over one chunk of a row: histogram of the next key digit of the logits whose keys
    match the bits the earlier passes chose, added into the row's counts."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    if tl.load(num_candidates_ptr + row) > CAP:
        num_rows = tl.num_programs(0)
        prefix = _chosen_bits(counts_ptr, row, tl.load(top_k_ptr + row).to(tl.int32), num_rows, PASS)
        shift = 32 - DIGIT_BITS * (PASS + 1)
        end = tl.minimum(chunk * chunk_size + chunk_size, vocab_size)
        counts = tl.zeros((NUM_BINS,), tl.int32)
        for start in range(chunk * chunk_size, end, BLOCK):
            offs, x = _load_chunk(logits_ptr + row * stride, start, end, BLOCK)
            key = _sort_key(x)
            match = offs < end
            if PASS > 0:
                match &= (key >> (shift + DIGIT_BITS)) == (prefix >> (shift + DIGIT_BITS))
            counts += tl.histogram((key >> shift) & (NUM_BINS - 1), NUM_BINS, mask=match)
        tl.atomic_add(counts_ptr + (PASS * num_rows + row) * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit
def _gather_above_kernel(logits_ptr, stride, top_k_ptr, num_candidates_ptr, counts_ptr, num_above_ptr, best_ptr,
                         vocab_size, chunk_size, NUM_PASSES: tl.constexpr, K_CAP: tl.constexpr, CAP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The logits above the row's k-th largest (fewer than k), appended to its `best` row."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    if tl.load(num_candidates_ptr + row) > CAP:
        k = tl.load(top_k_ptr + row).to(tl.int32)
        t = _kth_largest(counts_ptr, row, k, tl.num_programs(0), NUM_PASSES)
        end = tl.minimum(chunk * chunk_size + chunk_size, vocab_size)
        for start in range(chunk * chunk_size, end, BLOCK):
            offs, x = _load_chunk(logits_ptr + row * stride, start, end, BLOCK)
            _append(x, (x > t) & (offs < end), best_ptr + row * K_CAP, num_above_ptr + row, K_CAP)


@triton.jit
def _radix_cut_kernel(top_k_ptr, top_p_ptr, temps_ptr, min_p_ptr, num_candidates_ptr, counts_ptr, num_above_ptr,
                      best_ptr, cut_ptr, HAS_TOP_P: tl.constexpr, NUM_PASSES: tl.constexpr, K_CAP: tl.constexpr,
                      CAP: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(num_candidates_ptr + row) > CAP:
        k = tl.load(top_k_ptr + row).to(tl.int32)
        t = _kth_largest(counts_ptr, row, k, tl.num_programs(0), NUM_PASSES)
        if HAS_TOP_P:
            num_above = tl.load(num_above_ptr + row)
            ranks = tl.arange(0, K_CAP)
            best = tl.load(best_ptr + row * K_CAP + ranks, mask=ranks < num_above, other=float("-inf"))
            best = tl.sort(tl.where((ranks >= num_above) & (ranks < k), t, best), descending=True)
            t = _top_p_cut(best, ranks, k, t, tl.load(temps_ptr + row), tl.load(top_p_ptr + row),
                           tl.load(min_p_ptr + row))
        tl.store(cut_ptr + row, t)


def top_k_top_p_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int,
                    temperatures: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] (16-bit or float32, rows contiguous); top_k: [B] in 1..max_top_k; top_p: [B]
    or None; temperatures: [B] float32; min_p: [B] float32 or None -> [B] float32 cuts (as
    layers/sampling_filters.py's reference on the logits that min-p keeps; min-p's own cut is the sampler's)."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1 and 1 <= max_top_k <= vocab_size
    device, stride, has_top_p = logits.device, logits.stride(0), top_p is not None
    top_p = top_p if has_top_p else temperatures          # a placeholder the kernels do not read
    if min_p is None:                                     # (read with top_p only)
        min_p = torch.zeros_like(temperatures) if has_top_p else temperatures
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, triton.cdiv(PROGRAMS_WANTED, batch)), BLOCK) * BLOCK
    grid = (batch, triton.cdiv(vocab_size, chunk_size))
    num_passes = (16 if logits.element_size() == 2 else 32) // DIGIT_BITS.value
    num_bins = NUM_BINS.value
    # int32 counters: num_candidates [B], num_above [B], the radix histograms [passes, B, bins]
    # Each part starts 16-byte aligned whatever the batch size: Triton specialises kernels on their
    # pointers' alignment, and parts at batch offsets compiled new variants for odd batch sizes
    # inside a timed run (~1.3 s on an H200, the first top-k run of a machine).
    rows = triton.cdiv(batch, 4) * 4
    counters = torch.zeros((2 + num_passes * num_bins) * rows, dtype=torch.int32, device=device)
    num_candidates, num_above = counters[:batch], counters[rows:rows + batch]
    counts = counters[2 * rows:2 * rows + num_passes * num_bins * batch]
    cut = torch.empty(batch, dtype=torch.float32, device=device)
    cap = min(MAX_CAP, max(256, 4 * triton.next_power_of_2(max_top_k)))
    num_sub = triton.cdiv(vocab_size, SUB)
    if batch >= MIN_ROWS_FOR_CANDIDATES and num_sub >= max_top_k:   # else radix select for every row
        num_sub_pad = triton.next_power_of_2(num_sub)
        maxima = torch.empty(batch, num_sub_pad, dtype=torch.float32, device=device)
        floor = torch.empty(batch, dtype=torch.float32, device=device)
        candidates = torch.empty(batch, cap, dtype=torch.float32, device=device)
        launch(_sub_block_maxima_kernel, grid, logits, stride, maxima, vocab_size, chunk_size,
               NUM_SUB_PAD=num_sub_pad, BLOCK=BLOCK, SUB=SUB, num_warps=4)
        launch(_candidate_floor_kernel, (batch,), maxima, top_k, floor, num_sub, NUM_SUB_PAD=num_sub_pad, num_warps=4)
        launch(_gather_candidates_kernel, grid, logits, stride, floor, candidates, num_candidates, vocab_size,
               chunk_size, CAP=cap, BLOCK=BLOCK, num_warps=4)
        launch(_cut_from_candidates_kernel, (batch,), top_k, top_p, temperatures, min_p, candidates, num_candidates,
               cut, HAS_TOP_P=has_top_p, CAP=cap, num_warps=8)
    else:
        num_candidates.fill_(cap + 1)
    k_cap = triton.next_power_of_2(max_top_k)
    best = torch.empty(batch, k_cap, dtype=torch.float32, device=device) if has_top_p else cut   # read with top_p
    for p in range(num_passes):
        launch(_histogram_kernel, grid, logits, stride, top_k, num_candidates, counts, vocab_size, chunk_size,
               PASS=p, CAP=cap, BLOCK=BLOCK, num_warps=4)
    if has_top_p:
        launch(_gather_above_kernel, grid, logits, stride, top_k, num_candidates, counts, num_above, best,
               vocab_size, chunk_size, NUM_PASSES=num_passes, K_CAP=k_cap, CAP=cap, BLOCK=BLOCK, num_warps=4)
    launch(_radix_cut_kernel, (batch,), top_k, top_p, temperatures, min_p, num_candidates, counts, num_above, best,
           cut, HAS_TOP_P=has_top_p, NUM_PASSES=num_passes, K_CAP=k_cap, CAP=cap, num_warps=4)
    return cut
