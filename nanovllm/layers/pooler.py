"""The pooler of a pooling engine (runner="pooling"): a step's final hidden states -> the result of
each prompt that the step completes (pooling_params.py says what each task returns).

On CUDA the results travel to the host while the GPU goes on (pinned buffers, non-blocking copies,
an event after the last): the engine launches the next step before it reads them, so that the
host's work for a step overlaps the GPU's work for the one before."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.pooling_params import PoolerConfig


@dataclass
class PooledStep:
    """One step's finished prompts: seq_ids[i]'s result is parts[i] (host tensors, joined by rows),
    to be read once event has passed (None on the CPU: at once)."""
    seq_ids: list[int]
    parts: list[list[torch.Tensor]]
    params: list
    event: "torch.cuda.Event | None"

    def results(self) -> dict[int, torch.Tensor]:
        """{seq_id: its result}, cut to its dimensions and normalized as its params say. Call after the event.
        (The results are copies: the pinned buffers go back to torch's cache once the step is dropped.)"""
        results, vectors = {}, {}   # vectors: (dimensions, use_activation) -> [(seq_id, "embed" vector)]
        for seq_id, parts, params in zip(self.seq_ids, self.parts, self.params):
            if len(parts) == 1 and parts[0].ndim == 1:
                vectors.setdefault((params.dimensions, params.use_activation), []).append((seq_id, parts[0]))
            else:
                results[seq_id] = finish(torch.cat(parts), params.dimensions, params.use_activation)
        for (dimensions, use_activation), items in vectors.items():   # one pass for the step's vectors alike
            block = finish(torch.stack([vector for _, vector in items]), dimensions, use_activation)
            results.update(zip([seq_id for seq_id, _ in items], block))
        return results


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config
        self.chunks: dict[int, list[torch.Tensor]] = {}   # seq_id -> a "token_embed" prompt's rows so far (host)

    def __call__(self, hidden: torch.Tensor, seqs: list, num_scheduled: list[int],
                 query_start_loc: list[int]) -> PooledStep:
        """hidden: the step's final hidden states, sequence i owning rows query_start_loc[i]:[i + 1]
        -> the results of the sequences whose prompts this step completes, on their way to the host."""
        done: dict[int, list[torch.Tensor]] = {}
        last_rows, last_ids = [], []
        for i, (seq, n) in enumerate(zip(seqs, num_scheduled)):
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            completes = seq.num_computed_tokens + n == seq.num_prompt_tokens
            if seq.pooling_params.task == "token_embed":
                if seq.num_computed_tokens == 0:   # (again after a preemption)
                    self.chunks[seq.seq_id] = []
                self.chunks[seq.seq_id].append(to_host(rows))
                if completes:
                    done[seq.seq_id] = self.chunks.pop(seq.seq_id)
            elif completes and self.config.seq_pooling_type == "LAST":
                last_rows.append(query_start_loc[i + 1] - 1)
                last_ids.append(seq.seq_id)
            elif completes:   # CLS or MEAN: the whole prompt ran in this step (Config turns chunking off for them)
                assert seq.num_computed_tokens == 0 and n == seq.num_prompt_tokens
                done[seq.seq_id] = [to_host(rows[0] if self.config.seq_pooling_type == "CLS" else rows.float().mean(0))]
        if last_rows:
            rows = to_host(hidden.index_select(0, torch.tensor(last_rows, device=hidden.device)))
            done.update((seq_id, [row]) for seq_id, row in zip(last_ids, rows))
        event = None
        if hidden.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        finished = [seq for seq in seqs if seq.seq_id in done]
        return PooledStep([seq.seq_id for seq in finished], [done[seq.seq_id] for seq in finished],
                          [seq.pooling_params for seq in finished], event)

    def forget(self, seq_id: int):
        """Drop what was kept of an aborted sequence."""
        self.chunks.pop(seq_id, None)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """t in float32 on the host: a copy under way into pinned memory on CUDA (read it after an event
    recorded later), a copy at once on the CPU."""
    t = t.float()
    if t.device.type == "cpu":
        return t.clone()
    return torch.empty(t.shape, dtype=torch.float32, pin_memory=True).copy_(t, non_blocking=True)


def finish(data: torch.Tensor, dimensions: int | None, use_activation: bool) -> torch.Tensor:
    """Pooled vectors (the last dimension) cut to their first `dimensions` features and, with
    use_activation, scaled to length 1 (vLLM's order)."""
    if dimensions is not None:
        data = data[..., :dimensions]
    if use_activation:
        data = F.normalize(data, p=2, dim=-1)
    return data
