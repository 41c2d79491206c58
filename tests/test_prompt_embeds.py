"""Prompts given as the model's input vectors (LLM(enable_prompt_embeds=True), {"prompt_embeds": tensor},
vLLM's EmbedsPrompt): greedy tokens equal HF transformers' from the same vectors (inputs_embeds), through chunked
prefill, preemption and the prefix cache, with vLLM's mixed form (some positions token ids), at TP=2 and in a
pooling model; bad inputs are ValueErrors that leave the engine usable."""
import pytest
import torch

from conftest import assert_pooling_idle, hf_greedy, hf_model, make_prompts
from nanovllm import LLM, PoolingParams, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import can_draft
from nanovllm.inputs import PromptEmbeds
from nanovllm.sampling_params import BeamSearchParams

HIDDEN = 64   # conftest's tiny models
# chunked prompts, a cache small enough for preemptions
BUSY = dict(dtype="float32", block_size=16, num_kvcache_blocks=16, max_num_seqs=4, max_num_batched_tokens=48,
            enable_prompt_embeds=True)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_vectors(seed: int, n: int) -> torch.Tensor:
    """n input vectors of the tiny model's width, about as large as its token embeddings (std 0.1)."""
    return 0.1 * torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_greedy_from(model, vectors: torch.Tensor, max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of a prompt given as inputs_embeds (each step recomputes the whole prefix)."""
    x, out = vectors[None], []
    for _ in range(max_new_tokens):
        token = int(model(inputs_embeds=x).logits[0, -1].argmax())
        out.append(token)
        x = torch.cat([x, model.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
    return out


def mixed_vectors(model, ids: list[int], given: list[bool], vectors: torch.Tensor) -> torch.Tensor:
    """vLLM's mixed form as HF's inputs_embeds: a position marked given takes its token's embedding."""
    with torch.no_grad():
        embedded = model.get_input_embeddings()(torch.tensor(ids))
    return torch.where(torch.tensor(given)[:, None], embedded, vectors)


def test_prompt_embeds_match_hf(qwen3_dir):
    """Vector prompts of 1 to 150 positions, a mixed one and token-id prompts in one busy engine (chunked
    prompts, preemptions): each completion is HF's from the same vectors, vector prompts report zeros as their
    ids, and a prompt given as its own token embeddings completes as the ids do."""
    hf = hf_model(qwen3_dir)
    lengths = [1, 7, 40, 150, 33]
    vectors = [random_vectors(seed, n) for seed, n in enumerate(lengths)]
    ids = make_prompts(num=8)
    given = [i % 3 != 0 for i in range(len(ids[6]))]   # mixed: ids 6, every third position a vector
    mixed = random_vectors(9, len(ids[6]))
    with torch.no_grad():
        own = hf.get_input_embeddings()(torch.tensor(ids[7]))   # ids 7 as its token embeddings
    prompts = ([{"prompt_embeds": v} for v in vectors] + [ids[3], ids[5]]
               + [{"prompt_embeds": mixed, "prompt_token_ids": ids[6], "prompt_is_token_ids": given},
                  {"prompt_embeds": own[None]}, ids[7]])   # (a batch of one, as vLLM squeezes it)
    with LLM(qwen3_dir, **BUSY) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    expected = ([hf_greedy_from(hf, v, 12) for v in vectors] + [None, None]
                + [hf_greedy_from(hf, mixed_vectors(hf, ids[6], given, mixed), 12)])
    for output, want in zip(outputs, expected):
        if want is not None:
            assert output.outputs[0].token_ids == want
    for output, v in zip(outputs, vectors):
        assert output.prompt_token_ids == [0] * len(v) and output.prompt is None
    assert outputs[7].prompt_token_ids == ids[6]
    assert outputs[8].outputs[0].token_ids == outputs[9].outputs[0].token_ids


def test_prompt_embeds_in_the_prefix_cache(qwen3_dir):
    """A prompt's full blocks of vectors hit for the same vectors only: their ids are all placeholders, so
    the vectors must be in the blocks' hashes. Each completion stays HF's."""
    hf = hf_model(qwen3_dir)
    first, other = random_vectors(1, 70), random_vectors(2, 70)
    again = torch.cat([first[:64], random_vectors(3, 6)])   # the same 4 full blocks, then other vectors
    with LLM(qwen3_dir, dtype="float32", block_size=16, enable_prompt_embeds=True) as llm:
        outputs = [llm.generate({"prompt_embeds": v}, GREEDY, use_tqdm=False)[0] for v in (first, other, again)]
    assert [output.num_cached_tokens for output in outputs] == [0, 0, 64]
    for output, v in zip(outputs, (first, other, again)):
        assert output.outputs[0].token_ids == hf_greedy_from(hf, v, 12)


def test_prompt_embeds_truncated_as_token_ids(qwen3_dir):
    """truncate_prompt_tokens (SamplingParams' last tokens, or tokenization_kwargs' side) cuts the vectors as it
    cuts ids: the completion is HF's from the kept vectors."""
    hf = hf_model(qwen3_dir)
    v = random_vectors(8, 40)
    last = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=25)
    with LLM(qwen3_dir, dtype="float32", enable_prompt_embeds=True) as llm:
        [by_params] = llm.generate({"prompt_embeds": v}, last, use_tqdm=False)
        [first] = llm.generate({"prompt_embeds": v}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 10,
                                                                    "truncation_side": "right"})
    assert by_params.prompt_token_ids == [0] * 25 and by_params.outputs[0].token_ids == hf_greedy_from(hf, v[15:], 6)
    assert len(first.prompt_token_ids) == 10 and first.outputs[0].token_ids == hf_greedy_from(hf, v[:10], 6)


def test_prompt_embeds_beside_speculative_decoding(qwen3_dir):
    """Drafts come from token ids, which a prompt given as vectors lacks: such a request decodes without drafts
    beside requests that draft, and completes as HF does."""
    hf = hf_model(qwen3_dir)
    v = random_vectors(6, 30)
    ids = make_prompts(num=4)[3]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(qwen3_dir, dtype="float32", enable_prompt_embeds=True, speculative_config=spec,
             disable_log_stats=False) as llm:
        by_vectors, by_ids = llm.generate([{"prompt_embeds": v}, ids * 3], GREEDY, use_tqdm=False)
        assert next(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens") > 0
    assert by_vectors.outputs[0].token_ids == hf_greedy_from(hf, v, 12)
    assert by_ids.outputs[0].token_ids == hf_greedy(qwen3_dir, [ids * 3], 12)[0]
    seq = Sequence("r", 0, [0] * 30, GREEDY)
    assert can_draft(seq)
    seq.prompt_embeds = PromptEmbeds(v)
    assert not can_draft(seq)


def test_prompt_embeds_with_tensor_parallelism(qwen3_dir):
    """At TP=2 every rank takes the step's vectors: the completions are HF's."""
    vectors = [random_vectors(seed, n) for seed, n in ((4, 20), (5, 3))]
    with LLM(qwen3_dir, dtype="float32", enable_prompt_embeds=True, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt_embeds": v} for v in vectors], GREEDY, use_tqdm=False)
    hf = hf_model(qwen3_dir)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy_from(hf, v, 12) for v in vectors]


def test_prompt_embeds_in_a_pooling_model(qwen3_dir):
    """A pooling model takes vector prompts too: a prompt given as its token embeddings pools as its ids do."""
    ids = make_prompts(num=4)[3]
    with torch.no_grad():
        own = hf_model(qwen3_dir).get_input_embeddings()(torch.tensor(ids))
    with LLM(qwen3_dir, runner="pooling", dtype="float32", enable_prompt_embeds=True) as llm:
        by_ids, by_vectors = llm.encode([ids, {"prompt_embeds": own}], PoolingParams(), pooling_task="token_embed",
                                        use_tqdm=False)
        assert by_vectors.prompt_token_ids == [0] * len(ids)
        torch.testing.assert_close(by_vectors.outputs.data, by_ids.outputs.data, rtol=1e-5, atol=1e-5)
        assert_pooling_idle(llm)


def test_bad_prompt_embeds_are_value_errors(qwen3_dir):
    """Each is a ValueError naming what is wrong, nothing is added, and the engine then runs a good request."""
    v = random_vectors(0, 5)
    with LLM(qwen3_dir, dtype="float32") as llm:
        with pytest.raises(ValueError, match="You must set `enable_prompt_embeds=True`"):
            llm.generate({"prompt_embeds": v}, GREEDY, use_tqdm=False)
    with LLM(qwen3_dir, dtype="float32", enable_prompt_embeds=True, max_model_len=64) as llm:
        bad = [({"prompt_embeds": random_vectors(0, 5)[:, :32]}, GREEDY,
                "prompt 1: prompt_embeds has 32 features a row, the model's hidden_size is 64"),
               ({"prompt_embeds": v[0]}, GREEDY,
                r"prompt_embeds must be of shape \(seq_len, hidden_size\), got \(64,\)"),
               ({"prompt_embeds": v.long()}, GREEDY, "prompt_embeds must be floating point, got torch.int64"),
               ({"prompt_embeds": v.tolist()}, GREEDY, "prompt_embeds must be a torch.Tensor, got list"),
               ({"prompt_embeds": v, "prompt_token_ids": [1] * 5}, GREEDY, "give both or neither"),
               ({"prompt_embeds": v, "prompt_token_ids": [1] * 4, "prompt_is_token_ids": [True] * 4}, GREEDY,
                r"prompt_token_ids \(4\), prompt_is_token_ids \(4\) and prompt_embeds \(5 rows\)"),
               ({"prompt_embeds": random_vectors(0, 64)}, GREEDY, "prompt 1 .length 64. plus the number of requested"),
               ({"prompt_embeds": v}, SamplingParams(prompt_logprobs=1),
                "prompt_logprobs needs the prompt's token ids")]
        for prompt, params, message in bad:
            with pytest.raises(ValueError, match=message):
                llm.generate([[1, 2], prompt], params, use_tqdm=False)
            assert not llm.llm_engine.requests
        with pytest.raises(ValueError, match="beam_search takes text or token-id prompts, not prompt_embeds"):
            llm.beam_search([{"prompt_embeds": v}], BeamSearchParams(beam_width=2, max_tokens=3))
        [output] = llm.generate({"prompt_embeds": v}, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy_from(hf_model(qwen3_dir), v, 12)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
