"""Sleep mode (vLLM's LLM.sleep / wake_up, with LLM(enable_sleep_mode=True)): give back the memory
of the weights and of the KV cache while the engine idles, and keep everything else: the process,
its compiled kernels and CUDA graphs, the tokenizer, the scheduler.

A tensor's storage is emptied in place (resized to zero bytes; on CUDA its blocks then go back to
the driver) and refilled by resizing it back, so every view of it stays valid: the layers'
k_cache / v_cache, an LM head tied to the embedding. Level 1 copies the weights to host memory
first (pinned on CUDA) and back on wake-up; level 2 forgets them, and the caller loads weights
again (collective_rpc("reload_weights"), as with vLLM). A refilled storage may lie at another
address, where a captured CUDA graph would not look: `moved` tells the runner to capture again.
"""
import torch

SLEEP_TAGS = ("weights", "kv_cache")


class Hibernation:
    """Some tensors' storages, emptied and refilled in place."""

    def __init__(self, tensors):
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)   # views and tied tensors share one
        self.storages = list(storages.values())
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.addresses = list(storages)
        self.backups: list[torch.UntypedStorage] | None = None
        self.asleep = False

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def sleep(self, keep: bool):
        """Free the storages; keep: copy their bytes to host memory first."""
        if keep:
            self.backups = []
            for storage in self.storages:
                backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.is_cuda)
                self.backups.append(backup.untyped_storage().copy_(storage))
        for storage in self.storages:
            storage.resize_(0)
        self.asleep = True

    def wake_up(self) -> bool:
        """Allocate the storages again, with the kept bytes if any (else uninitialised) -> whether
        one of them now lies at another address."""
        for i, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            storage.resize_(size)
            if self.backups is not None:
                storage.copy_(self.backups[i])
        self.backups = None
        self.asleep = False
        addresses = [storage.data_ptr() for storage in self.storages]
        moved, self.addresses = addresses != self.addresses, addresses
        return moved
