"""In-place edits of the logits before sampling, in Triton, each one pass over the rows it
touches: penalties from token counts, and grammars' bitmasks. The plain-torch references are
layers/logit_edits.py's apply_penalties and apply_token_bitmask.

Penalties: each program reads a block of one penalised row's float32 logits and the same block
of its row of token counts (engine/penalty_counts.py: 2 x output count + 1 if in the prompt),
and writes the penalised logits back; in torch the same takes a gather of the counts and ten or
so passes over [rows, vocab] float32.

Bitmasks: each program reads a block of one constrained row's bitmask words (bit j of word w:
token 32 w + j allowed) and writes -inf over the tokens whose bit is 0, without reading the
logits; in torch the bits are first expanded to a [rows, vocab] int32 tensor.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.compile_ahead import launch

BLOCK = 2048


@triton.jit
def _penalties_kernel(logits_ptr, table_ptr, rows_ptr, table_rows_ptr, presence_ptr, frequency_ptr,
                      repetition_ptr, vocab_size, stride_logits, stride_table, BLOCK: tl.constexpr):
    i, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    entry = tl.load(table_ptr + tl.load(table_rows_ptr + i) * stride_table + offs, mask=mask, other=0)
    ptrs = logits_ptr + tl.load(rows_ptr + i) * stride_logits + offs
    x = tl.load(ptrs, mask=mask)
    rep = tl.load(repetition_ptr + i)
    x = tl.where(entry > 0, tl.where(x > 0, x / rep, x * rep), x)
    count = (entry >> 1).to(tl.float32)
    x = x - tl.load(frequency_ptr + i) * count
    x = x - tl.where(count > 0, tl.load(presence_ptr + i), 0.0)
    tl.store(ptrs, x, mask=mask)


def penalize(logits: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, table_rows: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor):
    """In place on float32 logits [B, V]: rows `rows` ([P]) penalised from table rows table_rows
    ([P]; the table [R, >= V] int32), with [P] presence, frequency and repetition penalties."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and table.stride(1) == 1
    vocab_size = logits.shape[1]
    launch(_penalties_kernel, (rows.shape[0], triton.cdiv(vocab_size, BLOCK)),
        logits, table, rows, table_rows, presence, frequency, repetition, vocab_size, logits.stride(0),
        table.stride(0), BLOCK=BLOCK, num_warps=4)


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, stride_logits, stride_bitmask,
                    BLOCK: tl.constexpr):
    i, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    words = tl.load(bitmask_ptr + i * stride_bitmask + offs // 32, mask=mask, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    ptrs = logits_ptr + tl.load(rows_ptr + i) * stride_logits + offs
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=mask & banned)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """In place on logits [B, V]: in rows `rows` ([R]), tokens whose bit is 0 in bitmask ([R,
    ceil(V / 32)] int32) get -inf."""
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    vocab_size = logits.shape[1]
    launch(_bitmask_kernel, (rows.shape[0], triton.cdiv(vocab_size, BLOCK)),
        logits, bitmask, rows, vocab_size, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK, num_warps=4)
