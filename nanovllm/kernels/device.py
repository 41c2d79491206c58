"""What a CUDA device has that the kernels size their grids by, read once per device."""
import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size
