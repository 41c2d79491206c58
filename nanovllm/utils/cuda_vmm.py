"""Device memory whose virtual address outlives its physical memory (CUDA's virtual memory
management, called through the driver API with ctypes: torch does not expose it).

An Arena reserves an address range once and maps physical memory there; release() gives the
physical memory back to the driver and keep() maps new memory at the same addresses. Tensors made
from it (arena.tensor() and views of it) stay valid across the two, and so do CUDA graphs that read
or write them: this is how sleep mode frees the weights and the KV cache without capturing the
graphs again. Between release() and keep() no kernel may touch them.
"""
import ctypes

import torch

from nanovllm.utils.arrays import aligned_offsets

# CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):   # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("location", _Location),
                ("win32_handle_metadata", ctypes.c_void_p), ("alloc_flags", ctypes.c_uint8 * 8)]


class _AccessDesc(ctypes.Structure):       # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver = None


def _call(name: str, *args):
    """The driver function `name`, called; a RuntimeError with the driver's message if it fails."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    result = getattr(_driver, name)(*args)
    if result != 0:
        message = ctypes.c_char_p()
        _driver.cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{name} failed: {(message.value or b'?').decode()} (CUresult {result}).")


class Arena:
    """nbytes of device memory at a fixed address, seen as uint8 tensors (tensor())."""

    def __init__(self, nbytes: int, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()   # the driver calls below use the device's (current) primary context
        self.prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, index))
        self.access = _AccessDesc(location=_Location(_ON_DEVICE, index), flags=_READ_WRITE)
        granularity = ctypes.c_size_t()
        _call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop), 0)
        self.nbytes = nbytes
        self.size = -(-max(nbytes, 1) // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        _call("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
              ctypes.c_uint64(0), ctypes.c_uint64(0))
        self.address = address.value
        self.device = torch.device("cuda", index)
        self.handle: int | None = None
        self.keep()

    def tensor(self) -> torch.Tensor:
        """The arena's bytes; the tensor (through torch.as_tensor, which reads the interface
        below) holds the arena, so its addresses stay reserved while any view of it lives."""
        return torch.as_tensor(self, device=self.device)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3,
                "strides": None, "stream": None}

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def keep(self):
        """Map physical memory at the arena's addresses (uninitialised)."""
        if self.mapped:
            return
        handle = ctypes.c_uint64()
        _call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self.prop),
              ctypes.c_uint64(0))
        try:
            _call("cuMemMap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                  handle, ctypes.c_uint64(0))
        except RuntimeError:
            _call("cuMemRelease", handle)
            raise
        self.handle = handle.value
        _call("cuMemSetAccess", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size), ctypes.byref(self.access),
              ctypes.c_size_t(1))

    def release(self):
        """Give the physical memory back to the driver; the addresses stay reserved."""
        if not self.mapped:
            return
        _call("cuMemUnmap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        _call("cuMemRelease", ctypes.c_uint64(self.handle))
        self.handle = None

    def __del__(self):
        try:
            self.release()
            _call("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        except Exception:   # at interpreter exit the driver may be gone already; the process's end frees it
            pass


def place_in_arena(tensors: list[torch.Tensor], device: torch.device, align: int = 256) -> Arena:
    """One arena holding the tensors' values, each tensor's .data then a view of it (so a
    Parameter keeps its identity and attributes, and modules sharing it share the view)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"place_in_arena needs contiguous tensors, got strides {t.stride()}.")
    offsets, total = aligned_offsets([t.numel() * t.element_size() for t in tensors], align)
    arena = Arena(total, device)
    memory = arena.tensor()
    for t, offset in zip(tensors, offsets):
        view = memory[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
    return arena
