"""Linear layers sharded Megatron-style across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that copies this
rank's slice of a full checkpoint tensor into it and checks the shape. Fused projections
(q/k/v, gate/up) load one checkpoint tensor per `shard_id`.

With quantization="fp8" (vLLM's online quantization of an unquantized checkpoint) the layers of the
decoder keep their weights in fp8 (e4m3), a scale an output row (`use_fp8`): each row is quantized
as it loads, so fused and sharded weights load as before. Their products are fp8 products
(`fp8_linear`): the activations quantized a row (token) at a time as they come, both scales applied
to the product's float32 sums (torch._scaled_mm's row-wise scaling on CUDA, the small-batch kernel at a few rows).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import SINGLE, TPGroup
from nanovllm.kernels.triton_fp8 import FP8_MAX, MIN_SCALE
from nanovllm.layers.activation import silu_and_mul

FP8 = torch.float8_e4m3fn


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "parameter"):
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match "
                         f"parameter shape {tuple(param.shape)}.")
    param.data.copy_(loaded)


def is_16bit_cuda_matrix(x: torch.Tensor) -> bool:
    """Activations that our CUDA product paths take: 16-bit rows on CUDA."""
    return x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)


def takes_small_batch_kernel(x: torch.Tensor) -> bool:
    """Whether linear() multiplies x by kernels/triton_skinny.py's kernel: a few rows of 16-bit
    activations on CUDA (a decode step at small batch), where it streams the weight faster than
    cuBLAS."""
    if not (is_16bit_cuda_matrix(x) and x.stride(1) == 1):
        return False
    from nanovllm.kernels import triton_skinny
    return x.shape[0] <= triton_skinny.MAX_ROWS and triton_skinny.enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """F.linear (see takes_small_batch_kernel for when it is ours). out: where to write the result
    ([rows, out_features], contiguous), if not in a new tensor. silu_mul: weight's rows hold gate |
    up halves and the result is silu(gate) * up, which the small-batch kernel computes in the same
    kernel (no out or bias then)."""
    if takes_small_batch_kernel(x):
        from nanovllm.kernels.triton_skinny import skinny_linear
        return skinny_linear(x, weight, bias, out=out, silu_mul=silu_mul)
    if silu_mul:
        assert out is None and bias is None
        return silu_and_mul(F.linear(x, weight))
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x in fp8 [M, K], float32 scales [M, 1]): each row divided by its largest magnitude over
    FP8_MAX (kernels/triton_fp8.py on CUDA; this is its reference)."""
    if x.is_cuda:
        from nanovllm.kernels.triton_fp8 import quantize_rows
        return quantize_rows(x.contiguous())
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               silu_mul: bool = False) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T (+ bias), weight in fp8 with a float32 scale a row: x quantized a
    row at a time (quantize_rows_fp8), then one product of the fp8 operands scaled by both. On the CPU the
    operands are multiplied out in float32 (the same values; for tests). silu_mul as in linear()."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    q, scale = quantize_rows_fp8(x)
    if takes_small_batch_kernel(x):   # (streams the fp8 weight at a few rows; torch's product does not)
        from nanovllm.kernels.triton_skinny import skinny_linear
        y = skinny_linear(q, weight, bias, x_scale=scale, weight_scale=weight_scale, out_dtype=x.dtype,
                          silu_mul=silu_mul)
        return y.view(*shape[:-1], y.shape[-1])
    if x.is_cuda:   # (row-wise scaling gives bf16 only)
        y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16).to(x.dtype)
    else:
        y = F.linear(q.float() * scale, weight.float() * weight_scale[:, None]).to(x.dtype)
    if bias is not None:
        y += bias
    y = y.view(*shape[:-1], weight.shape[0])
    return silu_and_mul(y) if silu_mul else y


# Row-parallel products whose output an RMSNorm takes next (o_proj, down_proj) have few output
# features (1,024 at the 0.6B shape): at decode batch sizes cuBLAS runs them on a fraction of the
# SMs. Split along the input features into float32 partial products by one strided-batched call,
# summed by the norm kernel, they take 1-2.5 us less a product (docs/perf_notes.md row 50).
SPLIT_K_ROWS = (17, 256)          # above triton_skinny.MAX_ROWS, up to the default max_num_seqs
SPLIT_K_MAX_OUT_FEATURES = 1024   # as measured (tests/bench_gemm.py --split); wider outputs unmeasured
MIN_SPLIT_FEATURES = 256


def split_k_before_norm(rows: int, in_features: int, out_features: int) -> int:
    """Splits of the input features for a product whose output goes to an RMSNorm (1: none):
    8 up to 64 rows, 4 above, as far as each split keeps MIN_SPLIT_FEATURES features."""
    low, high = SPLIT_K_ROWS
    if not low <= rows <= high or out_features > SPLIT_K_MAX_OUT_FEATURES:
        return 1
    splits = 8 if rows <= 64 else 4
    while splits > 1 and (in_features % splits or in_features // splits < MIN_SPLIT_FEATURES):
        splits //= 2
    return splits


class Partials(NamedTuple):
    """A layer's output left as parts whose sum it is, [splits, rows, out_features], for the RMSNorm
    after it to add up (layers/layernorm.py): a product x @ weight.T as float32 partial products
    over slices of the input features (split-K), or a MoE layer's output as each choice's weighted
    output (layers/moe.py; 16-bit, a strided view)."""
    parts: torch.Tensor


def split_k_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> Partials:
    """x @ weight.T in `splits` partial products, from one strided-batched cuBLAS call on views of
    x and weight (no copies for a contiguous x)."""
    (rows, k), n = x.shape, weight.shape[0]
    xs = x.reshape(rows, splits, k // splits).transpose(0, 1)           # [splits, rows, k / splits]
    ws = weight.view(n, splits, k // splits).permute(1, 2, 0)           # [splits, k / splits, n]
    return Partials(torch.bmm(xs, ws, out_dtype=torch.float32))


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.shard_dim = shard_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.lora = None   # with LoRA adapters: lora/layers.py's LoRALinear, which adds its products to the output
        self.weight_scale: torch.Tensor | None = None   # an fp8 weight's, a float32 scale an output row

    def use_fp8(self):
        """Keep the weight in fp8 from now on (to be loaded: its values are gone), quantized a row at a time."""
        rows, columns = self.weight.shape
        device = self.weight.device
        self.model_dtype = self.weight.dtype   # (a loaded weight is rounded to it first: vLLM quantizes what it loaded)
        self.weight = nn.Parameter(torch.empty(rows, columns, dtype=FP8, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.store_rows = self.store_rows
        self.weight_scale = torch.empty(rows, dtype=torch.float32, device=device)

    @property
    def fp8(self) -> bool:
        return self.weight_scale is not None

    def store_rows(self, param: nn.Parameter, loaded: torch.Tensor, offset: int = 0, size: int | None = None,
                   name: str = "parameter"):
        """Copy loaded into param's rows offset .. offset + size (None: to the end), checking the shape; an fp8
        weight's quantized, its scales beside."""
        target = param.data.narrow(0, offset, param.shape[0] - offset if size is None else size)
        if param is not self.weight or not self.fp8 or target.shape != loaded.shape:
            return copy_checked(target, loaded, name)   # (a shape error, if any, from there)
        q, scale = quantize_rows_fp8(loaded.to(target.device, self.model_dtype))
        target.copy_(q)
        self.weight_scale[offset:offset + len(q)] = scale.view(-1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if self.shard_dim is not None and param.dim() > self.shard_dim:
            loaded = loaded.chunk(self.tp_size, self.shard_dim)[self.tp_rank]
        self.store_rows(param, loaded)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
        """x times this rank's weight (+ bias): an fp8 product for an fp8 weight (never into out), else linear()."""
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale, bias, silu_mul)
        return linear(x, self.weight, bias, out=out, silu_mul=silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.product(x, self.bias)
        shrunk = self.lora.shrink(x)   # (beside the base product, on CUDA)
        return self.lora.add_to(self.product(x, self.bias), x, shrunk)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, shard_dim=None, tp=SINGLE)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__(input_size, output_size // tp.size, bias, shard_dim=0, tp=tp)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_up_proj); shard_id is the index of the part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: the two parts are a gated MLP's gate and up; return silu(gate) * up (see linear)."""
        assert not silu_mul or len(self.output_sizes) == 2
        if self.lora is not None:   # (the adapters' products join before the activation)
            shrunk = self.lora.shrink(x)
            return self.lora.add_to(self.product(x, self.bias), x, shrunk, silu_mul)
        return self.product(x, self.bias, silu_mul=silu_mul)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        offset, size = self.shard_range(shard_id)
        loaded = loaded.chunk(self.tp_size, 0)[self.tp_rank]
        self.store_rows(param, loaded, offset, size, f"shard {shard_id!r}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused; each rank holds its own query and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = SINGLE):
        self.shard_ids = {"q": 0, "k": 1, "v": 2}
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, tp)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return super().shard_range(self.shard_ids[shard_id])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce.

    to_norm: the caller hands the output straight to an RMSNorm (layers/layernorm.py). Then, on
    one CUDA rank at decode batch sizes, the output may come back as Partials, which the
    norm sums (see split_k_before_norm)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE,
                 to_norm: bool = False):
        super().__init__(input_size // tp.size, output_size, bias, shard_dim=1, tp=tp)
        self.to_norm = to_norm and tp.size == 1 and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor | Partials:
        shrunk = None if self.lora is None else self.lora.shrink(x)   # (beside the base product, on CUDA)
        if self.to_norm and not self.fp8 and (self.lora is None or self.lora.slots.fused) and is_16bit_cuda_matrix(x):
            splits = split_k_before_norm(x.shape[0], *self.weight.shape[::-1])
            if splits > 1:
                partials = split_k_partials(x, self.weight, splits)
                if self.lora is not None:   # (the Triton expand adds into a float32 part as well)
                    self.lora.add_to(partials.parts[0], x, shrunk)
                return partials
        # Bias is added once, on rank 0, before the sum. The product goes straight into the
        # all-reduce's input buffer when it has one (no copy into it; an fp8 product writes its own).
        out = None
        if x.dim() == 2 and not self.fp8:
            out = self.tp.all_reduce_input((x.shape[0], self.weight.shape[0]), x.dtype)
        y = self.product(x, self.bias if self.tp_rank == 0 else None, out=out)
        if self.lora is not None:   # (each rank's part of the adapters' products, summed with the rest)
            self.lora.add_to(y, x, shrunk)
        return self.tp.all_reduce(y)
