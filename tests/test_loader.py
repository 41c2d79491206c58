"""Strict weight loading (a checkpoint that does not fit the model is a clear error), and fp8 checkpoints
dequantized as they load."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fp8_checkpoints, hf_greedy, make_prompts
from nanovllm import LLM, SamplingParams


def edited_checkpoint(src, dst, edit):
    shutil.copytree(src, dst)
    path = f"{dst}/model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor(qwen3_dir, tmp_path):
    path = edited_checkpoint(qwen3_dir, tmp_path / "m",
                             lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): model.layers.1.self_attn.qkv_proj.weight \(shard 'k'\)"):
        LLM(path)


def test_unused_tensor(qwen3_dir, tmp_path):
    path = edited_checkpoint(qwen3_dir, tmp_path / "m",
                             lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' in model.safetensors matches no model parameter"):
        LLM(path)


def test_misshapen_tensor(qwen3_dir, tmp_path):
    path = edited_checkpoint(qwen3_dir, tmp_path / "m",
                             lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight': .*checkpoint shape \(65,\) does not match parameter shape \(64,\)"):
        LLM(path)


def test_untied_lm_head_is_loaded(qwen2_dir):
    llm = LLM(qwen2_dir, block_size=16, num_kvcache_blocks=8)
    model = llm.llm_engine.model_runner.model
    ref = load_file(f"{qwen2_dir}/model.safetensors")
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.bias[:64], ref["model.layers.0.self_attn.q_proj.bias"])
    assert torch.equal(qkv.weight[64 + 32:], ref["model.layers.0.self_attn.v_proj.weight"])


def test_moe_experts_are_stacked_and_checked(qwen3_moe_dir, tmp_path):
    llm = LLM(qwen3_moe_dir, block_size=16, num_kvcache_blocks=8)
    experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
    ref = load_file(f"{qwen3_moe_dir}/model.safetensors")
    prefix = "model.layers.0.mlp.experts.2"
    assert torch.equal(experts.w13[2], torch.cat([ref[f"{prefix}.gate_proj.weight"], ref[f"{prefix}.up_proj.weight"]]))
    assert torch.equal(experts.w2[2], ref[f"{prefix}.down_proj.weight"])
    path = edited_checkpoint(qwen3_moe_dir, tmp_path / "m", lambda t: t.pop(f"{prefix}.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): model.layers.0.mlp.experts.w13 \(shard \(2, 'up'\)\)"):
        LLM(path)


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_fp8_checkpoint_loads_dequantized(qwen3_dir, tmp_path, scheme):
    """An fp8 checkpoint loads as its dequantized weights: the same parameters and greedy tokens as the
    plain checkpoint of those weights, which HF transformers runs to the same tokens; quantization reads
    "fp8". Block scales (quant_method fp8; in a file of their own, part blocks at the edges) and a scale a
    row (compressed-tensors)."""
    fp8_dir, ref_dir = fp8_checkpoints(qwen3_dir, tmp_path, scheme)
    sizes = dict(dtype="float32", block_size=16, num_kvcache_blocks=32)
    fp8, ref = LLM(fp8_dir, **sizes), LLM(ref_dir, quantization=None, **sizes)
    assert fp8.llm_engine.model_config.quantization == "fp8"
    for (name, a), (_, b) in zip(fp8.llm_engine.model_runner.model.named_parameters(),
                                 ref.llm_engine.model_runner.model.named_parameters()):
        assert torch.equal(a, b), name
    ref_weights = load_file(f"{ref_dir}/model.safetensors")
    assert not torch.equal(ref_weights["model.layers.0.mlp.down_proj.weight"],
                           load_file(f"{qwen3_dir}/model.safetensors")["model.layers.0.mlp.down_proj.weight"])
    prompts = make_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in fp8.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert tokens == hf_greedy(ref_dir, prompts, 8)
    assert LLM(fp8_dir, quantization="fp8", **sizes).llm_engine.config.quantization == "fp8"


def test_fp8_moe_checkpoint_loads_dequantized(qwen3_moe_dir, tmp_path):
    """Each expert's fp8 projection is dequantized before it is stacked (Qwen3-30B-A3B-FP8's layout)."""
    fp8_dir, ref_dir = fp8_checkpoints(qwen3_moe_dir, tmp_path)
    sizes = dict(dtype="float32", block_size=16, num_kvcache_blocks=8)
    fp8, ref = LLM(fp8_dir, **sizes), LLM(ref_dir, **sizes)
    for (name, a), (_, b) in zip(fp8.llm_engine.model_runner.model.named_parameters(),
                                 ref.llm_engine.model_runner.model.named_parameters()):
        assert torch.equal(a, b), name


def test_fp8_checkpoint_errors(qwen3_dir, tmp_path):
    """A scale of the wrong shape, a weight without its scale, quantization="fp8" for a plain checkpoint
    (vLLM's online quantization) and fp8 weights without a quantization_config are clear errors."""
    fp8_dir, _ = fp8_checkpoints(qwen3_dir, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    scales = load_file(f"{fp8_dir}/scales.safetensors")
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    save_file(scales | {f"{name}_scale_inv": torch.ones(2, 2)}, f"{bad}/scales.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {name!r}: its scale has shape (2, 2): neither "
                                                   f"one number, one a row (64), nor one a [24, 40] block (3, 2) of a "
                                                   f"(64, 64) weight.")):
        LLM(str(bad))
    save_file({k: v for k, v in scales.items() if k != f"{name}_scale_inv"}, f"{bad}/scales.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {name!r}: it is torch.float8_e4m3fn, but the "
                                                   f"checkpoint has no {name}_scale_inv or {name}_scale.")):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps(json.loads((bad / "config.json").read_text())
                                                | {"quantization_config": None}))
    with pytest.raises(ValueError, match="it is torch.float8_e4m3fn, but config.json has no fp8 quantization_config."):
        LLM(str(bad))


def test_fp8_dequantize_by_tensor_row_or_block():
    """A scale of one number, one a row, or one a block (part blocks at the edges)."""
    from nanovllm.model.fp8 import dequantize
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, -1.0, 2.0]]).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(w, torch.tensor(2.0), None), w.float() * 2)
    assert torch.equal(dequantize(w, torch.tensor([[1.0], [2.0], [4.0]]), None),
                       w.float() * torch.tensor([[1.0], [2.0], [4.0]]))
    blocks = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])   # [2, 2] blocks: rows 0-1 | 2, columns 0-1 | 2
    expected = w.float() * torch.tensor([[1.0, 1, 10], [1, 1, 10], [100, 100, 1000]])
    assert torch.equal(dequantize(w, blocks, (2, 2)), expected)
    with pytest.raises(ValueError, match=re.escape("its scale has shape (2,): neither one number, one a row (3) of")):
        dequantize(w, torch.ones(2), None)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4}, "the checkpoint is quantized (quant_method 'awq'); nanovllm loads unquantized "
                                         "checkpoints and fp8 ones (quant_method 'fp8' or 'compressed-tensors') only."),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     "quantization_config weight_block_size must be two positive integers, got [128]."),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}},
     "the checkpoint is quantized (compressed-tensors, config group 'group_0': weights of type 'int', 4 bits, "
     "strategy 'group'); nanovllm loads its fp8 weights only"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}},
        "b": {"weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [64, 64]}}}},
     "the checkpoint's config groups have different block structures: [(64, 64), (128, 128)]."),
])
def test_quantization_configs_that_are_refused(config, message):
    from nanovllm.model.fp8 import fp8_checkpoint
    with pytest.raises(ValueError, match=re.escape(message)):
        fp8_checkpoint(config)
