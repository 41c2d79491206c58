"""Programmatic dependent launch (Hopper and newer), for the decode step's Triton kernels.

A kernel launched with it may be scheduled while the kernel before it in the stream is still
finishing; its first instruction (`griddepcontrol.wait`) holds it until that kernel has completed
and its writes are visible, so nothing it reads or writes can race. What overlaps is the launch
itself: at batch 1 a decode step is ~300 kernels of a few microseconds each, and the gaps between
them are a large part of the step. Each kernel also lets its own successor launch early
(`griddepcontrol.launch_dependents`) once it has started.

Experimental, so off unless NANOVLLM_PDL=1 (docs/perf_notes.md: not yet measured).
"""
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def enabled() -> bool:
    return (os.environ.get("NANOVLLM_PDL") == "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def launch_options() -> dict:
    """Keyword arguments for a kernel launch: the PDL constexpr and, when on, Triton's launch flag."""
    return dict(PDL=True, launch_pdl=True) if enabled() else dict(PDL=False)


@triton.jit
def begin(PDL: tl.constexpr):
    """First statement of a kernel launched with launch_options()."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
