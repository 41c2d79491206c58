import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] holding gate | up  ->  silu(gate) * up: [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanovllm.kernels.triton_fused import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
