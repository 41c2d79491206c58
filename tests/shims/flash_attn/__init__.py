"""flash-attn's two paged-attention functions, taken from the FlashAttention build that vLLM ships
(`vllm.vllm_flash_attn`), so that the engine's flash_attn backend can run its GPU tests and
benchmarks on a machine where the flash-attn package itself cannot be installed.

Usage (on the GPU machine, with vLLM installed): put tests/shims on PYTHONPATH; "auto" then picks
the flash_attn backend. FLASH_ATTN_SHIM_VERSION picks the kernels: 2 (the default, what the
flash-attn package is) or 3 (FlashAttention 3, Hopper).
"""
import functools
import os

from vllm.vllm_flash_attn import flash_attn_varlen_func as _varlen
from vllm.vllm_flash_attn import flash_attn_with_kvcache as _with_kvcache

FA_VERSION = int(os.environ.get("FLASH_ATTN_SHIM_VERSION", "2"))
flash_attn_varlen_func = functools.partial(_varlen, fa_version=FA_VERSION)
flash_attn_with_kvcache = functools.partial(_with_kvcache, fa_version=FA_VERSION)
