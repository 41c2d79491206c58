"""All-reduce time per call on the GPUs of one host, by message size (a developer tool, not a test).
The decode step's all-reduces are [num_seqs, hidden] bf16 tensors replayed inside a CUDA graph;
this times exactly that: 50 all-reduces captured in one graph, per batch size, through NCCL and
through the symmetric-memory all-reduce (custom_all_reduce.py), on the engine's own TPGroup.
Set NCCL_* variables (NCCL_PROTO, NCCL_ALGO, ...) in the environment to compare NCCL's choices.

    PYTHONPATH=. python3 tests/bench_allreduce.py [--tp 2] [--hidden 4096]
"""
import argparse
import multiprocessing as mp

import torch
import torch.distributed as dist

from nanovllm import distributed

BATCH_SIZES = (1, 8, 32, 64, 128, 256, 512)
CALLS_PER_GRAPH = 50


def time_per_call(reduce, x: torch.Tensor) -> float:
    """Microseconds per call of reduce(x), captured CALLS_PER_GRAPH times in one CUDA graph."""
    reduce(x)                       # warm-up outside the graph (NCCL sets up its channels here)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            reduce(x)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH


def run(group: distributed.TPGroup, hidden: int) -> list[tuple[int, float, float | None]]:
    """Every rank: (batch size, NCCL us, symmetric-memory us or None) per batch size."""
    nccl = lambda t: dist.all_reduce(t, group=group.process_group)
    rows = []
    for num_seqs in BATCH_SIZES:
        x = torch.zeros(num_seqs, hidden, dtype=torch.bfloat16, device=torch.cuda.current_device())
        custom = group.custom_all_reduce
        symm = time_per_call(custom, x) if custom is not None and custom.can_reduce(x) else None
        rows.append((num_seqs, time_per_call(nccl, x), symm))
    return rows


def worker(rank: int, size: int, port: int, hidden: int):
    group = distributed.connect(port, rank, size, torch.device("cuda", rank), custom_all_reduce=True)
    run(group, hidden)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=torch.cuda.device_count())
    p.add_argument("--hidden", type=int, default=4096, help="4096: the Qwen3-8B shape")
    args = p.parse_args()
    rendezvous = distributed.Rendezvous(args.tp, torch.device("cuda", 0))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, args.tp, rendezvous.port, args.hidden), daemon=True)
             for rank in range(1, args.tp)]
    for proc in procs:
        proc.start()
    group = rendezvous.join(custom_all_reduce=True)
    rows = run(group, args.hidden)
    for proc in procs:
        proc.join()
    print(f"TP={args.tp}, [batch, {args.hidden}] bf16, us per all-reduce inside a CUDA graph")
    print(f"{'batch':>6} {'KiB':>7} {'NCCL':>8} {'symm-mem':>9}")
    for num_seqs, nccl_us, symm_us in rows:
        symm = f"{symm_us:9.1f}" if symm_us is not None else f"{'-':>9}"
        print(f"{num_seqs:6} {num_seqs * args.hidden * 2 // 1024:7} {nccl_us:8.1f} {symm}")


if __name__ == "__main__":
    main()
