"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token scored given the ones
before it, from the logits of the rows before it (step_inputs.prompt_spans says which)."""
from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplerOutput, token_logprobs


@dataclass
class PromptLogprobsChunk:
    """Prompt tokens first, first + 1, ... of one sequence, scored in one step (host values),
    each given the tokens before it."""
    seq: Sequence
    first: int
    logprobs: list[float]
    ranks: list[int]
    top: list[tuple[list[int], list[float]]] | None   # per token: (token ids, logprobs), best first


def score_prompts(spans: list[tuple[Sequence, int, list[int]]], prompt_logits: list[torch.Tensor],
                  device: torch.device) -> list[PromptLogprobsChunk]:
    """spans: (sequence, its first prompt token scored, the rows that score it and the next ones);
    prompt_logits: those rows' logits, in order, in parts -> one chunk a span, read to the host."""
    targets = [seq.token_ids[t] for seq, first, rows in spans for t in range(first, first + len(rows))]
    targets = torch.tensor(targets, device=device)
    num_top = max(seq.sampling_params.prompt_logprobs for seq, _, _ in spans)
    parts, start = [], 0
    for logits in prompt_logits:
        end = start + logits.shape[0]
        parts.append(_score(logits, targets[start:end], num_top))
        start = end
    logprobs = torch.cat([p.logprobs for p in parts]).tolist()
    ranks = torch.cat([p.ranks for p in parts]).tolist()
    top = None
    if num_top:
        top = list(zip(torch.cat([p.top_ids for p in parts]).tolist(),
                       torch.cat([p.top_logprobs for p in parts]).tolist()))
    chunks, start = [], 0
    for seq, first, rows in spans:
        end = start + len(rows)
        chunks.append(PromptLogprobsChunk(seq, first, logprobs[start:end], ranks[start:end],
                                          top[start:end] if top else None))
        start = end
    return chunks


def _score(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> SamplerOutput:
    """logits: [rows, V] raw; targets: [rows] -> each target's logprob and rank, and the rows' num_top
    best. On CUDA in two passes over the logits (kernels/triton_logprobs.py, as the sampled tokens'),
    without a float32 log_softmax of every row, for up to its MAX_TOP best."""
    if logits.is_cuda:
        from nanovllm.kernels import triton_logprobs
        if num_top <= triton_logprobs.MAX_TOP:
            out = SamplerOutput(targets)
            out.logprobs, out.ranks, out.top_logprobs, out.top_ids = triton_logprobs.token_logprobs(
                logits, targets, num_top)
            return out
    return token_logprobs(logits.float().log_softmax(-1), targets, num_top)
