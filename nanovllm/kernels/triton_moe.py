"""The experts of a mixture-of-experts layer on the GPU, in shapes that depend only on the number
of tokens, so that a step with MoE layers can be captured in a CUDA graph. Its reference is the
per-expert loop of layers/moe.py (`Experts.per_expert`, the CPU path).

Each (token, choice) pair is an assignment: num_tokens x top_k of them, numbered token-major
(assignment a = token * top_k + choice). They are grouped by expert (no host sync) and each
expert's run is padded to whole blocks of block_m rows:

    sorted_ids:    | e0 e0 e0 pad | e1 pad pad pad | e3 e3 e3 e3 | e3 pad pad pad | pad ... |
    block_expert:  |      0       |       1       |      3      |       3        | E ...   |

(pad: the id num_assignments; block_expert E: a block past the last used one.) There are at most
cdiv(num_assignments, block_m) + min(num_experts, num_assignments) blocks; the grid covers that
many and the blocks past the end return at once. Up to ROUTE_TOKENS tokens (decode steps) one
program routes (layers/moe.py's `route`: softmax, top_k, renormalising) and groups, placing each
assignment by comparing it with every other. Above that two kernels do it: the routing kernel also
counts each expert's assignments with atomic adds, each add's old value being the assignment's
place in its run (so a run's order is the order the adds land in, which changes no product), and
the placement kernel writes the assignments, the padding and each block's expert.
`group_by_expert` is their plain-torch reference (fixed-shape ops, each run in assignment order).

`moe_product` is then one grouped GEMM: a program takes one block of rows, all of one expert, and
block_n output features; it gathers its rows of the input (token rows for the first product,
assignment rows for the second) and multiplies them by that expert's weight. The gate | up
product (each program reading the gate rows and the up rows of its features, and writing
SiLU(gate) x up), then the down product scaled by the routing weights, give one output row per
assignment; a token's output is the sum of its top_k rows.

With LoRA adapters (ExpertLoRA) each product first runs on the adapters' A matrices, stacked as an expert's
weight of every slot's rows (the shrink: each row's products with all slots' A, the rank's few columns a slot);
the product with the base weight then adds, for each row, its own slot's columns of that times the expert's B
of that slot (the other slots' columns masked to zero), before the activation and the routing weight.

Triton does not specialise these kernels on the token, assignment and block counts (`do_not_specialize`):
they only bound masks, and a step whose count start-up did not meet (not a multiple of 16, say) would
otherwise compile a variant of its own while it runs (perf_notes row 83). Up to pdl.MAX_ROWS tokens (decode
steps of small batches) the routing and the products are PDL launches, as the dense layers' kernels are.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.triton_fused import silu_mul


class ExpertLoRA(NamedTuple):
    """The LoRA adapters of a layer's experts (lora/layers.py's LoRAExperts): a13 [experts, 2 (gate, up), slots,
    rank, hidden], b13 [experts, 2, slots, rank, intermediate], a2 [experts, slots, rank, intermediate], b2
    [experts, slots, rank, hidden]; token_slots [tokens] each token's slot, -1 for none."""
    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    token_slots: torch.Tensor


class Tiles(NamedTuple):
    """A product kernel's launch shape."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The fastest of tests/bench_moe.py's sweep on an H200, Qwen3-30B-A3B's shape, for the rows per
# block: (gate | up product, down product). Wider tiles serve more rows per weight tile read;
# the widest need ~200 KB of shared memory (a Hopper GPU's 227).
TILES = {16: (Tiles(64, 128, 4, 3), Tiles(128, 64, 4, 3)),
         32: (Tiles(128, 128, 4, 3), Tiles(256, 64, 4, 3)),
         128: (Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 3))}
# At a few assignments (as many experts, each with one row) 128 features a program leave SMs idle
# (1 token of top-8: 8 experts x 2,048 / 128 = 128 programs on 132 SMs): narrower, deeper tiles.
# The fastest at 1 token, and within 1.5% of the fastest at 2 (16 assignments; perf_notes row 78).
FEW_ASSIGNMENTS = 16
FEW_TILES = (Tiles(64, 128, 4, 4), Tiles(64, 64, 4, 4))
MAX_BLOCK_R = 64   # of a LoRA slot's rank, the rows of B a product's program multiplies at once


def shrink_tiles(block_m: int, n: int) -> Tiles:
    """The LoRA shrinks' tiles (n: their few output columns, slots x rank (x 2)): as narrow as n, and at
    blocks of up to 32 rows (decode steps) long steps along K, whose loop is what the step waits for."""
    return Tiles(min(64, max(16, triton.next_power_of_2(n))), 256 if block_m <= 32 else 64, 4, 3)


def shrink_splits(num_assignments: int, k: int, tiles: Tiles) -> int:
    """The slices of K a LoRA shrink runs in: at a few assignments (a program a used expert) one K step each, so
    that its programs' serial loads become parallel ones (perf_notes row 154); otherwise 1."""
    return triton.cdiv(k, tiles.block_k) if num_assignments <= FEW_ASSIGNMENTS else 1


def block_m_for(num_assignments: int, num_experts: int) -> int:
    """Rows per block (a key of TILES): the MMA's smallest width when experts get a few rows each
    (decode), 128 when they get more than 32 (prompts), even though a run's last block is then
    mostly padding, so that each expert's weight tile serves more rows."""
    per_expert = num_assignments / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 128


def num_blocks_for(num_assignments: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_assignments, block_m) + min(num_experts, num_assignments)


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [num_tokens, top_k] expert ids -> (sorted_ids [num_blocks * block_m] int32,
    block_expert [num_blocks] int32), as drawn in the module docstring; each run in assignment order."""
    flat = ids.flatten()                                                   # [A] expert of each assignment
    num_assignments = flat.numel()
    num_blocks = num_blocks_for(num_assignments, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))                    # [E] assignments per expert
    blocks = (counts + block_m - 1) // block_m                             # [E] blocks per expert
    block_end = blocks.cumsum(0)
    order = flat.argsort(stable=True)                                      # assignments, by expert
    expert = flat[order]
    rank = torch.arange(num_assignments, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    padded_pos = (block_end - blocks)[expert] * block_m + rank             # where each goes in sorted_ids
    sorted_ids = torch.full((num_blocks * block_m,), num_assignments, dtype=torch.int32, device=ids.device)
    sorted_ids[padded_pos] = order.to(torch.int32)
    # Block b belongs to the first expert whose blocks end after b (E past the last used block).
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=ids.device), right=True)
    return sorted_ids, block_expert.to(torch.int32)


ROUTE_TOKENS = 16   # tokens a program of the routing kernel takes; up to this many, one program may do it all
# The one program's warps for its tokens (a power of two): the fewest instructions a warp, compiled for sm_90
ROUTE_WARPS = {1: 1, 2: 2, 4: 4, 8: 4, 16: 8}


@triton.jit
def _route(logits_ptr, weights_ptr, ids_ptr, counts_ptr, rank_ptr, tokens, num_tokens, stride_l,
           NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, CHOICES: tl.constexpr,
           RENORMALIZE: tl.constexpr, COUNT: tl.constexpr):
    """layers/moe.py's `route` for the given tokens (softmax over the experts, the top_k best, best
    first, rescaled to sum to 1 if RENORMALIZE), stored to weights and ids; with COUNT each choice
    is counted in its expert's run. -> the ids, [tokens, CHOICES] (CHOICES: top_k to a power of two)."""
    experts = tl.arange(0, EXPERTS)
    choices = tl.arange(0, CHOICES)
    is_token = tokens < num_tokens
    logits = tl.load(logits_ptr + tokens[:, None] * stride_l + experts[None, :],
                     mask=is_token[:, None] & (experts < NUM_EXPERTS)[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(is_token[:, None], logits, 0.0)            # (rows past the end: no NaNs)
    probs = tl.exp(logits - tl.max(logits, 1)[:, None])
    probs = probs / tl.sum(probs, 1)[:, None]                    # [tokens, EXPERTS]; 0 past NUM_EXPERTS
    weights = tl.zeros((tokens.shape[0], CHOICES), tl.float32)
    ids = tl.zeros((tokens.shape[0], CHOICES), tl.int32)
    for choice in tl.static_range(TOP_K):
        best = tl.argmax(probs, 1)                               # (the first of equals)
        weight = tl.max(probs, 1)
        weights = tl.where(choices[None, :] == choice, weight[:, None], weights)
        ids = tl.where(choices[None, :] == choice, best[:, None], ids)
        probs = tl.where(experts[None, :] == best[:, None], -1.0, probs)
        if COUNT:
            rank = tl.atomic_add(counts_ptr + best, 1, mask=is_token, sem="relaxed")
            tl.store(rank_ptr + tokens * TOP_K + choice, rank, mask=is_token)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = tokens[:, None] * TOP_K + choices[None, :]
    ok = is_token[:, None] & (choices < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)
    return ids


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, rank_ptr, num_tokens, stride_l,
                  NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, CHOICES: tl.constexpr,
                  RENORMALIZE: tl.constexpr, TOKENS: tl.constexpr):
    """`route` for TOKENS tokens, each choice counted in its expert's run by an atomic add whose
    old value is the choice's place in the run."""
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    _route(logits_ptr, weights_ptr, ids_ptr, counts_ptr, rank_ptr, tokens, num_tokens, stride_l,
           NUM_EXPERTS, EXPERTS, TOP_K, CHOICES, RENORMALIZE, COUNT=True)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _route_and_place_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_tokens,
                            num_blocks, stride_l, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                            TOP_K: tl.constexpr, CHOICES: tl.constexpr, RENORMALIZE: tl.constexpr,
                            TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Up to TOKENS tokens in one program: `_route_kernel` and `_place_kernel` without atomics.
    Each expert's count and each assignment's place in its run come from comparisons of every
    assignment with every expert and every other assignment, so a run is in assignment order, as
    `group_by_expert` places it."""
    pdl.begin(PDL)
    tokens = tl.arange(0, TOKENS)
    ids = _route(logits_ptr, weights_ptr, ids_ptr, ids_ptr, ids_ptr, tokens, num_tokens, stride_l,
                 NUM_EXPERTS, EXPERTS, TOP_K, CHOICES, RENORMALIZE, COUNT=False)
    choices = tl.arange(0, CHOICES)
    ok = (tokens < num_tokens)[:, None] & (choices < TOP_K)[None, :]
    assignment = tl.reshape(tl.where(ok, tokens[:, None] * TOP_K + choices[None, :], -1), (TOKENS * CHOICES,))
    expert = tl.reshape(tl.where(ok, ids, NUM_EXPERTS), (TOKENS * CHOICES,))   # NUM_EXPERTS: no assignment
    experts = tl.arange(0, EXPERTS)
    counts = tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), 0)
    counts = tl.where(experts < NUM_EXPERTS, counts, 0)                         # [EXPERTS]
    earlier = (expert[None, :] == expert[:, None]) & (assignment[None, :] < assignment[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)                                      # its place in its run
    blocks = (counts + BLOCK_M - 1) // BLOCK_M                                  # each expert's blocks
    _place_runs(expert, rank, assignment, assignment >= 0, blocks, sorted_ids_ptr, EXPERTS, BLOCK_M)
    _place_padding(counts, blocks, sorted_ids_ptr, block_expert_ptr, num_tokens * TOP_K, num_blocks, NUM_EXPERTS,
                   BLOCK_M, CHUNK)


def route_and_group(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                    single_program: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, top_k] float32, ids [T, top_k] int32, sorted_ids,
    block_expert): `route` then `group_by_expert`, in two kernels (and a memset), or, up to
    ROUTE_TOKENS tokens with single_program, in one (perf_notes row 80)."""
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    shape = dict(NUM_EXPERTS=num_experts, EXPERTS=triton.next_power_of_2(num_experts), TOP_K=top_k,
                 CHOICES=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, TOKENS=ROUTE_TOKENS)
    if single_program and num_tokens <= ROUTE_TOKENS:
        num_blocks = num_blocks_for(num_tokens * top_k, num_experts, block_m)
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
        # (sized for the step's tokens: at 1 token one warp, whose reductions need no barrier; perf_notes row 155)
        tokens = triton.next_power_of_2(num_tokens)
        launch(_route_and_place_kernel, (1,), router_logits, weights, ids, sorted_ids, block_expert, num_tokens,
               num_blocks, router_logits.stride(0), **(shape | dict(TOKENS=tokens)), BLOCK_M=block_m,
               CHUNK=GROUP_CHUNK, num_warps=ROUTE_WARPS[tokens], **pdl.launch_options(num_tokens))
        return weights, ids, sorted_ids, block_expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_tokens * top_k, dtype=torch.int32, device=device)
    launch(_route_kernel, (triton.cdiv(num_tokens, ROUTE_TOKENS),), router_logits, weights, ids, counts, rank,
           num_tokens, router_logits.stride(0), **shape)
    return (weights, ids, *_place(ids.view(-1), counts, rank, block_m))


GROUP_CHUNK = 32   # assignments (or blocks) a program of the placement kernel takes at once


@triton.jit
def _place_runs(expert, rank, assignment, ok, blocks, sorted_ids_ptr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each assignment to its place: its expert's first block (blocks: each expert's count of
    them), plus its rank in the run."""
    experts = tl.arange(0, EXPERTS)
    block_first = tl.cumsum(blocks, 0) - blocks
    first = tl.sum(tl.where(expert[:, None] == experts[None, :], block_first[None, :], 0), 1)
    tl.store(sorted_ids_ptr + first * BLOCK_M + rank, assignment, mask=ok)


@triton.jit
def _place_padding(counts, blocks, sorted_ids_ptr, block_expert_ptr, num_assignments, num_blocks,
                   NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The padding rows (the rows after each expert's run, in its last block, and every row of the
    blocks past the last used one) and every block's expert (counts: each expert's assignments;
    blocks: its blocks)."""
    block_end = tl.cumsum(blocks, 0)
    row = tl.arange(0, BLOCK_M)
    used_in_last = counts - (blocks - 1) * BLOCK_M
    pad = (blocks[:, None] > 0) & (row[None, :] >= used_in_last[:, None])
    tl.store(sorted_ids_ptr + (block_end - 1)[:, None] * BLOCK_M + row[None, :], num_assignments, mask=pad)
    total = tl.sum(blocks, 0)
    for start in range(0, num_blocks, CHUNK):
        block = start + tl.arange(0, CHUNK)
        in_grid = block < num_blocks
        owner = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + block, tl.minimum(owner, NUM_EXPERTS), mask=in_grid)
        unused = (block >= total) & in_grid
        tl.store(sorted_ids_ptr + block[:, None] * BLOCK_M + row[None, :], num_assignments, mask=unused[:, None])


@triton.jit(do_not_specialize=["num_assignments", "num_blocks"])
def _place_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ids_ptr, block_expert_ptr, num_assignments, num_blocks,
                  NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Programs 0 .. n-2 place a chunk of assignments each; the last one writes the padding rows
    and every block's expert (the two sets of rows are disjoint: no order between programs)."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + experts, mask=experts < NUM_EXPERTS, other=0)   # [EXPERTS]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    if tl.program_id(0) < tl.num_programs(0) - 1:
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < num_assignments
        expert = tl.load(ids_ptr + offs, mask=ok, other=0)
        rank = tl.load(rank_ptr + offs, mask=ok, other=0)
        _place_runs(expert, rank, offs, ok, blocks, sorted_ids_ptr, EXPERTS, BLOCK_M)
    else:
        _place_padding(counts, blocks, sorted_ids_ptr, block_expert_ptr, num_assignments, num_blocks, NUM_EXPERTS,
                       BLOCK_M, CHUNK)


def _place(flat_ids: torch.Tensor, counts: torch.Tensor, rank: torch.Tensor,
           block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The placement kernel after the routing kernel's counts and ranks: -> (sorted_ids, block_expert)."""
    num_assignments, num_experts = flat_ids.numel(), counts.numel()
    num_blocks = num_blocks_for(num_assignments, num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat_ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat_ids.device)
    launch(_place_kernel, (triton.cdiv(num_assignments, GROUP_CHUNK) + 1,), flat_ids, counts, rank, sorted_ids,
           block_expert, num_assignments, num_blocks, NUM_EXPERTS=num_experts,
           EXPERTS=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=GROUP_CHUNK)
    return sorted_ids, block_expert


@triton.jit(do_not_specialize=["num_assignments", "stride_split", "stride_shrunk_split"])
def _moe_product_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, scale_ptr, shrunk_ptr, lora_b_ptr,
                        token_slots_ptr, N, K, num_assignments, stride_x, stride_we, stride_wn, stride_o,
                        stride_split, stride_shrunk, stride_shrunk_split, stride_lora_b, NUM_EXPERTS: tl.constexpr,
                        ROWS_PER_X: tl.constexpr, SCALED: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, LORA: tl.constexpr,
                        TOP_K: tl.constexpr, NUM_SLOTS: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
                        SHRUNK_SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)   # (nothing to read before it: which expert's weights a block needs is the routing's output)
    block, n_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:      # past the last used block
        return
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))   # [BLOCK_M] assignments
    is_row = ids < num_assignments
    rows = ids // ROWS_PER_X       # x's row of each: its token (ROWS_PER_X = top_k) or itself (1)
    # N output features; with SILU_MUL, w has 2 N rows (gate | up) and a program reads BLOCK_N of
    # them: BLOCK_N / 2 gate rows and the up rows of the same features.
    OUT_N: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    offs_n = n_block * OUT_N + tl.arange(0, OUT_N)
    k_start, k_end = 0, K
    if SPLIT_K > 1:   # the program's slice of K: the split-th of SPLIT_K runs of BLOCK_K-long steps
        k_start = split * tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_end = tl.minimum(K, k_start + tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + (k_start + offs_k)[None, :]                  # [M, K]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + (k_start + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, OUT_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, OUT_N), tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = offs_k < k_end - k
        x = tl.load(x_ptrs, mask=is_row[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        if SILU_MUL:
            up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(x, up, acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LORA:   # each row's own slot's shrink columns (RANK a slot; the sum of SHRUNK_SPLITS partials) times the
        # expert's B rows of that slot, for the slots the block's rows use, BLOCK_R of a slot's rows at a time
        slot = tl.load(token_slots_ptr + ids // TOP_K, mask=is_row, other=-1)
        offs_r = tl.arange(0, BLOCK_R)
        SLOT_ROWS: tl.constexpr = NUM_SLOTS * RANK   # (with SILU_MUL the gate's, then the up's as many)
        for s in range(NUM_SLOTS):
            mine = slot == s
            if tl.max(mine.to(tl.int32)) > 0:
                for r in range(0, RANK, BLOCK_R):
                    r_ok = offs_r < RANK - r
                    cols = s * RANK + r + offs_r
                    shrunk_ptrs = shrunk_ptr + ids[:, None].to(tl.int64) * stride_shrunk + cols[None, :]
                    b_ptrs = lora_b_ptr + expert.to(tl.int64) * stride_lora_b + cols[:, None] * N + offs_n[None, :]
                    part_ok, b_ok = mine[:, None] & r_ok[None, :], r_ok[:, None] & n_ok[None, :]
                    acc = tl.dot(_shrunk_part(shrunk_ptrs, part_ok, stride_shrunk_split, SHRUNK_SPLITS, x_ptr),
                                 tl.load(b_ptrs, mask=b_ok, other=0.0), acc)
                    if SILU_MUL:
                        acc_up = tl.dot(_shrunk_part(shrunk_ptrs + SLOT_ROWS, part_ok, stride_shrunk_split,
                                                     SHRUNK_SPLITS, x_ptr),
                                        tl.load(b_ptrs + SLOT_ROWS * N, mask=b_ok, other=0.0), acc_up)
    out_dtype = out_ptr.dtype.element_ty
    if SILU_MUL:                   # each product rounded first, as the two-kernel path rounds them
        acc = silu_mul(acc.to(out_dtype), acc_up.to(out_dtype))
    if SCALED:                     # by each assignment's routing weight
        acc *= tl.load(scale_ptr + ids, mask=is_row, other=0.0)[:, None]
    out_ptrs = out_ptr + ids[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    if SPLIT_K > 1:   # (float32 partials)
        out_ptrs += split.to(tl.int64) * stride_split
    tl.store(out_ptrs, acc.to(out_dtype), mask=is_row[:, None] & n_ok[None, :])


@triton.jit
def _shrunk_part(ptrs, mask, stride_split, SPLITS: tl.constexpr, x_ptr):
    """The shrink's columns at ptrs: the sum of its SPLITS partials (stride_split apart), rounded to x's dtype
    (as the shrink's output is when it comes whole)."""
    part = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for s in range(1, SPLITS):
        part += tl.load(ptrs + s * stride_split, mask=mask, other=0.0).to(tl.float32)
    return part.to(x_ptr.dtype.element_ty)


def moe_product(x: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                num_assignments: int, rows_per_x: int, block_m: int, scale: torch.Tensor | None = None,
                silu_mul: bool = False, tiles: Tiles | None = None,
                lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
                num_tokens: int | None = None, split_k: int = 1) -> torch.Tensor:
    """x: [num_assignments // rows_per_x, K]; w: [num_experts, N, K] -> [num_assignments, N], row a
    = x[a // rows_per_x] @ w[expert of a].T (times scale[a] if given). silu_mul: w's rows hold
    gate | up, and the output is silu(gate) * up: [num_assignments, N / 2]. tiles: TILES's for
    block_m (FEW_TILES for a few assignments) unless given. lora: (shrunk [num_assignments, (2 with silu_mul)
    x slots x rank] or its split_k partials [splits, ...], b [num_experts, (2,) slots, rank, N (/ 2)], token_slots,
    top_k): each row's own slot's part of shrunk times that slot's b is added to the product (to gate and up each,
    with silu_mul). num_tokens: the step's tokens, which decide a PDL launch (pdl.launch_options); num_assignments
    // rows_per_x if not given. split_k > 1 (for the LoRA shrinks): the product in that many slices of K, returned
    as their float32 partials [split_k, num_assignments, N]."""
    gate_up_tiles, down_tiles = FEW_TILES if num_assignments <= FEW_ASSIGNMENTS else TILES[block_m]
    tiles = tiles or (gate_up_tiles if silu_mul else down_tiles)
    num_experts, n, k = w.shape
    n = n // 2 if silu_mul else n
    assert x.shape[1] == k and x.stride(1) == 1 and w.stride(2) == 1
    out = torch.empty(split_k, num_assignments, n, dtype=torch.float32 if split_k > 1 else x.dtype, device=x.device)
    out_n = tiles.block_n // 2 if silu_mul else tiles.block_n
    shrunk, lora_b, token_slots, top_k = lora or (out, out, out, 1)
    shrunk = shrunk if shrunk.dim() == 3 else shrunk[None]   # [splits, num_assignments, columns]
    num_slots, rank = lora_b.shape[-3:-1] if lora else (1, 1)
    launch(_moe_product_kernel, (block_expert.numel(), triton.cdiv(n, out_n), split_k),
           x, w, out, sorted_ids, block_expert, scale if scale is not None else out, shrunk, lora_b, token_slots,
           n, k, num_assignments, x.stride(0), w.stride(0), w.stride(1), out.stride(1), out.stride(0),
           shrunk.stride(1), shrunk.stride(0), lora_b.stride(0), NUM_EXPERTS=num_experts, ROWS_PER_X=rows_per_x,
           SCALED=scale is not None, SILU_MUL=silu_mul, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
           BLOCK_K=tiles.block_k, SPLIT_K=split_k, LORA=lora is not None, TOP_K=top_k, NUM_SLOTS=num_slots,
           RANK=rank, BLOCK_R=min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank))), SHRUNK_SPLITS=len(shrunk),
           num_warps=tiles.num_warps, num_stages=tiles.num_stages,
           **pdl.launch_options(num_tokens or num_assignments // rows_per_x))
    return out if split_k > 1 else out[0]


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, sum_choices: bool = True, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """x: [T, hidden]; router_logits: [T, E]; w13: [E, 2 I, hidden] (gate | up rows); w2: [E, hidden, I]
    -> [T, hidden]: routed as `route(router_logits, top_k, renormalize)` says, the sum over a token's
    choices of weight x down(silu(gate) * up). Without sum_choices, the terms of that sum:
    [top_k, T, hidden] (a strided view), for the next RMSNorm to add up. lora: each token's adapter's
    products join each of its experts' gate, up and down (the merged weights' result)."""
    num_tokens = x.shape[0]
    num_assignments = num_tokens * top_k
    num_experts = w13.shape[0]
    block_m = block_m_for(num_assignments, num_experts)
    weights, _, sorted_ids, block_expert = route_and_group(router_logits, top_k, renormalize, block_m)
    grouping = (sorted_ids, block_expert, num_assignments)
    lora13 = lora2 = None
    if lora is not None:   # the shrinks: every slot's A rows, as an expert's weight
        a13 = lora.a13.view(num_experts, -1, x.shape[1])
        tiles = shrink_tiles(block_m, a13.shape[1])
        shrunk = moe_product(x, a13, *grouping, top_k, block_m, tiles=tiles,
                             split_k=shrink_splits(num_assignments, x.shape[1], tiles))
        lora13 = (shrunk, lora.b13, lora.token_slots, top_k)
    act = moe_product(x, w13, *grouping, top_k, block_m, silu_mul=True, lora=lora13)                  # [A, I]
    if lora is not None:
        a2 = lora.a2.view(num_experts, -1, act.shape[1])
        tiles = shrink_tiles(block_m, a2.shape[1])
        shrunk = moe_product(act, a2, *grouping, 1, block_m, tiles=tiles, num_tokens=num_tokens,
                             split_k=shrink_splits(num_assignments, act.shape[1], tiles))
        lora2 = (shrunk, lora.b2, lora.token_slots, top_k)
    down = moe_product(act, w2, *grouping, 1, block_m, scale=weights.view(-1), lora=lora2,
                       num_tokens=num_tokens)                                                    # [A, hidden]
    choices = down.view(num_tokens, top_k, -1)
    return choices.sum(1) if sum_choices else choices.transpose(0, 1)   # (summed in float32, rounded once)
