"""Strict weight loading: a checkpoint that does not fit the model is a clear error."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM


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
