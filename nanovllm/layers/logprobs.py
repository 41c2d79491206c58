"""Logprobs of a sampled batch in torch: each drawn token's logprob and rank, the rows' top N,
chosen ids' (logprob_token_ids), and the scores of the processed logprobs modes. On CUDA, for up to
kernels/triton_logprobs.py's MAX_TOP best, Triton passes over the logits do it instead
(kernel_token_logprobs); the torch code is their reference and the path for the rest."""
import torch

from nanovllm.layers.sampling_filters import filter_logits, row_blocks
from nanovllm.layers.sampling_metadata import SamplerOutput, SamplingMetadata


def processed_scores(logits: torch.Tensor, md: SamplingMetadata, as_logits: bool, cut: torch.Tensor | None = None,
                     filtered: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32: the logits tokens are drawn from (vLLM's processed logits: after the logit
    edits and, in sampling rows, temperature, min-p, top-k and top-p, dropped tokens at -inf;
    greedy rows' edited logits as they are: SamplingParams drops their filters), or their log_softmax.
    SORT_ROWS rows at a time. cut: the fused sampler's cut (_sample_fused), which stands for the
    filters: the tokens kept are then exactly those the kernels could draw, and no row is sorted.
    filtered: the scaled and filtered logits the sampler drew from (_sample_torch's, or a sorted
    batch's in _sample_fused), not filtered again: the scores are written over them."""
    if filtered is not None:
        if not as_logits:
            for rows in row_blocks(len(filtered)):
                filtered[rows] = filtered[rows].log_softmax(-1)
        return filtered
    scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if cut is not None:
        cut = processed_cuts(cut, md, len(logits), logits.device)[0][:, None]
    for rows in row_blocks(len(logits)):
        x = logits[rows].float()
        if cut is not None:
            x = x.masked_fill(x < cut[rows], float("-inf")).div_(md.temperatures[rows, None])
        elif not md.all_greedy:
            x = filter_logits(x / md.temperatures[rows, None], md, rows)
        scores[rows] = x if as_logits else x.log_softmax(-1)
    return scores


def processed_cuts(cut: torch.Tensor | None, md: SamplingMetadata, num_rows: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] cuts and [B] temperatures of the processed distribution: the fused sampler's cut (-inf
    without one) and the rows' temperatures, where greedy rows keep every token at temperature 1."""
    temperatures = torch.ones(num_rows, device=device) if md.all_greedy else md.temperatures
    if cut is None:
        return torch.full_like(temperatures, float("-inf")), temperatures
    return cut.masked_fill(md.is_greedy, float("-inf")), temperatures


def kernel_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logits: bool = False,
                          chosen: tuple[torch.Tensor, torch.Tensor] | None = None, **processed) -> SamplerOutput:
    """token_logprobs' outputs from the logits (CUDA, num_top <= kernels/triton_logprobs.py's MAX_TOP)
    in two passes over them, without a [B, V] float32 log_softmax. as_logits: the values themselves;
    chosen: chosen_logprobs' rows and ids, scored in one more pass over those rows; processed:
    kernels/triton_logprobs.py's cuts and temperatures."""
    from nanovllm.kernels import triton_logprobs
    out = SamplerOutput(token_ids)
    out.logprobs, out.ranks, out.top_logprobs, out.top_ids = triton_logprobs.token_logprobs(
        logits, token_ids, num_top, as_logits, **processed)
    if chosen is not None:
        rows, ids = chosen
        put_chosen(out, rows, ids, *triton_logprobs.ids_logprobs(logits, rows, ids, as_logits, **processed))
    return out


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    """logprobs: [B, V] log_softmax of raw logits (or the scores of another logprobs_mode); token_ids:
    [B] -> each token's logprob and rank (1 = most likely), and the rows' num_top best (none when
    num_top is 0)."""
    out = SamplerOutput(token_ids)
    out.logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    out.ranks = torch.cat([(logprobs[rows] > out.logprobs[rows, None]).sum(-1) + 1
                           for rows in row_blocks(len(logprobs))])   # (SORT_ROWS' comment)
    if num_top > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(num_top, -1)
    return out


def chosen_logprobs(out: SamplerOutput, logprobs: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor):
    """In out's top-N: rows `rows` get the logprobs and ranks of their own ids ([L, K] padded; K
    <= max_num_logprobs) in place of their best (put_chosen)."""
    values = logprobs[rows].gather(-1, ids)                                        # [L, K]
    ranks = torch.stack([(logprobs[row] > value[:, None]).sum(-1) + 1 for row, value in zip(rows, values)])
    put_chosen(out, rows, ids, values, ranks)


def put_chosen(out: SamplerOutput, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor):
    """Rows `rows` of out's top-N take their ids ([L, K]) with those ids' logprobs and ranks ([L, K]
    each) in their first K places; top_ranks gives every row's ranks (1..N for the other rows)."""
    num_rows, num_top = out.top_ids.shape
    out.top_ranks = torch.arange(1, num_top + 1, device=ids.device).expand(num_rows, num_top).clone()
    k = ids.shape[1]
    out.top_ids[rows, :k], out.top_logprobs[rows, :k], out.top_ranks[rows, :k] = ids, values, ranks
