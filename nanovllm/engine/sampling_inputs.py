"""Per-step sampling inputs: the batch's SamplingParams turned into the sampler's tensors."""
from dataclasses import fields

import numpy as np
import torch

from nanovllm.engine.penalty_counts import PenaltyCounts
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import BitmaskFiller, grammar_bitmask
from nanovllm.engine.upload import upload
from nanovllm.layers.sampling_metadata import SamplingMetadata
from nanovllm.utils.arrays import padded


def build_sampling_metadata(seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int],
                            device: torch.device, counts: PenaltyCounts | None = None,
                            filler: BitmaskFiller | None = None) -> SamplingMetadata:
    """One row per sequence. Optional parts stay None when no row uses them. The parts are built
    as host arrays and moved to the sampler's device in one copy, without a sync. counts: the
    penalised sequences' token counts on the device (needed when a row has penalties); filler:
    what fills the grammar bitmasks (needed when a row is held to a grammar)."""
    md = host_sampling_metadata(seqs, vocab_size, eos_token_ids, counts, filler, pin_memory=device.type == "cuda")
    names = [f.name for f in fields(md) if isinstance(getattr(md, f.name), np.ndarray)]
    for name, tensor in zip(names, upload([getattr(md, name) for name in names], device)):
        setattr(md, name, tensor)
    if md.grammar_bitmask is not None:   # filled in pinned memory already: a copy of its own
        md.grammar_bitmask = md.grammar_bitmask.to(device, non_blocking=True)
    return md


def host_sampling_metadata(seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int],
                           counts: PenaltyCounts | None = None, filler: BitmaskFiller | None = None,
                           pin_memory: bool = False) -> SamplingMetadata:
    """SamplingMetadata with numpy arrays where the sampler takes tensors, but for the grammar
    bitmask: a host tensor (pinned if pin_memory), which xgrammar fills in place."""
    params = [seq.sampling_params for seq in seqs]
    vocab = vocab_size
    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    md = SamplingMetadata(   # an all-greedy batch takes the argmax: no temperatures
        temperatures=None if all_greedy else np.asarray([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                                        np.float32),
        is_greedy=None if all_greedy else np.asarray(greedy, np.bool_),
        all_greedy=all_greedy,
        any_greedy=any(greedy),
        top_k=None, max_top_k=None, top_p=None, min_p=None, row_seeds=[], banned_rows=None, banned_tokens=None,
    )
    if all(seq.samples_by_temperature_alone for seq in seqs):   # (most steps: the passes below find nothing)
        return md
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]   # a top_k >= vocab keeps every token: none
    if any(top_k):
        md.top_k = np.asarray([k or vocab for k in top_k], np.int64)
        md.max_set_top_k = max(top_k)
        if all(top_k):
            md.max_top_k = md.max_set_top_k
    if any(p.top_p < 1.0 for p in params):
        md.top_p = np.asarray([p.top_p for p in params], np.float32)
    if any(p.min_p > 0.0 for p in params):
        md.min_p = np.asarray([p.min_p for p in params], np.float32)
    # Seeded rows: the noise of output token t depends only on (seed, t).
    md.row_seeds = [(i, (p.seed * 1_000_003 + seq.num_output_tokens) % (1 << 63))
                    for i, (seq, p) in enumerate(zip(seqs, params)) if p.seed is not None]
    if md.row_seeds:
        rows, seeds = zip(*md.row_seeds)
        md.seeded_rows, md.seed_values = np.asarray(rows, np.int64), np.asarray(seeds, np.int64)
    banned = [(i, t) for i, (seq, p) in enumerate(zip(seqs, params))
              if seq.num_output_tokens < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))]
    # Rows that restrict or bias their logits (rare: one pass to find them, then only those).
    edited = [i for i, (seq, p) in enumerate(zip(seqs, params))
              if seq.bad_words_token_ids or p.allowed_token_ids is not None or p.logit_bias]
    banned += [(i, t) for i in edited for t in bad_word_endings(seqs[i])]
    if banned:
        rows, tokens = zip(*banned)
        md.banned_rows = np.asarray(rows, np.int64)
        md.banned_tokens = np.asarray(tokens, np.int64)
    allowed = [(i, params[i].allowed_token_ids) for i in edited if params[i].allowed_token_ids is not None]
    if allowed:
        rows, lists = zip(*allowed)
        md.allowed_rows = np.asarray(rows, np.int64)
        md.allowed_token_ids = padded(list(lists), vocab)
    bias = [(i, t, b) for i in edited for t, b in (params[i].logit_bias or {}).items()]
    if bias:
        rows, tokens, values = zip(*bias)
        md.bias_rows, md.bias_tokens = np.asarray(rows, np.int64), np.asarray(tokens, np.int64)
        md.bias_values = np.asarray(values, np.float32)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        # Counted on the device across steps (engine/penalty_counts.py): the rows' table rows, and
        # the prompts of the sequences penalised for the first time, to mark.
        table_rows, new = counts.rows([seqs[i] for i in penalised])
        md.penalty_rows, md.penalty_table_rows = np.asarray(penalised, np.int64), table_rows
        md.penalty_table = counts.table
        if new:
            md.new_table_rows = np.asarray([row for row, _ in new], np.int64)
            md.new_prompt_ids = padded([seq.known_prompt_token_ids for _, seq in new], vocab)
        md.presence_penalties = np.asarray([params[i].presence_penalty for i in penalised], np.float32)
        md.frequency_penalties = np.asarray([params[i].frequency_penalty for i in penalised], np.float32)
        md.repetition_penalties = np.asarray([params[i].repetition_penalty for i in penalised], np.float32)
    forced = [(i, token) for i, seq in enumerate(seqs) if seq.thinking_budget is not None
              for token in [seq.thinking_budget.forced_token(seq.token_ids)] if token is not None]
    if forced:
        rows, tokens = zip(*forced)
        md.forced_rows, md.forced_tokens = np.asarray(rows, np.int64), np.asarray(tokens, np.int64)
    constrained = grammar_bitmask(seqs, vocab, filler, pin_memory)
    if constrained is not None:
        md.grammar_rows, md.grammar_bitmask = constrained
    num_logprobs = [p.num_logprobs for p in params if p.num_logprobs is not None]
    md.max_num_logprobs = max(num_logprobs) if num_logprobs else None
    chosen = [(i, p.logprob_token_ids) for i, p in enumerate(params) if p.logprob_token_ids]
    if chosen:
        rows, lists = zip(*chosen)
        md.logprob_rows = np.asarray(rows, np.int64)
        md.logprob_token_ids = padded(list(lists), 0)
    return md


def bad_word_endings(seq: Sequence) -> set[int]:
    """Last tokens of seq's bad words whose other tokens end its output so far (a one-token bad
    word: always). Multi-token ones read output ids: the engine keeps them resolved for seq."""
    out = seq.output_token_ids
    return {ids[-1] for ids in seq.bad_words_token_ids
            if len(ids) <= len(out) + 1 and out[len(out) - len(ids) + 1:] == ids[:-1]}

