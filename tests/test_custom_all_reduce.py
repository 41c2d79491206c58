"""The symmetric-memory all-reduce's start-up, on the CPU with stand-in reducers: the self-check
passes a sum added in bf16 rank by rank (as the kernels add) at 2, 4 and 8 ranks and fails a
wrong one; and the ranks agree before the rendezvous, so one rank's failure (or a group set up
earlier in rank 0's process) leaves no rank waiting in it."""
import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from nanovllm import custom_all_reduce, distributed
from nanovllm.custom_all_reduce import _sums_correctly


def part(rank: int, numel: int) -> torch.Tensor:   # the self-check's own inputs
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(numel, generator=gen).to(torch.bfloat16)


class Bf16Sum:
    def __init__(self, ranks: list[int]):
        self.ranks = ranks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        total = part(self.ranks[0], x.numel())
        for rank in self.ranks[1:]:
            total = total + part(rank, x.numel())        # rounded to bf16 after every addition
        return x.copy_(total)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_bf16_sums_pass(size):
    assert _sums_correctly(Bf16Sum(list(range(size))), 0, size, torch.device("cpu"))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_wrong_sums_fail(size):
    assert not _sums_correctly(Bf16Sum(list(range(size - 1))), 0, size, torch.device("cpu"))   # a rank missing
    assert not _sums_correctly(Bf16Sum([0] + list(range(size))), 0, size, torch.device("cpu"))  # one counted twice


class StandIn:
    """Plays SymmMemAllReduce over a gloo group; `fail` names the step that fails on rank 1."""
    fail = None
    events = None

    def __init__(self, name, rank, size, store, device, backend):
        self.rank, self.backend = rank, backend
        if rank == 1 and self.fail == "setup":
            raise RuntimeError("no P2P access between the GPUs")

    def rendezvous(self):
        self.events.put(("rendezvous", self.rank))

    def __call__(self, x):
        total = x.float()
        dist.all_reduce(total, group=self.backend)
        if self.rank == 1 and self.fail == "sum":
            total += 1.0
        return x.copy_(total)

    def close(self):
        pass


def start_rank(port, rank, fail, events):
    StandIn.fail, StandIn.events = fail, events
    custom_all_reduce.SymmMemAllReduce = StandIn
    if rank == 0 and fail == "earlier_group":      # rank 0's process set up a group before
        custom_all_reduce._rendezvous_started = True
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    group = dist.ProcessGroupGloo(store, rank, 2)
    name = distributed.symm_mem_group_name(store, rank)
    reducer = custom_all_reduce.try_symm_mem_all_reduce(name, rank, 2, store, torch.device("cpu"), group)
    events.put(("result", rank, name, reducer is not None))


@pytest.mark.parametrize("fail", [None, "setup", "sum", "earlier_group"])
def test_ranks_agree_before_the_rendezvous(fail):
    rendezvous = distributed.Rendezvous(2, torch.device("cpu"))
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=start_rank, args=(rendezvous.port, rank, fail, events)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        seen = [events.get(timeout=60) for _ in range(2 if fail in ("setup", "earlier_group") else 4)]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    results = sorted(e for e in seen if e[0] == "result")
    assert [rank for _, rank, _, _ in results] == [0, 1]
    assert results[0][2] == results[1][2]                          # one group name, from rank 0
    assert [ok for *_, ok in results] == [fail is None] * 2        # both on, or both on NCCL
    assert sorted(e for e in seen if e[0] == "rendezvous") == (
        [] if fail in ("setup", "earlier_group") else [("rendezvous", 0), ("rendezvous", 1)])


def test_group_names_are_never_reused():
    class Store(dict):
        set = dict.__setitem__

    store = Store()
    names = {distributed.symm_mem_group_name(store, 0) for _ in range(3)}
    assert len(names) == 3 and store["symm_mem_group"] in names


def test_settle_flags_sets_what_peers_owe_and_clears_what_they_hold():
    """release_waiters' pass over the signal pads, on CPU tensors: 4 ranks, 3 blocks, seen from
    rank 1 (slot [b, r] of a pad: rank r's flag for block b)."""
    from nanovllm.custom_all_reduce import settle_flags
    pads = [torch.full((3, 4), 7, dtype=torch.int32) for _ in range(4)]   # 7: a value no pass writes
    settle_flags(pads, 1)
    assert pads[1][:, [0, 2, 3]].eq(1).all() and pads[1][:, 1].eq(7).all()       # own pad: the peers' flags set
    for peer in (0, 2, 3):
        assert pads[peer][:, 1].eq(0).all()                                       # rank 1's flags there cleared
        assert pads[peer][:, [0, 2, 3]].eq(7).all()                               # the rest untouched
