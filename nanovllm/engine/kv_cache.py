"""The paged KV cache: one tensor holding every layer's keys and values, and how many blocks it gets.

    kv_cache: [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]

Each attention layer gets views of its own K and V ([num_blocks, block_size, num_kv_heads,
head_dim]). How many blocks: num_kvcache_blocks if set; else the bytes kv_cache_memory_bytes
gives, or on CUDA what gpu_memory_utilization leaves of the card after the peak of a worst-case
step (ModelRunner runs that step: the whole token budget over up to max_num_seqs sequences of
sizing_lens), or on the CPU vLLM's default 4 GiB; never more than max_num_seqs full-length
sequences could use.
"""
import torch

CPU_KV_CACHE_BYTES = 4 << 30   # vLLM's default CPU KV-cache space


def even_split(total: int, parts: int) -> list[int]:
    """total as parts lengths differing by at most one, the longer first ([] for no parts)."""
    return [total // parts + (i < total % parts) for i in range(parts)] if parts else []


def sizing_lens(num_tokens: int, num_seqs: int, max_len: int) -> list[int]:
    """The sequence lengths of the KV-cache sizing's step (num_tokens over num_seqs sequences): the
    last as long as max_len and the budget allow, the first a single token beside them (a mixed
    step's decode), the rest even. So its dry pass also compiles the attention kernels of long
    contexts and of mixed steps, which a run would otherwise compile in its first such step."""
    if num_seqs == 1 or 1 + (num_seqs - 1) * max_len < num_tokens:   # (no room for the one-token row)
        return even_split(num_tokens, num_seqs)
    longest = min(max_len, num_tokens - (num_seqs - 1))
    return [1] + even_split(num_tokens - 1 - longest, num_seqs - 2) + [longest]


def block_bytes(layers: list, block_size: int, dtype: torch.dtype) -> int:
    """The bytes of one block across the attention layers (K and V)."""
    per_layer = 2 * block_size * layers[0].num_kv_heads * layers[0].head_dim
    return per_layer * len(layers) * dtype.itemsize


def allocate(layers: list, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
             memory: torch.Tensor | None = None) -> torch.Tensor:
    """The cache tensor, its views handed to the layers (layer.k_cache, layer.v_cache). memory:
    bytes to lay it in (sleep mode's arena), exactly its size; None: a new tensor."""
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    kv_cache = torch.empty(shape, dtype=dtype, device=device) if memory is None else memory.view(dtype).view(shape)
    if kv_cache.is_cuda:
        # The Gluon prefill kernel reads whole tiles of a page, past a sequence's end too: values
        # never written must be finite there (their weights are 0, but 0 * NaN is NaN).
        kv_cache.zero_()
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache


def release(layers: list):
    """The layers' views dropped (the cache's memory goes once no one else holds it)."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.tensor([])


def cuda_budget(device: torch.device, gpu_memory_utilization: float, peak: int) -> int:
    """Bytes left for the cache: gpu_memory_utilization of the card, less a step's peak of torch
    allocations and what lies outside torch (CUDA context, NCCL, ...)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    return int(total * gpu_memory_utilization) - peak - non_torch
