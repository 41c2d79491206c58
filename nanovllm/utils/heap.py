"""The garbage collector and the engine's long-lived objects."""
import contextlib
import gc


def freeze_heap():
    """Move every object alive now (model, tokenizer, libraries) out of the garbage collector's
    view, as vLLM does after start-up, so that a full collection scans only what the run creates.
    On the CPU machine one full collection, set off while 256 requests were added, took ~0.1 s
    before and ~1 ms after. Garbage already there is collected first."""
    gc.collect()
    gc.freeze()


def unfreeze_heap():
    """Undo freeze_heap (for every engine of the process: the others only lose the speed-up)."""
    gc.unfreeze()


@contextlib.contextmanager
def fewer_collections():
    """While the engine runs: a young collection every 50,000 net allocations instead of 700 and
    a full one 10x more rarely; the thresholds restored afterwards. A run's outputs grow the heap
    by millions of tracked objects (with logprobs, a dict and Logprobs for every token), and every
    full collection scans them all: on the CPU machine, keeping 256 sequences' top-5 logprobs for
    520 steps took 0.73-0.90 s of Python at CPython's thresholds, 0.42-0.49 s at these, 0.37-0.42
    s with the collector off; on the H200 `bench.py --logprobs 5` went from 6.3-7.2 to 5.7-6.1 s
    (perf_notes row 94). Cycles are still collected, later."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 50_000), before[1], max(before[2], 10 * before[2]))
    try:
        yield
    finally:
        gc.set_threshold(*before)
