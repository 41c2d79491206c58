"""Tensor-parallel rank and world size of this process (1 process = rank 0 of 1)."""
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x):
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x
