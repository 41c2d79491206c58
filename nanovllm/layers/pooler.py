"""The pooler of a pooling engine (runner="pooling"): a step's final hidden states -> the result of
each prompt that the step completes (pooling_params.py says what each task returns)."""
import torch
import torch.nn.functional as F

from nanovllm.pooling_params import PoolerConfig


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config
        self.chunks: dict[int, list[torch.Tensor]] = {}   # seq_id -> a "token_embed" prompt's rows so far (host)

    def __call__(self, hidden: torch.Tensor, seqs: list, num_scheduled: list[int],
                 query_start_loc: list[int]) -> dict[int, torch.Tensor]:
        """hidden: the step's final hidden states, sequence i owning rows query_start_loc[i]:[i + 1]
        -> {seq_id: result on the host} for each sequence whose prompt this step completes."""
        results, last_rows, last_ids = {}, [], []
        for i, (seq, n) in enumerate(zip(seqs, num_scheduled)):
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            done = seq.num_computed_tokens + n == seq.num_prompt_tokens
            if seq.pooling_params.task == "token_embed":
                if seq.num_computed_tokens == 0:   # (again after a preemption)
                    self.chunks[seq.seq_id] = []
                self.chunks[seq.seq_id].append(rows.to("cpu", torch.float32, copy=True))
                if done:
                    results[seq.seq_id] = torch.cat(self.chunks.pop(seq.seq_id))
            elif done and self.config.seq_pooling_type == "LAST":
                last_rows.append(query_start_loc[i + 1] - 1)
                last_ids.append(seq.seq_id)
            elif done:   # CLS or MEAN: the whole prompt ran in this step (Config turns chunking off for them)
                assert seq.num_computed_tokens == 0 and n == seq.num_prompt_tokens
                results[seq.seq_id] = rows[0] if self.config.seq_pooling_type == "CLS" else rows.float().mean(0)
        if last_rows:
            index = torch.tensor(last_rows, device=hidden.device)
            results.update(zip(last_ids, hidden.index_select(0, index).to("cpu", torch.float32)))
        return {seq.seq_id: finish(results[seq.seq_id].to("cpu", torch.float32, copy=True), seq.pooling_params)
                for seq in seqs if seq.seq_id in results}

    def forget(self, seq_id: int):
        """Drop what was kept of an aborted sequence."""
        self.chunks.pop(seq_id, None)


def finish(data: torch.Tensor, params) -> torch.Tensor:
    """A pooled vector (or one a token, rows of data) cut to params.dimensions and, with
    use_activation, scaled to length 1 (vLLM's order)."""
    if params.dimensions is not None:
        data = data[..., :params.dimensions]
    if params.use_activation:
        data = F.normalize(data, p=2, dim=-1)
    return data
