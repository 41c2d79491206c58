"""Shared prefixes of a decode step (cascade attention), planned on the host (numpy, no torch).

Requests that share a system prompt, or the n completions of one request, hold the same pages at
the start of their block tables (the prefix cache hands them out). Plain decode attention reads
those pages once per sequence; with a plan, the attention backend reads them once for a tile of
the sequences that share them (kernels/triton_attention.py, _shared_prefix_kernel) and each
sequence's own programs read only the rest of its context.

    seq 0  | p0 | p1 | p2 | a3 |          a run of three sequences sharing pages p0-p2
    seq 1  | p0 | p1 | p2 | b3 | b4 |     -> prefix_lens [3, 3, 3, 0] x page size,
    seq 2  | p0 | p1 | p2 | c3 |          one tile (0, 3 sequences, 3 x page size tokens)
    seq 3  | d0 | d1 |                    (seq 3 alone: read as before)

Runs are of consecutive sequences, as the scheduler keeps them: a request's completions are
admitted together, and requests admitted together stay in order.
"""
from dataclasses import dataclass

import numpy as np

# A plan is made only where it saves at least this share of the step's context reads. Measured on
# the H200 with planned steps run eagerly between the piecewise graphs (~3-4 ms more host work a
# step; docs/perf_notes.md row 109): a shared 2,048-token system prompt (bench.py --workload prefix,
# ~90% of the reads) ran faster, the n = 8 completions of 64 requests (~45%, which L2 already served
# once per request's page) slower. Planned steps now replay decode graphs of their own (rows 110-111),
# where plans from a quarter of the reads saved still did not pay for the n = 8 run (7.04-7.08 against
# 7.02 s).
MIN_SAVED_SHARE = 0.5


@dataclass
class SharedPrefixPlan:
    prefix_lens: np.ndarray     # [num_seqs] int32: tokens of each sequence's context its run shares (0: none)
    tiles: np.ndarray           # [num_tiles, 3] int32: (first sequence, sequences, shared tokens)


def max_tiles(num_seqs: int, seqs_per_tile: int) -> int:
    """The most tiles a plan of num_seqs sequences can have (a CUDA graph's shared-prefix kernel is
    captured for that many): runs of two or more sequences, at most num_seqs // 2 of them, each one
    partial tile beyond its share of num_seqs / seqs_per_tile full ones."""
    return min(num_seqs, num_seqs // 2 + -(-num_seqs // seqs_per_tile))


def plan_arrays(plan: SharedPrefixPlan | None, num_seqs: int, num_tiles: int) -> list[np.ndarray]:
    """What the kernels read of a plan, int32: prefix_lens [num_seqs], tiles [num_tiles, 3] and the
    tiles' count [1]; the plan's values first, zeros after (a CUDA graph's inputs are sized for its
    bucket: padding rows read no prefix, tiles past the count are not read). None: all zeros."""
    prefix_lens, tiles, count = np.zeros(num_seqs, np.int32), np.zeros((num_tiles, 3), np.int32), np.zeros(1, np.int32)
    if plan is not None:
        prefix_lens[:len(plan.prefix_lens)], tiles[:len(plan.tiles)] = plan.prefix_lens, plan.tiles
        count[0] = len(plan.tiles)
    return [prefix_lens, tiles, count]


def plan_shared_prefixes(block_tables: np.ndarray, seq_lens: list[int], page: int, seqs_per_tile: int,
                         min_saved_share: float | None = None) -> SharedPrefixPlan | None:
    """block_tables: [num_seqs, max_pages] (padded), seq_lens: the decode step's context lengths,
    the newest token included. A run shares the pages its neighbours all agree on, never the page
    that holds a sequence's newest token (it is being written). None: nothing worth sharing
    (less than min_saved_share of the reads, MIN_SAVED_SHARE when None)."""
    if min_saved_share is None:
        min_saved_share = MIN_SAVED_SHARE
    num_seqs = len(seq_lens)
    if num_seqs < 2:
        return None
    lens = np.asarray(seq_lens, np.int64)
    full = (lens - 1) // page                     # pages before the one holding the newest token
    same = block_tables[1:] == block_tables[:-1]
    same &= np.arange(block_tables.shape[1]) < np.minimum(full[1:], full[:-1])[:, None]
    # pages shared by sequences i and i + 1: the length of the leading run of agreement
    shared = np.argmin(np.pad(same, ((0, 0), (0, 1))), axis=1).tolist()

    prefix_lens = np.zeros(num_seqs, np.int32)
    tiles, saved, i = [], 0, 0
    while i < num_seqs - 1:
        pages = shared[i]
        if pages == 0:
            i += 1
            continue
        last = i + 1
        while last < num_seqs - 1 and shared[last] >= pages:
            last += 1
        tokens = pages * page
        prefix_lens[i:last + 1] = tokens
        tiles += [(first, min(seqs_per_tile, last + 1 - first), tokens)
                  for first in range(i, last + 1, seqs_per_tile)]
        saved += (last - i) * tokens
        i = last + 1
    if not tiles or saved < min_saved_share * lens.sum():
        return None
    return SharedPrefixPlan(prefix_lens, np.asarray(tiles, np.int32))
