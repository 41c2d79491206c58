"""Arrival counters, for kernels in which the last program of a group finishes the group's work
(the split-K projection of triton_skinny.py, the split attention of triton_attention.py with
fuse_merge): each program adds one to its group's counter after writing its partial result; the
one that sees count == group size - 1 combines the partials and sets the counter back to zero.

So the counters are zero between kernels, and kernels on one stream run one after another (under
programmatic dependent launch too: a kernel touches them only after waiting for its predecessor):
every such kernel on a device shares one buffer, without a memset between calls. The one
exception, the second half of an overlapped decode graph (engine/cuda_graph.py), runs on a
stream of its own at the same time as the first: its kernels, captured inside second_set(), get
a buffer of their own.
"""
import contextlib
import functools

import torch

NUM_COUNTERS = 1 << 16
_set = 0


@contextlib.contextmanager
def second_set():
    global _set
    _set = 1
    try:
        yield
    finally:
        _set = 0


def counters(device: torch.device) -> torch.Tensor:
    return _counters(device, _set)


@functools.cache
def _counters(device: torch.device, index: int) -> torch.Tensor:
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
