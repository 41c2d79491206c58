"""Activations quantized to fp8 (e4m3) a row at a time, for the fp8 products of quantization="fp8"
(layers/linear.py's fp8_linear): each row's scale is its largest magnitude over FP8_MAX (at least
MIN_SCALE), and its values are divided by it and rounded to fp8. One program a row, the row in
registers. Its reference is layers/linear.py's quantize_rows_fp8 on the CPU."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.compile_ahead import launch

FP8_MAX = 448.0                     # e4m3's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512)   # (a row of zeros keeps a finite scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # (IEEE divisions, as torch's: Triton's "/" on float32 is an approximate one)
    scale = tl.maximum(tl.div_rn(amax, tl.zeros_like(amax) + FP8_MAX), MIN_SCALE)
    q = tl.clamp(tl.div_rn(x, tl.zeros_like(x) + scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (x in float8_e4m3fn [M, K], the rows' float32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    launch(_quantize_rows_kernel, (m,), x, q, scale, k, x.stride(0), FP8_MAX, MIN_SCALE, block,
           num_warps=min(16, max(4, block // 1024)), **pdl.launch_options(m))
    return q, scale
