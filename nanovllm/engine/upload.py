"""A step's host arrays moved to the GPU in one copy.

Each host-to-device copy is an operation of its own in the stream: the copy engine waits for the
kernels before it and the kernels after it wait for the copy, a few microseconds each time. A
decode step had nine such copies (its inputs, the rows of its pending tokens, the sampling
settings); packed into one pinned buffer they travel as one or two.

    pinned host bytes  | input_ids | positions | slot_mapping | seq_lens | ... |
                         ^ each array starts at a multiple of ALIGN bytes
    device bytes       the same layout; each array is a view of it, in its own dtype and shape
"""
import numpy as np
import torch

from nanovllm.utils.arrays import aligned_offsets

ALIGN = 16   # bytes


def packed_offsets(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """-> (each array's byte offset, total bytes) when packed back to back at ALIGN."""
    return aligned_offsets([a.nbytes for a in arrays], ALIGN)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def views(buffer: torch.Tensor, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """buffer (uint8) seen as the arrays packed into it: one view per array, its dtype and shape."""
    offsets, _ = packed_offsets(arrays)
    return [buffer[off:off + a.nbytes].view(torch_dtype(a.dtype)).view(a.shape) for a, off in zip(arrays, offsets)]


def packed(arrays: list[np.ndarray], pin_memory: bool = True) -> torch.Tensor:
    """The arrays packed into one uint8 host tensor, in pinned memory unless pin_memory=False."""
    offsets, size = packed_offsets(arrays)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
    host_bytes = host.numpy()
    for a, off in zip(arrays, offsets):
        host_bytes[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host


def upload(arrays: list[np.ndarray], device: torch.device, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The arrays on `device`, after one non-blocking copy from pinned memory. out: a uint8 device
    buffer to copy into (a CUDA graph's static inputs are views of it), else a new one; its bytes past
    the last array are left as they are (the padding after it is not copied). On the CPU without out,
    the arrays themselves, as tensors."""
    if device.type == "cpu" and out is None:
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    host = packed(arrays, pin_memory=device.type != "cpu")
    end = host.numel() - (-arrays[-1].nbytes % ALIGN) if arrays else 0   # (the last array's padding left out)
    # The caching host allocator keeps `host` from reuse until the copy has run.
    device_bytes = torch.empty(host.numel(), dtype=torch.uint8, device=device) if out is None else out[:host.numel()]
    device_bytes[:end].copy_(host[:end], non_blocking=True)
    return views(device_bytes, arrays)
