"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token scored given the ones
before it, from the logits of the rows before it (step_inputs.prompt_spans says which).

A step's scores are copied to the host while the GPU goes on, and read with its sampled tokens
(LLMEngine._resolve), so a step that scores prompt tokens does not make the host wait for it."""
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.upload import upload
from nanovllm.layers.logprobs import kernel_token_logprobs, token_logprobs
from nanovllm.layers.sampling_metadata import SamplerOutput


@dataclass
class PromptLogprobsChunk:
    """Prompt tokens first, first + 1, ... of one sequence, scored in one step (host arrays, a row a
    token), each given the tokens before it."""
    seq: Sequence
    first: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray | None   # [tokens, the step's top N], best first
    top_logprobs: np.ndarray | None


@dataclass
class PromptScores:
    """One step's prompt scores on their way to the host: every span's tokens in order (scores'
    rows), readable once event has passed (None: on the CPU, at once)."""
    spans: list[tuple[Sequence, int, list[int]]]
    scores: SamplerOutput
    event: "torch.cuda.Event | None"

    def chunks(self) -> list[PromptLogprobsChunk]:
        """One chunk a span, from the host copy (after event)."""
        scores = self.scores
        columns = [None if t is None else t.numpy() for t in
                   (scores.token_ids, scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)]
        chunks, start = [], 0
        for seq, first, rows in self.spans:
            end = start + len(rows)
            chunks.append(PromptLogprobsChunk(seq, first, *(None if c is None else c[start:end] for c in columns)))
            start = end
        return chunks


def score_prompts(spans: list[tuple[Sequence, int, list[int]]], prompt_logits: Iterable[torch.Tensor],
                  device: torch.device, as_logits: bool = False) -> SamplerOutput:
    """spans: (sequence, its first prompt token scored, the rows that score it and the next ones);
    prompt_logits: those rows' logits, in order, in parts, each scored before the next is made ->
    their scores (on the device; the spans' tokens in order): logprobs, or with as_logits (the
    engine's logprobs_mode "raw_logits" or "processed_logits") the logits themselves. Marks the tokens scored
    (Sequence.num_prompt_scored), so that no later step scores them again while these are on their
    way to the host."""
    targets = []
    for seq, first, rows in spans:
        targets += seq.token_ids[first:first + len(rows)]
    targets = upload([np.array(targets, np.int64)], device)[0]
    num_top = max(seq.sampling_params.prompt_logprobs for seq, _, _ in spans)
    parts, start = [], 0
    for logits in prompt_logits:
        end = start + logits.shape[0]
        parts.append(_score(logits, targets[start:end], num_top, as_logits))
        start = end
        del logits   # (before the next part's logits are made)
    for seq, first, rows in spans:
        seq.num_prompt_scored = first + len(rows) - 1
    return SamplerOutput(targets, **{f.name: torch.cat([getattr(p, f.name) for p in parts])
                                     for f in fields(SamplerOutput)
                                     if f.name != "token_ids" and getattr(parts[0], f.name) is not None})


def _score(logits: torch.Tensor, targets: torch.Tensor, num_top: int, as_logits: bool) -> SamplerOutput:
    """logits: [rows, V] raw; targets: [rows] -> each target's logprob (as_logits: logit) and rank, and
    the rows' num_top best. On CUDA in two passes over the logits (kernels/triton_logprobs.py, as the
    sampled tokens'), without a float32 log_softmax of every row, for up to its MAX_TOP best."""
    if logits.is_cuda:
        from nanovllm.kernels import triton_logprobs
        if num_top <= triton_logprobs.MAX_TOP:
            return kernel_token_logprobs(logits, targets, num_top, as_logits)
    return token_logprobs(logits.float() if as_logits else logits.float().log_softmax(-1), targets, num_top)
