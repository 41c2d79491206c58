"""The adapters' products beside the base model's (vLLM's multi-LoRA batching).

The engine holds up to max_loras adapters in slots. Each adapted projection keeps every slot's A and B
stacked, zero where a slot's adapter has a smaller rank or no weights for the projection:

    a: [slots, parts, max_rank, in_features]    b: [slots, parts, max_rank, out_features]

(parts: a fused projection's q, k, v or gate, up; part p's rows of b are zero outside p's output
columns, and carry the adapter's scaling). A step's tokens each use one slot or none, given by a
one-hot mask [tokens, slots] that the runner writes before the forward pass (LoRASlots). Then

    delta = ((x @ a.T) * mask, per slot) @ b

is two products whatever the mix of adapters in the step: the mask zeroes each token's other slots.
That is the plain-torch path (the CPU's, and the reference). On CUDA two Triton kernels
(kernels/triton_lora.py) compute each token's own slot's products from its slot id, skipping the slots
that none of a tile's tokens use; they take the tokens sorted by slot (sorted_tokens), so that a tile
of tokens mostly holds one slot. Mask and sorted tokens are buffers at fixed addresses, so CUDA graphs
replay with each step's.
"""
import os

import numpy as np
import torch
from torch import nn

from nanovllm.engine.upload import upload
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from nanovllm.layers.mlp import GatedMLP
from nanovllm.lora.adapter import LoRAAdapter

# Our fused projection -> the adapter targets of its parts, in order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def sorted_tokens(slots: np.ndarray, length: int) -> np.ndarray:
    """The Triton kernels' view of a step's tokens: int32 [length, 2], the (slot, token) pairs in the order of
    the slots (base-model tokens first), then (-1, i) up to length."""
    order = np.argsort(slots, kind="stable")
    pairs = np.empty((length, 2), np.int32)
    pairs[:len(slots), 0], pairs[:len(slots), 1] = slots[order], order
    pairs[len(slots):, 0], pairs[len(slots):, 1] = -1, np.arange(len(slots), length)
    return pairs


def uses_kernels(device: torch.device) -> bool:
    """Whether the projections take the Triton kernels: on CUDA unless NANOVLLM_LORA_TRITON=0 (A/B runs against
    the torch formula); on the CPU only with NANOVLLM_LORA_TRITON=1, under TRITON_INTERPRET=1 (the engine's LoRA
    tests through the kernels, without a GPU)."""
    setting = os.environ.get("NANOVLLM_LORA_TRITON")
    return setting != "0" if device.type == "cuda" else setting == "1"


class LoRASlots:
    """The step's slot of each token (-1: the base model), shared by the projections: as the tokens sorted by
    slot for the Triton kernels (on CUDA) and as a one-hot mask [tokens, slots] for the torch formula."""

    def __init__(self, max_loras: int, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_loras = max_loras
        self.fused = uses_kernels(device)
        self.tokens = torch.from_numpy(sorted_tokens(np.zeros(0, np.int64), max_tokens)).to(device)
        self.written = 0   # tokens beyond this many in self.tokens are (-1, i)
        self.mask = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)

    def set_tokens(self, slots: np.ndarray):
        """slots: [tokens] int, each token's slot or -1."""
        if self.fused:   # straight into the buffer, from pinned memory (the host does not wait)
            # (past the step's tokens, the last step's are overwritten: a CUDA graph's padding rows then read
            # slot -1, which the kernels neither read nor write)
            pairs = sorted_tokens(slots, max(len(slots), self.written))
            upload([pairs], self.tokens.device, out=self.tokens.view(torch.uint8).view(-1))
            self.written = len(slots)
            return
        onehot = np.zeros((len(slots), self.max_loras), np.float32)
        used = slots >= 0
        onehot[np.flatnonzero(used), slots[used]] = 1.0
        [onehot] = upload([onehot], self.mask.device)
        self.mask[:len(slots)].copy_(onehot)


class LoRALinear(nn.Module):
    """The slots' A and B of one projection (this rank's shard), whose delta(x) add_to() adds to its output."""

    def __init__(self, slots: LoRASlots, linear: LinearBase, name: str, max_rank: int):
        super().__init__()
        self.slots, self.name = slots, name
        self.targets = PARTS[name]
        self.row_parallel = isinstance(linear, RowParallelLinear)
        self.tp_rank, self.tp_size = linear.tp_rank, linear.tp_size
        out_features, in_features = linear.weight.shape
        # this rank's output columns of each part
        if isinstance(linear, MergedColumnParallelLinear):
            self.columns = [MergedColumnParallelLinear.shard_range(linear, i) for i in range(len(self.targets))]
        else:
            self.columns = [(0, out_features)]
        shape = (slots.max_loras, len(self.targets), max_rank)
        dtype, device = linear.weight.dtype, linear.weight.device
        self.register_buffer("a", torch.zeros(*shape, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(*shape, out_features, dtype=dtype, device=device), persistent=False)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += delta(x), in place: the two Triton kernels of each token's own slot on CUDA, else three torch
        operations over all slots (the shrink product, the mask, the expand product with the add)."""
        n = x.shape[0]
        if self.slots.fused:
            from nanovllm.kernels.triton_lora import lora_expand, lora_shrink
            a, b = (w.view(self.slots.max_loras, -1, w.shape[-1]) for w in (self.a, self.b))
            tokens = self.slots.tokens[:n]
            return lora_expand(y, lora_shrink(x, a, tokens), b, tokens)
        rows = self.a.shape[0] * self.a.shape[1] * self.a.shape[2]
        shrunk = x @ self.a.view(rows, -1).t()                                   # [n, slots * parts * rank]
        shrunk = shrunk.view(n, self.slots.max_loras, -1) * self.slots.mask[:n, :, None]
        return y.addmm_(shrunk.view(n, rows), self.b.view(rows, -1))

    def load(self, slot: int, layer: int, adapter: LoRAAdapter):
        """Write adapter's weights for this projection of `layer` into slot (zero where it has none)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for part, target in enumerate(self.targets):
            weights = adapter.weights.get((layer, target))
            if weights is None:
                continue
            a, b = weights
            if self.row_parallel:    # the input features are split: A's columns too; B whole
                a = a.chunk(self.tp_size, 1)[self.tp_rank]
            else:                    # the output features are split: B's rows
                b = b.chunk(self.tp_size, 0)[self.tp_rank]
            start, size = self.columns[part]
            self.a[slot, part, :adapter.rank].copy_(a)
            self.b[slot, part, :adapter.rank, start:start + size].copy_((b.float() * adapter.scaling).t())

    def clear(self, slot: int):
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoRAModel:
    """The adapted projections of a model (attention's q/k/v and o, a dense MLP's gate/up and down)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_tokens: int):
        first = next(model.parameters())
        self.slots = LoRASlots(max_loras, max_tokens, first.dtype, first.device)
        self.projections: list[tuple[int, LoRALinear]] = []
        for index, layer in enumerate(model.model.layers):
            modules = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
            if isinstance(layer.mlp, GatedMLP):
                modules += [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]
            for name, linear in modules:
                linear.lora = LoRALinear(self.slots, linear, name, max_rank)
                self.projections.append((index, linear.lora))

    def load(self, slot: int, adapter: LoRAAdapter):
        for layer, projection in self.projections:
            projection.load(slot, layer, adapter)

    def clear(self, slot: int):
        for _, projection in self.projections:
            projection.clear(slot)


class SlotTable:
    """Rank 0's choice of slots: which adapter (lora_int_id; 0 none) each slot holds, the least recently
    used given up first for an adapter a step needs (the scheduler lets at most max_loras adapters run)."""

    def __init__(self, max_loras: int):
        self.ids = [0] * max_loras
        self.last_used = [0] * max_loras
        self.clock = 0

    def assign(self, requests: list) -> tuple[np.ndarray, list]:
        """requests: each of a step's sequences' LoRARequest or None -> (each one's slot or -1, the
        (slot, LoRARequest) loads that must happen first)."""
        self.clock += 1
        needed = {r.lora_int_id: r for r in requests if r is not None}
        loads = []
        for lora_id, request in needed.items():
            if lora_id not in self.ids:
                free = [s for s in range(len(self.ids)) if self.ids[s] not in needed]
                slot = min(free, key=lambda s: (self.ids[s] != 0, self.last_used[s]))
                self.ids[slot] = lora_id
                loads.append((slot, request))
            self.last_used[self.ids.index(lora_id)] = self.clock
        slots = np.array([-1 if r is None else self.ids.index(r.lora_int_id) for r in requests], np.int64)
        return slots, loads

    def forget(self, lora_int_id: int):
        """The adapter is gone (remove_lora): its slot, if any, is free."""
        if lora_int_id in self.ids:
            self.ids[self.ids.index(lora_int_id)] = 0
