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

This module runs those steps in order; the steps themselves are in layers/logit_edits.py (bitmasks,
restrictions, bias, penalties), layers/sampling_filters.py (min-p, top-k, top-p in torch) and
layers/logprobs.py (the logprobs in torch), on layers/sampling_metadata.py's batch description.
"""
import torch

from nanovllm.layers.logit_edits import apply_penalties, apply_token_bitmask, count_sampled, fill_at, restrict_and_bias
from nanovllm.layers.logprobs import (chosen_logprobs, kernel_token_logprobs, processed_cuts, processed_scores,
                                      token_logprobs)
from nanovllm.layers.sampling_filters import filter_logits, min_p_cut, row_blocks, sorts
from nanovllm.layers.sampling_metadata import SamplerOutput, SamplingMetadata


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
        row 84); each with one logprob a row and the logprob of a chosen id in the first (the
        logprobs kernels, on the raw logits or, in the processed modes, on the processed ones, and
        then once on raw ones for prompt logprobs). A dry pass over the same batches first queues
        every kernel variant's compile at once (kernels/compile_ahead.py), so that they compile side
        by side rather than one by one. The noise generator is left as it was. -> False if there is
        nothing to compile (the CPU path)."""
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
                                          logprob_rows=one(0, torch.int64), logprob_token_ids=one(0, torch.int64)[None],
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
        MAX_TOP of a row's best; in the raw modes with the raw logits kept (the edits work in place
        on float32 logits, on a copy of others), in the processed modes where the fused sampler's
        cut stands for the filters."""
        from nanovllm.kernels.triton_logprobs import MAX_TOP
        if not (self.fused and md.max_num_logprobs is not None and md.max_num_logprobs <= MAX_TOP):
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
            if md.processors is not None:   # LLM(logits_processors=...): those that may change the argmax
                logits = md.processors.before_penalties(logits)
            if md.penalty_rows is not None:
                logits = apply_penalties(logits, md)
            if md.processors is not None:   # ...and the argmax-invariant ones, on the tempered logits
                logits = md.processors.after_temperature(logits, md.temperatures)
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
        chosen = None if md.logprob_rows is None else (md.logprob_rows, md.logprob_token_ids)
        if in_kernels and mode.startswith("raw"):
            return kernel_token_logprobs(raw_logits, token_ids, md.max_num_logprobs, as_logits, chosen)
        if in_kernels:   # the processed modes
            cuts, temperatures = processed_cuts(cut, md, len(logits), logits.device)
            return kernel_token_logprobs(logits, token_ids, md.max_num_logprobs, as_logits, chosen, cuts=cuts,
                                         temperatures=temperatures)
        if scores is None:   # the processed modes
            scores = processed_scores(logits, md, as_logits, cut=cut, filtered=filtered)
        out = token_logprobs(scores, token_ids, md.max_num_logprobs)
        if chosen is not None:
            chosen_logprobs(out, scores, *chosen)
        return out
