"""All-reduce through symmetric memory, for the small tensors of decode steps.

Each rank owns a buffer that every GPU of the group can read and write directly (over
NVLink); torch's symm_mem kernels reduce in one launch, with flags in the same memory as the
only synchronisation, where NCCL runs its ring protocol. Tensors larger than the buffer, of
another dtype, or not 16-byte sized go through NCCL.

- one-shot: every rank reads all buffers and sums (fewest steps; reads N x the bytes);
- two-shot: reduce-scatter then all-gather through the buffers (reads ~2x the bytes), for
  larger tensors on more than two GPUs.

Its kernels synchronise through per-block flags in each rank's signal pad: a rank sets a flag in
its peer's pad and spins until the peer has set the matching one in its own. A dead peer never
sets it, and NCCL's abort does not reach these kernels, so after a peer died release_waiters()
sets the flags the dead peer owed, over and over from a side stream, until rank 0's stream drains.

On by default, as vLLM's own all-reduce is (LLM(..., disable_custom_all_reduce=True) turns it
off). On 2x H200 it summed correctly at every size class, made the Qwen3-8B-shape benchmark 3%
faster at TP=2 (9.84 -> 9.54 s, docs/perf_notes.md), passed the TP=2 logprob tests with and
without CUDA graphs, and with a worker killed mid-generate the caller got the rank named and rank
0's GPU drained (2026-11-30, third session; at one commit of the fourth that test hung in the
release thread, whose stream change is undone: not rerun since, see perf_notes "Next
measurements"). Runs on more than two GPUs have not yet been on a GPU. Only the first engine of
a process gets it (see _rendezvous_started); later ones use NCCL. A start-up self-check falls
back to NCCL on any doubt.
"""
import math
import threading
import time

import torch
import torch.distributed as dist

from nanovllm.logger import init_logger

logger = init_logger(__name__)

BUFFER_BYTES = 16 << 20          # 2,048 tokens x 4,096 hidden in bf16
ONE_SHOT_MAX_BYTES = 512 << 10   # above this, two-shot when there are more than 2 ranks


class SymmMemAllReduce:
    def __init__(self, name: str, rank: int, size: int, store, device: torch.device, backend):
        """name: a group name never used before in this process (symm_mem keeps every name it was
        given); store: the group's TCPStore; backend: its NCCL backend. Local: sets up this rank's
        buffer; rendezvous() then exchanges the buffers (collective). Raises if symmetric memory is
        unusable."""
        from torch.distributed import _symmetric_memory as symm_mem
        self.name, self.rank, self.size = name, rank, size
        self.handle = None
        # symm_mem finds its group by name in c10d's registry: register a ProcessGroup over our backend.
        group = dist.ProcessGroup(store, rank, size)
        group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, group)
        self.group = group
        symm_mem._SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(f"{name}/", store))
        self.buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)

    def rendezvous(self):
        """Collective: map every rank's buffer into this one's address space."""
        from torch.distributed import _symmetric_memory as symm_mem
        self.handle = symm_mem.rendezvous(self.buffer, self.name)

    def close(self):
        """Drop the group from c10d's registry (it holds the NCCL communicators) and the buffer."""
        torch._C._distributed_c10d._unregister_process_group(self.name)
        self.group = self.buffer = self.handle = None

    def release_waiters(self, timeout_s: float = 30.0) -> threading.Thread | None:
        """After a peer died: free this rank's kernels that wait for it, in a background thread.

        torch's kernels synchronise block b of every rank through slot b * size + r of each
        signal pad: rank r sets that slot in its peer's pad (waiting while it is still 1) and
        then waits for the peer's flag in slot b * size + peer of its own pad (taking it back to
        0). So, over and over until everything this rank's stream holds now has run (or
        timeout_s), the flags a peer owes are set in this rank's pad and this rank's flags in
        every peer's pad are cleared; the stuck kernels finish, with garbage, in an engine
        that is closing. A kernel's own slot (r = this rank) is left alone."""
        if self.handle is None:
            return None
        device = self.buffer.device
        drained = torch.cuda.Event()
        drained.record(torch.cuda.current_stream(device))
        pads = [self.handle.get_signal_pad(r, (self.handle.signal_pad_size // 4,), torch.int32).view(-1, self.size)
                for r in range(self.size)]

        def run():
            side = torch.cuda.Stream(device)
            deadline = time.monotonic() + timeout_s
            with torch.cuda.stream(side):
                while not drained.query() and time.monotonic() < deadline:
                    settle_flags(pads, self.rank)
                    # Polled, not side.synchronize(): that never returned in a run on 2x H200
                    # (d8c7481), and the caller's close waits for this thread.
                    settled = torch.cuda.Event()
                    settled.record(side)
                    while not settled.query() and time.monotonic() < deadline:
                        time.sleep(0.001)

        thread = threading.Thread(target=run, name="nanovllm-release-all-reduce", daemon=True)
        thread.start()
        return thread

    @staticmethod
    def _fits(nbytes: int) -> bool:
        return nbytes <= BUFFER_BYTES and nbytes % 16 == 0

    def can_reduce(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and self._fits(x.numel() * x.element_size())

    def input_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The start of the buffer as a tensor of this shape, to compute straight into; None if
        such a tensor could not be reduced here."""
        numel = math.prod(shape)
        if not self._fits(numel * dtype.itemsize):
            return None
        return self.buffer.view(dtype)[:numel].view(shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks: in place, or into a new tensor if x is input_buffer's (the buffer
        itself is what the peers read). Caller checks can_reduce(x) first."""
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[:flat.numel()]
        in_buffer = flat.data_ptr() == staged.data_ptr()
        # (not torch's one_shot_all_reduce_copy_out, which copies x inside the reducing kernel: in
        # the torch source we read, its blocks signal their peers before all their threads' copies
        # are done)
        if not in_buffer:
            staged.copy_(flat)
        out = torch.empty_like(flat) if in_buffer else flat
        if self.size == 2 or flat.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.name)
            out.copy_(staged)
        return out.view(x.shape)


def settle_flags(pads: list[torch.Tensor], rank: int):
    """pads: every rank's signal pad as [blocks, world_size] int32 (slot [b, r]: rank r's flag for
    block b). Sets in rank's own pad the flags its peers owe it, and clears rank's flags in its
    peers' pads, so that rank's kernels neither wait for a peer nor for a peer to take a flag.
    Rank's own column, which its kernels set and take themselves, is left alone."""
    for peer in range(len(pads)):
        if peer != rank:
            pads[rank][:, peer].fill_(1)
            pads[peer][:, rank].fill_(0)


# torch numbers the store keys of its symmetric-memory handle exchanges with one counter per
# process. For a second group in rank 0's process that counter is past 0 while the new workers'
# is at 0, and each side waits in the rendezvous for keys the other never writes (seen on 2x H200:
# a second TP engine with this all-reduce hung there). So one such group per process.
_rendezvous_started = False


def try_symm_mem_all_reduce(name: str, rank: int, size: int, store, device: torch.device,
                            process_group) -> SymmMemAllReduce | None:
    """A SymmMemAllReduce if every rank could set one up and it sums correctly, else None
    (every rank then agrees to use NCCL). Collective. The ranks agree after the local set-up,
    before the rendezvous: a rank that failed to set up must not leave the others waiting in it."""
    global _rendezvous_started
    reducer, reason = None, ""
    if _rendezvous_started:
        reason = "an earlier engine in this process set one up (torch allows one per process)"
    else:
        try:
            reducer = SymmMemAllReduce(name, rank, size, store, device, process_group)
        except Exception as e:   # not built with symm_mem, no P2P between the GPUs, driver too old, ...
            reason = f"{type(e).__name__}: {e}"
    if _all_ranks(reducer is not None, device, process_group):
        _rendezvous_started = True       # even a failed rendezvous has moved torch's counter
        try:
            reducer.rendezvous()
            if not _sums_correctly(reducer, rank, size, device):
                reason = "its self-check gave a wrong sum"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if _all_ranks(not reason, device, process_group):
            return reducer
    if reducer is not None:
        reducer.close()
    if rank == 0:
        logger.warning(f"custom all-reduce is off, using NCCL ({reason or 'another rank could not set it up'})")
    return None


def _all_ranks(ok: bool, device: torch.device, process_group) -> bool:
    """True if ok is true on every rank (collective)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
    return bool(flag.item())


def _sums_correctly(reducer: SymmMemAllReduce, rank: int, size: int, device: torch.device) -> bool:
    """Each rank reduces its own random tensor; every rank can recompute all of them from the seeds.
    The kernels add in bf16, so each of the size - 1 additions may round by 2^-8 (bf16's unit
    roundoff) of a partial sum's magnitude, which is at most the sum of magnitudes: the bound is
    2^-5 of that, enough for up to 8 ranks."""
    def part(r: int, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1234 + r)
        return torch.randn(n, generator=gen).to(torch.bfloat16).float()

    ok = True
    for n in (8 * 1024, 600 * 1024):   # one-shot and (with > 2 ranks) two-shot; every rank runs both
        x = part(rank, n).to(torch.bfloat16).to(device)
        reducer(x)
        parts = [part(r, n) for r in range(size)]
        error = (x.float().cpu() - sum(parts)).abs()
        ok &= bool((error <= 2 ** -5 * sum(p.abs() for p in parts) + 1e-3).all())
    return ok
