"""The engine's side of custom logits processors (nanovllm/logits_processor.py): a persistent batch of the
sampling sequences, as vLLM keeps one, told to the processors as BatchUpdates, and the step's logits handed to
them in that batch's order.

Each step the sequences that sample keep their indices; those gone leave holes, new ones take the lowest holes
(or the end), and the last ones move down into the holes left, so that the batch is indices 0 .. n - 1. The
step's logits come in the scheduler's order of the sequences; where that differs from the batch's, they are
gathered into it for the processors and scattered back.
"""
from collections.abc import Sequence as SequenceABC

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.logits_processor import BatchUpdate, MoveDirectionality


class OutputTokens(SequenceABC):
    """A sequence's output token ids so far, read live (vLLM hands processors a reference to the growing list);
    a token still on the device (async scheduling) is not in it yet."""

    def __init__(self, seq: Sequence):
        self.seq = seq

    def __len__(self) -> int:
        return self.seq.num_output_tokens - self.seq.num_pending_tokens

    def __getitem__(self, index):
        start, n = self.seq.num_prompt_tokens, len(self)
        if isinstance(index, slice):
            return self.seq.token_ids[start:start + n][index]
        if not -n <= index < n:
            raise IndexError("output token index out of range")
        return self.seq.token_ids[start + index % n]

    def __repr__(self) -> str:
        return repr(list(self))


class ProcessorBatch:
    """The processors (instances, split as vLLM splits them by is_argmax_invariant) and the persistent batch they
    see (seq_id -> index)."""

    def __init__(self, classes: list[type], config, device: torch.device):
        self.processors = [cls(config, device, device.type == "cuda") for cls in classes]
        self.invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self.varying = [p for p in self.processors if not p.is_argmax_invariant()]
        self.index: dict[int, int] = {}   # seq_id -> its index in the batch
        self.order: list[int] = []        # index -> seq_id

    def step(self, seqs: list[Sequence]) -> "StepProcessors":
        """Tell the processors how the batch changed to seqs (this step's sampling sequences, in the order of the
        logits' rows) -> the step's processors."""
        current = {seq.seq_id for seq in seqs}
        holes = sorted(i for seq_id, i in self.index.items() if seq_id not in current)
        for i in holes:
            del self.index[self.order[i]]
        added = []
        for seq in seqs:
            if seq.seq_id not in self.index:
                i = holes.pop(0) if holes else len(self.order)
                self.order[i:i + 1] = [seq.seq_id]
                self.index[seq.seq_id] = i
                # (vLLM's prompt ids: None for a prompt given as vectors alone)
                embeds_only = seq.prompt_embeds is not None and seq.prompt_embeds.is_token_ids is None
                prompt_ids = None if embeds_only else seq.token_ids[:seq.num_prompt_tokens]
                added.append((i, seq.sampling_params, prompt_ids, OutputTokens(seq)))
        removed, moved = list(holes), []
        occupied, last = set(self.index.values()), len(self.order) - 1
        for hole in holes:   # the last ones down into the holes below the batch's new end
            if hole >= len(current):
                break
            while last not in occupied:
                last -= 1
            seq_id = self.order[last]
            self.order[hole], self.index[seq_id] = seq_id, hole
            occupied.discard(last)
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self.order[len(current):]
        update = BatchUpdate(len(current), removed, added, moved) if removed or added else None
        for processor in self.processors:
            processor.update_state(update)
        order = [0] * len(seqs)   # each batch index's logits row
        for row, seq in enumerate(seqs):
            order[self.index[seq.seq_id]] = row
        return StepProcessors(self, None if order == list(range(len(order))) else order)


class StepProcessors:
    """A step's processors over its logits, in two phases as vLLM runs them: those that may change the argmax
    before the penalties, the argmax-invariant ones on the logits divided by the temperature."""

    def __init__(self, batch: ProcessorBatch, order: list[int] | None):
        self.batch = batch
        self.order = order   # each batch index's logits row, where the rows are in another order (else None)

    def before_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        return self._run(self.batch.varying, logits)

    def after_temperature(self, logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
        """The argmax-invariant ones on logits / temperature (temperatures None: all greedy, where vLLM runs
        none), then multiplied back (the sampler divides by the temperature itself)."""
        if not self.batch.invariant or temperatures is None:
            return logits
        return self._run(self.batch.invariant, logits / temperatures[:, None]) * temperatures[:, None]

    def _run(self, processors: list, logits: torch.Tensor) -> torch.Tensor:
        if not processors:
            return logits
        if self.order is None:
            for processor in processors:
                logits = processor.apply(logits)
            return logits
        index = torch.tensor(self.order, device=logits.device)
        batch = logits[index]
        for processor in processors:
            batch = processor.apply(batch)
        logits[index] = batch
        return logits
