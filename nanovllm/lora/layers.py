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
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.lora.adapter import LORA_MODULES, LoRAAdapter

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
    """The step's slot of each token (-1: the base model), shared by the adapted modules: as token_slots [max_tokens]
    (the embedding's and the LM head's), and as the tokens sorted by slot for the Triton kernels (on CUDA) or as a
    one-hot mask [tokens, slots] for the torch formula (the projections'). All at fixed addresses, so that CUDA
    graphs replay with each step's."""

    def __init__(self, max_loras: int, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_loras = max_loras
        self.fused = uses_kernels(device)
        self.written = 0   # tokens beyond this many are slot -1, in token_slots and in tokens
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.tokens = torch.from_numpy(sorted_tokens(np.zeros(0, np.int64), max_tokens)).to(device)
        self.slot_ids = torch.arange(max_loras, device=device)
        self.mask = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)
        self.row_slots = self.token_slots   # the slots of the rows the LM head computes logits of (select_rows)
        # On CUDA a projection's shrink runs on this stream, beside the base product (in the graphs too)
        self.side = torch.cuda.Stream(device) if self.fused and device.type == "cuda" else None

    def set_tokens(self, slots: np.ndarray):
        """slots: [tokens] int, each token's slot or -1."""
        # Straight into the buffers, from pinned memory (the host does not wait). Past the step's tokens the last
        # step's are overwritten: a CUDA graph's padding rows then read slot -1, which the kernels neither read
        # nor write and the torch formula masks out.
        length = max(len(slots), self.written)
        token_slots = np.full(length, -1, np.int64)
        token_slots[:len(slots)] = slots
        upload([token_slots], self.token_slots.device, out=self.token_slots.view(torch.uint8))
        if self.fused:
            upload([sorted_tokens(slots, length)], self.tokens.device, out=self.tokens.view(torch.uint8).view(-1))
        else:   # (rows past `length` are slot -1 already: zero)
            self.mask[:length].copy_(self.token_slots[:length, None] == self.slot_ids)
        self.written = len(slots)

    def select_rows(self, index: torch.Tensor | slice):
        """The LM head's next rows are the hidden states of these tokens (a device index or a slice)."""
        self.row_slots = self.token_slots[index]

    def one_hot(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """slots [n] -> [n, max_loras, 1]: 1 at each row's slot, none for -1."""
        return (slots[:, None] == self.slot_ids).to(dtype)[:, :, None]


def torch_formula(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """y += each row's own slot's products, through every slot at once (the plain-torch path), in place:
    x [n, in_features], a [slots, ..., in_features] and b [slots, ..., out_features] (the same rows), mask
    [n, slots, 1] one-hot (zero for -1)."""
    rows = a.numel() // a.shape[-1]
    shrunk = (x @ a.view(rows, -1).t()).view(len(x), mask.shape[1], -1) * mask   # [n, slots, rows per slot]
    return y.addmm_(shrunk.view(len(x), rows), b.view(rows, -1))


class SlotWeights(nn.Module):
    """An adapted module's A and B buffers, a slot's first: zero where a slot holds no weights for it."""

    def __init__(self, slots: LoRASlots, a_shape: tuple, b_shape: tuple, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.slots = slots
        for name, shape in (("a", a_shape), ("b", b_shape)):
            self.register_buffer(name, torch.zeros(slots.max_loras, *shape, dtype=dtype, device=device),
                                 persistent=False)

    def clear(self, slot: int):
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoRALinear(SlotWeights):
    """The slots' A and B of one projection (this rank's shard), whose delta(x) add_to() adds to its output."""

    def __init__(self, slots: LoRASlots, linear: LinearBase, name: str, max_rank: int, prefix: str = ""):
        """prefix: of the adapter's target names (a shared expert's "shared_expert.")."""
        out_features, in_features = linear.weight.shape
        parts = len(PARTS[name])
        dtype = linear.model_dtype if linear.fp8 else linear.weight.dtype   # (an fp8 projection's: the model's)
        super().__init__(slots, (parts, max_rank, in_features), (parts, max_rank, out_features), dtype,
                         linear.weight.device)
        self.name, self.targets = name, [prefix + target for target in PARTS[name]]
        self.row_parallel = isinstance(linear, RowParallelLinear)
        self.tp_rank, self.tp_size = linear.tp_rank, linear.tp_size
        # this rank's output columns of each part
        if isinstance(linear, MergedColumnParallelLinear):
            self.columns = [MergedColumnParallelLinear.shard_range(linear, i) for i in range(len(self.targets))]
        else:
            self.columns = [(0, out_features)]

    def shrink(self, x: torch.Tensor) -> torch.Tensor | None:
        """The Triton path's first kernel (None on the torch path), begun before the base product: on CUDA on the
        side stream, so that the two run at once (the caller's add_to waits for it)."""
        if not self.slots.fused:
            return None
        from nanovllm.kernels.triton_lora import lora_shrink, shrink_output
        a, tokens, side = self.a.view(self.slots.max_loras, -1, x.shape[1]), self.slots.tokens[:len(x)], self.slots.side
        if side is None:
            return lora_shrink(x, a, tokens)
        out = shrink_output(x, a)   # (allocated on the caller's stream, which frees it after add_to)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return lora_shrink(x, a, tokens, out=out)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, shrunk: torch.Tensor | None = None,
               silu_mul: bool = False) -> torch.Tensor:
        """y += delta(x), in place, with shrunk = shrink(x) begun before y's product: on CUDA the Triton expand
        of each token's own slot, else three torch operations over all slots (the shrink product, the mask, the
        expand product with the add). silu_mul: return silu(gate) * up of the sum's halves (gate_up_proj's), in
        the expand on CUDA."""
        n = x.shape[0]
        if self.slots.fused:
            from nanovllm.kernels.triton_lora import lora_expand
            if self.slots.side is not None:
                torch.cuda.current_stream().wait_stream(self.slots.side)
            tokens = self.slots.tokens[:n]
            return lora_expand(y, shrunk, self.b.view(self.slots.max_loras, -1, y.shape[1]), tokens, silu_mul)
        y = torch_formula(y, x, self.a, self.b, self.slots.mask[:n, :, None])
        return silu_and_mul(y) if silu_mul else y

    def load(self, slot: int, layer: int, adapter: LoRAAdapter):
        """Write adapter's weights for this projection of `layer` into slot (zero where it has none)."""
        self.clear(slot)
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


class LoRAExperts(nn.Module):
    """The slots' A and B of every expert of a mixture-of-experts layer (layers/moe.py's Experts), this rank's
    shard, by expert and then by slot as the MoE kernels read them (kernels/triton_moe.py's ExpertLoRA):

        a13: [experts, 2, slots, max_rank, hidden]    b13: [experts, 2, slots, max_rank, intermediate]
        a2:  [experts, slots, max_rank, intermediate]  b2:  [experts, slots, max_rank, hidden]

    (2: the gate and up projections). An expert's gate | up output gains its tokens' slots' products of
    x before the activation, its down output theirs of the activation before the routing weight, as the
    merged weights would give."""

    def __init__(self, slots: LoRASlots, experts: nn.Module, max_rank: int):
        super().__init__()
        self.slots = slots
        self.tp_rank, self.tp_size = experts.tp.rank, experts.tp.size
        num_experts, hidden, inter = experts.w2.shape
        shapes = {"a13": (num_experts, 2, slots.max_loras, max_rank, hidden),
                  "b13": (num_experts, 2, slots.max_loras, max_rank, inter),
                  "a2": (num_experts, slots.max_loras, max_rank, inter),
                  "b2": (num_experts, slots.max_loras, max_rank, hidden)}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=experts.w2.dtype, device=experts.w2.device),
                                 persistent=False)

    def weights(self, num_tokens: int):
        """The MoE kernels' view, for a step of num_tokens tokens."""
        from nanovllm.kernels.triton_moe import ExpertLoRA
        return ExpertLoRA(self.a13, self.b13, self.a2, self.b2, self.slots.token_slots[:num_tokens])

    def add_to(self, y: torch.Tensor, x: torch.Tensor, expert: int, tokens: torch.Tensor, down: bool):
        """The torch path (layers/moe.py's per-expert loop): y += the products of expert's rows x of the step's
        tokens `tokens`, in place: gate | up's (y [n, 2 intermediate]) or, with down, the down projection's."""
        mask = self.slots.one_hot(self.slots.token_slots[tokens], x.dtype)
        if down:
            return torch_formula(y, x, self.a2[expert], self.b2[expert], mask)
        for part, columns in enumerate(y.chunk(2, -1)):
            torch_formula(columns, x, self.a13[expert, part], self.b13[expert, part], mask)
        return y

    def load(self, slot: int, layer: int, adapter: LoRAAdapter):
        """Write adapter's weights for the experts of `layer` into slot (zero where it has none): a projection's
        experts' A (and B) stacked on the host, moved and written at once (not a copy a matrix: ~37k for
        Qwen3-30B-A3B's 48 layers, 1.77 s an adapter against 0.40 s on an H100)."""
        for name in ("a13", "b13"):
            getattr(self, name)[:, :, slot].zero_()
        for name in ("a2", "b2"):
            getattr(self, name)[:, slot].zero_()
        rank, scaling, device, dtype = adapter.rank, adapter.scaling, self.a2.device, self.a2.dtype
        for part, target in enumerate(("gate_proj", "up_proj", "down_proj")):
            found = {expert: weights for expert in range(self.a2.shape[0])
                     if (weights := adapter.weights.get((layer, f"experts.{expert}.{target}"))) is not None}
            if not found:
                continue
            experts = torch.tensor(list(found), device=device)
            a = torch.stack([a for a, _ in found.values()]).to(device, dtype)              # [n, rank, in]
            b = torch.stack([b for _, b in found.values()]).to(device).float() * scaling   # [n, out, rank]
            b = b.to(dtype).transpose(1, 2)                                                 # [n, rank, out]
            if part < 2:   # gate, up: this rank's rows of the intermediate features, in B
                self.a13[experts, part, slot, :rank] = a
                self.b13[experts, part, slot, :rank] = b.chunk(self.tp_size, 2)[self.tp_rank]
            else:          # down: its columns of them, in A (each rank's part of the product is summed after)
                self.a2[experts, slot, :rank] = a.chunk(self.tp_size, 2)[self.tp_rank]
                self.b2[experts, slot, :rank] = b


class LoRAEmbedding(SlotWeights):
    """The slots' A and B of the token embedding, whole on every rank (added after the ranks' sum): a token's
    embedding gains a[slot, token] @ b[slot], A's product with the token's one-hot row being a lookup."""

    def __init__(self, slots: LoRASlots, embedding: nn.Module, max_rank: int):
        vocab_size, hidden_size = embedding.num_embeddings, embedding.weight.shape[1]
        super().__init__(slots, (vocab_size, max_rank), (max_rank, hidden_size), embedding.weight.dtype,
                         embedding.weight.device)

    def add_to(self, y: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """y += each token's a[slot, token] @ b[slot], in place: on CUDA the Triton expand with the lookup in
        it, else a lookup and one product over all slots."""
        if self.slots.fused:
            from nanovllm.kernels.triton_lora import lora_expand
            return lora_expand(y, self.a, self.b, self.slots.tokens[:len(y)], ids=input_ids)
        num_slots, vocab_size, rank = self.a.shape
        slots = self.slots.token_slots[:len(input_ids)]
        looked_up = self.a.view(-1, rank)[slots.clamp(min=0) * vocab_size + input_ids]     # [n, rank]
        per_slot = looked_up[:, None, :] * self.slots.one_hot(slots, y.dtype)              # [n, slots, rank]
        return y.addmm_(per_slot.view(len(y), -1), self.b.view(num_slots * rank, -1))

    def load(self, slot: int, adapter: LoRAAdapter):
        self.clear(slot)
        weights = adapter.weights.get((None, "embed_tokens"))
        if weights is not None:
            a, b = weights                                   # [rank, vocab], [hidden, rank]
            self.a[slot, :, :adapter.rank].copy_(a.t())
            self.b[slot, :adapter.rank].copy_((b.float() * adapter.scaling).t())


class LoRAHead(SlotWeights):
    """The slots' A and B of the LM head (B's columns: this rank's shard of the vocabulary, added before the
    ranks' logits are gathered), for the rows that LoRASlots.select_rows named. The torch formula: a step's
    logits rows are few. Skipped while no slot holds LM-head weights (the head runs outside the CUDA graphs)."""

    def __init__(self, slots: LoRASlots, head: nn.Module, max_rank: int):
        shard_size, hidden_size = head.weight.shape
        super().__init__(slots, (max_rank, hidden_size), (max_rank, shard_size), head.weight.dtype, head.weight.device)
        self.vocab_start, self.num_embeddings = head.vocab_start, head.num_embeddings
        self.holding: set[int] = set()   # the slots with LM-head weights

    def add_to(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if not self.holding:
            return logits
        return torch_formula(logits, hidden, self.a, self.b, self.slots.one_hot(self.slots.row_slots, hidden.dtype))

    def load(self, slot: int, adapter: LoRAAdapter):
        self.clear(slot)
        weights = adapter.weights.get((None, "lm_head"))
        self.holding.discard(slot)
        if weights is not None:
            self.holding.add(slot)
            a, b = weights                                   # [rank, hidden], [vocab, rank]
            b = b[self.vocab_start:min(self.vocab_start + self.b.shape[-1], self.num_embeddings)]   # this shard's
            self.a[slot, :adapter.rank].copy_(a)
            self.b[slot, :adapter.rank, :len(b)].copy_((b.float() * adapter.scaling).t())


class LoRAModel:
    """The adapted modules of a model: attention's q/k/v and o, a dense MLP's gate/up and down (a mixture of
    experts': each expert's, and the shared expert's), the token embedding and the LM head (a pooling model has
    none: the runner leaves "lm_head" out of its target modules, so that its adapters' LM-head weights are left out
    with a warning)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_tokens: int,
                 target_modules: list[str] | None = None):
        """target_modules (lora_target_modules): only these modules (of adapter.LORA_MODULES) take adapters."""
        first = next(model.parameters())
        self.slots = LoRASlots(max_loras, max_tokens, first.dtype, first.device)
        self.projections: list[tuple[int, LoRALinear | LoRAExperts]] = []
        chosen = set(target_modules or LORA_MODULES)
        for index, layer in enumerate(model.model.layers):
            modules = [("qkv_proj", layer.self_attn.qkv_proj, ""), ("o_proj", layer.self_attn.o_proj, "")]
            mlp, mlp_prefix = layer.mlp, ""   # (a dense MLP, or a mixture of experts' shared expert, if any)
            if isinstance(mlp, SparseMoeBlock):
                if "experts" in chosen:
                    mlp.experts.lora = LoRAExperts(self.slots, mlp.experts, max_rank)
                    self.projections.append((index, mlp.experts.lora))
                mlp, mlp_prefix = mlp.shared_expert, "shared_expert."
            if mlp is not None:
                modules += [("gate_up_proj", mlp.gate_up_proj, mlp_prefix), ("down_proj", mlp.down_proj, mlp_prefix)]
            for name, linear, prefix in modules:
                if name in chosen:
                    linear.lora = LoRALinear(self.slots, linear, name, max_rank, prefix)
                    self.projections.append((index, linear.lora))
        self.model_modules = []
        embedding = model.model.embed_tokens
        if "embed_tokens" in chosen:
            embedding.lora = LoRAEmbedding(self.slots, embedding, max_rank)
            self.model_modules.append(embedding.lora)
        if model.lm_head is not None and "lm_head" in chosen:
            model.lm_head.lora = LoRAHead(self.slots, model.lm_head, max_rank)
            self.model_modules.append(model.lm_head.lora)

    def load(self, slot: int, adapter: LoRAAdapter):
        for layer, projection in self.projections:
            projection.load(slot, layer, adapter)
        for module in self.model_modules:
            module.load(slot, adapter)


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
