"""Arrival counters, for kernels in which the last program of a group finishes the group's work
(the split-K projection of triton_skinny.py, the split attention of triton_attention.py with
fuse_merge): each program adds one to its group's counter after writing its partial result; the
one that sees count == group size - 1 combines the partials and sets the counter back to zero.

So the counters are zero between kernels, and kernels on one stream run one after another (under
programmatic dependent launch too: a kernel touches them only after waiting for its predecessor):
every such kernel on a device shares one buffer, without a memset between calls.
"""
import functools

import torch

NUM_COUNTERS = 1 << 16


@functools.cache
def counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
