"""TPGroup: this process's place in its engine's tensor-parallel group, and the collectives
the model uses. Each engine owns its own group (no global default group), so several engines
can live in one process or on one host."""
import itertools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.custom_all_reduce import SymmMemAllReduce, try_symm_mem_all_reduce


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    process_group: object = None   # a torch ProcessGroup (gloo on the CPU, NCCL on CUDA); None alone
    custom_all_reduce: SymmMemAllReduce | None = None   # CUDA: NVLink all-reduce for small tensors

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: in place, or in a new tensor if x is all_reduce_input's buffer."""
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None and self.custom_all_reduce.can_reduce(x):
            return self.custom_all_reduce(x)
        dist.all_reduce(x, group=self.process_group)
        return x

    def all_reduce_input(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where to compute a tensor that all_reduce will sum next, if there is a better place than
        a new tensor: the symmetric-memory all-reduce's input buffer (saves copying it there)."""
        if self.custom_all_reduce is None:
            return None
        return self.custom_all_reduce.input_buffer(shape, dtype)

    def abort(self):
        """Make every pending and later collective of this group fail (a peer is gone), and free
        the symmetric-memory all-reduce's kernels that wait for the peer (NCCL's abort does not
        reach them)."""
        releaser = self.custom_all_reduce.release_waiters() if self.custom_all_reduce is not None else None
        try:
            self.process_group.abort()
        except Exception:   # a backend without abort: its collectives fail on their own
            pass
        if releaser is not None:
            releaser.join()

    def close(self):
        if self.custom_all_reduce is not None:
            self.custom_all_reduce.close()
            self.custom_all_reduce = None

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.process_group, group_dst=0)
        return parts

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(t.item())

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, group=self.process_group, group_src=0)
        return x


SINGLE = TPGroup()


def connect(store_port: int, rank: int, size: int, device: torch.device, custom_all_reduce: bool = False,
            timeout_s: float = 300) -> TPGroup:
    """Ranks > 0: join the group whose TCPStore (run by rank 0) listens on 127.0.0.1:store_port.
    custom_all_reduce: try the symmetric-memory all-reduce on CUDA (every rank must agree)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=timeout)
    store.set(f"arrived/{rank}", "1")
    return _make_group(store, rank, size, device, timeout, custom_all_reduce)


class Rendezvous:
    """Rank 0's side: a TCPStore on a free port that the other ranks connect to."""

    def __init__(self, size: int, device: torch.device, timeout_s: float = 300):
        self.size, self.device = size, device
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self.port = self.store.port

    def has_arrived(self, rank: int) -> bool:
        return self.store.check([f"arrived/{rank}"])

    def join(self, custom_all_reduce: bool = False) -> TPGroup:
        return _make_group(self.store, 0, self.size, self.device, self.timeout, custom_all_reduce)


def _make_group(store, rank: int, size: int, device: torch.device, timeout: timedelta,
                custom_all_reduce: bool) -> TPGroup:
    if device.type != "cuda":
        return TPGroup(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))
    torch.cuda.set_device(device)
    group = TPGroup(rank, size, dist.ProcessGroupNCCL(store, rank, size))
    if custom_all_reduce:
        group.custom_all_reduce = try_symm_mem_all_reduce(symm_mem_group_name(store, rank), rank, size, store,
                                                          device, group.process_group)
    return group


_group_ids = itertools.count()


def symm_mem_group_name(store, rank: int) -> str:
    """A name no group of this rank-0 process had before (symm_mem refuses a name it has seen,
    and a port can come back for a later engine), sent to the other ranks through the store."""
    if rank == 0:
        name = f"nanovllm-tp-{os.getpid()}-{next(_group_ids)}"
        store.set("symm_mem_group", name)
        return name
    return store.get("symm_mem_group").decode()
