"""Sleep mode (vLLM's LLM.sleep / wake_up, with LLM(enable_sleep_mode=True)): give back the memory
of the weights and of the KV cache while the engine idles, and keep everything else: the process,
its compiled kernels and CUDA graphs, the tokenizer, the scheduler.

On CUDA, with sleep mode on, the weights and the KV cache live in arenas (utils/cuda_vmm.py) from
start-up: sleeping releases an arena's physical memory and waking maps new memory at the same
addresses, so every tensor, view and captured CUDA graph stays valid (as vLLM's CuMemAllocator
does). On the CPU, where there are no graphs, a tensor's storage is emptied in place (resized to
zero bytes) and refilled by resizing it back, so its views stay valid too. Level 1 copies the
weights to host memory first (pinned on CUDA) and back on wake-up; level 2 forgets them, and the
caller loads weights again (collective_rpc("reload_weights"), as with vLLM).
"""
import torch

from nanovllm.utils.cuda_vmm import Arena

SLEEP_TAGS = ("weights", "kv_cache")
SLEEP_MODES = ("abort", "wait", "keep")   # what sleep() does with unfinished requests (vLLM's)


class Storages:
    """Tensors' storages (views and tied tensors share one), emptied and refilled by resizing."""

    def __init__(self, tensors):
        storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage() for tensor in tensors}
        self.parts = list(storages.values())
        self.sizes = [storage.nbytes() for storage in self.parts]
        self.nbytes = sum(self.sizes)

    def release(self):
        for storage in self.parts:
            storage.resize_(0)

    def keep(self):
        for storage, size in zip(self.parts, self.sizes):
            storage.resize_(size)


class ArenaMemory:
    """An arena, released and mapped again at the same addresses."""

    def __init__(self, arena: Arena):
        self.arena, self.nbytes = arena, arena.nbytes
        self.parts = [arena.tensor().untyped_storage()]

    def release(self):
        self.arena.release()

    def keep(self):
        self.arena.keep()


class Hibernation:
    """Memory (Storages or ArenaMemory) given back while asleep, with its bytes kept or not."""

    def __init__(self, memory: Storages | ArenaMemory):
        self.memory = memory
        self.backups: list[torch.UntypedStorage] | None = None
        self.asleep = False

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def sleep(self, keep: bool):
        """Free the memory; keep: copy its bytes to host memory first."""
        if keep:
            self.backups = []
            for part in self.memory.parts:
                backup = torch.empty(part.nbytes(), dtype=torch.uint8, pin_memory=part.is_cuda)
                self.backups.append(backup.untyped_storage().copy_(part))
        self.memory.release()
        self.asleep = True

    def wake_up(self):
        """Allocate the memory again, with the kept bytes if any (else uninitialised)."""
        self.memory.keep()
        for part, backup in zip(self.memory.parts, self.backups or []):
            part.copy_(backup)
        self.backups = None
        self.asleep = False
