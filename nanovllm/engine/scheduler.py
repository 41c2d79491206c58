"""Scheduler: picks which tokens of which sequences the next step computes (no torch here).

One token budget per step (vLLM v1): running sequences first, in admission order, each takes
what it still needs (1 token for a decode, with its drafts under speculative decoding; the rest
of its prompt for a prefill; capped by what is left of the budget); then waiting sequences are
admitted while budget, blocks and `max_num_seqs` allow. Any sequence's prefill can be chunked,
so decodes and prefill chunks share one batch (unless chunked prefill is off: then a prompt that
does not fit what is left of the budget waits for the next step). When blocks run out, the most
recently admitted sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed (cheaply, when its blocks are still in the prefix cache).

With policy="priority" (vLLM's `scheduling_policy`) both queues stay ordered by (priority,
arrival), lower priority values first: admission takes the best waiting sequence, the budget goes
to the best running ones, and preemption takes the worst running one.
"""
import bisect
from collections import deque
from dataclasses import dataclass

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_scheduled_tokens: list[int]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """Sequences whose scheduled tokens reach their last token: they get a new one (or more,
        with drafts)."""
        return [seq for seq, n in zip(self.seqs, self.num_scheduled_tokens)
                if seq.num_computed_tokens + n >= seq.num_tokens]

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, chunked_prefill: bool = True, policy: str = "fcfs", max_loras: int = 0):
        """max_loras: with LoRA, the most adapters the running sequences may use at once."""
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_cache_queries = 0   # tokens looked up in the prefix cache at admission
        self.num_prefix_cache_hits = 0      # of those, tokens found

    def add(self, seq: Sequence):
        self._enqueue(self.waiting, seq, self.waiting.append)

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence, fcfs_put):
        """Priority policy: into queue at its (priority, arrival) place; FCFS: fcfs_put(seq)."""
        if self.policy == "priority":
            bisect.insort(queue, seq, key=_priority_order)
        else:
            fcfs_put(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and seq.reached_length_limit(self.max_model_len):
                i += 1      # done once its pending token is read; nothing left to compute
                continue
            num_new = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            del seq.spec_token_ids[max(seq.num_computed_tokens + num_new - seq.num_tokens, 0):]   # past the budget
            while not self.block_manager.allocate_slots(seq, num_new):
                if seq.spec_token_ids:   # drafts are a guess: drop them before preempting anyone
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break

        # Admit nothing new in a step that had to preempt: memory is tight. A sequence whose LoRA adapter
        # would be one too many waits, and those after it may go first (vLLM's).
        loras = {seq.lora_int_id for seq in self.running} - {0} if self.max_loras else set()   # (LoRA off: none)
        skipped = 0
        while (not preempted and skipped < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[skipped]
            lora_id = seq.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                skipped += 1
                continue
            # skip_reading_prefix_cache (vLLM's; on by default for prompt logprobs): the whole prompt
            # is computed, no prefix-cache hits.
            computed_blocks = ([] if seq.sampling_params.skip_reading_prefix_cache
                               else self.block_manager.get_computed_blocks(seq))
            num_cached = len(computed_blocks) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.chunked_prefill and num_new < seq.num_tokens - num_cached:
                break
            if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                break
            del self.waiting[skipped]
            if lora_id:
                loras.add(lora_id)
            self.num_prefix_cache_queries += seq.num_tokens
            self.num_prefix_cache_hits += num_cached
            seq.num_computed_tokens = num_cached
            if seq.is_first_admission:
                seq.num_cached_tokens = num_cached
                seq.is_first_admission = False
            seq.status = SequenceStatus.RUNNING
            self.block_manager.cache_full_blocks(seq, num_cached + num_new)
            self._enqueue(self.running, seq, self.running.append)   # priority: running.pop() is the worst
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return out

    def preempt_all(self):
        """Every running sequence back to waiting, its blocks freed (sleep mode's "keep")."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, seq: Sequence):
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0   # (the K/V of both models goes with the blocks)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, self.waiting.appendleft)
        self.num_preemptions += 1

    def update_computed(self, out: SchedulerOutput):
        """After the model ran: the scheduled tokens' KV is in the cache."""
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence):
        """Remove a finished or aborted sequence, wherever it is, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED


def _priority_order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.seq_id
