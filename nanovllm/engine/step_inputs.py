"""What one step computes, built on the host from the scheduler's output (numpy, no torch).

Rank 0 builds a StepInputs and sends it to the other ranks; every rank then runs it
(ModelRunner.run_step). The batch is flat: sequence i owns rows query_start_loc[i]:[i+1] of
input_ids, positions and slot_mapping.

    seq 0 (decode)    seq 1 (prefill chunk of 3)    seq 2 (decode)
    | row 0 |         | row 1 | row 2 | row 3 |     | row 4 |        query_start_loc = [0, 1, 4, 5]
"""
from dataclasses import dataclass, field, replace
from itertools import accumulate

import numpy as np

from nanovllm.engine.block_table_sync import TableUpdates
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.arrays import padded


@dataclass
class HostBatch:
    """One step's inputs on the host, flattened: sequence i owns rows query_start_loc[i]:[i+1]."""
    input_ids: np.ndarray        # [num_tokens] int64
    positions: np.ndarray        # [num_tokens] int64
    slot_mapping: np.ndarray     # [num_tokens] int64
    block_tables: np.ndarray | None   # [num_seqs, max_num_blocks] int32; None in a worker's message
    query_start_loc: list[int]   # [num_seqs + 1]
    seq_lens: list[int]          # [num_seqs]


@dataclass
class StepInputs:
    """Everything a rank needs to run one step; rank 0 sends it to the other ranks."""
    batch: HostBatch
    pending_rows: list[int]         # input rows whose token id is only on the device:
    pending_sources: list[int]      # ...row pending_sources[i] of the previous step's sampled tokens
    logits_rows: list[int] | None   # rows whose hidden state becomes logits; None: every row
    num_sampling: int               # number of logits rows (0: nothing is sampled)
    table_updates: TableUpdates | None = None   # to the workers, in place of batch.block_tables
    prompt_rows: list[int] = field(default_factory=list)   # rows whose logits score the next prompt token
    lora_slots: np.ndarray | None = None   # with LoRA: [num_tokens] each token's adapter slot, -1 for none
    lora_loads: list = field(default_factory=list)   # (slot, LoRARequest): adapters to put in slots first
    # (rows, vectors [len(rows), hidden] on the host) for positions of prompts given as vectors (prompt_embeds)
    embeds: tuple | None = None


def host_batch(out: SchedulerOutput, block_size: int) -> HostBatch:
    """Flatten the scheduled tokens of all sequences into one batch (paged_batch)."""
    seqs, counts = out.seqs, out.num_scheduled_tokens
    starts = [seq.num_computed_tokens for seq in seqs]
    input_ids = []
    for seq, start, end in zip(seqs, starts, (start + n for start, n in zip(starts, counts))):
        input_ids += seq.token_ids[start:end]
        if end > seq.num_tokens:   # drafts (engine/speculative.py)
            input_ids += seq.spec_token_ids[:end - seq.num_tokens]
    return paged_batch(input_ids, counts, starts, padded([seq.block_table for seq in seqs], 0, np.int32), block_size)


def paged_batch(input_ids: list[int], counts: list[int], starts: list[int], block_tables: np.ndarray,
                block_size: int) -> HostBatch:
    """The HostBatch of sequences whose counts[i] tokens (input_ids, one after another) begin at position
    starts[i]: token t of a sequence sits at slot block_table[t // block_size] * block_size + t % block_size."""
    bs = block_size
    query_start_loc = [0, *accumulate(counts)]
    if len(input_ids) == len(counts):   # one token a sequence, a decode step (each schedules at least one)
        rows, positions = np.arange(len(counts)), np.asarray(starts, np.int64)
    else:                               # each token's sequence and position
        rows = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(len(input_ids)) + np.repeat(np.asarray(starts) - query_start_loc[:-1], counts)
    slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
    seq_lens = [start + n for start, n in zip(starts, counts)]
    return HostBatch(np.asarray(input_ids, np.int64), positions, slots, block_tables, query_start_loc, seq_lens)


def build_step(out: SchedulerOutput, sampling_seqs: list[Sequence], pending: dict[int, int] | None,
               block_size: int) -> StepInputs:
    """pending: {seq_id: row in the previous step's sampled tokens} for sequences whose last token
    the host has not read yet."""
    batch = host_batch(out, block_size)
    rows, sources = [], []
    for i, seq in enumerate(out.seqs):
        if seq.num_pending_tokens:
            assert seq.num_pending_tokens == 1 and batch.query_start_loc[i + 1] - batch.query_start_loc[i] == 1
            rows.append(batch.query_start_loc[i + 1] - 1)
            sources.append(pending[seq.seq_id])
    num_tokens = len(batch.input_ids)
    if len(sampling_seqs) == len(out.seqs) == num_tokens:
        logits_rows = None                          # pure decode: every row samples
    else:   # a sampling sequence's last 1 + len(drafts) rows: its last token's and its drafts'
        sampling = {id(s) for s in sampling_seqs}
        logits_rows = [row for i, seq in enumerate(out.seqs) if id(seq) in sampling
                       for row in range(batch.query_start_loc[i + 1] - 1 - len(seq.spec_token_ids),
                                        batch.query_start_loc[i + 1])]
    return StepInputs(batch, rows, sources, logits_rows, num_tokens if logits_rows is None else len(logits_rows))


def embed_rows(out: SchedulerOutput, batch: HostBatch) -> tuple[np.ndarray, list] | None:
    """The batch rows of the step's positions given as vectors (prompt_embeds, inputs.py), and those
    vectors in parts (a tensor a sequence), in the rows' order; None if the step has none."""
    rows, parts = [], []
    for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        start = seq.num_computed_tokens
        if seq.prompt_embeds is None or start >= len(seq.prompt_embeds):
            continue
        positions = seq.prompt_embeds.positions(start, start + n)
        rows += [batch.query_start_loc[i] - start + p for p in positions]
        parts.append(seq.prompt_embeds.values[positions])
    return (np.asarray(rows, np.int64), parts) if rows else None


def token_rows(batch: HostBatch) -> HostBatch:
    """The batch as a decode step of one row a token: each token attends to its sequence's context up to
    itself, the step's earlier tokens included (all are stored before attention reads the cache), which is
    causal attention over the sequence's new tokens. A speculative step (each sequence's last token and its
    drafts) runs so in the decode kernel and graphs instead of the prefill kernel.

        seq 0: tokens at 7, 8, 9    seq 1: token at 4    ->  rows 7, 8, 9 (seq 0's pages), 4 (seq 1's)
        query_start_loc [0, 3, 4]                             query_start_loc [0, 1, 2, 3, 4]
        seq_lens [10, 5]                                      seq_lens [8, 9, 10, 5]
    """
    seq_of_row = np.repeat(np.arange(len(batch.seq_lens)), np.diff(batch.query_start_loc))
    return replace(batch, block_tables=batch.block_tables[seq_of_row],
                   query_start_loc=list(range(len(batch.input_ids) + 1)), seq_lens=(batch.positions + 1).tolist())


def prompt_spans(out: SchedulerOutput, batch: HostBatch) -> list[tuple[Sequence, int, list[int]]]:
    """(seq, first prompt token scored, batch rows) for each sequence that asked for prompt
    logprobs and has prompt tokens to score in this step: the row of position p scores
    prompt token p + 1. Tokens scored before a preemption are not scored again."""
    spans = []
    for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        if seq.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        first = max(start, seq.num_prompt_scored)
        end = min(start + n, seq.num_prompt_tokens - 1)
        row0 = batch.query_start_loc[i] - start
        if first < end:
            spans.append((seq, first + 1, list(range(row0 + first, row0 + end))))
    return spans


def mixed_step_decodes(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], int]:
    """A step with prompt tokens -> (its one-token sequences, the longest of its other sequences):
    the decode kernel takes the first, and the second picks the prefill kernel's configuration."""
    decodes = [i for i, (a, b) in enumerate(zip(query_start_loc, query_start_loc[1:])) if b - a == 1]
    longest = max(n for n, a, b in zip(seq_lens, query_start_loc, query_start_loc[1:]) if b - a > 1)
    return decodes, longest
