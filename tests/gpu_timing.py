"""Timing helpers for the GPU developer tools (bench_kernels.py, bench_skinny.py, bench_gemm.py); not a test."""
import torch

L2_FLUSH_BYTES = 160 << 20   # more than the H200's L2 (50 MB), with room


def copies_beyond_l2(w: torch.Tensor) -> list[torch.Tensor]:
    """w and enough copies of it that calls cycling through them read each from HBM, as a decode
    step reads its weights, not from L2."""
    return [w] + [w.clone() for _ in range(max(1, L2_FLUSH_BYTES // w.nbytes))]


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
