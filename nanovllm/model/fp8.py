"""FP8 checkpoints: quant_method "fp8" in config.json's quantization_config (as Qwen3-*-FP8 and
DeepSeek ship them), or "compressed-tensors" with 8-bit float weights (as llm-compressor writes them).
Each projection's weight is stored in float8 with a dequantization scale: one a [128, 128] block of
the weight (`weight_scale_inv`, weight_block_size [128, 128]; compressed-tensors' block strategy
names it `weight_scale`), or one a tensor or an output row (`weight_scale`). The loader multiplies
them out as the weights load, so the model runs in its dtype (bf16) as the unquantized checkpoint
would: an fp8 checkpoint takes the memory and time of a bf16 one here, where vLLM would run fp8
products on the fp8 weights."""
import math
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("_scale_inv", "_scale")   # of "<name>.weight": its dequantization scale
# Scales for fp8 activations and an fp8 KV cache (static schemes): the products run in the model's
# dtype here and the fp8 KV cache is unscaled (config.KV_CACHE_DTYPES), so they are not used.
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class FP8Checkpoint:
    weight_block_size: tuple[int, int] | None   # (output rows, input columns) a scale; None: per tensor or row


def fp8_checkpoint(quantization_config) -> FP8Checkpoint | None:
    """config.json's quantization_config -> FP8Checkpoint; None without one. Taken: quant_method "fp8"
    (weight_block_size, if any, two positive integers) and "compressed-tensors" whose weights are all
    8-bit floats (llm-compressor's FP8 checkpoints: a scale a tensor, channel or block); anything else
    is a ValueError."""
    if not quantization_config:
        return None
    config = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(config)
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized (quant_method {method!r}); nanovllm loads unquantized "
                         f"checkpoints and fp8 ones (quant_method 'fp8' or 'compressed-tensors') only.")
    return FP8Checkpoint(_block_size(config.get("weight_block_size"), "quantization_config weight_block_size"))


def _compressed_tensors_fp8(config: dict) -> FP8Checkpoint:
    blocks = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel", "block"):
            raise ValueError(f"the checkpoint is quantized (compressed-tensors, config group {name!r}: weights of "
                             f"type {kind[0]!r}, {kind[1]} bits, strategy {kind[2]!r}); nanovllm loads its fp8 "
                             f"weights only (type 'float', 8 bits, strategy 'tensor', 'channel' or 'block').")
        if kind[2] == "block":
            blocks.add(_block_size(weights.get("block_structure"), f"config group {name!r} block_structure"))
    if len(blocks) > 1:
        raise ValueError(f"the checkpoint's config groups have different block structures: {sorted(blocks)}.")
    return FP8Checkpoint(blocks.pop() if blocks else None)


def _block_size(block, what: str) -> tuple[int, int] | None:
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{what} must be two positive integers, got {block!r}.")
    return None if block is None else tuple(block)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight (float8, [..., N, K]) times its scale, in float32. The scale's shape says what it scales:
    one number the tensor, N numbers ([N] or [N, 1]) a row each, and with block (bn, bk) a
    [..., ceil(N / bn), ceil(K / bk)] scale a block each."""
    w, s = weight.float(), scale.float()
    n, k = w.shape[-2:]
    grid = None if block is None else (*w.shape[:-2], math.ceil(n / block[0]), math.ceil(k / block[1]))
    if s.numel() == 1:
        return w * s.reshape(())
    if tuple(s.shape) in ((n,), (n, 1)):
        return w * s.reshape(n, 1)
    if tuple(s.shape) == grid:
        return w * s.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    blocks = f", nor one a [{block[0]}, {block[1]}] block {grid}" if block else ""
    raise ValueError(f"its scale has shape {tuple(s.shape)}: neither one number, one a row ({n}){blocks} of a "
                     f"{tuple(w.shape)} weight.")
