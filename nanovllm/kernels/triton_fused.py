"""Fused element-wise kernels for the decoder layer, in Triton. Their references are the plain-torch
modules in nanovllm/layers (RMSNorm; q/k RMSNorm + RotaryEmbedding + the KV-cache store of
kernels/torch_attention.py; layers/activation.py's silu_and_mul).

A decode step is short enough that kernel count, not bytes, sets its time: unfused, the norms,
RoPE, KV-cache store and activation cost ~45 small kernels per layer; fused, 4.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.compile_ahead import launch
from nanovllm.kernels.triton_attention import to_cache_dtype

# Heads per program of the q/k norm + RoPE + store kernel. One head per one-warp program made
# 8,192 programs at 256 tokens (two waves of short, latency-bound programs, 5.8 us a call on the
# H200); four fit a batch of 256 in one wave (docs/perf_notes.md row 29), on four warps (two
# were 0.4-0.6 us slower a call at 32-256 tokens, row 51).
QK_HEADS_PER_PROGRAM = 4
ONE_HEAD_PER_PROGRAM_UP_TO = 16   # tokens; at batch 1 four heads per program cost 1.0 -> 1.024 ms/token


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_split, stride_r, stride_o,
                     stride_ro, n_cols, eps, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    if SPLITS == 1:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    else:
        # x is the sum of SPLITS parts (split-K products, or a MoE layer's choices), added in float32
        # and rounded to the model dtype as the layer's own output would be.
        acc = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, SPLITS):
            acc += tl.load(x_ptr + s * stride_split + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        # The residual sum is rounded to the model dtype, as `x + residual` in torch is.
        x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [num_tokens, hidden], or parts [splits, num_tokens, hidden] whose sum is x (layers/linear.py's
    Partials: float32 split-K products, or a MoE layer's choices in 16 bits; any strides but the
    last). Without residual -> norm(x); with it -> (norm(x + residual), x + residual), in the
    residual's dtype (without it, in x's or, for parts, the weight's)."""
    splits = 1 if x.dim() == 2 else x.shape[0]
    n_rows, n_cols = x.shape[-2:]
    dtype = residual.dtype if residual is not None else x.dtype if splits == 1 else weight.dtype
    out = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res = residual if residual is not None else out
    launch(_rms_norm_kernel, (n_rows,), x, res, weight, out, res_out, x.stride(-2), x.stride(0), res.stride(0),
           out.stride(0), res_out.stride(0), n_cols, eps, HAS_RESIDUAL=residual is not None, SPLITS=splits,
           BLOCK=triton.next_power_of_2(n_cols), num_warps=4 if n_cols <= 2048 else 8, **pdl.launch_options(n_rows))
    return out if residual is None else (out, res_out)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                               slot_ptr, stride_qkv, stride_q, eps, NUM_Q_HEADS: tl.constexpr,
                               NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                               HEADS: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    token = tl.program_id(0)
    # This program's HEADS heads of the token, one per tile row: q heads, then k heads, then v heads.
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs = tl.arange(0, HALF)
    exists = heads < NUM_Q_HEADS + 2 * NUM_KV_HEADS           # (the last program's tile may overhang)
    is_q = heads < NUM_Q_HEADS
    is_k = (heads >= NUM_Q_HEADS) & (heads < NUM_Q_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_Q_HEADS + NUM_KV_HEADS) & exists
    src = qkv_ptr + token * stride_qkv + heads[:, None] * 2 * HALF + offs[None, :]
    x1 = tl.load(src, mask=exists[:, None], other=0.0)
    x2 = tl.load(src + HALF, mask=exists[:, None], other=0.0)
    slot = tl.load(slot_ptr + token)
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + offs)[None, :]
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + offs)[None, :]
    dtype = x1.dtype
    y1, y2 = x1, x2
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(qw_ptr + offs)[None, :], tl.load(kw_ptr + offs)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(qw_ptr + HALF + offs)[None, :], tl.load(kw_ptr + HALF + offs)[None, :])
        y1, y2 = (f1 * rstd).to(dtype) * w1, (f2 * rstd).to(dtype) * w2
    f1, f2 = y1.to(tl.float32), y2.to(tl.float32)
    y1, y2 = (f1 * cos - f2 * sin).to(dtype), (f2 * cos + f1 * sin).to(dtype)
    dst = q_out_ptr + token * stride_q + heads[:, None] * 2 * HALF + offs[None, :]
    tl.store(dst, y1, mask=is_q[:, None])
    tl.store(dst + HALF, y2, mask=is_q[:, None])
    # k (normed, rotated) and v (as is) into the cache; a padding row (slot -1) writes nothing.
    kv_head = (heads - NUM_Q_HEADS) % NUM_KV_HEADS
    cache = slot * (NUM_KV_HEADS * 2 * HALF) + kv_head[:, None] * 2 * HALF + offs[None, :]
    k_rows = (is_k & (slot >= 0))[:, None]
    v_rows = (is_v & (slot >= 0))[:, None]
    tl.store(k_cache_ptr + cache, to_cache_dtype(y1, k_cache_ptr), mask=k_rows)
    tl.store(k_cache_ptr + cache + HALF, to_cache_dtype(y2, k_cache_ptr), mask=k_rows)
    tl.store(v_cache_ptr + cache, to_cache_dtype(x1, v_cache_ptr), mask=v_rows)
    tl.store(v_cache_ptr + cache + HALF, to_cache_dtype(x2, v_cache_ptr), mask=v_rows)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                       num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] -> q [num_tokens, num_q_heads, head_dim]:
    per-head RMSNorm (if weights are given), then RoPE, on q and k; k and v are written straight
    into the paged cache ([num_blocks, page, num_kv_heads, head_dim]) at slot_mapping (slot -1: skipped),
    which is all the attention kernels read them from. out: where to write q (contiguous rows), else
    a new tensor."""
    num_tokens = qkv.shape[0]
    q = out if out is not None else torch.empty(num_tokens, num_q_heads, head_dim, dtype=qkv.dtype,
                                                device=qkv.device)
    has_norm = q_weight is not None
    num_heads = num_q_heads + 2 * num_kv_heads
    heads = 1
    if num_tokens > ONE_HEAD_PER_PROGRAM_UP_TO:
        heads = min(QK_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
    launch(_qk_norm_rope_store_kernel, (num_tokens, triton.cdiv(num_heads, heads)),
        qkv, positions, cos_sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv, q,
        k_cache, v_cache, slot_mapping, qkv.stride(0), q.stride(0), eps, NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, HAS_NORM=has_norm, HEADS=heads,
        num_warps=1 if heads == 1 else 4, **pdl.launch_options(num_tokens))
    return q


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row, col_block = tl.program_id(0), tl.program_id(1)
    offs = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up, the SiLU in float32 and rounded to gate's dtype, as torch's F.silu on 16-bit
    tensors gives it."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding gate | up -> silu(gate) * up: [num_tokens, d]."""
    n_rows, two_d = x.shape
    d = two_d // 2
    out = torch.empty(n_rows, d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    launch(_silu_and_mul_kernel, (n_rows, triton.cdiv(d, block)), x, out, x.stride(0), out.stride(0), d, BLOCK=block,
           **pdl.launch_options(n_rows))
    return out
