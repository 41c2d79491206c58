import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed import TPGroup
from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear


def require_silu(config: PretrainedConfig):
    """The gated MLPs here (dense and experts) apply SiLU; refuse a model that uses another activation."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is.")


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: PretrainedConfig, tp: TPGroup,
                 to_norm: bool = False):
        """to_norm: the output goes straight to an RMSNorm (see RowParallelLinear)."""
        super().__init__()
        require_silu(config)
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported.")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, to_norm=to_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At small batches the gate_up projection's kernel applies the activation to its products.
        return self.down_proj(self.gate_up_proj(x, silu_mul=True))
