"""quantization="fp8" on an unquantized checkpoint (vLLM's online quantization): the decoder's projections in
fp8 with a scale a row, their inputs quantized a token at a time, the products of the quantized operands. On
the CPU (float32) the engine's greedy tokens equal HF transformers' with the same quantization applied to its
projections (every dense architecture and an MoE one, chunked prefill and preemption); the quantizer's values;
dummy weights, reload_weights and tensor parallelism; bad combinations."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from safetensors.torch import load_file

from conftest import hf_model, make_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import FP8, fp8_linear, quantize_rows_fp8

PROMPTS = make_prompts()
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quantized(t: torch.Tensor) -> torch.Tensor:
    """t's rows quantized to fp8 and multiplied out again (float32)."""
    q, scale = quantize_rows_fp8(t.reshape(-1, t.shape[-1]))
    return (q.float() * scale).reshape(t.shape)


def adapter_products(adapter: str | None, device: str = "cpu"):
    """A PEFT adapter's products, for HF modules by name: name -> f(x) = scaling * x @ A.T @ B.T in x's dtype (None
    where the adapter has no weights for that module, or there is no adapter), scaling as its adapter_config.json
    says (lora_alpha / r, or over sqrt(r) with use_rslora)."""
    if adapter is None:
        return lambda name: None
    tensors = load_file(f"{adapter}/adapter_model.safetensors", device=device)
    config = json.loads(Path(adapter, "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])

    def products(name: str):
        a, b = (tensors.get(f"base_model.model.{name}.lora_{part}.weight") for part in "AB")
        if a is None:
            return None
        return lambda x: scaling * F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
    return products


@torch.no_grad()
def hf_fp8_greedy(path, prompts: list[list[int]], max_new_tokens: int, ranks: int = 1,
                  adapter: str | None = None) -> list[list[int]]:
    """HF transformers' greedy tokens with its projections (not the MoE experts or routers) as ours on `ranks`
    tensor-parallel ranks: the weight's rows and each input token quantized to fp8, multiplied out in float32;
    a row-parallel projection (o, down) as the sum of its ranks' products, each of its shard of the columns.
    adapter: a PEFT adapter's directory, whose products of the unquantized input are added to its projections'
    (adapter_products; at one rank)."""
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    lora = adapter_products(adapter)
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.endswith(PROJECTIONS) and ".experts." not in name):
            continue
        if (products := lora(name)) is not None:
            module.weight.copy_(fake_quantized(module.weight))
            module.forward = lambda x, w=module.weight, products=products: (F.linear(fake_quantized(x), w)
                                                                             + products(x))
        elif ranks > 1 and name.endswith(("o_proj", "down_proj")):
            shards = [fake_quantized(w) for w in module.weight.chunk(ranks, 1)]
            module.forward = lambda x, shards=shards: sum(F.linear(fake_quantized(part), w)
                                                          for part, w in zip(x.chunk(len(shards), -1), shards))
        else:
            module.weight.copy_(fake_quantized(module.weight))
            module.register_forward_pre_hook(lambda _, args: (fake_quantized(args[0]),))
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def test_rows_quantize_by_their_largest_magnitude():
    x = torch.tensor([[1.0, -2.0, 4.0], [0.0, 0.0, 0.0], [-896.0, 1.0, 0.0]])
    q, scale = quantize_rows_fp8(x)
    assert q.dtype == FP8 and scale.shape == (3, 1)
    assert scale.view(-1).tolist() == torch.tensor([4.0 / 448, 1.0 / (448 * 512), 2.0]).tolist()
    assert q.float().tolist() == [[112.0, -224.0, 448.0], [0.0, 0.0, 0.0], [-448.0, 0.5, 0.0]]
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.tensor([[0.01], [1.0], [30.0], [1e3], [1e-4]])
    relative = (fake_quantized(x) - x).abs().amax(-1) / x.abs().amax(-1)
    assert relative.max() <= 1 / 16   # (e4m3: three mantissa bits, at most half a step of 1/8)


def test_fp8_linear_multiplies_the_quantized_operands():
    torch.manual_seed(0)
    x, w, bias = torch.randn(3, 7, 32), torch.randn(48, 32), torch.randn(48)
    wq, wscale = quantize_rows_fp8(w)
    y = fp8_linear(x, wq, wscale.view(-1), bias)
    expected = F.linear(fake_quantized(x), wq.float() * wscale, bias)
    assert y.shape == (3, 7, 48)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    gated = fp8_linear(x[0], wq, wscale.view(-1), None, silu_mul=True)
    up = F.linear(fake_quantized(x[0]), wq.float() * wscale)
    torch.testing.assert_close(gated, F.silu(up[:, :24]) * up[:, 24:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen2_moe"])
def test_greedy_tokens_equal_hf_with_the_same_quantization(arch, request):
    """Prompts in 64-token chunks, and 12 blocks for 16 sequences (preemptions)."""
    path = request.getfixturevalue(f"{arch}_dir")
    expected = hf_fp8_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(path, dtype="float32", quantization="fp8", block_size=16, num_kvcache_blocks=24,
             max_num_batched_tokens=64) as llm:
        model = llm.llm_engine.model_runner.model
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == FP8 and layer.self_attn.o_proj.weight.dtype == FP8
        assert model.model.embed_tokens.weight.dtype == torch.float32
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_without_quantization_the_tokens_differ(qwen3_dir):
    """(The check above can fail: the quantization changes some of this model's greedy tokens.)"""
    with LLM(qwen3_dir, dtype="float32") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]
    assert plain != hf_fp8_greedy(qwen3_dir, PROMPTS, MAX_TOKENS)


def test_reload_weights_quantizes_again_and_dummy_weights_load(qwen3_dir):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    with LLM(qwen3_dir, dtype="float32", quantization="fp8") as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        qkv = llm.llm_engine.model_runner.model.model.layers[1].self_attn.qkv_proj
        qkv.weight.data.zero_()
        qkv.weight_scale.zero_()
        llm.collective_rpc("reload_weights")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    with LLM(qwen3_dir, dtype="float32", quantization="fp8", load_format="dummy") as llm:
        qkv = llm.llm_engine.model_runner.model.model.layers[1].self_attn.qkv_proj
        assert qkv.weight.float().abs().amax(-1).eq(448).all() and qkv.weight_scale.gt(0).all()
        assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 4


def test_weights_rounded_to_the_model_dtype_before_they_are_quantized(qwen3_dir):
    """A bfloat16 engine on this float32 checkpoint quantizes each weight as rounded to bfloat16 (as vLLM quantizes
    the weights it loaded), which gives other fp8 values than the float32 ones would in some rows."""
    from safetensors.torch import load_file
    loaded = load_file(f"{qwen3_dir}/model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    with LLM(qwen3_dir, dtype="bfloat16", quantization="fp8") as llm:
        down = llm.llm_engine.model_runner.model.model.layers[0].mlp.down_proj
        q, scale = quantize_rows_fp8(loaded.bfloat16())
        assert torch.equal(down.weight.float(), q.float()) and torch.equal(down.weight_scale, scale.view(-1))
        assert not torch.equal(q.float(), quantize_rows_fp8(loaded)[0].float())


def test_lora_adapters_join_the_fp8_products(qwen3_dir, tmp_path):
    """enable_lora with quantization="fp8" (as vLLM runs adapters on an fp8 model): each projection's adapter
    product, of the unquantized input in the model's dtype, is added to its fp8 product. Requests with the adapter
    and without it in one batch, prompts chunked: greedy tokens equal HF's with the same quantization, plus the
    adapter's products for the first kind."""
    from nanovllm.lora.request import LoRARequest
    from test_lora import ALL_TARGETS, write_adapter
    adapter, _ = write_adapter(tmp_path, qwen3_dir, targets=ALL_TARGETS)
    prompts = PROMPTS[4:12]
    adapted, plain = hf_fp8_greedy(qwen3_dir, prompts, MAX_TOKENS, adapter=adapter), hf_fp8_greedy(
        qwen3_dir, prompts, MAX_TOKENS)
    assert adapted != plain
    requests = [LoRARequest("adapter", 1, adapter) if i % 2 == 0 else None for i in range(len(prompts))]
    with LLM(qwen3_dir, dtype="float32", quantization="fp8", enable_lora=True, max_lora_rank=8, block_size=16,
             max_num_batched_tokens=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests)
    assert [o.outputs[0].token_ids for o in outs] == [a if i % 2 == 0 else b
                                                     for i, (a, b) in enumerate(zip(adapted, plain))]


def test_tensor_parallel_quantizes_each_shard(qwen3_dir):
    """Two gloo ranks: each quantizes its own shard (a row-parallel shard's rows and inputs are part rows); the
    greedy tokens equal HF's with that quantization."""
    prompts = PROMPTS[:8]
    with LLM(qwen3_dir, dtype="float32", quantization="fp8", tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_fp8_greedy(qwen3_dir, prompts, MAX_TOKENS, ranks=2)


def test_refusals(qwen3_dir):
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(qwen3_dir, quantization="awq")
