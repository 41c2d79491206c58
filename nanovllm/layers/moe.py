"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): a router picks top_k experts per token; each
expert is a SiLU-gated MLP; a token's output is the routing-weighted sum of its experts' outputs,
plus, in Qwen2-MoE, a shared expert's output scaled by a sigmoid gate.

The experts' weights are stacked, [num_experts, ...], and split Megatron-style across
tensor-parallel ranks like the dense MLP: each rank holds a slice of every expert's
intermediate features, and the partial outputs are summed with one all-reduce.

On the GPU the experts run as two grouped GEMMs over the tokens sorted by expert, in shapes that
depend only on the number of tokens (kernels/triton_moe.py), so MoE models are captured in CUDA
graphs like dense ones. On one GPU the sum over a token's choices is left to the RMSNorm after
the layer (layers/linear.py's Partials), when nothing else comes between. On the CPU each expert
used gathers its tokens with `nonzero` (shapes that depend on the data): the plain-torch
reference of the kernels.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed import TPGroup
from nanovllm.layers.linear import Partials, ReplicatedLinear, copy_checked
from nanovllm.layers.mlp import GatedMLP, require_silu


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, top_k] weights in float32, [T, top_k] expert ids), best first:
    the softmax over all experts, restricted to the top_k (and rescaled to sum to 1 if asked)."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """num_experts SiLU-gated MLPs: w13[e] = gate | up rows, w2[e] = down (this rank's slices).
    to_norm: the output goes straight to an RMSNorm, which may then sum the choices itself."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 to_norm: bool = False):
        super().__init__()
        self.tp = tp
        self.to_norm = to_norm and tp.size == 1
        self.intermediate = intermediate_size // tp.size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        # The checkpoint has one tensor per expert and projection: (expert, "gate" | "up" | "down").
        self.w13.shard_ids = [(e, part) for e in range(num_experts) for part in ("gate", "up")]
        self.w2.shard_ids = [(e, "down") for e in range(num_experts)]
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.lora = None   # with LoRA adapters: lora/layers.py's LoRAExperts, whose products join each expert's

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]):
        expert, part = shard_id
        if part == "down":                      # [hidden, intermediate]: split the columns
            copy_checked(param.data[expert], loaded.chunk(self.tp.size, 1)[self.tp.rank], f"expert {expert} down")
            return
        rows = loaded.chunk(self.tp.size, 0)[self.tp.rank]
        offset = 0 if part == "gate" else self.intermediate
        copy_checked(param.data[expert].narrow(0, offset, self.intermediate), rows, f"expert {expert} {part}")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> torch.Tensor | Partials:
        """x: [T, hidden]; router_logits: [T, num_experts] -> [T, hidden], routed as `route` says
        (with to_norm on CUDA: each choice's weighted output, Partials of [top_k, T, hidden])."""
        if x.is_cuda:
            from nanovllm.kernels.triton_moe import fused_moe
            lora = None if self.lora is None else self.lora.weights(len(x))
            out = fused_moe(x, router_logits, self.w13, self.w2, top_k, renormalize, sum_choices=not self.to_norm,
                            lora=lora)
            if self.to_norm:
                return Partials(out)
        else:
            out = self.per_expert(x, *route(router_logits, top_k, renormalize))
        return self.tp.all_reduce(out)

    def per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CPU path and the kernels' reference: x: [T, hidden]; weights, ids: [T, top_k] ->
        [T, hidden], this rank's part (before the all-reduce)."""
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            rows = x[tokens]
            gate_up = F.linear(rows, self.w13[expert])
            if self.lora is not None:
                gate_up = self.lora.add_to(gate_up, rows, expert, tokens, down=False)
            gate, up = gate_up.chunk(2, -1)
            act = F.silu(gate) * up
            y = F.linear(act, self.w2[expert])
            if self.lora is not None:
                y = self.lora.add_to(y, act, expert, tokens, down=True)
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup, to_norm: bool = False):
        """to_norm: the output goes straight to an RMSNorm (see Experts)."""
        super().__init__()
        require_silu(config)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp,
                               to_norm=to_norm and not shared)
        self.shared_expert = self.shared_expert_gate = None
        if shared:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config, tp)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Partials:
        out = self.experts(x, self.gate(x), self.top_k, self.renormalize)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_moe_layer(config: PretrainedConfig, index: int) -> bool:
    """Qwen3-MoE: every decoder_sparse_step-th layer, except those in mlp_only_layers."""
    return (getattr(config, "num_experts", 0) > 0 and index not in (getattr(config, "mlp_only_layers", None) or [])
            and (index + 1) % config.decoder_sparse_step == 0)
