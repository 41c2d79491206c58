"""Strict safetensors loading: every checkpoint tensor consumed, every parameter filled."""
import glob
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import copy_checked
from nanovllm.model.fp8 import FP8_DTYPES, SCALE_SUFFIXES, UNUSED_SUFFIXES, FP8Checkpoint, dequantize

# Checkpoint tensors that hold nothing we need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One MoE expert's projection -> the stacked parameter (layers/moe.py) and its (expert, part) shard.
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
    copy_checked(param, loaded)


def _expected_shards(model: nn.Module) -> set[tuple[str, object]]:
    """(parameter name, shard id) pairs the checkpoint must provide."""
    packed = {}
    for ckpt_name, (fused, shard_id) in model.packed_modules_mapping.items():
        packed.setdefault(fused, []).append(shard_id)
    expected = set()
    for name, param in model.named_parameters():
        module_name = name.split(".")[-2]
        for shard_id in getattr(param, "shard_ids", None) or packed.get(module_name, [None]):
            expected.add((name, shard_id))
    return expected


def _param_for(model: nn.Module, ckpt_name: str) -> tuple[str, object]:
    """Checkpoint tensor name -> (our parameter's name, shard id or None)."""
    expert = EXPERT_TENSOR.search(ckpt_name)
    if expert:
        index, part = int(expert.group(1)), expert.group(2)
        prefix = ckpt_name[:expert.start()]
        return f"{prefix}.experts.{'w2' if part == 'down' else 'w13'}", (index, part)
    for ckpt_part, (fused, shard_id) in model.packed_modules_mapping.items():
        if f".{ckpt_part}." in ckpt_name:
            return ckpt_name.replace(f".{ckpt_part}.", f".{fused}."), shard_id
    return ckpt_name, None


def load_model(model: nn.Module, path: str, tie_word_embeddings: bool, fp8: FP8Checkpoint | None = None):
    """fp8: the checkpoint's fp8 weights are dequantized by their scales as they load (model/fp8.py).
    A model without LM head (a pooling model's) skips the checkpoint's, and takes a base model's
    tensors (Qwen3Model's: layers.0..., without the model. prefix) as well as a causal LM's. A
    classifier's head is the checkpoint's score.weight, or is made of rows of its LM head
    (model.score_source)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {path!r}.")
    file_of = {}   # of an fp8 checkpoint: tensor -> its file (a weight's scale may be in another)
    for file in files if fp8 else []:
        with safe_open(file, "pt", "cpu") as f:
            file_of |= dict.fromkeys(f.keys(), file)
    params = dict(model.named_parameters())
    headless = getattr(model, "lm_head", 0) is None
    score_source = getattr(model, "score_source", None)   # a classifier head made of LM-head rows: their tensor
    expected = _expected_shards(model)
    loaded = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith(IGNORED_SUFFIXES):
                    continue
                if ckpt_name == score_source:
                    model.score.load_from_lm_head(f.get_slice(ckpt_name))   # (its rows only: it may load again below)
                    loaded.add(("score.weight", None))
                if ckpt_name == "lm_head.weight" and (tie_word_embeddings or headless):
                    continue  # the same tensor as the embedding, or a head the model does without
                if fp8 and ckpt_name.endswith(UNUSED_SUFFIXES):
                    continue
                if fp8 and ckpt_name.endswith(SCALE_SUFFIXES) and ckpt_name.rsplit("_scale", 1)[0] in file_of:
                    continue  # read with its weight
                name, shard_id = _param_for(model, ckpt_name)
                if name not in params and f"model.{name}" in params and headless:
                    name = f"model.{name}"   # a base model's checkpoint
                if name not in params:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} in {os.path.basename(file)} "
                                     f"matches no model parameter.")
                param = params[name]
                try:
                    tensor = f.get_tensor(ckpt_name)
                    if tensor.dtype in FP8_DTYPES:
                        tensor = _dequantized(tensor, ckpt_name, fp8, file_of, (file, f), param.device)
                    weight_loader = getattr(param, "weight_loader", default_weight_loader)
                    weight_loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
                loaded.add((name, shard_id))
    missing = sorted(f"{n}" + (f" (shard {s!r})" if s is not None else "") for n, s in expected - loaded)
    if missing:
        hint = ("; a causal LM's classifier head is made of LM-head rows when hf_overrides name its "
                "classifier_from_token and method (vLLM's reranker recipe)") if "score.weight" in missing else ""
        raise ValueError(f"the checkpoint in {path!r} lacks {len(missing)} tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else "") + hint)


def _dequantized(weight: torch.Tensor, name: str, fp8: FP8Checkpoint | None, file_of: dict, reading: tuple,
                 device: torch.device) -> torch.Tensor:
    """An fp8 checkpoint tensor times its scale (on the parameter's device, for speed). reading: the
    file being read and its open handle, which serves the scale when it lies beside its weight."""
    if fp8 is None:
        raise ValueError(f"it is {weight.dtype}, but config.json has no fp8 quantization_config.")
    scale_name = next((name + suffix for suffix in SCALE_SUFFIXES if name + suffix in file_of), None)
    if scale_name is None:
        raise ValueError(f"it is {weight.dtype}, but the checkpoint has no {name}_scale_inv or {name}_scale.")
    file, handle = reading
    if file_of[scale_name] == file:
        scale = handle.get_tensor(scale_name)
    else:
        with safe_open(file_of[scale_name], "pt", "cpu") as other:
            scale = other.get_tensor(scale_name)
    return dequantize(weight.to(device), scale.to(device), fp8.weight_block_size)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights for benchmarks: normal(0, 0.02) for matrices, 1 for norms, 0 for biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        elif hasattr(param, "store_rows"):   # an fp8 weight (quantization="fp8"): drawn, then quantized
            param.store_rows(param, torch.empty(param.shape, device=param.device).normal_(0.0, 0.02, generator=gen))
        else:
            param.normal_(0.0, 0.02, generator=gen)
