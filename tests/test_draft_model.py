"""Speculative decoding with a draft model (vLLM's method "draft_model", engine/draft_model.py): a draft that is
the model itself has every draft accepted (its K/V kept in step through chunked prompts, preemptions and prefix
hits), a draft of its own gives the tokens of HF transformers and of an engine without drafts (greedy and
seeded), and a draft the engine cannot run is a ValueError."""
import json

import pytest

from conftest import build_model_dir, hf_greedy, make_prompts
from nanovllm import LLM, SamplingParams

PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# chunked prompts, a cache small enough for preemptions, the drafts' counters
BUSY = dict(dtype="float32", block_size=16, num_kvcache_blocks=14, max_num_seqs=4, max_num_batched_tokens=48,
            disable_log_stats=False)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, tokenizer):
    """A draft of its own: one layer, other weights, positions up to 128 (the prompts run past it)."""
    return build_model_dir(tmp_path_factory.mktemp("draft"), "qwen3", tokenizer, seed=5, num_hidden_layers=1,
                           max_position_embeddings=128)


def draft_counts(llm) -> tuple[int, int]:
    counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return counts["vllm:spec_decode_num_draft_tokens"], counts["vllm:spec_decode_num_accepted_tokens"]


def generate(llm, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_model_as_its_own_draft_has_every_draft_accepted(qwen3_dir, async_scheduling):
    """The draft's K/V must mirror the sequence's tokens for its drafts to be the model's greedy tokens: every
    draft is accepted, through chunked prompts and preemptions (a preempted sequence's draft K/V goes with its
    blocks), and again on prefix-cache hits (whose draft K/V the draft writes itself)."""
    spec = {"model": qwen3_dir, "num_speculative_tokens": 3}
    longer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # (a preempted sequence gets other blocks back once others took its own: 20 blocks do that here, and
    # without setting num_draft_computed back its drafts then miss)
    engine = BUSY | dict(num_kvcache_blocks=20)
    with LLM(qwen3_dir, speculative_config=spec, async_scheduling=async_scheduling, **engine) as llm:
        assert generate(llm, longer) == hf_greedy(qwen3_dir, PROMPTS, 24)
        drafted, accepted = draft_counts(llm)
        assert llm.llm_engine.scheduler.num_preemptions > 0 and drafted > 200 and accepted == drafted
        hits = llm.llm_engine.scheduler.num_prefix_cache_hits
        assert generate(llm, prompts=PROMPTS[8:]) == hf_greedy(qwen3_dir, PROMPTS[8:], 12)
        assert llm.llm_engine.scheduler.num_prefix_cache_hits > hits
        assert draft_counts(llm)[1] == draft_counts(llm)[0] > drafted
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_a_draft_model_keeps_the_outputs(qwen3_dir, small_draft):
    """A draft of its own (mostly rejected): greedy tokens are HF's, seeded samples those of an engine without
    drafts, and sequences past the draft's 128 positions go on without drafts."""
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(PROMPTS))]
    spec = {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 4}
    with LLM(qwen3_dir, speculative_config=spec, **BUSY) as llm:
        assert generate(llm) == hf_greedy(qwen3_dir, PROMPTS, 12)
        drafted, accepted = draft_counts(llm)
        assert drafted > accepted
        samples = generate(llm, seeded)
    with LLM(qwen3_dir, **BUSY) as plain:
        assert samples == generate(plain, seeded)


def test_a_draft_model_beside_tensor_parallelism(qwen3_dir):
    """At TP=2 the draft runs on the first rank, which sends its drafts with the step: every draft of the model
    as its own draft is accepted, and the tokens are HF's."""
    spec = {"model": qwen3_dir, "num_speculative_tokens": 2}
    with LLM(qwen3_dir, speculative_config=spec, tensor_parallel_size=2, **BUSY) as llm:
        assert generate(llm, prompts=PROMPTS[:6]) == hf_greedy(qwen3_dir, PROMPTS[:6], 12)
        drafted, accepted = draft_counts(llm)
        assert drafted > 30 and accepted == drafted


@pytest.mark.parametrize("engine, message", [
    (dict(draft_tensor_parallel_size=2), "draft_tensor_parallel_size must be 1"),
    (dict(vocab_size=320), "has vocab_size 320, the model 384: a draft model must share the model's vocabulary"),
    (dict(path="/no/such/draft"), "model must be a local directory or a Hugging Face hub id"),
    (dict(quantized="gptq"), r"the checkpoint is quantized \(quant_method 'gptq'\)"),
])
def test_draft_models_the_engine_cannot_run(qwen3_dir, tmp_path, tokenizer, engine, message):
    path = engine.pop("path", qwen3_dir)
    if "vocab_size" in engine:
        path = build_model_dir(tmp_path, "qwen3", tokenizer, vocab_size=engine.pop("vocab_size"))
    if "quantized" in engine:   # (refused as the engine starts, before the model loads)
        path = build_model_dir(tmp_path, "qwen3", tokenizer)
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": engine.pop("quantized")}
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, speculative_config={"model": path, "num_speculative_tokens": 2} | engine)
