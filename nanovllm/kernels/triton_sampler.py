"""Sampling from softmax(logits / T) in two short passes over the logits, in Triton.

A token is drawn as a group of GROUP consecutive ids, chosen by the probability mass it holds,
then a token of that group, chosen by its probability within the group: the product of the two is
the token's probability, exactly. The first pass reads every logit once and keeps, per group, the
largest scaled logit and the mass relative to it (one exp per logit, no random numbers). The
second, one program per row, draws the group from those sums and then the token from the group's
GROUP logits by the Gumbel-max trick: argmax(x / T + g), g = -log(-log(u)), u ~ U(0, 1), the race
that the torch sampler runs as argmax(probs / q), q ~ Exponential(1). A row takes GROUP + 1
uniforms instead of one per vocabulary entry: drawing philox numbers for all 151,936 logits made a
one-pass Gumbel kernel compute-bound (docs/perf_notes.md rows 6 and 47).

Greedy rows take the same two passes with each group's maximum and its first index: exactly
torch's argmax (first index of the maximum). A row's cut (top-k, top-p and min-p as one value)
leaves its logits below it out of both passes. Row r's draw depends on (seeds[r], its logits)
alone: a seeded request draws the same token whatever batch it is in. The plain-torch reference
is layers/sampler.py's race.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.compile_ahead import in_dry_run, launch

GROUP = 1024    # vocab ids per group: 149 groups for a 152k vocab


@triton.jit
def _scaled(row_ptr, offs, vocab_size, inv_temp, cut_ptr, HAS_CUT: tl.constexpr):
    """x / T for ids in the vocabulary and, with HAS_CUT, at or above the row's cut (*cut_ptr);
    else -inf (never drawn)."""
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    if HAS_CUT:
        x = tl.where(x >= tl.load(cut_ptr), x, float("-inf"))
    return x * inv_temp


@triton.jit
def _first_max(x, offs, none):
    """The first of offs where x is at its maximum (none if nowhere, e.g. x all NaN)."""
    return tl.min(tl.where(x == tl.max(x, 0), offs, none), 0)


@triton.jit
def _group_stats_kernel(logits_ptr, stride, temps_ptr, greedy_ptr, cut_ptr, top_ptr, mass_ptr, arg_ptr,
                        vocab_size, num_groups, HAS_CUT: tl.constexpr, GROUP: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    out = row * num_groups + group
    if tl.load(greedy_ptr + row) != 0:
        x = _scaled(logits_ptr + row * stride, offs, vocab_size, 1.0, cut_ptr + row, False)   # as they are
        tl.store(top_ptr + out, tl.max(x, 0))
        tl.store(arg_ptr + out, _first_max(x, offs, vocab_size))
    else:
        y = _scaled(logits_ptr + row * stride, offs, vocab_size, 1.0 / tl.load(temps_ptr + row), cut_ptr + row,
                    HAS_CUT)
        top = tl.max(y, 0)
        tl.store(top_ptr + out, top)
        # a group with nothing to draw (all -inf) gets mass 0 (exp(-inf - -inf) would be NaN)
        tl.store(mass_ptr + out, tl.sum(tl.exp(y - tl.maximum(top, -3.0e38)), 0))


@triton.jit
def _draw_kernel(logits_ptr, stride, temps_ptr, greedy_ptr, seeds_ptr, cut_ptr, top_ptr, mass_ptr, arg_ptr,
                 token_ptr, vocab_size, num_groups, HAS_CUT: tl.constexpr, GROUP: tl.constexpr,
                 GROUPS: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.arange(0, GROUPS)
    stats = row * num_groups + groups
    top = tl.load(top_ptr + stats, mask=groups < num_groups, other=float("-inf"))
    if tl.load(greedy_ptr + row) != 0:
        # the first group holding the row's maximum, and the first index of it there
        token = tl.load(arg_ptr + row * num_groups + _first_max(top, groups, num_groups))
    else:
        mass = tl.load(mass_ptr + stats, mask=groups < num_groups, other=0.0)
        weight = tl.where(mass > 0, mass * tl.exp(top - tl.max(top, 0)), 0.0)
        # The group whose share of the cumulative mass holds a uniform draw. Groups without mass
        # are never chosen, even where rounding in the scan would land the draw on one; the
        # uniform comes from philox's counter vocab_size, which no token's noise uses.
        seed = tl.load(seeds_ptr + row)
        target = tl.rand(seed, vocab_size) * tl.sum(weight, 0)
        last = tl.max(tl.where(weight > 0, groups, 0), 0)
        group = tl.min(tl.where((tl.cumsum(weight, 0) > target) & (weight > 0), groups, last), 0)
        offs = group * GROUP + tl.arange(0, GROUP)
        y = _scaled(logits_ptr + row * stride, offs, vocab_size, 1.0 / tl.load(temps_ptr + row), cut_ptr + row,
                    HAS_CUT)
        u = tl.rand(seed, offs)      # token t's noise: philox counter t
        token = _first_max(y - tl.log(-tl.log(tl.maximum(u, 1e-20))), offs, vocab_size)
    tl.store(token_ptr + row, token.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, is_greedy: torch.Tensor,
                  seeds: torch.Tensor, cut: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float32; is_greedy: [B] bool;
    seeds: [B] int64; cut: [B] float32 or None, a sampled row's logits below its cut are never
    drawn (top-k/top-p as one value per row) -> sampled token ids [B] int64."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1
    num_groups = triton.cdiv(vocab_size, GROUP)
    top = torch.empty(batch, num_groups, dtype=torch.float32, device=logits.device)
    mass = torch.empty_like(top)
    arg = torch.empty(batch, num_groups, dtype=torch.int32, device=logits.device)
    # (zeros in a dry pass, where the kernels do not run: the caller indexes with the tokens)
    tokens = (torch.zeros if in_dry_run() else torch.empty)(batch, dtype=torch.int64, device=logits.device)
    cut_or_any = cut if cut is not None else temperatures
    # two warps a group: the fastest of seven shapes at 16-256 sampled rows (perf_notes row 47)
    launch(_group_stats_kernel, (batch, num_groups), logits, logits.stride(0), temperatures, is_greedy, cut_or_any,
           top, mass, arg, vocab_size, num_groups, HAS_CUT=cut is not None, GROUP=GROUP, num_warps=2)
    launch(_draw_kernel, (batch,), logits, logits.stride(0), temperatures, is_greedy, seeds, cut_or_any, top, mass,
           arg, tokens, vocab_size, num_groups, HAS_CUT=cut is not None, GROUP=GROUP,
           GROUPS=triton.next_power_of_2(num_groups), num_warps=4)
    return tokens
