"""The draft model of speculative decoding's "draft_model" method (vLLM's speculative_config={"model": a
smaller model of the same vocabulary, "num_speculative_tokens": k}).

The engine asks for drafts before it schedules a step (engine/speculative.py's DraftModelProposer gives each
sequence that may speculate k placeholders, of which the scheduler keeps what fits); once the step is scheduled
the model runner has the draft model make them, greedily, before the model checks them as it checks any drafts
(which keeps the outputs as without drafts, however the drafts were chosen).

The draft model keeps a KV cache of its own, laid out as the model's: the same blocks, by the same block tables,
so a sequence's draft K/V lies at the slots of its K/V, in blocks the scheduler has already given it (the KV
cache's blocks are sized for both models). Sequence.num_draft_computed counts the tokens whose draft K/V is
written; a step's drafts are made in k passes:

    tokens     | written by the draft | since: the last step's accepted tokens | last |
    pass 1     the tokens since, and the last        -> d1 (the last row's argmax)
    pass j     d(j-1), at the position after the one before -> dj, for j = 2 .. k

Pass 1 runs a sequence's whole prompt at its first drafting step (the draft K/V of a prefix-cache hit may
never have been written), in parts of at most max_num_batched_tokens tokens; after that it has one token more
than the drafts the step before accepted. It runs as a decode step of a row a token (step_inputs.token_rows)
where that fits the draft's CUDA graphs, as passes 2 .. k do. The drafts' own K/V (d1 .. d(k-1)) lies past the
sequence's tokens: the next pass 1 writes over what the model rejected. A preempted sequence's blocks go, and
with them what the draft had written (the scheduler sets num_draft_computed back to 0).
"""
import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine import kv_cache
from nanovllm.engine.cuda_graph import DecodeGraphs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import HostBatch, paged_batch, token_rows
from nanovllm.layers.attention import Attention
from nanovllm.layers.rotary import max_positions
from nanovllm.model.loader import init_dummy_weights, load_model
from nanovllm.model.qwen3 import build_model
from nanovllm.utils.arrays import padded


class DraftModel:
    def __init__(self, config: Config, device: torch.device, backend, splits_for):
        """backend: the model's attention backend (the draft's layers share it); splits_for(num_kv_heads) -> the
        SplitRules of a model with that many KV heads."""
        spec = config.speculative_config
        hf = spec.draft_hf_config
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.model = build_model(hf, config.torch_dtype, device)
        if config.load_format == "dummy":   # (the model's seed: a draft of the model's shape is the same model)
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, spec.draft_path, hf.tie_word_embeddings, spec.draft_fp8_checkpoint)
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.layers:
            layer.backend = backend
        self.splits = splits_for(self.layers[0].num_kv_heads)
        self.max_model_len = min(config.max_model_len, max_positions(hf))   # (the positions it can embed)
        self.hidden_size = hf.hidden_size
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None

    def block_bytes(self, dtype: torch.dtype) -> int:
        return kv_cache.block_bytes(self.layers, self.block_size, dtype)

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype):
        self.kv_cache = kv_cache.allocate(self.layers, num_blocks, self.block_size, dtype, self.device)

    def capture_graphs(self, max_rows: int, max_blocks_per_seq: int, pool) -> DecodeGraphs:
        self.graphs = DecodeGraphs(self.model, max_rows, max_blocks_per_seq, self.hidden_size,
                                   self.config.torch_dtype, self.device, self.splits.decode_split, pool=pool)
        return self.graphs

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], device_inputs):
        """Replace the placeholders in each of seqs' spec_token_ids by the draft model's greedy drafts.
        device_inputs: the model runner's (_device_inputs), which turns a HostBatch into the model's inputs."""
        passes = []   # (the indices into seqs of a pass's rows, their drafts on the device)
        rows, drafts = self._catch_up(seqs, device_inputs)
        passes.append((rows, drafts))
        for j in range(1, max(len(seq.spec_token_ids) for seq in seqs)):
            row_of = {i: r for r, i in enumerate(rows)}   # (the last pass's row of each sequence)
            rows = [i for i, seq in enumerate(seqs) if len(seq.spec_token_ids) > j]
            positions = [seqs[i].num_tokens - 1 + j for i in rows]
            batch = self._batch([seqs[i] for i in rows], [[0]] * len(rows), positions)
            hidden = self._forward(batch, drafts, [row_of[i] for i in rows], device_inputs)
            drafts = self.model.compute_logits(hidden).argmax(-1)
            passes.append((rows, drafts))
        values = iter(torch.cat([drafts for _, drafts in passes]).tolist())   # (the one wait for the GPU)
        made = [[] for _ in seqs]
        for rows, _ in passes:
            for i in rows:
                made[i].append(next(values))
        for seq, ids in zip(seqs, made):
            seq.spec_token_ids[:] = ids

    def _catch_up(self, seqs: list[Sequence], device_inputs) -> tuple[list[int], torch.Tensor]:
        """Pass 1: each sequence's tokens from num_draft_computed (or its last) to its end, in parts of at most
        max_num_batched_tokens -> (the indices of seqs, their first drafts on the device)."""
        starts = [min(seq.num_draft_computed, seq.num_tokens - 1) for seq in seqs]
        budget = self.config.max_num_batched_tokens
        firsts = [None] * len(seqs)
        while any(start < seq.num_tokens for start, seq in zip(starts, seqs)):
            part, ends, left = [], [], budget
            for i, (seq, start) in enumerate(zip(seqs, starts)):
                if start < seq.num_tokens and left > 0:
                    end = min(seq.num_tokens, start + left)
                    part.append(i)
                    ends.append(end)
                    left -= end - start
            batch = self._batch([seqs[i] for i in part], [seqs[i].token_ids[starts[i]:end] for i, end in
                                                          zip(part, ends)], [starts[i] for i in part])
            hidden = self._forward(batch, None, None, device_inputs)
            # (the sequences this part ends, by their row in it)
            last = [(r, i) for r, (i, end) in enumerate(zip(part, ends)) if end == seqs[i].num_tokens]
            if last:
                at = torch.tensor([batch.query_start_loc[r + 1] - 1 for r, _ in last], device=self.device)
                drafts = self.model.compute_logits(hidden[at]).argmax(-1)
                for k, (_, i) in enumerate(last):
                    firsts[i] = drafts[k:k + 1]
            for i, end in zip(part, ends):
                starts[i] = end
        for seq in seqs:
            seq.num_draft_computed = seq.num_tokens
        return list(range(len(seqs))), torch.cat(firsts)

    def _batch(self, seqs: list[Sequence], token_ids: list[list[int]], starts: list[int]) -> HostBatch:
        """A HostBatch of seqs' token_ids[i] from position starts[i] on, at their slots."""
        return paged_batch([t for ids in token_ids for t in ids], [len(ids) for ids in token_ids], starts,
                           padded([seq.block_table for seq in seqs], 0, np.int32), self.block_size)

    def _forward(self, batch: HostBatch, tokens: torch.Tensor | None, sources: list[int] | None,
                 device_inputs) -> torch.Tensor:
        """The draft model on batch -> hidden states [tokens, hidden]. tokens[sources[r]] (on the device) is row
        r's input id where given. A batch of up to num_speculative_tokens + 1 tokens a sequence runs as a decode
        step of a row a token, in the draft's graphs where they hold its rows."""
        num_tokens = len(batch.input_ids)
        if num_tokens > len(batch.seq_lens) and max(np.diff(batch.query_start_loc)) <= (
                self.config.speculative_config.num_speculative_tokens + 1):
            batch = token_rows(batch)
        pending = None if sources is None else (list(range(num_tokens)), sources)
        if self.graphs is not None and num_tokens == len(batch.seq_lens) <= self.graphs.max_batch_size:
            return self.graphs.run(batch.input_ids, batch.positions, batch.slot_mapping,
                                   np.asarray(batch.seq_lens, np.int32), batch.block_tables, pending, tokens)
        return self.model(*device_inputs(batch, pending, splits=self.splits, sampled=tokens))
