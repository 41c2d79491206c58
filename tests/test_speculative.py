"""Speculative decoding by n-gram prompt lookup (engine/speculative.py): the proposer against a
brute-force search, the config's checks as vLLM's, and engines with drafts giving the tokens of
engines without them (and of HF transformers), with drafts both accepted and rejected."""
import random

import pytest

from conftest import hf_greedy, log_lines
from nanovllm import LLM, BeamSearchParams, EngineArgs, LLMEngine, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.speculative import (GAIN_WEIGHT, MIN_GAIN, PROBE_STEPS, NgramProposer, SpeculativeConfig,
                                         accepted_tokens, ngram_drafts)
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.utils.argparse_utils import FlexibleArgumentParser

SETTINGS = dict(dtype="float32", max_model_len=256, disable_log_stats=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repetitive_prompts(num: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random 8-token phrase (drafts to propose), and a one-token prompt."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(3, 384) for _ in range(8)]
        prompts.append(phrase * 4 + phrase[:3])
    return prompts + [[5]]


PROMPTS = repetitive_prompts()


def run(llm, params, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def draft_counts(llm) -> dict:
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def assert_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    return LLM(qwen3_dir, **SETTINGS)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def spec(qwen3_dir, request):
    return LLM(qwen3_dir, speculative_config=NGRAM, async_scheduling=request.param, **SETTINGS)


# ---- the proposer -------------------------------------------------------------------------------------------
def brute_force_drafts(tokens, min_n, max_n, k):
    """The longest n in [min_n, max_n] whose last n tokens occur earlier (ending before the last token):
    the k tokens after its earliest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_drafts_match_a_brute_force_search():
    """Random token lists over a few ids, some of whose 4-byte words overlap others' bytes (256, 65536,
    16777216), so a match across token boundaries would show."""
    rng = random.Random(0)
    ids = [0, 1, 2, 256, 65536, 16777216, 257, 151935]
    found = 0
    for _ in range(3000):
        tokens = [rng.choice(ids[:rng.randint(2, len(ids))]) for _ in range(rng.randint(1, 30))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        expected = brute_force_drafts(tokens, min_n, max_n, k)
        assert ngram_drafts(tokens, min_n, max_n, k) == expected, (tokens, min_n, max_n, k)
        found += bool(expected)
    assert 500 < found < 2900   # both outcomes exercised


def test_ngram_drafts_examples():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 1, 3, 2) == [9, 1]   # "2 3": its earliest occurrence
    assert ngram_drafts([4, 2, 3, 5, 1, 2, 3], 1, 3, 3) == [5, 1, 2]        # "2 3" (no earlier "1 2 3")
    assert ngram_drafts([1, 2, 3, 4, 5, 6, 3], 2, 3, 2) == []                # "6 3" never occurs before
    assert ngram_drafts([7, 7, 7], 1, 2, 5) == [7]                          # the occurrence may overlap the suffix
    assert ngram_drafts([1, 256], 1, 1, 3) == []                            # 256's bytes hold 1's, off a word boundary
    assert ngram_drafts([5], 1, 1, 3) == []


def test_accepted_tokens():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]   # all drafts, then the last row's token
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]         # the first mismatch ends it
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]


# ---- configuration -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, lookup", [
    ({"method": "ngram", "num_speculative_tokens": 3}, (5, 5)),               # vLLM's defaults
    ({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, (4, 4)),
    ({"method": "ngram", "num-speculative-tokens": 3, "prompt_lookup_min": 2}, (2, 2)),
    (SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3), (1, 3)),
])
def test_speculative_config_forms(value, lookup):
    config = SpeculativeConfig.from_engine_args(value)
    assert (config.method, config.model) == ("ngram", "ngram")
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == lookup


def test_speculative_config_from_vllm_flags():
    config = SpeculativeConfig.from_engine_args(None, spec_method="ngram", spec_tokens=3)
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    config = SpeculativeConfig.from_engine_args({"prompt_lookup_max": 2}, spec_model="[ngram]", spec_tokens=1)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min) == ("ngram", 1, 2)
    assert SpeculativeConfig.from_engine_args(None) is None


def test_drafts_per_batch_size():
    """vLLM's num_speculative_tokens_per_batch_size: a range's k, the k before a gap or past the last range,
    never more than num_speculative_tokens; JSON's lists are taken, in any order."""
    config = SpeculativeConfig.from_engine_args({"method": "ngram", "num_speculative_tokens": 4,
                                                 "num_speculative_tokens_per_batch_size": [[32, 128, 2], [1, 16, 6],
                                                                                           [129, 129, 0]]})
    assert config.num_speculative_tokens_per_batch_size == [(1, 16, 6), (32, 128, 2), (129, 129, 0)]
    assert [config.num_drafts_for(b) for b in (1, 16, 17, 31, 32, 128, 129, 130, 1000)] == [4, 4, 4, 4, 2, 2, 0, 0, 0]
    plain = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert [plain.num_drafts_for(b) for b in (1, 256)] == [3, 3]


@pytest.mark.parametrize("value, flags, message", [
    ({"method": "ngram"}, {}, "speculative_config num_speculative_tokens must be a positive integer, got None."),
    ({"method": "ngram", "num_speculative_tokens": 0}, {}, "must be a positive integer, got 0."),
    ({"method": "eagle3", "num_speculative_tokens": 2}, {}, "method='eagle3' (model=None) is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "method='draft_model' needs model (the draft"),
    ({"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, {},
     "draft_tensor_parallel_size must be 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, {},
     "speculative_config prompt_lookup_min must be a positive integer, got 0."),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": 1}, {},
     "speculative_config has unknown key(s) ['quantization']; known: method, model"),
    ({"method": "ngram"}, {"spec_method": "ngram"}, "--spec-method and --speculative-config['method'] are mutually "
                                                    "exclusive"),
    ("ngram", {}, "speculative_config must be a dict of its fields, got 'ngram'."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}, {},
     "num_speculative_tokens_per_batch_size must be a non-empty list of (range_start, range_end, "
     "num_speculative_tokens) entries."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 8)]}, {},
     "Each num_speculative_tokens_per_batch_size entry must be a 3-item sequence of integers: (range_start, "
     "range_end, num_speculative_tokens), got (1, 8)."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 0, 2)]}, {},
     "num_speculative_tokens_per_batch_size: Batch-size range (1, 0) must be positive."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 8, 2),
                                                                                                (9, 4, 1)]}, {},
     "num_speculative_tokens_per_batch_size: Batch-size range start must be <= end for (9, 4, 1)."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 8, -1)]}, {},
     "num_speculative_tokens_per_batch_size values must be >= 0, got -1 for (1, 8)."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 8, 2),
                                                                                                (8, 16, 1)]}, {},
     "num_speculative_tokens_per_batch_size: Batch-size ranges must be non-overlapping and sorted, got "
     "[(1, 8, 2), (8, 16, 1)]."),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(2, 8, 2)]}, {},
     "num_speculative_tokens_per_batch_size: The first batch-size range must start at 1 so every runtime batch "
     "size has a defined schedule, got [(2, 8, 2)]."),
])
def test_speculative_config_refusals(value, flags, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_engine_args(value, **flags)
    assert message in str(e.value)


def test_engine_arguments(qwen3_dir):
    """vLLM's flags, async scheduling kept (unlike vLLM's n-gram drafts: a step with drafts is read before the
    next is scheduled), and no speculation for a pooling model."""
    config = Config(qwen3_dir, speculative_config=NGRAM, async_scheduling=True, device="cpu")
    assert config.async_scheduling is True and config.speculative_config.num_speculative_tokens == 4
    config = Config(qwen3_dir, spec_method="ngram", spec_tokens=2, device="cpu")
    assert config.speculative_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="speculative_config is for generative models"):
        Config(qwen3_dir, speculative_config=NGRAM, runner="pooling", device="cpu")
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", qwen3_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


# ---- engines with drafts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_greedy_tokens_equal_the_plain_engine_and_hf(arch, async_scheduling, request):
    path = request.getfixturevalue(f"{arch}_dir")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(path, speculative_config=NGRAM, async_scheduling=async_scheduling, **SETTINGS)
    ours = [o.outputs[0].token_ids for o in run(llm, params)]
    assert ours == hf_greedy(path, PROMPTS, 40)
    counts = draft_counts(llm)
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]   # accepted and rejected drafts
    assert len(counts["num_accepted_tokens_per_pos"]) == 4
    assert sum(counts["num_accepted_tokens_per_pos"]) == counts["num_accepted_tokens"]
    generation = next(m.value for m in llm.get_metrics() if m.name == "vllm:generation_tokens")
    assert generation == 40 * len(PROMPTS)
    assert_idle(llm)


def test_drafting_steps_attend_as_decode_rows(qwen3_dir):
    """A step of last tokens and their drafts runs as a decode step of a row a token (step_inputs.token_rows),
    which CUDA's decode kernel and graphs take; a step with a longer prompt chunk keeps its sequences."""
    llm = LLM(qwen3_dir, speculative_config=NGRAM, max_num_seqs=2, **SETTINGS)
    runner = llm.llm_engine.model_runner
    assert (runner.decode_query_len, runner.max_decode_rows) == (5, 10)
    layer, steps = runner.attention_layers[0], []
    backend = layer.backend

    def spy(q, k, v, k_cache, v_cache, meta, scale, out=None):
        steps.append((len(q), len(meta.seq_lens_cpu), meta.max_query_len))
        return backend(q, k, v, k_cache, v_cache, meta, scale, out)
    layer.backend = spy
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in run(llm, params, PROMPTS[:2])] == hf_greedy(qwen3_dir, PROMPTS[:2], 40)
    assert steps[0] == (70, 2, 35)   # the prompts
    drafting = [step for step in steps[1:] if step[0] > 2]
    assert drafting and all(rows == seqs and query_len == 1 for rows, seqs, query_len in steps[1:])


def test_drafts_follow_the_batch_size_schedule(qwen3_dir):
    """num_speculative_tokens_per_batch_size: no drafts while 3 or more sequences run, at most 2 below that;
    the greedy tokens are HF's all the same."""
    config = dict(NGRAM, num_speculative_tokens_per_batch_size=[(1, 2, 2), (3, 256, 0)])
    llm = LLM(qwen3_dir, speculative_config=config, **SETTINGS)
    batch_sizes = []
    propose = llm.llm_engine.proposer.propose
    llm.llm_engine.proposer.propose = lambda seqs, drafting: (
        batch_sizes.append((len(seqs), drafting)), propose(seqs, drafting))
    prompts = PROMPTS[:4]
    lengths = [10, 20, 30, 40]   # sequences finish one by one: 4, 3, 2 then 1 run
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    ours = [o.outputs[0].token_ids for o in run(llm, params, prompts)]
    assert ours == [tokens[:n] for tokens, n in zip(hf_greedy(qwen3_dir, prompts, 40), lengths)]
    assert not any(drafting for size, drafting in batch_sizes if size >= 3)
    assert any(drafting for size, drafting in batch_sizes if size == 1)
    counts = draft_counts(llm)
    assert counts["num_accepted_tokens"] > 0 and counts["num_accepted_tokens_per_pos"][2:] == [0, 0]
    assert_idle(llm)


def test_seeded_sampling_equals_the_plain_engine(plain, spec):
    """Each row draws with its own output position's noise: with seeds, the same tokens and logprobs
    as without drafts, under top-k, top-p, min-p, min_tokens, logit_bias and n > 1."""
    params = [SamplingParams(temperature=0.4, top_k=20, top_p=0.9, min_p=0.05, seed=i, max_tokens=30,
                             min_tokens=12, logprobs=3, n=2 if i == 1 else 1, logit_bias={7: 1.5} if i == 2 else None)
              for i in range(len(PROMPTS))]
    before = draft_counts(spec)["num_accepted_tokens"]
    expected, ours = run(plain, params), run(spec, params)
    assert draft_counts(spec)["num_accepted_tokens"] > before
    for a, b in zip(expected, ours):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert p.keys() == q.keys()
                assert [v.logprob for v in p.values()] == pytest.approx([v.logprob for v in q.values()], abs=1e-4)
    assert_idle(spec)


def test_stops_inside_accepted_drafts(plain, spec):
    """A stop token, a stop string or max_tokens reached part-way through a step's accepted drafts ends
    the output there, as without drafts."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = run(plain, greedy)
    stop_token = reference[0].outputs[0].token_ids[13]
    stop_text = reference[1].outputs[0].text[20:24]
    cases = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0, max_tokens=40, stop=[stop_text]),
             SamplingParams(temperature=0, max_tokens=40, stop=[stop_text], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)]
    for params in cases:
        expected, ours = run(plain, params), run(spec, params)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in ours] == [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                    o.outputs[0].stop_reason) for o in expected]
    assert len(run(spec, cases[0])[0].outputs[0].token_ids) < 14
    assert_idle(spec)


def test_requests_that_read_their_tokens_decode_beside_drafted_ones(plain, spec):
    """Penalties, multi-token bad words and a grammar get no drafts (their sampling reads earlier output
    tokens); in a batch with drafted requests their tokens are those of the plain engine."""
    speculating = spec.llm_engine.proposer
    seen = []
    propose = speculating.propose

    def recording(seqs, drafting):
        propose(seqs, drafting)
        seen.extend((seq.request_id, bool(seq.spec_token_ids)) for seq in seqs)
    speculating.propose = recording
    try:
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
                  SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=["fox jumps"]),
                  SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
                  *[SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * (len(PROMPTS) - 3)]
        expected, ours = run(plain, params), run(spec, params)
    finally:
        del speculating.propose
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]
    drafted = {request_id for request_id, has_drafts in seen if has_drafts}
    assert not drafted & {o.request_id for o in ours[:3]}
    assert drafted & {o.request_id for o in ours[3:]}
    assert_idle(spec)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_small_cache_small_budget_and_chunked_prompts(qwen3_dir, async_scheduling):
    """Blocks of 16 tokens, too few for every sequence (preemptions), and 24 tokens a step (drafts cut to
    the budget, prompts chunked): the greedy tokens of an engine without drafts."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    small = dict(SETTINGS, block_size=16, num_kvcache_blocks=14, max_num_batched_tokens=24, max_num_seqs=8)
    prompts = repetitive_prompts(8, seed=1)
    expected = [o.outputs[0].token_ids for o in run(LLM(qwen3_dir, **small), params, prompts)]
    llm = LLM(qwen3_dir, speculative_config=NGRAM, async_scheduling=async_scheduling, **small)
    assert [o.outputs[0].token_ids for o in run(llm, params, prompts)] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0 and draft_counts(llm)["num_accepted_tokens"] > 0
    assert_idle(llm)


def test_streamed_deltas_carry_every_accepted_token(qwen3_dir):
    """LLMEngine.step() with DELTA outputs: a step may bring several tokens; the deltas add up to the
    final output."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, speculative_config=NGRAM, **SETTINGS))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens, sizes = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            sizes.append(len(out.outputs[0].token_ids))
    assert max(sizes) > 1
    final = run(LLM(qwen3_dir, **SETTINGS), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                PROMPTS[:3])
    assert [tokens[str(i)] for i in range(3)] == [o.outputs[0].token_ids for o in final]


def test_tensor_parallel(qwen3_dir):
    """TP=2 on the CPU: the rows of the drafts reach every rank; the greedy tokens of one rank without drafts."""
    path = qwen3_dir
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run(LLM(path, **SETTINGS), params)]
    with LLM(path, speculative_config=NGRAM, tensor_parallel_size=2, **SETTINGS) as llm:
        assert [o.outputs[0].token_ids for o in run(llm, params)] == expected
        assert draft_counts(llm)["num_accepted_tokens"] > 0


def test_stats_log_the_drafts(qwen3_dir):
    """disable_log_stats=False: the accepted drafts count as generated tokens in vLLM's periodic line, and
    vLLM's SpecDecoding line follows it."""
    llm = LLM(qwen3_dir, speculative_config=NGRAM, **SETTINGS)
    stats = llm.llm_engine.stat_logger
    stats.interval_s = float("inf")
    run(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    counts = draft_counts(llm)
    assert stats.num_generation_tokens == 40 * len(PROMPTS)
    with log_lines("nanovllm.engine.stat_logger") as lines:
        stats.log(llm.llm_engine.scheduler, llm.llm_engine.block_manager)
    accepted, drafted, drafts = counts["num_accepted_tokens"], counts["num_draft_tokens"], counts["num_drafts"]
    rates = ", ".join(f"{n / drafts:.3f}" for n in counts["num_accepted_tokens_per_pos"])
    assert lines[1].startswith(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, ")
    assert lines[1].endswith(f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance "
                             f"rate: {rates}, Avg Draft acceptance rate: {accepted / drafted:.1%}")
    with log_lines("nanovllm.engine.stat_logger") as lines:   # (nothing drafted since)
        stats.log(llm.llm_engine.scheduler, llm.llm_engine.block_manager)
    assert len(lines) == 1


def test_chat_and_beam_search(plain, spec):
    """The facade's other generating calls on an engine with drafts: chat's tokens, and beam search (one
    token a step: no room for drafts) as without drafts."""
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown"}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected, ours = plain.chat(messages, params, use_tqdm=False), spec.chat(messages, params, use_tqdm=False)
    assert ours[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    beams = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    assert ([[b.tokens for b in o.sequences] for o in spec.beam_search(prompts, beams)]
            == [[b.tokens for b in o.sequences] for o in plain.beam_search(prompts, beams)])
    assert_idle(spec)


def test_drafting_stops_where_drafts_do_not_pay():
    """The proposer drafts while the tokens drafts added per sequence average at least MIN_GAIN over recent
    drafting steps (from 1 at the start), and below that in one step of PROBE_STEPS."""
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4), max_model_len=256)
    decisions = []
    for _ in range(3 * PROBE_STEPS):
        drafting = proposer.should_draft(8)
        decisions.append(drafting)
        proposer.propose([], drafting)
        if drafting:
            proposer.record(num_seqs=8, num_accepted_tokens=0)
    first_off = decisions.index(False)
    assert all(decisions[:first_off]) and first_off == next(n for n in range(1, 100)
                                                           if (1 - GAIN_WEIGHT) ** n < MIN_GAIN)
    probes = [i for i, d in enumerate(decisions) if d and i >= first_off]
    assert [b - a for a, b in zip(probes, probes[1:])] == [PROBE_STEPS] * (len(probes) - 1) and len(probes) >= 2
    for _ in range(2):   # probes that find drafts paying turn drafting back on
        proposer.record(num_seqs=8, num_accepted_tokens=24)
    assert proposer.gain >= MIN_GAIN and proposer.should_draft(8)


def test_an_async_engine_drafts_rarely_where_nothing_repeats(qwen3_dir):
    """Random prompts sampled at temperature 1: drafts are found but not accepted, so after a few steps the
    engine drafts only in probe steps; the seeded tokens are the plain engine's all the same."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=96, ignore_eos=True)
    llm = LLM(qwen3_dir, speculative_config=NGRAM, async_scheduling=True, **SETTINGS)
    steps = []
    should_draft = llm.llm_engine.proposer.should_draft
    llm.llm_engine.proposer.should_draft = lambda batch_size: steps.append(should_draft(batch_size)) or steps[-1]
    ours = run(llm, params, prompts)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids
                                                      for o in run(LLM(qwen3_dir, **SETTINGS), params, prompts)]
    first_off = next(n for n in range(1, 100) if (1 - GAIN_WEIGHT) ** n < MIN_GAIN)
    assert len(steps) >= 96 and sum(steps) <= first_off + len(steps) // PROBE_STEPS + 1
    assert draft_counts(llm)["num_drafts"] > 0
    assert_idle(llm)
