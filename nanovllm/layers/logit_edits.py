"""Edits to a batch's logits before sampling, in place on float32 logits [B, V] and only in the rows
that ask for them: allowed_token_ids, min_tokens' banned stop tokens and logit_bias
(restrict_and_bias), structured outputs' grammar bitmasks, and presence / frequency / repetition
penalties from token counts kept on the device (engine/penalty_counts.py). On CUDA the bitmask and
the penalties are one Triton pass each (kernels/triton_logit_edits.py); the torch code here is
their reference and the CPU path."""
import torch

from nanovllm.layers.sampling_metadata import SamplingMetadata


def id_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids: [R, N] token ids padded with vocab_size -> [R, vocab_size] bool, True at each row's ids
    (the padding lands in an extra column, dropped)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def fill_at(x: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float):
    """x[indices] = value, with the value made on x's device. (Assigning a Python number through
    tensor indices copies it from pageable host memory to a CUDA x, and such a copy waits for
    everything queued on the stream: the step's whole forward pass.)"""
    x.index_put_(indices, x.new_full((), value))


def restrict_and_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place on float32 logits [B, V]: tokens outside a row's allowed_token_ids and stop tokens
    under min_tokens get -inf, then logit_bias is added (vLLM's order, before penalties)."""
    if md.allowed_rows is not None:
        keep = id_mask(md.allowed_token_ids, logits.shape[1])
        logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill(~keep, float("-inf"))
    if md.banned_rows is not None:
        fill_at(logits, (md.banned_rows, md.banned_tokens), float("-inf"))
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """In place on logits [B, V]: in rows `rows`, tokens whose bit is 0 in bitmask ([R, ceil(V /
    32)] int32) get -inf. On CUDA one pass (kernels/triton_logit_edits.py)."""
    if logits.is_cuda:
        from nanovllm.kernels.triton_logit_edits import apply_bitmask
        apply_bitmask(logits, rows, bitmask)
        return
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[1]]   # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place on float32 logits [B, V], in the penalised rows, vLLM's way: a token in the prompt
    or the output so far has its logit divided by the repetition penalty (multiplied, if
    negative); one in the output loses the frequency penalty per occurrence and the presence
    penalty once."""
    table, rows = md.penalty_table, md.penalty_rows
    if md.new_table_rows is not None:   # sequences penalised for the first time: their prompts
        fill_at(table, (md.new_table_rows,), 0)
        fill_at(table, (md.new_table_rows[:, None], md.new_prompt_ids), 1)
    if logits.is_cuda:   # one pass (kernels/triton_logit_edits.py)
        from nanovllm.kernels.triton_logit_edits import penalize
        penalize(logits, rows, table, md.penalty_table_rows, md.presence_penalties, md.frequency_penalties,
                 md.repetition_penalties)
        return logits
    entries = table[md.penalty_table_rows, :logits.shape[1]]   # [P, V]
    counts = entries >> 1
    x = logits[rows]
    rep = md.repetition_penalties[:, None]
    x = torch.where(entries > 0, torch.where(x > 0, x / rep, x * rep), x)
    logits[rows] = x - md.frequency_penalties[:, None] * counts - md.presence_penalties[:, None] * (counts > 0)
    return logits


def count_sampled(md: SamplingMetadata, token_ids: torch.Tensor):
    """After sampling: each penalised row's new token counts once more in its output."""
    rows = md.penalty_table_rows
    md.penalty_table.index_put_((rows, token_ids[md.penalty_rows]), torch.full_like(rows, 2, dtype=torch.int32),
                                accumulate=True)
