"""Start-up on an empty Triton cache: the model's kernel variants compiled side by side, ahead.

Triton compiles a kernel variant at its first launch and waits for it. The decode graphs' warm-ups
meet a few dozen variants one after another (row counts, PDL, split configurations), which took
~5 s of a fresh machine's start-up (docs/perf_notes.md row 56). Inside `compiling()`, a launch made
through `launch()` runs nothing: it hands its variant's compile to a thread pool (Triton's
asynchronous compile mode) and returns. So one dry pass of the model's forward per batch size
queues every variant, the pool compiles them at once (most of a compile is ptxas, a process of
its own, and C++ passes), and the real warm-ups after it find them compiled. The outputs the
skipped kernels would have written are left as allocated; a dry pass must not read them on the host.
"""
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

try:
    from triton.runtime._async_compile import AsyncCompileMode   # Triton 3.4 and later
except ImportError:
    AsyncCompileMode = None

_dry_run = False


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); inside compiling(), only the variant's compile is queued."""
    kernel.run(*args, grid=grid, warmup=_dry_run, **kwargs)


@contextlib.contextmanager
def compiling():
    """-> whether a dry pass is wanted: False where this Triton cannot compile asynchronously (the
    caller then just runs its real pass). On leaving, every queued compile has finished."""
    global _dry_run
    if AsyncCompileMode is None:
        yield False
        return
    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
        _dry_run = True
        try:
            yield True
        finally:
            _dry_run = False
