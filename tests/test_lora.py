"""LoRA adapters (enable_lora=True, lora_request=LoRARequest(...)): the tokens of HF transformers running
the base model with the adapter merged into its weights (W + scaling * B @ A), float32 on the CPU.
The CUDA path's Triton kernels run these tests too, in the Triton interpreter:
    TRITON_INTERPRET=1 NANOVLLM_LORA_TRITON=1 pytest tests/test_lora.py"""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conftest import as_prompts, hf_greedy, log_lines, make_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.layers.moe import is_moe_layer
from nanovllm.lora.adapter import (ATTENTION_TARGETS, MLP_TARGETS, MODEL_TARGETS, layer_targets, peft_names,
                                   projection_shapes, read_adapter, save_adapter, target_shape)
from nanovllm.lora.request import LoRARequest

ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = dict(dtype="float32", block_size=16, num_kvcache_blocks=128, max_num_batched_tokens=64)
PROMPTS = make_prompts(num=12)[4:12]   # 17-150 tokens; the last four share a 70-token prefix in pairs and triples


def save_with_merged(path, model_dir: str, tensors: dict, weights: dict, rank: int, alpha: int, targets,
                     **config) -> tuple[str, str]:
    """The adapter's tensors into path/adapter (PEFT's files), and path/merged: model_dir's checkpoint with the
    merged weights."""
    adapter, merged = path / "adapter", path / "merged"
    save_adapter(str(adapter), tensors, rank, alpha, targets, **config)
    shutil.copytree(model_dir, merged)
    save_file(weights, f"{merged}/model.safetensors", metadata={"format": "pt"})
    return str(adapter), str(merged)


def write_adapter(path, model_dir: str, targets=ALL_TARGETS, rank: int = 8, alpha: int = 16, seed: int = 1,
                  use_rslora: bool = False, **config) -> tuple[str, str]:
    """A random PEFT adapter in path/adapter, and path/merged: the base checkpoint with it merged in (its LM head
    untied from the embedding where the adapter has either). An MLP target of a mixture-of-experts layer adapts
    that projection of every expert and of the shared expert."""
    hf = AutoConfig.from_pretrained(model_dir)
    shapes = projection_shapes(hf)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    g = torch.Generator().manual_seed(seed)
    weights = load_file(f"{model_dir}/model.safetensors")
    untie = hf.tie_word_embeddings and any(t in MODEL_TARGETS for t in targets)
    if untie:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    tensors = {}
    layers = [(layer, target) for layer in range(hf.num_hidden_layers) for target in layer_targets(hf, layer)
              if target.rsplit(".", 1)[-1] in targets]
    for layer, target in layers + [(None, t) for t in MODEL_TARGETS if t in targets]:
        in_features, out_features = target_shape(shapes, target)
        a = torch.randn(rank, in_features, generator=g) * 0.1
        b = torch.randn(out_features, rank, generator=g) * 0.1
        a_name, b_name = peft_names(layer, target)
        tensors[a_name], tensors[b_name] = a, b
        if target == "embed_tokens":   # (the one-hot product is a lookup: A's columns are the tokens')
            weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] + scaling * (b @ a).t()
        else:
            name = a_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            weights[f"{name}.weight"] = weights[f"{name}.weight"] + scaling * b @ a
    adapter, merged = save_with_merged(path, model_dir, tensors, weights, rank, alpha, targets, use_rslora=use_rslora,
                                       **config)
    if untie:
        merged_config = json.loads((path / "merged" / "config.json").read_text())
        (path / "merged" / "config.json").write_text(json.dumps(merged_config | {"tie_word_embeddings": False}))
    return adapter, merged


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory):
    """Two adapters of the tiny Qwen3 (its LM head tied to the embedding): every projection, the embedding and
    the LM head at rank 8, and q/v only at rank 4 with rsLoRA."""
    first = write_adapter(tmp_path_factory.mktemp("lora_a"), qwen3_dir, targets=ALL_TARGETS + MODEL_TARGETS)
    second = write_adapter(tmp_path_factory.mktemp("lora_b"), qwen3_dir, targets=("q_proj", "v_proj"), rank=4,
                           seed=2, use_rslora=True)
    return first, second


@pytest.fixture(scope="module")
def references(qwen3_dir, adapters):
    """Greedy tokens of PROMPTS: base model, first adapter merged, second merged."""
    return [hf_greedy(path, PROMPTS, GREEDY.max_tokens) for path in (qwen3_dir, adapters[0][1], adapters[1][1])]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_mixed_in_a_batch_match_merged_weights(qwen3_dir, adapters, references, max_loras):
    """Each prompt with its own adapter or none, in one generate(): every completion is that of HF with its
    adapter merged. With max_loras=1 the scheduler runs one adapter's requests at a time."""
    base, first, second = references
    assert first != base and second != base and first != second     # (the adapters change the tokens)
    a, b = LoRARequest("a", 1, adapters[0][0]), LoRARequest("b", 2, adapters[1][0])
    plan = [a, None, b, a, b, None, a, b]
    with LLM(qwen3_dir, enable_lora=True, max_loras=max_loras, max_lora_rank=8, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False, lora_request=plan)
        expected = [{None: base, a: first, b: second}[lora][i] for i, lora in enumerate(plan)]
        assert tokens(outputs) == expected
        assert [o.lora_request for o in outputs] == plan
        assert [o.outputs[0].lora_request for o in outputs] == plan
        # one adapter for every prompt; then none: the base model again
        assert tokens(llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False, lora_request=b)) == second
        assert tokens(llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False)) == base
        assert llm.llm_engine.list_loras() == ({1, 2} if max_loras == 2 else {2})   # (max_cpu_loras: max_loras)


def test_prompt_and_sampled_logprobs_with_an_adapter_on_the_lm_head(qwen3_dir, adapters):
    """Prompt logprobs (the LM head over a step's prompt rows) and sampled logprobs (its logits rows) of an
    adapter on the embedding and the LM head, beside requests without one: the merged checkpoint's."""
    adapter, merged = adapters[0]
    a = LoRARequest("a", 1, adapter)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    def logprobs(outputs):   # each output's [(token, logprob)] of every prompt and sampled position
        return [[sorted((t, p.logprob) for t, p in entry.items())
                 for entry in out.prompt_logprobs[1:] + out.outputs[0].logprobs] for out in outputs]

    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        got = logprobs(llm.generate(as_prompts(PROMPTS[:4]), params, use_tqdm=False, lora_request=[a, None, a, None]))
    with LLM(merged, **SMALL) as llm:
        adapted = logprobs(llm.generate(as_prompts(PROMPTS[:4]), params, use_tqdm=False))
    with LLM(qwen3_dir, **SMALL) as llm:
        plain = logprobs(llm.generate(as_prompts(PROMPTS[:4]), params, use_tqdm=False))
    expected = [adapted[0], plain[1], adapted[2], plain[3]]
    assert [[[t for t, _ in e] for e in out] for out in got] == [[[t for t, _ in e] for e in out] for out in expected]
    torch.testing.assert_close(torch.tensor([p for out in got for e in out for _, p in e]),
                               torch.tensor([p for out in expected for e in out for _, p in e]), atol=1e-4, rtol=0)
    assert adapted[0][0] != plain[0][0]


def test_prefix_cache_keeps_each_adapter_to_its_own_blocks(qwen3_dir, adapters, references):
    """The same prompt without an adapter, then with one: no cache hit across them (the K/V differ), hits
    within one adapter."""
    base, first, _ = references
    a = LoRARequest("a", 1, adapters[0][0])
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        prompt = as_prompts(PROMPTS[3:4])    # 150 tokens: 9 full blocks
        plain = llm.generate(prompt, GREEDY, use_tqdm=False)
        adapted = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)
        again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)
    assert tokens(plain) == base[3:4] and tokens(adapted) == tokens(again) == first[3:4]
    assert (plain[0].num_cached_tokens, adapted[0].num_cached_tokens, again[0].num_cached_tokens) == (0, 0, 144)


@pytest.mark.parametrize("variant", ["preemption", "ngram"])
def test_adapters_under_preemption_and_ngram_drafts(qwen3_dir, adapters, references, variant):
    """A KV cache too small for the batch (sequences preempted and recomputed with their adapters), and n-gram
    drafts (each draft row computed with its sequence's adapter): still the merged models' tokens."""
    base, first, second = references
    a, b = LoRARequest("a", 1, adapters[0][0]), LoRARequest("b", 2, adapters[1][0])
    plan = [a, b, None, b, a, None, b, a]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    settings = (dict(num_kvcache_blocks=14) if variant == "preemption"
                else dict(disable_log_stats=False, speculative_config=ngram))
    with LLM(qwen3_dir, enable_lora=True, max_loras=2, max_lora_rank=8, **(SMALL | settings)) as llm:
        outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False, lora_request=plan)
        if variant == "preemption":
            assert llm.llm_engine.scheduler.num_preemptions > 0
        else:
            drafts = next(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
            assert drafts > 0
    assert tokens(outputs) == [{None: base, a: first, b: second}[lora][i] for i, lora in enumerate(plan)]


def test_tp2_with_adapters_matches_merged_weights(qwen3_dir, adapters, references):
    """Tensor parallelism (two gloo ranks): each rank adds its shard's part of the adapters' products."""
    base, first, second = references
    a, b = LoRARequest("a", 1, adapters[0][0]), LoRARequest("b", 2, adapters[1][0])
    plan = [b, a, None, a, b, a, None, b]
    with LLM(qwen3_dir, enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False, lora_request=plan)
    assert tokens(outputs) == [{None: base, a: first, b: second}[lora][i] for i, lora in enumerate(plan)]


def test_llama_adapter_with_attention_biases(llama_dir, tmp_path):
    """Llama's q/k/v/o carry biases; the adapter's products add to them."""
    adapter, merged = write_adapter(tmp_path, llama_dir, rank=8)
    with LLM(llama_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS[:4]), GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("a", 3, adapter))
    assert tokens(outputs) == hf_greedy(merged, PROMPTS[:4], GREEDY.max_tokens)


def write_fused_experts_adapter(path, model_dir: str, rank: int = 4, alpha: int = 12,
                                seed: int = 3) -> tuple[str, str]:
    """A random adapter as PEFT saves one trained on transformers v5's fused experts (LoraConfig.target_parameters
    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]: one pair a fused parameter, down_proj's under the experts
    module's name, gate_up_proj's under its base_layer), and path/merged: the checkpoint with expert e's delta
    scaling * B[:, e::experts] @ A[e r: e r + r] merged into its gate and up rows and its down projection."""
    hf = AutoConfig.from_pretrained(model_dir)
    num_experts, hidden, inter = hf.num_experts, hf.hidden_size, hf.moe_intermediate_size
    g = torch.Generator().manual_seed(seed)
    weights, tensors = load_file(f"{model_dir}/model.safetensors"), {}
    for layer in [layer for layer in range(hf.num_hidden_layers) if is_moe_layer(hf, layer)]:
        for nesting, parts, in_features, out_features in (("base_layer.", ("gate_proj", "up_proj"), hidden, 2 * inter),
                                                          ("", ("down_proj",), inter, hidden)):
            a = torch.randn(rank * num_experts, in_features, generator=g) * 0.1
            b = torch.randn(out_features, rank * num_experts, generator=g) * 0.1
            name = f"base_model.model.model.layers.{layer}.mlp.experts.{nesting}lora_"
            tensors[f"{name}A.weight"], tensors[f"{name}B.weight"] = a, b
            for e in range(num_experts):
                delta = alpha / rank * b[:, e::num_experts] @ a[e * rank:(e + 1) * rank]
                for part, rows in zip(parts, delta.chunk(len(parts))):
                    weights[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] += rows
    return save_with_merged(path, model_dir, tensors, weights, rank, alpha, [],
                            target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])


def test_fused_experts_adapter_matches_the_merged_model(qwen3_moe_dir, tmp_path):
    """An adapter trained on transformers v5's fused experts (PEFT's target_parameters) runs as its per-expert
    pairs: the merged weights' tokens (test_fused_experts_layout_is_peft_s checks the layout against PEFT itself).
    A pair of neither fused parameter's shapes, the experts adapted in both forms, or a pair on a dense layer is a
    ValueError."""
    adapter, merged = write_fused_experts_adapter(tmp_path / "fused", qwen3_moe_dir)
    with LLM(qwen3_moe_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS[:4]), GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("fused", 1, adapter))
        tensors = load_file(f"{adapter}/adapter_model.safetensors")
        name = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
        bad = tmp_path / "bad"
        shutil.copytree(adapter, bad)
        save_file(tensors | {name: tensors[name][:, :16].contiguous()}, f"{bad}/adapter_model.safetensors")
        with pytest.raises(ValueError, match=r"layer 0's fused experts pair \(mlp.experts.lora_A / lora_B\) has "
                                             r"shapes \(16, 16\) and \(64, 16\)"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 2, str(bad)))
        twice = "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_"
        save_file(tensors | {f"{twice}A.weight": torch.zeros(4, 32), f"{twice}B.weight": torch.zeros(64, 4)},
                  f"{bad}/adapter_model.safetensors")
        with pytest.raises(ValueError, match="layer 0's experts are adapted twice"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("two", 3, str(bad)))
        dense = {name.replace("layers.0.", "layers.1."): tensor for name, tensor in tensors.items()}   # (a dense MLP)
        save_file(dense, f"{bad}/adapter_model.safetensors")
        with pytest.raises(ValueError, match="layer 1 of the base model is not a mixture of experts"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("one", 4, str(bad)))
    assert tokens(outputs) == hf_greedy(merged, PROMPTS[:4], GREEDY.max_tokens)


def write_stacked_experts_adapter(path, model_dir: str, rank: int = 4, alpha: int = 8,
                                  seed: int = 4) -> tuple[str, str]:
    """A random adapter in vLLM's shared-outer layout (its enable_moe_shared_loras): per MoE layer
    mlp.experts.w1 (gate), w3 (up) and w2 (down), each an A [experts, r, in] and a B [experts, out, r] stack, where
    gate's and up's A and down's B have one entry that every expert shares; and path/merged: the checkpoint with
    expert e's scaling * B[e] @ A[e or 0] merged in."""
    hf = AutoConfig.from_pretrained(model_dir)
    num_experts, hidden, inter = hf.num_experts, hf.hidden_size, hf.moe_intermediate_size
    g = torch.Generator().manual_seed(seed)
    weights, tensors = load_file(f"{model_dir}/model.safetensors"), {}
    for layer in [layer for layer in range(hf.num_hidden_layers) if is_moe_layer(hf, layer)]:
        for stack, part, a_entries, b_entries, in_features, out_features in (
                ("w1", "gate_proj", 1, num_experts, hidden, inter), ("w3", "up_proj", 1, num_experts, hidden, inter),
                ("w2", "down_proj", num_experts, 1, inter, hidden)):
            a = torch.randn(a_entries, rank, in_features, generator=g) * 0.1
            b = torch.randn(b_entries, out_features, rank, generator=g) * 0.1
            name = f"base_model.model.model.layers.{layer}.mlp.experts.{stack}.lora_"
            tensors[f"{name}A.weight"], tensors[f"{name}B.weight"] = a, b
            for e in range(num_experts):
                weights[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] += (
                    alpha / rank * b[e % b_entries] @ a[e % a_entries])
    return save_with_merged(path, model_dir, tensors, weights, rank, alpha, ["experts.w1", "experts.w2", "experts.w3"])


def test_every_moe_adapter_layout_runs_in_one_engine(qwen3_moe_dir, tmp_path):
    """vLLM's shared-outer layout (stacked experts, some factors shared), the fused experts' pairs and the base
    model mixed in a batch: each its merged weights' tokens. vLLM's enable_mixed_moe_lora_format and
    enable_moe_shared_loras are accepted (every layout is read whatever they are), and so is a LoRARequest's
    is_3d_lora_weight. A stack of other shapes, or missing a half, is a ValueError naming it."""
    stacked, stacked_merged = write_stacked_experts_adapter(tmp_path / "stacked", qwen3_moe_dir)
    fused, fused_merged = write_fused_experts_adapter(tmp_path / "fused", qwen3_moe_dir)
    requests = [LoRARequest("stacked", 1, stacked), LoRARequest("fused", 2, fused, is_3d_lora_weight=True), None]
    with LLM(qwen3_moe_dir, enable_lora=True, max_lora_rank=8, max_loras=2, enable_mixed_moe_lora_format=True,
             enable_moe_shared_loras=True, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS[:6]), GREEDY, use_tqdm=False,
                               lora_request=[requests[i % 3] for i in range(6)])
        tensors = load_file(f"{stacked}/adapter_model.safetensors")
        name = "base_model.model.model.layers.0.mlp.experts.w2.lora_B.weight"
        bad = tmp_path / "bad"
        shutil.copytree(stacked, bad)
        save_file(tensors | {name: torch.zeros(2, 64, 4)}, f"{bad}/adapter_model.safetensors")
        with pytest.raises(ValueError, match=r"layer 0's stacked experts pair mlp.experts.w2 \(lora_A / lora_B\) "
                                             r"has shapes \(4, 4, 32\) and \(2, 64, 4\); at r=4 a down_proj's are "
                                             r"\(4 or 1, 4, 32\) and \(4 or 1, 64, 4\)"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 3, str(bad)))
        save_file({k: v for k, v in tensors.items() if k != name}, f"{bad}/adapter_model.safetensors")
        with pytest.raises(ValueError, match=r"mlp.experts.w2 \(lora_A / lora_B\) has no lora_B tensor"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("half", 4, str(bad)))
    for i, path in enumerate((stacked_merged, fused_merged, qwen3_moe_dir)):
        assert tokens(outputs)[i::3] == hf_greedy(path, PROMPTS[i:6:3], GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_fused_experts_layout_is_peft_s(arch, request, tmp_path):
    """With PEFT installed (not a test dependency; skipped without it): an adapter PEFT saves from transformers v5's
    fused experts (random, not zero-initialised) reads into per-expert pairs whose deltas are PEFT's own
    get_delta_weight, expert by expert, for gate_up_proj and down_proj (PEFT 0.22: equal to float32 rounding)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    model_dir = request.getfixturevalue(f"{arch}_dir")
    hf = AutoConfig.from_pretrained(model_dir)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    model.save_pretrained(tmp_path)
    adapter = read_adapter(LoRARequest("peft", 1, str(tmp_path)), hf, 8, str(tmp_path))
    experts = model.base_model.model.model.layers[0].mlp.experts
    deltas = {w.parameter_name: w.get_delta_weight("default") for w in (experts, experts.base_layer)}
    for e in range(hf.num_experts):
        pairs = [adapter.weights[0, f"experts.{e}.{target}"] for target in MLP_TARGETS]
        gate_up, down = torch.cat([b @ a for a, b in pairs[:2]]), pairs[2][1] @ pairs[2][0]
        torch.testing.assert_close(adapter.scaling * gate_up, deltas["gate_up_proj"][e], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(adapter.scaling * down, deltas["down_proj"][e], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 1), ("qwen2_moe", 1), ("qwen2_moe", 2)])
def test_moe_model_adapts_its_experts(arch, tp, request, tmp_path):
    """A mixture-of-experts model: an adapter on every expert's projections (and, in Qwen2-MoE, the shared
    expert's) beside the attention's matches the merged weights, mixed in a batch with an attention-only one
    and the base model, also with two tensor-parallel ranks (each adds its shard's part). A plain MLP target on
    an MoE layer (layer 0; layer 1 of Qwen3-MoE's is dense), or an expert the layer does not have, is a
    ValueError naming the tensor."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    experts = write_adapter(tmp_path / "experts", model_dir)
    attention = write_adapter(tmp_path / "attention", model_dir, targets=ATTENTION_TARGETS, rank=4, seed=2)
    mlp = tmp_path / "mlp"
    shutil.copytree(attention[0], mlp)
    name = "base_model.model.model.layers.0.mlp.gate_proj"
    save_file(load_file(f"{attention[0]}/adapter_model.safetensors") | {f"{name}.lora_A.weight": torch.zeros(4, 64),
                                                                      f"{name}.lora_B.weight": torch.zeros(128, 4)},
              f"{mlp}/adapter_model.safetensors")
    requests = [LoRARequest("experts", 1, experts[0]), LoRARequest("attention", 2, attention[0]), None]
    with LLM(model_dir, enable_lora=True, max_lora_rank=8, max_loras=2, tensor_parallel_size=tp, **SMALL) as llm:
        outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False,
                               lora_request=[requests[i % 3] for i in range(len(PROMPTS))])
        with pytest.raises(ValueError, match="layer 0's MLP is a mixture of experts; name its experts"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 3, str(mlp)))
        name = "base_model.model.model.layers.0.mlp.experts.4.up_proj.lora_B.weight"   # (experts 0-3)
        save_file(load_file(f"{attention[0]}/adapter_model.safetensors") | {name: torch.zeros(32, 4)},
                  f"{mlp}/adapter_model.safetensors")
        with pytest.raises(ValueError, match=f"tensor '{name}' names no projection of the base model"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp4", 4, str(mlp)))
    for i, path in enumerate((experts[1], attention[1], model_dir)):
        assert tokens(outputs)[i::3] == hf_greedy(path, PROMPTS[i::3], GREEDY.max_tokens)


def test_lora_target_modules_adapt_only_those_modules(qwen3_dir, adapters, references, tmp_path):
    """lora_target_modules=["qkv_proj", "o_proj"] (vLLM's): only attention takes adapters (no LoRA layers
    elsewhere), an adapter on every module runs as its attention weights alone (a warning names what is left
    out), one with none of those modules is a ValueError, and a module name not of LORA_MODULES too."""
    full = adapters[0][0]
    attention = tmp_path / "attention"
    shutil.copytree(full, attention)
    tensors = load_file(f"{full}/adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "self_attn" in k}, f"{attention}/adapter_model.safetensors")
    mlp = tmp_path / "mlp"
    shutil.copytree(full, mlp)
    save_file({k: v for k, v in tensors.items() if ".mlp." in k}, f"{mlp}/adapter_model.safetensors")
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        expected = tokens(llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False,
                                       lora_request=LoRARequest("attention", 1, str(attention))))
    assert expected != references[0] and expected != references[1]
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["qkv_proj", "o_proj"], **SMALL) as llm:
        layer = llm.llm_engine.model_runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.lora is not None and layer.mlp.gate_up_proj.lora is None
        with log_lines("nanovllm.lora.adapter") as lines:
            outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False,
                                   lora_request=LoRARequest("full", 1, full))
        assert any("weights for down_proj, embed_tokens, gate_up_proj, lm_head are left out" in line for line in lines)
        assert tokens(outputs) == expected
        with pytest.raises(ValueError, match=r"adapts down_proj, gate_up_proj, none of the modules this engine adapts "
                                             r"\(qkv_proj, o_proj\)"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 2, str(mlp)))
        assert tokens(llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False)) == references[0]
    with pytest.raises(ValueError, match="lora_target_modules must be a non-empty list of qkv_proj, o_proj"):
        LLM(qwen3_dir, enable_lora=True, lora_target_modules=["q_proj"], **SMALL)


def test_adapter_management(qwen3_dir, adapters, references):
    """vLLM's add_lora / list_loras / pin_lora / remove_lora; max_cpu_loras keeps that many read."""
    a, b = LoRARequest("a", 1, adapters[0][0]), LoRARequest("b", 2, adapters[1][0])
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        engine = llm.llm_engine
        assert engine.add_lora(a) and engine.list_loras() == {1}
        assert engine.pin_lora(1)
        assert engine.add_lora(b) and engine.list_loras() == {1, 2}   # (a pinned: kept beyond max_cpu_loras 1)
        assert engine.remove_lora(1) and not engine.remove_lora(1) and engine.list_loras() == {2}
        with pytest.raises(ValueError, match="LoRA adapter 7 is not known"):
            engine.pin_lora(7)
        # an id is one adapter
        with pytest.raises(ValueError, match="lora_int_id 2 is adapter 'b'"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("c", 2, adapters[0][0]))
        outputs = llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False, lora_request=a)
        assert tokens(outputs) == references[1]
        # removed while its requests run: they read it again and go on with it
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=a)
        finished = {o.request_id: o for o in engine.step() if o.finished}
        assert engine.remove_lora(1) and engine.list_loras() == set()   # (b gave way to a: max_cpu_loras 1)
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        assert [finished[str(i)].outputs[0].token_ids for i in range(3)] == references[1][:3]


def test_bad_adapters_are_value_errors_and_the_engine_goes_on(qwen3_dir, adapters, references, tmp_path):
    """Each names the adapter and what is wrong; nothing is added, and the next call runs."""
    path = adapters[0][0]
    config = json.loads(open(f"{path}/adapter_config.json").read())

    def variant(name, config_changes=None, drop=None, extra=None):
        target = tmp_path / name
        shutil.copytree(path, target)
        (target / "adapter_config.json").write_text(json.dumps(config | (config_changes or {})))
        tensors = load_file(f"{path}/adapter_model.safetensors")
        for key in [k for k in tensors if drop and drop in k]:
            del tensors[key]
        save_file(tensors | (extra or {}), f"{target}/adapter_model.safetensors")
        return str(target)

    cases = [
        (LoRARequest("big", 5, path), "LoRA rank 8 is greater than max_lora_rank 1"),
        (LoRARequest("none", 5, str(tmp_path / "missing")), "lora_path must be a local directory or a Hugging Face"),
        (LoRARequest("dora", 5, variant("dora", {"use_dora": True})), "use_dora=True is not supported"),
        (LoRARequest("save", 5, variant("save", {"modules_to_save": ["lm_head"]})), "modules_to_save"),
        (LoRARequest("half", 5, variant("half", drop="layers.1.mlp.down_proj.lora_B")),
         "layer 1 down_proj has no lora_B tensor"),
        (LoRARequest("head", 5, variant("head", drop="lm_head.lora_B")), "lm_head has no lora_B tensor"),
        (LoRARequest("embedding", 5, variant("embedding", drop="lora_embedding_A")),
         "embed_tokens has no lora_embedding_A tensor"),
        (LoRARequest("norm", 5, variant("norm", extra={
            "base_model.model.model.norm.lora_A.weight": torch.zeros(8, 64)})),
         "tensor 'base_model.model.model.norm.lora_A.weight' is not a LoRA A or B matrix"),
        (LoRARequest("vocab", 5, variant("vocab", extra={
            "base_model.model.lm_head.lora_B.weight": torch.zeros(1000, 8)})),
         r"lm_head.lora_B.weight' has shape \(1000, 8\), expected \(\d+, 8\)"),
        (LoRARequest("expert", 5, variant("expert", extra={
            "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(8, 64)})),
         r"tensor '.*layers.0.mlp.experts.0.gate_proj.lora_A.weight' names no projection of the base model"),
        (LoRARequest("block", 5, variant("block", extra={
            "base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight": torch.zeros(8, 64)})),
         "self_attn.gate_proj.lora_A.weight' names no projection of the base model"),
        (LoRARequest("shape", 5, variant("shape", extra={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 65)})),
         r"has shape \(8, 65\), expected \(8, 64\)"),
    ]
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=1, **SMALL) as llm:
        for request, message in cases[:1]:
            with pytest.raises(ValueError, match=message):
                llm.generate(as_prompts(PROMPTS[:2]), GREEDY, use_tqdm=False, lora_request=request)
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        for request, message in cases[1:]:
            with pytest.raises(ValueError, match=message):
                llm.generate(as_prompts(PROMPTS[:2]), GREEDY, use_tqdm=False, lora_request=request)
        with pytest.raises(ValueError, match=r"one per prompt \(2\), got a list of 1"):
            llm.generate(as_prompts(PROMPTS[:2]), GREEDY, use_tqdm=False, lora_request=[None])
        assert not llm.llm_engine.has_unfinished_requests()
        assert tokens(llm.generate(as_prompts(PROMPTS), GREEDY, use_tqdm=False)) == references[0]
    with LLM(qwen3_dir, **SMALL) as llm:
        with pytest.raises(ValueError, match="lora_request 'a': LoRA is not enabled"):
            llm.generate(as_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, path))
    with pytest.raises(ValueError, match="lora_int_id must be > 0, got 0"):
        LoRARequest("a", 0, path)
    for kwargs, message in [(dict(max_lora_rank=12), "max_lora_rank must be one of"),
                            (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
                            (dict(max_loras=0), "max_loras must be a positive integer"),
                            (dict(lora_dtype="int8"), "lora_dtype must be 'auto', 'float16' or 'bfloat16'"),
                            (dict(lora_dtype="float16"), "lora_dtype 'float16' must be 'auto' or the model's dtype")]:
        with pytest.raises(ValueError, match=message):
            LLM(qwen3_dir, enable_lora=True, **SMALL, **kwargs)


def test_beam_search_and_embeddings_with_an_adapter_match_the_merged_model(qwen3_dir, adapters):
    """beam_search and a pooling model's embed take lora_request too: the results of an engine that loads the
    checkpoint with the adapter merged in (a pooling model leaves the adapter's LM-head weights out, with a
    warning)."""
    from nanovllm import BeamSearchParams
    adapter, merged = adapters[0]
    a = LoRARequest("a", 1, adapter)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with LLM(qwen3_dir, enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        beams = llm.beam_search(as_prompts(PROMPTS[:2]), params, lora_request=a)
        with pytest.raises(ValueError, match="beam_search takes one lora_request for all its prompts"):
            llm.beam_search(as_prompts(PROMPTS[:2]), params, lora_request=[a, a])
    with LLM(merged, **SMALL) as llm:
        expected = llm.beam_search(as_prompts(PROMPTS[:2]), params)
    assert [[s.tokens for s in b.sequences] for b in beams] == [[s.tokens for s in b.sequences] for b in expected]
    with LLM(qwen3_dir, runner="pooling", enable_lora=True, max_lora_rank=8, **SMALL) as llm:
        with log_lines("nanovllm.lora.adapter") as lines:   # (no LM head to adapt)
            got = llm.embed(as_prompts(PROMPTS), use_tqdm=False, lora_request=[a, None] * 4)
    assert any("its weights for lm_head are left out (this engine adapts qkv_proj, o_proj, gate_up_proj, down_proj, "
               "experts, embed_tokens)" in line for line in lines)
    with pytest.raises(ValueError, match=r"lora_target_modules \['lm_head'\]: a pooling model"):
        LLM(qwen3_dir, runner="pooling", enable_lora=True, lora_target_modules=["lm_head"], **SMALL)
    with LLM(merged, runner="pooling", **SMALL) as llm:
        adapted = llm.embed(as_prompts(PROMPTS), use_tqdm=False)
    with LLM(qwen3_dir, runner="pooling", **SMALL) as llm:
        plain = llm.embed(as_prompts(PROMPTS), use_tqdm=False)
    for i, out in enumerate(got):
        expected = (adapted if i % 2 == 0 else plain)[i].outputs.embedding
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.tensor(expected), atol=2e-6, rtol=0)


def test_lm_head_adapter_takes_each_ranks_shard_of_the_vocabulary():
    """With the vocabulary split over 3 ranks (10 tokens: shards of 4, the last one padded by 2), each rank's
    LoRAHead holds its tokens' columns of scaling * B.T, zero in the padding; slot 1 holds nothing."""
    from nanovllm.distributed import TPGroup
    from nanovllm.layers.embed_head import ParallelLMHead
    from nanovllm.lora.adapter import LoRAAdapter
    from nanovllm.lora.layers import LoRAHead, LoRASlots
    b = torch.arange(30.0).view(10, 3)        # [vocab, rank]
    adapter = LoRAAdapter(LoRARequest("a", 1, "."), 3, 0.5, {(None, "lm_head"): (torch.ones(3, 8), b)})
    slots = LoRASlots(2, 4, torch.float32, torch.device("cpu"))
    for rank, tokens in enumerate([range(0, 4), range(4, 8), range(8, 10)]):
        head = LoRAHead(slots, ParallelLMHead(10, 8, TPGroup(rank=rank, size=3)), max_rank=4)
        head.load(0, adapter)
        expected = torch.zeros(4, 4)
        expected[:3, :len(tokens)] = 0.5 * b[list(tokens)].T
        assert torch.equal(head.b[0], expected) and not head.b[1].any() and head.holding == {0}


def test_the_kernels_tokens_are_sorted_by_slot_and_padded_with_none():
    """On the Triton path a step's tokens go to the kernels as (slot, row) pairs sorted by slot; past the step's
    tokens every pair is (-1, row) and every token's slot -1, also where a larger step wrote before (a CUDA graph's
    padding rows) and after an odd number of tokens (whose upload ends inside a 16-byte unit)."""
    import numpy as np
    from nanovllm.lora.layers import LoRASlots
    slots = LoRASlots(2, 16, torch.float32, torch.device("cpu"))
    slots.fused = True   # (the buffer the kernels read, written as on CUDA)
    slots.set_tokens(np.array([1, 0, -1, 1, 0, 1]))
    assert slots.tokens.tolist() == [[-1, 2], [0, 1], [0, 4], [1, 0], [1, 3], [1, 5]] + [[-1, i] for i in range(6, 16)]
    slots.set_tokens(np.array([1, 0]))
    assert slots.tokens.tolist() == [[0, 1], [1, 0]] + [[-1, i] for i in range(2, 16)]
    for step in ([0, -1, 1], [1]):
        slots.set_tokens(np.array(step))
        assert slots.token_slots.tolist() == step + [-1] * (16 - len(step))
        assert slots.tokens[len(step):].tolist() == [[-1, i] for i in range(len(step), 16)]
