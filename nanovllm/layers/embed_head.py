"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import SINGLE, TPGroup
from nanovllm.layers.linear import copy_checked


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.shard_size * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.lora = None   # with LoRA adapters: lora/layers.py's LoRAEmbedding (LoRAHead for the LM head)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding: checkpoint has {loaded.shape[0]} rows, "
                             f"config vocab_size is {self.num_embeddings}.")
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()   # the last rank's padding rows stay zero
        copy_checked(param.data[:shard.shape[0]], shard, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.vocab_start
            mask = (local >= 0) & (local < self.shard_size)
            y = self.tp.all_reduce(F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1))
        return y if self.lora is None else self.lora.add_to(y, input_ids)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ weight.T; with tensor parallelism rank 0 gathers the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.lora is not None:   # (this rank's shard of the adapters' logits)
            self.lora.add_to(logits, hidden)
        if self.tp_size == 1:
            return logits
        parts = self.tp.gather_to_first(logits)
        return torch.cat(parts, -1)[:, :self.num_embeddings] if parts is not None else None
