"""Min-p, top-k and top-p in torch: the CPU sampler's filters, the CUDA sampler's sorted path (a
top_k above SELECT_TOP_K_MAX) and the reference of the Triton cuts (kernels/triton_top_k.py,
kernels/triton_top_p.py). A filter drops a token by setting its logit to -inf; a cut says the same
as one value a row, the smallest logit kept."""
import torch

from nanovllm.layers.sampling_metadata import SamplingMetadata


# Up to this top_k (in every row) the filters work on the rows' top_k best logits (torch.topk)
# instead of sorting the whole vocabulary: with Qwen3's own defaults (top_k=20, top_p=0.95) a
# batch of 256 rows x 151,936 logits took a sort of 39M values per step.
SELECT_TOP_K_MAX = 1024
# Rows that the sampler's [rows, V] torch work takes at a time: the sorted path's filter (a sort's
# values, order, probabilities and cumulative sums are ~6 float32 copies of its rows) and draw, and
# the torch logprobs' ranks (a sum over bools goes through an int64 copy of them). The KV-cache
# sizing sets aside these paths' peak at max_num_seqs rows (1,024 x 151,936: ~4.5 GB more KV cache
# by 128 rows, perf_notes rows 120-122).
SORT_ROWS = 128


def row_blocks(num_rows: int) -> list[slice]:
    """num_rows rows as blocks of SORT_ROWS (one empty block for none)."""
    return [slice(start, start + SORT_ROWS) for start in range(0, max(num_rows, 1), SORT_ROWS)]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Dropped tokens get -inf: those below a row's top_k-th logit (ties with it are kept, as in
    vLLM), then, of the rest, those whose more likely tokens already hold top_p of the mass."""
    if selects_top_k(top_k, max_top_k):
        return logits.masked_fill(logits < top_k_top_p_cut(logits, top_k, top_p, max_top_k), float("-inf"))
    sorted_logits, order = logits.sort(-1)     # ascending
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab_size - top_k).clamp(0, vocab_size - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p[:, None]
        drop[:, -1] = False                    # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def selects_top_k(top_k: torch.Tensor | None, max_top_k: int | None) -> bool:
    """Whether top-k/top-p can work from each row's best logits (every row has a small top_k)."""
    return top_k is not None and max_top_k is not None and max_top_k <= SELECT_TOP_K_MAX


def sorts(md: SamplingMetadata) -> bool:
    """Whether the fused sampler sorts this batch's rows (a top_k above SELECT_TOP_K_MAX), filtering
    them in torch, rather than cutting them in its kernels."""
    return not md.all_greedy and md.top_k is not None and not selects_top_k(md.top_k, md.max_top_k or md.max_set_top_k)


def top_k_top_p_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int,
                    temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1]: each row's smallest logit that top-k, then top-p keep, from its max_top_k best
    logits; a token is kept if its logit reaches the cut. temperatures: the logits are unscaled
    and top-p's probabilities are those of logits / temperature."""
    best = logits.topk(max_top_k, -1).values.float()               # descending
    cut = best.gather(-1, top_k[:, None] - 1)                      # the top_k-th logit
    if top_p is not None:
        rank = torch.arange(max_top_k, device=logits.device)
        scaled = best if temperatures is None else best / temperatures[:, None]
        probs = scaled.masked_fill(rank >= top_k[:, None], float("-inf")).softmax(-1)
        ahead = probs.cumsum(-1) - probs                           # mass of the more likely tokens
        kept = (ahead < top_p[:, None]).sum(-1, keepdim=True)      # a prefix, at least the best token
        kept.clamp_(min=1)   # (also where constraints left the row nothing to draw: all -inf, NaN probabilities)
        cut = torch.maximum(cut, best.gather(-1, kept - 1))
    return cut


def min_p_cut(logits: torch.Tensor, min_p: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[B]: the smallest unscaled logit min-p keeps, p >= min_p * p_max at the row's temperature:
    logit >= max logit + T * log(min_p) (-inf where min_p is 0). The top-k and top-p cuts are taken
    over the tokens that min-p keeps (the kernels' min_p), and a token is drawn if it reaches both."""
    return logits.amax(-1).float() + temperatures * min_p.log()


def filter_logits(scaled: torch.Tensor, md: SamplingMetadata, rows: slice = slice(None)) -> torch.Tensor:
    """Min-p, then top-k and top-p on temperature-scaled float32 logits [B, V] (md's rows `rows`):
    dropped tokens get -inf. min-p keeps p >= min_p * p_max, i.e. logit >= max logit + log(min_p).
    vLLM's order: top-p's mass is that of the tokens min-p keeps (top-k's cut is the same either way)."""
    top_k, top_p, min_p = (None if t is None else t[rows] for t in (md.top_k, md.top_p, md.min_p))
    if min_p is not None:
        floor = scaled.amax(-1, keepdim=True) + min_p[:, None].log()
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p, md.max_top_k)
    return scaled
