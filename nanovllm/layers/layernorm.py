import torch
from torch import nn

from nanovllm.layers.linear import Partials


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, in float32. With `residual`, adds it first and returns the sum too
    (the fused add-and-norm between decoder layers). x may be a row-parallel or MoE layer's
    Partials (layers/linear.py), summed here and rounded to the residual's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor | Partials, residual: torch.Tensor | None = None):
        if isinstance(x, Partials):              # (made on CUDA only) summed by the kernel
            x = x.parts
        elif not (x.is_cuda and x.dim() == 2):
            if residual is None:
                return self._norm(x)
            x = x + residual
            return self._norm(x), x
        from nanovllm.kernels.triton_fused import rms_norm
        return rms_norm(x, self.weight, self.eps, residual)
