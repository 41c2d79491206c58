import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding gate | up  ->  silu(gate) * up: [..., d]."""
    if x.is_cuda:
        from nanovllm.kernels import triton_fused
        return triton_fused.silu_and_mul(x)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
