"""Start-up on an empty Triton cache: the model's kernel variants compiled side by side, ahead.

Triton compiles a kernel variant at its first launch and waits for it. The decode graphs' warm-ups
meet a few dozen variants one after another (row counts, PDL, split configurations), which took
~5 s of a fresh machine's start-up (docs/perf_notes.md row 56). Inside `dry_run(forwards)`, a launch
made through `launch()` runs nothing: it hands its variant's compile to a thread pool (Triton's
asynchronous compile mode) and returns. So one dry pass of the model's forward per batch size
queues every variant, the pool compiles them at once (most of a compile is ptxas, a process of
its own, and C++ passes), and the real warm-ups after it find them compiled. The outputs the
skipped kernels would have written are left as allocated, so a dry pass must neither read them on
the host nor index with them. The model's forward does neither; in the sampler, only the sampled
token ids are indices, and gumbel_argmax zeroes them in a dry pass (`in_dry_run()`).
"""
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

try:
    from triton.runtime._async_compile import AsyncCompileMode   # Triton 3.4 and later
except ImportError:
    AsyncCompileMode = None

_queued: set | None = None   # during a dry pass: the launches queued so far, by what sets their variant


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); inside a dry run, only the variant's compile is queued."""
    if _queued is not None:
        key = (kernel, *map(_specialized_on, args), *kwargs.items())
        if key in _queued:   # (the layers of a model launch the same variants)
            return
        _queued.add(key)
    kernel.run(*args, grid=grid, warmup=_queued is not None, **kwargs)


def in_dry_run() -> bool:
    """Whether launches now only queue their compiles (inside dry_run)."""
    return _queued is not None


def _specialized_on(arg):
    """What Triton tells a variant by, or finer: a tensor's dtype and 16-byte alignment; an int's
    equality to 1, divisibility by 16 and 32-bit range; any other value itself. (Were it coarser, a
    variant would only compile later, at its real launch.)"""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):   # a TMA descriptor (Gluon kernels): its dtype, box and layout
        return arg.base.dtype, tuple(arg.block_shape), arg.layout
    if isinstance(arg, int) and not isinstance(arg, bool):
        return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    return arg


def dry_run(forwards) -> float | None:
    """forwards() with every launch() in it only queuing its variant's compile -> the seconds until
    every queued compile finished; None where this Triton cannot compile asynchronously (forwards
    not called: the caller's real pass then compiles as it goes)."""
    global _queued
    if AsyncCompileMode is None:
        return None
    start = time.perf_counter()
    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
        _queued = set()
        try:
            forwards()
        finally:
            _queued = None
    return time.perf_counter() - start
