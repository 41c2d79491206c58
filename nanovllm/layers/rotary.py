import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX) layout, as Qwen and Llama use.

    scaling: None, or Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # cos_sin_cache: [max_position, head_dim] holding cos | sin, each head_dim / 2 wide
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1),
                             persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, -1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's long-context RoPE: frequencies whose wavelength exceeds the original context
    / low_freq_factor are slowed down by `factor`; those shorter than context / high_freq_factor
    are kept; the ones between are blended linearly in context / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short
    return inv_freq / factor * (1 - blend) + inv_freq * blend
