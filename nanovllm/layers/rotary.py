import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX) layout, as Qwen and Llama use.

    scaling: None, or the config's rope parameters for a long-context variant (SCALINGS):
    Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}, YaRN's {"rope_type": "yarn", "factor",
    "original_max_position_embeddings", optional "beta_fast", "beta_slow", "attention_factor",
    "mscale", "mscale_all_dim", "truncate"}, or {"rope_type": "linear", "factor"}."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attention_factor = 1.0
        if scaling is not None:
            inv_freq, attention_factor = SCALINGS[rope_type(scaling)](inv_freq, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # cos_sin_cache: [max_position, head_dim] holding cos | sin, each head_dim / 2 wide
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1) * attention_factor
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, -1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def rope_parameters(config) -> dict:
    """The HF config's RoPE parameters ({} for plain RoPE in older configs). A scaling given under
    the older name rope_scaling (e.g. through hf_overrides) wins over plain rope_parameters."""
    parameters = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) or {}
    if rope_type(legacy) != "default" and rope_type(parameters) == "default":
        return {**parameters, **legacy}
    return parameters or legacy


def rope_type(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_settings(config) -> tuple[float, dict | None]:
    """-> (theta, the long-context scaling's parameters or None); unsupported variants are refused."""
    rope = rope_parameters(config)
    kind = rope_type(rope)
    if kind != "default" and kind not in SCALINGS:
        raise ValueError(f"rope scaling {rope} is not supported; only the default RoPE and "
                         f"{', '.join(repr(k) for k in SCALINGS)} are.")
    theta = getattr(config, "rope_theta", None)
    return (theta if theta is not None else rope["rope_theta"]), (rope if kind != "default" else None)


def max_positions(config) -> int:
    """Positions the model can embed: max_position_embeddings, or with YaRN the original context
    times the factor, with linear scaling max_position_embeddings times it (vLLM's derived
    max_model_len)."""
    rope = rope_parameters(config)
    kind = rope_type(rope)
    if kind == "yarn":
        return int(rope["original_max_position_embeddings"] * rope["factor"])
    if kind == "linear":
        return int(config.max_position_embeddings * rope["factor"])
    return config.max_position_embeddings


def llama3_inv_freq(inv_freq: torch.Tensor, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Llama 3's long-context RoPE: frequencies whose wavelength exceeds the original context
    / low_freq_factor are slowed down by `factor`; those shorter than context / high_freq_factor
    are kept; the ones between are blended linearly in context / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short
    return inv_freq / factor * (1 - blend) + inv_freq * blend, 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: a frequency pair that turns more than beta_fast times over the original context keeps
    its frequency, one that turns fewer than beta_slow times is slowed down by `factor`, and the
    pairs between are blended along a linear ramp in their index; cos and sin are then scaled by
    the attention factor (0.1 ln(factor) + 1 unless given), which sharpens attention to match."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    head_dim = 2 * inv_freq.numel()

    def pair_turning(turns: float) -> float:
        """The (fractional) dimension whose frequency makes `turns` turns over the original context."""
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(inv_freq.numel(), dtype=torch.float) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)           # ramp 0: kept, 1: slowed down

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return inv_freq, attention_factor


def linear_inv_freq(inv_freq: torch.Tensor, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency slowed down by `factor`."""
    return inv_freq / scaling["factor"], 1.0


# rope_type -> (inverse frequencies, base, parameters) -> (scaled inverse frequencies, attention factor)
SCALINGS = {"llama3": llama3_inv_freq, "yarn": yarn_inv_freq, "linear": linear_inv_freq}
