"""Greedy tokens equal HF transformers' generate on the same weights, float32 on the CPU,
across prefix caching, preemption and chunked prefill."""
import functools

import pytest
import torch

from conftest import build_model_dir, check_logprobs_close, hf_greedy, make_prompts, tokens_and_tops
from nanovllm import LLM, SamplingParams

MAX_TOKENS = 12
PROMPTS = make_prompts()


@functools.lru_cache
def reference(path):
    return hf_greedy(path, PROMPTS, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

VARIANTS = {
    "prefix_caching": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    # 14 blocks of 16 tokens hold ~2 of the longest requests at once: forces preemption.
    "preemption": dict(num_kvcache_blocks=14),
    # Prompts up to 150 tokens through a 32-token budget: forces chunked prefill.
    "chunked_prefill": dict(max_num_batched_tokens=32),
    # Whole prompts only, at most 200 tokens per step.
    "no_chunked_prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=200, max_model_len=200),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(model_dir, variant, async_scheduling):
    kwargs = dict(dtype="float32", block_size=16, num_kvcache_blocks=256,
                  async_scheduling=async_scheduling) | VARIANTS[variant]
    llm = LLM(model_dir, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == reference(model_dir)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if variant == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks     # nothing leaked

    # A warm second call reuses every full block of every prompt (minus the last token).
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(model_dir)
    cached = [o.num_cached_tokens for o in outs]
    if variant == "no_prefix_caching":
        assert cached == [0] * len(PROMPTS)
    elif variant != "preemption":   # a small cache evicts some prefixes between the calls
        assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]


def test_shared_prefixes_hit_within_one_call(qwen3_dir):
    """Requests sharing a 70-token prefix: once the first is computed, the later ones hit it."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256, max_num_seqs=1)
    prompts = PROMPTS[8:12]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    assert [o.outputs[0].token_ids for o in outs] == reference(qwen3_dir)[8:12]


def test_shared_prefixes_hit_within_one_step(qwen3_dir):
    """Blocks are cached when scheduled: requests admitted in the same step as the first one
    already share its prefix blocks (each layer writes all new K/V before attention reads)."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256)
    prompts = PROMPTS[8:12]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    assert [o.outputs[0].token_ids for o in outs] == reference(qwen3_dir)[8:12]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(qwen3_dir, kv_cache_dtype):
    """An fp8 cache holds the model's K/V rounded to fp8 (exactly, in layer 0, whose K/V do not
    depend on earlier attention), and greedy logprobs stay close to the full-precision cache."""
    kwargs = dict(dtype="float32", block_size=16, num_kvcache_blocks=64)
    full, fp8 = LLM(qwen3_dir, **kwargs), LLM(qwen3_dir, kv_cache_dtype=kv_cache_dtype, **kwargs)
    fp8_dtype = fp8.llm_engine.model_runner.kv_cache.dtype
    assert fp8_dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    results = []
    for llm in (full, fp8):
        llm.llm_engine.model_runner.kv_cache.zero_()
        llm.generate([{"prompt_token_ids": PROMPTS[7]}], GREEDY, use_tqdm=False)   # 150 + 11 tokens stored
        results.append(llm.llm_engine.model_runner.kv_cache[:, 0].clone())
    limit = torch.finfo(fp8_dtype).max
    expected = results[0].clamp(-limit, limit).to(fp8_dtype)
    assert torch.equal(results[1][:, :150 // 16].view(torch.uint8), expected[:, :150 // 16].view(torch.uint8))

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)

    def run(llm):
        return tokens_and_tops(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False))

    full_matches = check_logprobs_close(run(fp8), run(full))   # asserts where the tokens first differ
    if kv_cache_dtype == "fp8":    # e5m2 keeps 2 mantissa bits: this tiny model's near-flat logits flip more
        assert full_matches >= len(PROMPTS) // 2


def test_mistral_within_its_sliding_window(tmp_path, tokenizer):
    """Full attention equals Mistral's sliding-window attention while sequences fit the window;
    beyond it the engine refuses to start rather than compute something else."""
    path = build_model_dir(tmp_path, "mistral", tokenizer, sliding_window=64)
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*set max_model_len <= 64 \\(got 512\\)"):
        LLM(path)
    llm = LLM(path, dtype="float32", block_size=16, num_kvcache_blocks=64, max_model_len=64)
    # vLLM's disable_sliding_window=True: full attention, max_model_len capped at the window
    capped = LLM(path, dtype="float32", block_size=16, num_kvcache_blocks=4, disable_sliding_window=True)
    assert capped.model_config.max_model_len == 64 and capped.model_config.get_sliding_window() == 64
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*\\(got 128\\)"):
        LLM(path, disable_sliding_window=True, max_model_len=128)
    prompts = [p for p in PROMPTS if len(p) + MAX_TOKENS <= 64]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert len(prompts) >= 6 and [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, beta_fast=16,
         beta_slow=2, mscale=1.0, mscale_all_dim=0.5),
    dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
], ids=["yarn", "yarn_mscale", "linear"])
def test_scaled_rope_matches_hf(tmp_path, tokenizer, rope):
    """Qwen3 with YaRN or linear RoPE scaling (prompts past the original context) equals HF; the
    allowed length is vLLM's derived one (original context x factor for YaRN, max_position x factor
    for linear), and the same weights with plain RoPE give other tokens (the scaling is applied)."""
    path = build_model_dir(tmp_path, "qwen3", tokenizer, rope_parameters=rope, max_position_embeddings=256)
    llm = LLM(path, dtype="float32", block_size=16, num_kvcache_blocks=256)
    base = rope.get("original_max_position_embeddings", 256)
    assert llm.llm_engine.config.max_model_len == int(base * rope["factor"])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(path, PROMPTS, MAX_TOKENS)
    plain = LLM(path, dtype="float32", block_size=16, num_kvcache_blocks=256, max_model_len=256,
                hf_overrides={"rope_parameters": dict(rope_type="default", rope_theta=10000.0)})
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != got


def test_rope_scaling_by_its_older_name(qwen3_dir):
    """hf_overrides={"rope_scaling": ...} (the name older configs and scripts use) scales as
    rope_parameters does; a dict override updates the config's dict (rope_theta is kept)."""
    yarn = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64)
    runs = []
    for name in ("rope_scaling", "rope_parameters"):
        overrides = {name: yarn if name == "rope_scaling" else yarn | dict(rope_theta=10000.0)}
        llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256, hf_overrides=overrides)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1] != reference(qwen3_dir)


def test_unsupported_rope_scaling_is_refused(qwen3_dir):
    """By the engine's config, before a tensor-parallel worker is spawned."""
    from nanovllm.config import Config
    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    for make in (Config, LLM):
        with pytest.raises(ValueError, match="rope scaling .*'dynamic'.* is not supported; only the default RoPE "
                                             "and 'llama3', 'yarn', 'linear' are."):
            make(qwen3_dir, hf_overrides={"rope_parameters": rope}, tensor_parallel_size=2)
