"""Arrival counters, for kernels in which the last program of a group finishes the group's work
(the split-K projection of triton_skinny.py, the split attention of triton_attention.py with
fuse_merge): each program adds one to its group's counter after writing its partial result; the
one that sees count == group size - 1 combines the partials and sets the counter back to zero.

So the counters are zero between kernels, and kernels on one stream run one after another (under
programmatic dependent launch too: a kernel touches them only after waiting for its predecessor):
every such kernel on a stream shares one buffer, without a memset between calls. Kernels on two
streams may run at once (the overlapped halves of a decode graph, engine/cuda_graph.py), so each
stream has a buffer of its own.
"""
import functools

import torch

NUM_COUNTERS = 1 << 16


def counters(device: torch.device) -> torch.Tensor:
    """The current stream's counters on device."""
    return _counters(device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


@functools.cache
def _counters(device: torch.device, stream: int) -> torch.Tensor:
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
