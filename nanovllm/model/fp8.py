"""FP8 checkpoints (quant_method "fp8" in config.json's quantization_config, as Qwen3-*-FP8 and
DeepSeek ship them): each projection's weight stored in float8 with a dequantization scale, one a
[128, 128] block of the weight (`weight_scale_inv`, weight_block_size [128, 128]) or one a tensor
or output row (`weight_scale`). The loader multiplies them out as the weights load, so the model
runs in its dtype (bf16) as the unquantized checkpoint would: an fp8 checkpoint takes the memory and
time of a bf16 one here, where vLLM would run fp8 products on the fp8 weights."""
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
    """config.json's quantization_config -> FP8Checkpoint; None without one; ValueError for another
    quantization method or a block size that is not two positive integers."""
    if not quantization_config:
        return None
    config = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized (quant_method {method!r}); nanovllm loads unquantized "
                         f"checkpoints and fp8 ones (quant_method 'fp8') only.")
    block = config.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config weight_block_size must be two positive integers, got {block!r}.")
    return FP8Checkpoint(tuple(block) if block is not None else None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight (float8, [..., N, K]) times its scale, in float32: with block (bn, bk) the scale is
    [..., ceil(N / bn), ceil(K / bk)], one a block; without, one number or one an output row."""
    w, s = weight.float(), scale.float()
    n, k = w.shape[-2:]
    if block is not None:
        bn, bk = block
        grid = (*w.shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
        if tuple(s.shape) != grid:
            raise ValueError(f"its scale has shape {tuple(s.shape)}, not {grid} (a scale a [{bn}, {bk}] block "
                             f"of a {tuple(w.shape)} weight).")
        return w * s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == n:
        return w * s.reshape(n, 1)
    raise ValueError(f"its scale has {s.numel()} values, neither one nor one a row of a {tuple(w.shape)} weight.")
