"""Token counts for presence, frequency and repetition penalties, kept on the sampler's device.

A penalised sequence's next token depends on every token it has produced so far (and, for the
repetition penalty, on those of its prompt). Sending those ids every step would cost host work
that grows with the sequence, and reading each step's sampled tokens before launching the next
would end async scheduling for the whole batch. So each penalised sequence gets a row of one
[rows, vocab + 1] int32 table on the device when it first samples; its prompt's tokens are
marked then, once, and after every step the sampler adds the tokens it drew
(layers/logit_edits.py, count_sampled). An entry holds 2 x (times the token is in the output) +
(1 if it is in the prompt); the last column takes the padding ids of the prompt upload.

A row stays with its sequence until the sequence finishes (through preemption too, so nothing
is ever recounted); then the next sequence that needs one takes it over. The first penalised
request makes the table max_num_seqs rows tall, which the KV cache's sizing leaves room for
(`reserved_bytes`); only preempted sequences holding rows beside a full batch make it grow. All of this is queued
on one device stream, so a token drawn for a sequence after it stopped is added before the new
owner's row is cleared.
"""
import numpy as np
import torch

from nanovllm.engine.sequence import Sequence


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device, max_num_seqs: int):
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.table = torch.zeros(0, vocab_size + 1, dtype=torch.int32, device=device)
        self.owners: list[Sequence | None] = []      # table row -> the sequence it counts for
        self.row_of: dict[int, int] = {}             # seq_id -> table row

    @property
    def reserved_bytes(self) -> int:
        """The table's bytes once a penalised request has made it (max_num_seqs rows)."""
        return self.max_num_seqs * self.table.shape[1] * self.table.element_size()

    def rows(self, seqs: list[Sequence]) -> tuple[np.ndarray, list[tuple[int, Sequence]]]:
        """The table rows of seqs (every one penalised), giving a row to each that has none.
        -> (their rows, [(row, sequence)] of the rows given now, which the sampler clears and
        fills with the sequence's prompt before it reads them)."""
        rows, new = [], []
        for seq in seqs:
            row = self.row_of.get(seq.seq_id)
            if row is None:
                # A sequence's first sampling step: it has no output tokens, pending ones least of all.
                assert seq.num_pending_tokens == 0, "a penalised sequence sampled without its row"
                row = self._free_row()
                self.owners[row], self.row_of[seq.seq_id] = seq, row
                new.append((row, seq))
            rows.append(row)
        return np.asarray(rows, np.int64), new

    def _free_row(self) -> int:
        for row, owner in enumerate(self.owners):
            if owner is None or owner.is_finished:
                if owner is not None:
                    del self.row_of[owner.seq_id]
                return row
        grown = torch.zeros(max(self.max_num_seqs, 2 * len(self.owners)), self.table.shape[1], dtype=self.table.dtype,
                            device=self.table.device)
        grown[:len(self.owners)] = self.table
        self.table = grown
        self.owners += [None] * (len(grown) - len(self.owners))
        return self._free_row()
