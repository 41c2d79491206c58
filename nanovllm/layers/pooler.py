"""The pooler of a pooling engine (runner="pooling"): a step's final hidden states -> the result of
each prompt that the step completes (pooling_params.py says what each task returns). A classifier's
head (layers/classifier.py) runs on the GPU, on the pooled rows only; what follows it (calibration,
activation), like an embedding's normalization, runs on the host on each step's results at once.

On CUDA the results travel to the host while the GPU goes on (pinned buffers, non-blocking copies,
an event after the last): the engine launches the next step before it reads them, so that the
host's work for a step overlaps the GPU's work for the one before."""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.classifier import activation_fn
from nanovllm.pooling_params import CLASSIFY_TASKS, TOKEN_TASKS, PoolerConfig


@dataclass
class PooledStep:
    """One step's finished prompts: seq_ids[i]'s result is parts[i] (host tensors, joined by rows; of
    those, the rows keep[i] where given: STEP pooling's), to be read once event has passed (None on the
    CPU: at once)."""
    seq_ids: list[int]
    parts: list[list[torch.Tensor]]
    keep: list[list[int] | None]
    params: list
    event: "torch.cuda.Event | None"
    finish: Callable   # (rows, params) -> the result (Pooler.finish)

    def results(self) -> dict[int, torch.Tensor]:
        """{seq_id: its result}, finished as its params say. Call after the event. (The results are
        copies: the pinned buffers go back to torch's cache once the step is dropped.)"""
        results, vectors = {}, {}   # (task, dimensions, use_activation) -> (params, seq_ids, one-vector results)
        for seq_id, parts, keep, params in zip(self.seq_ids, self.parts, self.keep, self.params):
            if keep is not None:
                results[seq_id] = self.finish(torch.cat(parts)[keep], params)
            elif len(parts) == 1 and parts[0].ndim == 1:
                _, ids, rows = vectors.setdefault((params.task, params.dimensions, params.use_activation),
                                                  (params, [], []))
                ids.append(seq_id)
                rows.append(parts[0])
            else:
                results[seq_id] = self.finish(torch.cat(parts), params)
        for params, ids, rows in vectors.values():   # one pass for the step's vectors alike
            results.update(zip(ids, self.finish(torch.stack(rows), params)))
        return results


class Pooler:
    def __init__(self, config: PoolerConfig, head: nn.Module | None = None):
        """head: a classifier's (None for an embedding model)."""
        self.config = config
        self.head = head
        self.activation = activation_fn(head.config.activation) if head is not None else None
        self.chunks: dict[int, list[torch.Tensor]] = {}   # seq_id -> a token task's rows so far (host)

    def __call__(self, hidden: torch.Tensor, seqs: list, num_scheduled: list[int],
                 query_start_loc: list[int]) -> PooledStep:
        """hidden: the step's final hidden states, sequence i owning rows query_start_loc[i]:[i + 1]
        -> the results of the sequences whose prompts this step completes, on their way to the host."""
        done: dict[int, list[torch.Tensor]] = {}
        last_rows, last_ids = [], []
        for i, (seq, n) in enumerate(zip(seqs, num_scheduled)):
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            completes = seq.num_computed_tokens + n == seq.num_prompt_tokens
            if seq.pooling_params.task in TOKEN_TASKS:
                if seq.num_computed_tokens == 0:   # (again after a preemption)
                    self.chunks[seq.seq_id] = []
                self.chunks[seq.seq_id].append(to_host(self.project(rows)))
                if completes:
                    done[seq.seq_id] = self.chunks.pop(seq.seq_id)
            elif completes and self.config.seq_pooling_type == "LAST":
                last_rows.append(query_start_loc[i + 1] - 1)
                last_ids.append(seq.seq_id)
            elif completes:   # CLS or MEAN: the whole prompt ran in this step (Config turns chunking off for them)
                assert seq.num_computed_tokens == 0 and n == seq.num_prompt_tokens
                pooled = rows[:1] if self.config.seq_pooling_type == "CLS" else rows.float().mean(0, keepdim=True)
                done[seq.seq_id] = [to_host(self.project(pooled))[0]]
        if last_rows:
            index = torch.tensor(last_rows)
            if hidden.device.type == "cuda":   # (pinned: a copy from pageable memory would wait for the GPU)
                index = index.pin_memory().to(hidden.device, non_blocking=True)
            rows = to_host(self.project(hidden.index_select(0, index)))
            done.update((seq_id, [row]) for seq_id, row in zip(last_ids, rows))
        event = None
        if hidden.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        finished = [seq for seq in seqs if seq.seq_id in done]
        return PooledStep([seq.seq_id for seq in finished], [done[seq.seq_id] for seq in finished],
                          [step_rows(seq) for seq in finished], [seq.pooling_params for seq in finished], event,
                          self.finish)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states [n, hidden] -> what a result is made of: themselves, or a classifier's logits."""
        return rows if self.head is None else self.head(rows)

    def finish(self, data: torch.Tensor, params) -> torch.Tensor:
        """A result's rows (host, float32) as its params ask: an embedding cut to its first `dimensions`
        features and, with use_activation, scaled to length 1 (vLLM's order); a classifier's logits
        calibrated by logit_mean and logit_sigma, then, with use_activation, made probabilities. Either
        keeps only the columns returned_token_ids first (STEP pooling)."""
        if params.returned_token_ids and params.task in TOKEN_TASKS:   # (an empty list: every column, as vLLM)
            data = data[:, params.returned_token_ids]
        if params.task not in CLASSIFY_TASKS:
            if params.dimensions is not None:
                data = data[..., :params.dimensions]
            return F.normalize(data, p=2, dim=-1) if params.use_activation else data
        if self.config.logit_mean is not None:
            data = data - self.config.logit_mean
        if self.config.logit_sigma is not None:
            data = data / self.config.logit_sigma
        return self.activation(data) if params.use_activation else data

    def forget(self, seq_id: int):
        """Drop what was kept of an aborted sequence."""
        self.chunks.pop(seq_id, None)


def step_rows(seq) -> list[int] | None:
    """The rows a token task's result keeps (STEP pooling): those of the prompt tokens whose id is the request's
    step_tag_id (never a position given as a vector); None: every row."""
    params = seq.pooling_params
    if params.task not in TOKEN_TASKS or params.step_tag_id is None:
        return None
    ids = seq.token_ids[:seq.num_prompt_tokens]
    if seq.prompt_embeds is None:
        return [i for i, t in enumerate(ids) if t == params.step_tag_id]
    known = seq.prompt_embeds.is_token_ids or []   # (None: every position a vector)
    return [i for i, (t, given) in enumerate(zip(ids, known)) if given and t == params.step_tag_id]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """t in float32 on the host: a copy under way into pinned memory on CUDA (read it after an event
    recorded later), a copy at once on the CPU."""
    t = t.float()
    if t.device.type == "cpu":
        return t.clone()
    return torch.empty(t.shape, dtype=torch.float32, pin_memory=True).copy_(t, non_blocking=True)

