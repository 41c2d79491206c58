"""The sampler's input and output for one batch: SamplingMetadata, each row's SamplingParams as
tensors on the logits' device (built by engine/sampling_inputs.py), and SamplerOutput, the tokens
drawn and, when asked, their logprobs."""
from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings as tensors on the logits' device; optional parts are None
    when no row of the batch uses them, so the common case does no work for them."""
    temperatures: torch.Tensor | None     # [B] float32; 1.0 for greedy rows; None if all_greedy
    is_greedy: torch.Tensor | None        # [B] bool; None if all_greedy
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None            # [B] int64; vocab_size where disabled
    top_p: torch.Tensor | None            # [B] float32; 1.0 where disabled
    min_p: torch.Tensor | None            # [B] float32; 0.0 where disabled
    # Per-row noise seeds for rows with SamplingParams.seed; other rows draw from the engine's generator.
    row_seeds: list[tuple[int, int]]
    # Banned (row, token) pairs: stop tokens of rows still under min_tokens.
    banned_rows: torch.Tensor | None
    banned_tokens: torch.Tensor | None
    max_top_k: int | None = None          # the largest top_k when every row has one (host int), else None
    max_set_top_k: int | None = None      # the largest top_k of the rows that have one (host int)
    # Penalties, for the [P] rows penalty_rows (None when no row has any): [P] each, and the rows'
    # token counts, rows penalty_table_rows of penalty_table (engine/penalty_counts.py:
    # [rows, V + 1] int32, 2 x output count + 1 if in the prompt). new_table_rows: [N] table
    # rows to clear first and mark with new_prompt_ids ([N, longest prompt] padded with V).
    penalty_rows: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    penalty_table: torch.Tensor | None = None
    penalty_table_rows: torch.Tensor | None = None
    new_table_rows: torch.Tensor | None = None
    new_prompt_ids: torch.Tensor | None = None
    max_num_logprobs: int | None = None
    # SamplingParams.logprob_token_ids: [L] rows that have a list, and their lists [L, longest] padded with 0
    logprob_rows: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    # row_seeds again, as [S] row indices and [S] int64 seeds on the device (for the fused sampler).
    seeded_rows: torch.Tensor | None = None
    seed_values: torch.Tensor | None = None
    # allowed_token_ids: [A] rows that have a list, and their lists [A, longest] padded with V.
    allowed_rows: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None
    # logit_bias as (row, token, bias) triples.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Rows that must sample one token (a spent thinking budget: engine/reasoning.py): [F] each.
    forced_rows: torch.Tensor | None = None
    forced_tokens: torch.Tensor | None = None
    # Structured outputs (engine/structured_output.py): [G] rows and their allowed tokens as bits,
    # [G, ceil(V / 32)] int32 (bit j of word w: token 32 w + j).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # LLM(logits_processors=...): the step's custom processors (engine/logits_processors.py's StepProcessors)
    processors: object = None

    @property
    def edits_logits(self) -> bool:
        return any(t is not None for t in (self.allowed_rows, self.banned_rows, self.bias_rows, self.penalty_rows,
                                           self.forced_rows, self.processors))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # [B]
    logprobs: torch.Tensor | None = None      # [B] logprob of each sampled token
    ranks: torch.Tensor | None = None         # [B] its rank (1 = most likely)
    top_ids: torch.Tensor | None = None       # [B, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None  # [B, max_num_logprobs]
    top_ranks: torch.Tensor | None = None     # [B, max_num_logprobs] with logprob_token_ids rows, else None
