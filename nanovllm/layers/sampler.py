"""Sampler: logits -> next tokens, for a batch whose rows each have their own SamplingParams.

Order of operations (vLLM v1's): structured outputs' grammar bitmasks first (vLLM's model runner
applies them before its sampler); then raw logprobs, from the logits otherwise unprocessed (or, by
the engine's logprobs_mode, the raw logits, or after sampling those of the processed distribution); then
min_tokens masking and penalties (from token counts kept on the device:
engine/penalty_counts.py), then the tokens that spent thinking budgets force; greedy rows take
the argmax of that; the others go through temperature, min-p, top-k and top-p, and are sampled
by the exponential race argmax(probs / q), q ~ Exponential(1), which needs no sort and no host
sync. On CUDA the same distribution is drawn in two Triton passes (kernels/triton_sampler.py: a
group of ids by its probability mass, then a token of it by Gumbel noise on its logits), with
temperature inside them, and min-p, top-k and top-p as one cut value per row below which nothing
is drawn: min-p from the row's maximum, top-k/top-p from a few candidates or radix select for
rows with a top_k (kernels/triton_top_k.py), top-p without top-k by a radix select on probability
mass (kernels/triton_top_p.py), top-p's mass that of the tokens min-p keeps. Only a batch with a top_k above
SELECT_TOP_K_MAX sorts its scaled logits first.
"""
from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings as tensors on the logits' device; optional parts are None
    when no row of the batch uses them, so the common case does no work for them."""
    temperatures: torch.Tensor | None     # [B] float32; 1.0 for greedy rows; None if all_greedy
    is_greedy: torch.Tensor | None        # [B] bool; None if all_greedy
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None            # [B] int64; vocab_size where disabled
    top_p: torch.Tensor | None            # [B] float32; 1.0 where disabled
    min_p: torch.Tensor | None            # [B] float32; 0.0 where disabled
    # Per-row noise seeds for rows with SamplingParams.seed; other rows draw from the engine's generator.
    row_seeds: list[tuple[int, int]]
    # Banned (row, token) pairs: stop tokens of rows still under min_tokens.
    banned_rows: torch.Tensor | None
    banned_tokens: torch.Tensor | None
    max_top_k: int | None = None          # the largest top_k when every row has one (host int), else None
    max_set_top_k: int | None = None      # the largest top_k of the rows that have one (host int)
    # Penalties, for the [P] rows penalty_rows (None when no row has any): [P] each, and the rows'
    # token counts, rows penalty_table_rows of penalty_table (engine/penalty_counts.py:
    # [rows, V + 1] int32, 2 x output count + 1 if in the prompt). new_table_rows: [N] table
    # rows to clear first and mark with new_prompt_ids ([N, longest prompt] padded with V).
    penalty_rows: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    penalty_table: torch.Tensor | None = None
    penalty_table_rows: torch.Tensor | None = None
    new_table_rows: torch.Tensor | None = None
    new_prompt_ids: torch.Tensor | None = None
    max_num_logprobs: int | None = None
    # SamplingParams.logprob_token_ids: [L] rows that have a list, and their lists [L, longest] padded with 0
    logprob_rows: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    # row_seeds again, as [S] row indices and [S] int64 seeds on the device (for the fused sampler).
    seeded_rows: torch.Tensor | None = None
    seed_values: torch.Tensor | None = None
    # allowed_token_ids: [A] rows that have a list, and their lists [A, longest] padded with V.
    allowed_rows: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None
    # logit_bias as (row, token, bias) triples.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Rows that must sample one token (a spent thinking budget: engine/reasoning.py): [F] each.
    forced_rows: torch.Tensor | None = None
    forced_tokens: torch.Tensor | None = None
    # Structured outputs (engine/structured_output.py): [G] rows and their allowed tokens as bits,
    # [G, ceil(V / 32)] int32 (bit j of word w: token 32 w + j).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @property
    def edits_logits(self) -> bool:
        return any(t is not None for t in (self.allowed_rows, self.banned_rows, self.bias_rows, self.penalty_rows,
                                           self.forced_rows))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # [B]
    logprobs: torch.Tensor | None = None      # [B] logprob of each sampled token
    ranks: torch.Tensor | None = None         # [B] its rank (1 = most likely)
    top_ids: torch.Tensor | None = None       # [B, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None  # [B, max_num_logprobs]
    top_ranks: torch.Tensor | None = None     # [B, max_num_logprobs] with logprob_token_ids rows, else None


def id_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids: [R, N] token ids padded with vocab_size -> [R, vocab_size] bool, True at each row's ids
    (the padding lands in an extra column, dropped)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def fill_at(x: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float):
    """x[indices] = value, with the value made on x's device. (Assigning a Python number through
    tensor indices copies it from pageable host memory to a CUDA x, and such a copy waits for
    everything queued on the stream: the step's whole forward pass.)"""
    x.index_put_(indices, x.new_full((), value))


def restrict_and_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place on float32 logits [B, V]: tokens outside a row's allowed_token_ids and stop tokens
    under min_tokens get -inf, then logit_bias is added (vLLM's order, before penalties)."""
    if md.allowed_rows is not None:
        keep = id_mask(md.allowed_token_ids, logits.shape[1])
        logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill(~keep, float("-inf"))
    if md.banned_rows is not None:
        fill_at(logits, (md.banned_rows, md.banned_tokens), float("-inf"))
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """In place on logits [B, V]: in rows `rows`, tokens whose bit is 0 in bitmask ([R, ceil(V /
    32)] int32) get -inf. On CUDA one pass (kernels/triton_logit_edits.py)."""
    if logits.is_cuda:
        from nanovllm.kernels.triton_logit_edits import apply_bitmask
        apply_bitmask(logits, rows, bitmask)
        return
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[1]]   # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place on float32 logits [B, V], in the penalised rows, vLLM's way: a token in the prompt
    or the output so far has its logit divided by the repetition penalty (multiplied, if
    negative); one in the output loses the frequency penalty per occurrence and the presence
    penalty once."""
    table, rows = md.penalty_table, md.penalty_rows
    if md.new_table_rows is not None:   # sequences penalised for the first time: their prompts
        fill_at(table, (md.new_table_rows,), 0)
        fill_at(table, (md.new_table_rows[:, None], md.new_prompt_ids), 1)
    if logits.is_cuda:   # one pass (kernels/triton_logit_edits.py)
        from nanovllm.kernels.triton_logit_edits import penalize
        penalize(logits, rows, table, md.penalty_table_rows, md.presence_penalties, md.frequency_penalties,
                 md.repetition_penalties)
        return logits
    entries = table[md.penalty_table_rows, :logits.shape[1]]   # [P, V]
    counts = entries >> 1
    x = logits[rows]
    rep = md.repetition_penalties[:, None]
    x = torch.where(entries > 0, torch.where(x > 0, x / rep, x * rep), x)
    logits[rows] = x - md.frequency_penalties[:, None] * counts - md.presence_penalties[:, None] * (counts > 0)
    return logits


def count_sampled(md: SamplingMetadata, token_ids: torch.Tensor):
    """After sampling: each penalised row's new token counts once more in its output."""
    rows = md.penalty_table_rows
    md.penalty_table.index_put_((rows, token_ids[md.penalty_rows]), torch.full_like(rows, 2, dtype=torch.int32),
                                accumulate=True)


# Up to this top_k (in every row) the filters work on the rows' top_k best logits (torch.topk)
# instead of sorting the whole vocabulary: with Qwen3's own defaults (top_k=20, top_p=0.95) a
# batch of 256 rows x 151,936 logits took a sort of 39M values per step.
SELECT_TOP_K_MAX = 1024
# Rows that the sampler's [rows, V] torch work takes at a time: the sorted path's filter (a sort's
# values, order, probabilities and cumulative sums are ~6 float32 copies of its rows) and draw, and
# the torch logprobs' ranks (a sum over bools goes through an int64 copy of them). The KV-cache
# sizing sets aside these paths' peak at max_num_seqs rows (1,024 x 151,936: ~4.5 GB more KV cache
# by 128 rows, perf_notes rows 120-122).
SORT_ROWS = 128


def row_blocks(num_rows: int) -> list[slice]:
    """num_rows rows as blocks of SORT_ROWS (one empty block for none)."""
    return [slice(start, start + SORT_ROWS) for start in range(0, max(num_rows, 1), SORT_ROWS)]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Dropped tokens get -inf: those below a row's top_k-th logit (ties with it are kept, as in
    vLLM), then, of the rest, those whose more likely tokens already hold top_p of the mass."""
    if selects_top_k(top_k, max_top_k):
        return logits.masked_fill(logits < top_k_top_p_cut(logits, top_k, top_p, max_top_k), float("-inf"))
    sorted_logits, order = logits.sort(-1)     # ascending
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab_size - top_k).clamp(0, vocab_size - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p[:, None]
        drop[:, -1] = False                    # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def selects_top_k(top_k: torch.Tensor | None, max_top_k: int | None) -> bool:
    """Whether top-k/top-p can work from each row's best logits (every row has a small top_k)."""
    return top_k is not None and max_top_k is not None and max_top_k <= SELECT_TOP_K_MAX


def sorts(md: SamplingMetadata) -> bool:
    """Whether the fused sampler sorts this batch's rows (a top_k above SELECT_TOP_K_MAX), filtering
    them in torch, rather than cutting them in its kernels."""
    return not md.all_greedy and md.top_k is not None and not selects_top_k(md.top_k, md.max_top_k or md.max_set_top_k)


def top_k_top_p_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int,
                    temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1]: each row's smallest logit that top-k, then top-p keep, from its max_top_k best
    logits; a token is kept if its logit reaches the cut. temperatures: the logits are unscaled
    and top-p's probabilities are those of logits / temperature."""
    best = logits.topk(max_top_k, -1).values.float()               # descending
    cut = best.gather(-1, top_k[:, None] - 1)                      # the top_k-th logit
    if top_p is not None:
        rank = torch.arange(max_top_k, device=logits.device)
        scaled = best if temperatures is None else best / temperatures[:, None]
        probs = scaled.masked_fill(rank >= top_k[:, None], float("-inf")).softmax(-1)
        ahead = probs.cumsum(-1) - probs                           # mass of the more likely tokens
        kept = (ahead < top_p[:, None]).sum(-1, keepdim=True)      # a prefix, at least the best token
        kept.clamp_(min=1)   # (also where constraints left the row nothing to draw: all -inf, NaN probabilities)
        cut = torch.maximum(cut, best.gather(-1, kept - 1))
    return cut


def min_p_cut(logits: torch.Tensor, min_p: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[B]: the smallest unscaled logit min-p keeps, p >= min_p * p_max at the row's temperature:
    logit >= max logit + T * log(min_p) (-inf where min_p is 0). The top-k and top-p cuts are taken
    over the tokens that min-p keeps (the kernels' min_p), and a token is drawn if it reaches both."""
    return logits.amax(-1).float() + temperatures * min_p.log()


def filter_logits(scaled: torch.Tensor, md: SamplingMetadata, rows: slice = slice(None)) -> torch.Tensor:
    """Min-p, then top-k and top-p on temperature-scaled float32 logits [B, V] (md's rows `rows`):
    dropped tokens get -inf. min-p keeps p >= min_p * p_max, i.e. logit >= max logit + log(min_p).
    vLLM's order: top-p's mass is that of the tokens min-p keeps (top-k's cut is the same either way)."""
    top_k, top_p, min_p = (None if t is None else t[rows] for t in (md.top_k, md.top_p, md.min_p))
    if min_p is not None:
        floor = scaled.amax(-1, keepdim=True) + min_p[:, None].log()
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p, md.max_top_k)
    return scaled


class Sampler:
    def __init__(self, generator: torch.Generator, logprobs_mode: str = "raw_logprobs"):
        self.generator = generator
        self.logprobs_mode = logprobs_mode   # config.py's LOGPROBS_MODES
        # On CUDA every batch samples through the fused Triton kernel, so a seeded request draws
        # the same noise whatever else is in its batch; the torch race is the CPU path.
        self.fused = generator.device.type == "cuda"

    def warm_up(self, vocab_size: int, dtype: torch.dtype, max_rows: int, top_k: int, top_p: float) -> bool:
        """Sample random logits with these top_k (0: none) and top_p at 1 and max_rows rows (with
        a top_k: radix select alone, then the candidate path), so that their kernels are compiled
        now, not inside the first request that uses them (top-k's took ~12 s on a fresh H200
        machine, ~0.05 s once Triton's cache holds them). Each batch is sampled twice: as it
        comes, in the model's dtype, and with its first row penalised and held to an all-allowing
        grammar bitmask, for the logit-edit kernels (after which the batch is float32; perf_notes
        row 84); each with one logprob a row (the logprobs kernels, on the raw logits or, in the
        processed modes, on the processed ones, and then once on raw ones for prompt logprobs). A
        dry pass over the same batches first queues every kernel variant's compile at once
        (kernels/compile_ahead.py), so that they compile side by side rather than one by one. The
        noise generator is left as it was. -> False if there is nothing to compile (the CPU path)."""
        if not self.fused:
            return False
        device, state = self.generator.device, self.generator.get_state()
        one = lambda value, kind=None: torch.full((1,), value, dtype=kind, device=device)
        edits = dict(penalty_rows=one(0, torch.int64), penalty_table_rows=one(0, torch.int64),
                     penalty_table=torch.zeros(1, vocab_size + 1, dtype=torch.int32, device=device),
                     presence_penalties=one(0.5), frequency_penalties=one(0.5), repetition_penalties=one(1.2),
                     grammar_rows=one(0, torch.int64),
                     grammar_bitmask=torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device))

        def sample_each_batch():
            values = torch.Generator(device=device).manual_seed(0)
            for rows in sorted({1, max_rows}):
                full = lambda value, kind=None: torch.full((rows,), value, dtype=kind, device=device)
                for row_edits in ({}, edits):
                    md = SamplingMetadata(temperatures=full(0.6), is_greedy=full(False), all_greedy=False,
                                          any_greedy=False, top_k=full(top_k, torch.int64) if top_k > 0 else None,
                                          max_top_k=top_k if top_k > 0 else None,
                                          top_p=full(top_p) if top_p < 1.0 else None, min_p=None,
                                          row_seeds=[], banned_rows=None, banned_tokens=None, max_num_logprobs=1,
                                          **row_edits)
                    self(torch.randn(rows, vocab_size, generator=values, device=device, dtype=dtype), md)
                if self.logprobs_mode.startswith("processed"):   # (prompt logprobs: from the raw logits in every mode)
                    kernel_token_logprobs(torch.randn(rows, vocab_size, generator=values, device=device, dtype=dtype),
                                          full(0, torch.int64), 1)

        from nanovllm.kernels import compile_ahead
        compile_ahead.dry_run(sample_each_batch)
        sample_each_batch()
        self.generator.set_state(state)
        return True

    def _logprobs_in_kernels(self, logits: torch.Tensor, md: SamplingMetadata) -> bool:
        """Whether kernels/triton_logprobs.py serves this batch's logprobs: on CUDA, for up to
        MAX_TOP of a row's best, without logprob_token_ids (which want the whole row's scores); in
        the raw modes with the raw logits kept (the edits work in place on float32 logits, on a copy
        of others), in the processed modes where the fused sampler's cut stands for the filters."""
        from nanovllm.kernels.triton_logprobs import MAX_TOP
        if not (self.fused and md.max_num_logprobs is not None and md.max_num_logprobs <= MAX_TOP
                and md.logprob_rows is None):
            return False
        if self.logprobs_mode.startswith("raw"):
            return not (md.edits_logits and logits.dtype == torch.float32)
        return not sorts(md)

    def _exponential_noise(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in md.row_seeds:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            q[row].exponential_(generator=gen)
        return q.clamp_min_(1e-20)

    def _row_seeds(self, md: SamplingMetadata, batch: int, device: torch.device) -> torch.Tensor:
        """[B] int64 noise seeds for the fused kernel: the request's own where it has one."""
        seeds = torch.randint(0, 1 << 62, (batch,), generator=self.generator, device=device)
        if md.seeded_rows is not None:
            seeds[md.seeded_rows] = md.seed_values
        return seeds

    def _sample_fused(self, logits: torch.Tensor, md: SamplingMetadata,
                      keep_filtered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> token ids [B]; where the kernels cut the rows, the cut: [B] float32, each row's smallest
        unscaled logit that may be drawn (None where no filter is set, or where torch filtered the
        rows); where torch filtered them and keep_filtered is set, the logits drawn from, as
        _sample_torch gives them (else None)."""
        from nanovllm.kernels.triton_sampler import gumbel_argmax
        if md.all_greedy:
            # torch's argmax: the two passes' greedy rows are faster on the GPU (3.8 against 8.8 us
            # at one row), but their launches cost batch-1 latency more (perf_notes row 48)
            return logits.argmax(-1), None, None
        seeds = self._row_seeds(md, logits.shape[0], logits.device)
        if sorts(md):
            # a top_k above SELECT_TOP_K_MAX: sorted and drawn SORT_ROWS rows at a time (temperature and
            # min-p applied in the filtered logits)
            tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
            filtered = torch.empty(logits.shape, device=logits.device) if keep_filtered else None
            for rows in row_blocks(len(logits)):
                scaled = filter_logits(logits[rows].float() / md.temperatures[rows, None], md, rows)
                tokens[rows] = gumbel_argmax(scaled, torch.ones_like(md.temperatures[rows]), md.is_greedy[rows],
                                             seeds[rows])
                if filtered is not None:
                    filtered[rows] = scaled
            return tokens, None, filtered
        # The filters as one cut value per row (top_k_top_p_cut's and min_p_cut's values), applied
        # inside the kernel: no [B, V] pass of torch
        from nanovllm.kernels import triton_top_k, triton_top_p
        cut = None
        if md.top_k is not None and md.max_top_k is None:
            # rows with and without a top_k: each row's cut from the kernel that serves it (the
            # other's result for it, with top_k 1 or top_p 1, is dropped)
            has_k = md.top_k < logits.shape[1]
            cut = triton_top_k.top_k_top_p_cut(logits, torch.where(has_k, md.top_k, 1), md.top_p, md.max_set_top_k,
                                               md.temperatures, md.min_p)
            rest = (torch.full_like(cut, float("-inf")) if md.top_p is None else
                    triton_top_p.top_p_cut(logits, torch.where(has_k, 1.0, md.top_p), md.temperatures, md.min_p))
            cut = torch.where(has_k, cut, rest)
        elif md.top_k is not None:
            cut = triton_top_k.top_k_top_p_cut(logits, md.top_k, md.top_p, md.max_top_k, md.temperatures, md.min_p)
        elif md.top_p is not None:
            cut = triton_top_p.top_p_cut(logits, md.top_p, md.temperatures, md.min_p)
        if md.min_p is not None:
            floor = min_p_cut(logits, md.min_p, md.temperatures)
            cut = floor if cut is None else torch.maximum(cut, floor)
        return gumbel_argmax(logits, md.temperatures, md.is_greedy, seeds, cut), cut, None

    def _sample_torch(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [B, V] float32 -> token ids [B] and the logits drawn from: scaled and filtered [B, V]
        (greedy rows' too, though their tokens are the argmax; None if all are greedy)."""
        token_ids = logits.argmax(-1) if md.any_greedy else None
        if md.all_greedy:
            return token_ids, None
        filtered = filter_logits(logits / md.temperatures[:, None], md)
        probs = filtered.softmax(-1)
        sampled = probs.div_(self._exponential_noise(probs, md)).argmax(-1)
        return (sampled if token_ids is None else torch.where(md.is_greedy, token_ids, sampled)), filtered

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V]
        if md.grammar_rows is not None:   # before the logprobs, as vLLM applies its grammar bitmask
            apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
        raw_logits, scores, mode = logits, None, self.logprobs_mode
        in_kernels, as_logits = self._logprobs_in_kernels(logits, md), mode.endswith("logits")
        if md.max_num_logprobs is not None and not in_kernels and mode.startswith("raw"):
            scores = logits.to(torch.float32, copy=True) if as_logits else logits.float().log_softmax(-1)
        if md.edits_logits:
            logits = restrict_and_bias(logits.float(), md)
            if md.penalty_rows is not None:
                logits = apply_penalties(logits, md)
            if md.forced_rows is not None:   # last: whatever the other edits did, these rows take their token
                fill_at(logits, (md.forced_rows,), float("-inf"))
                fill_at(logits, (md.forced_rows, md.forced_tokens), 0.0)
        cut = filtered = None
        if self.fused:   # (the processed modes' torch path keeps what a sorted batch was drawn from)
            processed_in_torch = md.max_num_logprobs is not None and not in_kernels and mode.startswith("processed")
            token_ids, cut, filtered = self._sample_fused(logits, md, keep_filtered=processed_in_torch)
        else:
            token_ids, filtered = self._sample_torch(logits.float(), md)
        if md.penalty_rows is not None:
            count_sampled(md, token_ids)
        if md.max_num_logprobs is None:
            return SamplerOutput(token_ids)
        if in_kernels and mode.startswith("raw"):
            return kernel_token_logprobs(raw_logits, token_ids, md.max_num_logprobs, as_logits)
        if in_kernels:   # the processed modes
            cuts, temperatures = processed_cuts(cut, md, len(logits), logits.device)
            return kernel_token_logprobs(logits, token_ids, md.max_num_logprobs, as_logits, cuts=cuts,
                                         temperatures=temperatures)
        if scores is None:   # the processed modes
            scores = processed_scores(logits, md, as_logits, cut=cut, filtered=filtered)
        out = token_logprobs(scores, token_ids, md.max_num_logprobs)
        if md.logprob_rows is not None:
            chosen_logprobs(out, scores, md.logprob_rows, md.logprob_token_ids)
        return out


def processed_scores(logits: torch.Tensor, md: SamplingMetadata, as_logits: bool, cut: torch.Tensor | None = None,
                     filtered: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32: the logits tokens are drawn from (vLLM's processed logits: after the logit
    edits and, in sampling rows, temperature, min-p, top-k and top-p, dropped tokens at -inf;
    greedy rows' edited logits as they are: SamplingParams drops their filters), or their log_softmax.
    SORT_ROWS rows at a time. cut: the fused sampler's cut (_sample_fused), which stands for the
    filters: the tokens kept are then exactly those the kernels could draw, and no row is sorted.
    filtered: the scaled and filtered logits the sampler drew from (_sample_torch's, or a sorted
    batch's in _sample_fused), not filtered again: the scores are written over them."""
    if filtered is not None:
        if not as_logits:
            for rows in row_blocks(len(filtered)):
                filtered[rows] = filtered[rows].log_softmax(-1)
        return filtered
    scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if cut is not None:
        cut = processed_cuts(cut, md, len(logits), logits.device)[0][:, None]
    for rows in row_blocks(len(logits)):
        x = logits[rows].float()
        if cut is not None:
            x = x.masked_fill(x < cut[rows], float("-inf")).div_(md.temperatures[rows, None])
        elif not md.all_greedy:
            x = filter_logits(x / md.temperatures[rows, None], md, rows)
        scores[rows] = x if as_logits else x.log_softmax(-1)
    return scores


def processed_cuts(cut: torch.Tensor | None, md: SamplingMetadata, num_rows: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] cuts and [B] temperatures of the processed distribution: the fused sampler's cut (-inf
    without one) and the rows' temperatures, where greedy rows keep every token at temperature 1."""
    temperatures = torch.ones(num_rows, device=device) if md.all_greedy else md.temperatures
    if cut is None:
        return torch.full_like(temperatures, float("-inf")), temperatures
    return cut.masked_fill(md.is_greedy, float("-inf")), temperatures


def kernel_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logits: bool = False,
                          **processed) -> SamplerOutput:
    """token_logprobs' outputs from the logits (CUDA, num_top <= kernels/triton_logprobs.py's MAX_TOP)
    in two passes over them, without a [B, V] float32 log_softmax. as_logits: the values themselves;
    processed: kernels/triton_logprobs.py's cuts and temperatures."""
    from nanovllm.kernels import triton_logprobs
    out = SamplerOutput(token_ids)
    out.logprobs, out.ranks, out.top_logprobs, out.top_ids = triton_logprobs.token_logprobs(
        logits, token_ids, num_top, as_logits, **processed)
    return out


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    """logprobs: [B, V] log_softmax of raw logits (or the scores of another logprobs_mode); token_ids:
    [B] -> each token's logprob and rank (1 = most likely), and the rows' num_top best (none when
    num_top is 0)."""
    out = SamplerOutput(token_ids)
    out.logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    out.ranks = torch.cat([(logprobs[rows] > out.logprobs[rows, None]).sum(-1) + 1
                           for rows in row_blocks(len(logprobs))])   # (SORT_ROWS' comment)
    if num_top > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(num_top, -1)
    return out


def chosen_logprobs(out: SamplerOutput, logprobs: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor):
    """In out's top-N: rows `rows` get the logprobs and ranks of their own ids ([L, K] padded; K
    <= max_num_logprobs) in place of their best; top_ranks gives every row's ranks (1..N for the others)."""
    num_rows, num_top = out.top_ids.shape
    out.top_ranks = torch.arange(1, num_top + 1, device=logprobs.device).expand(num_rows, num_top).clone()
    values = logprobs[rows].gather(-1, ids)                                        # [L, K]
    ranks = torch.stack([(logprobs[row] > value[:, None]).sum(-1) + 1 for row, value in zip(rows, values)])
    k = ids.shape[1]
    out.top_ids[rows, :k], out.top_logprobs[rows, :k], out.top_ranks[rows, :k] = ids, values, ranks
