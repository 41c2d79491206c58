"""Timing helper for the GPU developer tools (bench_kernels.py, bench_skinny.py); not a test."""
import torch


def us_per_call_in_graph(calls: list, replays: int = 5) -> float:
    """Microseconds per call when `calls` (argument-less callables) run back to back inside one
    CUDA graph, as kernels of a decode step do."""
    for call in calls[:1]:
        call()                          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))
