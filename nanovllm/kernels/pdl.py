"""Programmatic dependent launch (Hopper and newer), for the decode step's Triton kernels.

A kernel launched with it may be scheduled while the kernel before it in the stream is still
finishing; its first instruction (`griddepcontrol.wait`) holds it until that kernel has completed
and its writes are visible, so nothing it reads or writes can race. What overlaps is the launch
itself, and whatever a kernel does before that wait with memory no earlier kernel writes (the
skinny projection kernel prefetches its weights there). Each kernel also lets its own successor
launch early (`griddepcontrol.launch_dependents`) once it has waited.

Used only for launches over at most MAX_ROWS rows (tokens or sequences), i.e. the decode steps of
small batches: at batch 1 it takes the H200's latency from 1.14 to 1.00 ms/token, while on the
default workload, with every launch using it, the large batches made the run ~2% slower
(docs/perf_notes.md rows 17 and 19). The rule is the launch's own size, not whether a CUDA graph
is being captured, so that a graph's warm-up run compiles the very kernels the capture launches
(a PDL launch is a kernel of its own to Triton). On by default on sm_90 and newer; NANOVLLM_PDL=0
turns it off (for A/B runs).
"""
import functools
import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@functools.cache
def enabled() -> bool:
    """Unless NANOVLLM_PDL=0: on a Hopper or newer GPU, with a Triton that has PDL (3.4 and later;
    the project allows older ones)."""
    return (os.environ.get("NANOVLLM_PDL") != "0" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait"))


def launch_options(rows: int) -> dict:
    """Keyword arguments for a kernel launch over `rows` rows (tokens or sequences): the PDL
    constexpr and, when on, Triton's launch flag."""
    return dict(PDL=True, launch_pdl=True) if rows <= MAX_ROWS and enabled() else dict(PDL=False)


@triton.jit
def begin(PDL: tl.constexpr):
    """First statement of a kernel launched with launch_options() (after any prefetch of memory
    that no earlier kernel writes)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the cache lines at ptrs (no registers written, nothing waited for): what a kernel does before
    begin() with memory no earlier kernel writes, such as its weights."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
