"""One mixed workload under every scheduling pressure at once gives the same tokens as with room to
spare: greedy and seeded sampled requests, n > 1, penalties, logprobs, prompt logprobs, shared
prefixes, priorities; a cache small enough to preempt, a token budget small enough to chunk.
Seeded sampling depends only on (seed, output index), so it is compared exactly too; so is a
tensor-parallel run (gloo, float32)."""
import random

import pytest

from nanovllm import LLM, SamplingParams

ROOMY = dict(num_kvcache_blocks=256)
PRESSURE = {
    "preempt_and_chunk": dict(num_kvcache_blocks=20, max_num_batched_tokens=48),
    "priority_preempt": dict(num_kvcache_blocks=20, scheduling_policy="priority"),
    "few_seqs_no_prefix_cache": dict(max_num_seqs=3, enable_prefix_caching=False, max_num_batched_tokens=64),
    "async_preempt_and_chunk": dict(num_kvcache_blocks=20, max_num_batched_tokens=48, async_scheduling=True),
    "tp2_preempt_and_chunk": dict(num_kvcache_blocks=20, max_num_batched_tokens=48, tensor_parallel_size=2),
}


def workload(seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 380) for _ in range(40)]
    prompts, params, priorities = [], [], []
    for i in range(14):
        own = [rng.randrange(3, 380) for _ in range(rng.randint(1, 60))]
        prompts.append(shared + own if i % 3 == 0 else own)
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True, logprobs=2)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_k=30, seed=100 + i, n=2, max_tokens=rng.randint(4, 16),
                               ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(temperature=0, max_tokens=rng.randint(4, 16), ignore_eos=True,
                               repetition_penalty=1.3, presence_penalty=0.5, prompt_logprobs=1)
        else:
            p = SamplingParams(temperature=0.7, top_p=0.9, seed=200 + i, max_tokens=rng.randint(4, 16),
                               ignore_eos=True, min_p=0.02)
        params.append(p)
        priorities.append(rng.randint(0, 3))
    return prompts, params, priorities


def run(model_dir, rounds: int = 1, **kwargs):
    """-> the LLM, and per round and request: its completions' token ids, their logprob token sets
    and the prompt logprob token sets. A second round runs on the warm prefix cache."""
    prompts, params, priorities = workload()
    llm = LLM(model_dir, dtype="float32", block_size=16, **kwargs)
    priority = priorities if kwargs.get("scheduling_policy") == "priority" else None
    results = []
    for _ in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=priority)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks          # nothing leaked
        results.append([
            ([c.token_ids for c in o.outputs],
             [[sorted(d) for d in c.logprobs] if c.logprobs else None for c in o.outputs],
             [None if d is None else sorted(d) for d in o.prompt_logprobs] if o.prompt_logprobs else None)
            for o in outs])
    return llm, results


@pytest.fixture(scope="module")
def roomy(qwen3_dir):
    return run(qwen3_dir, **ROOMY)[1][0]


@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_mixed_workload_is_unchanged_by_scheduling_pressure(qwen3_dir, roomy, pressure):
    llm, rounds = run(qwen3_dir, rounds=2, **PRESSURE[pressure])
    llm.close()                                          # (tensor-parallel workers end here)
    if "num_kvcache_blocks" in PRESSURE[pressure]:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert rounds == [roomy, roomy]
    assert sum(len(c[0]) for c in roomy) == 14 + sum(1 for i in range(14) if i % 4 == 1)   # n=2 gives two
