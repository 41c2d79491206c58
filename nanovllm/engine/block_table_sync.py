"""Block tables for the tensor-parallel workers, sent as changes.

Rank 0 owns the sequences; the workers only need each scheduled sequence's block table. A
step message carries, per sequence, the block ids the workers have not seen yet (none on most
decode steps), or the whole table when it no longer starts with what they have (the sequence
was preempted and given new blocks); and the ids of sequences that finished, to forget.

    rank 0:  updates = sender.updates(scheduled_seqs)   ->  step message
    rank k:  block_tables = receiver.apply(updates)      ==  rank 0's block tables
"""
from dataclasses import dataclass

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.utils.arrays import padded


@dataclass
class TableUpdates:
    rows: list[tuple[int, bool, list[int]]]   # per scheduled sequence: (seq_id, replace, new block ids)
    forget: list[int]                         # finished sequences


class BlockTableSender:
    """Rank 0: remembers what each worker-side table holds."""

    def __init__(self):
        self.sent: dict[int, tuple[Sequence, list[int]]] = {}

    def updates(self, seqs: list[Sequence]) -> TableUpdates:
        forget = [seq_id for seq_id, (seq, _) in self.sent.items() if seq.is_finished]
        for seq_id in forget:
            del self.sent[seq_id]
        rows = []
        for seq in seqs:
            table = seq.block_table
            _, sent = self.sent.get(seq.seq_id, (seq, None))
            if sent is not None and table[:len(sent)] == sent:
                rows.append((seq.seq_id, False, table[len(sent):]))
            else:
                rows.append((seq.seq_id, True, list(table)))
            self.sent[seq.seq_id] = (seq, list(table))
        return TableUpdates(rows, forget)


class BlockTableReceiver:
    """Ranks > 0: the tables, rebuilt from the updates."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}

    def apply(self, updates: TableUpdates) -> np.ndarray:
        """-> [num_seqs, max_num_blocks] int32, zero-padded, as rank 0's HostBatch.block_tables."""
        for seq_id in updates.forget:
            self.tables.pop(seq_id, None)
        tables = []
        for seq_id, replace, new in updates.rows:
            table = [] if replace else self.tables[seq_id]
            table.extend(new)
            self.tables[seq_id] = table
            tables.append(table)
        return padded(tables, 0, np.int32)
