"""Random engine workloads, checked against the engine's invariants (a developer tool;
tests/test_fuzz.py runs a few seeds in CI).

A seed picks a small engine configuration (block size, KV blocks, max_num_seqs, token budget,
chunked prefill, prefix caching, async scheduling, CUDA graphs, scheduling policy, an fp8 KV cache,
a reasoning parser, the logprobs mode, speculative decoding in three seeds of ten: by n-gram lookup, or in
half of those at TP=1 with the model as its own draft model, random_draft) and a
random run of requests (random sampling options, among them penalties, stops, bad words, allowed
ids, logprobs, truncation, thinking budgets and, with xgrammar, a choice, regex or JSON grammar;
output kinds, priorities and cache salts), requests it must refuse, aborts and sleeps (levels 0-2,
modes "keep" and "abort") between step() calls. Every fourth seed samples its rows with a top_k
above 16 on the sampler's sorted path (SORTED_PATH_TOP_K_MAX). Two seeds in five enable LoRA
(random_lora_config, drawn apart so that the other draws stay as they were): 1 or 2 slots, three
adapters and the base model drawn per request, and in one of those four some modules only
(lora_target_modules). A third of the seeds without speculative decoding run a custom logits processor that
checks the engine's persistent batch of sampling requests (BatchCheck). A fourth of the seeds without an
adapted embedding give half their prompts as their tokens' embeddings (prompt_embeds; half of those in vLLM's
mixed form), which must complete as the ids do (random_embeds). A fifth of the seeds run fp8 products
(quantization="fp8", random_quantization). Checked:
- a bad request (out-of-vocabulary id, a prompt too long, an unfinished request's id, ...) is a
  ValueError and changes nothing else;
- every request that is not aborted is reported finished exactly once, and the engine counts as
  unfinished the requests not yet reported; streamed CUMULATIVE outputs extend the ones before,
  DELTA outputs add up to the completion;
- no completion is longer than max_tokens; logprobs have an entry a token, holding the token (in the
  processed modes never at -inf: it was drawn from there), prompt logprobs one a prompt token, each
  after the first holding it; the text streamed or returned is the completion's tokens decoded
  (check_text); a completion's finish_reason and stop_reason agree with its tokens and options
  (check_finish); prefix-cache hits are whole blocks short of the prompt's end, and none where the
  request may not read the cache;
- once idle, every KV block is free and step() returns [];
- greedy and seeded requests give the tokens and text they give alone, in a fresh engine. On the
  GPU other batch sizes round otherwise (bf16, and float32 through TF32 products), and on the CPU
  in float32 a prompt chunked at other boundaries does (its attention summed in other pieces: one
  greedy token in ~1,000 seeds, where the token alone led by 1.4e-6), so a near tie may flip:
  differences are counted and printed with the logprob lead at the first differing token, not
  raised.
With --llm a seed makes random calls of the LLM facade instead (run_llm_seed): generate and chat
with mixed prompt forms, enqueue / wait_for_completion with other calls between, beam_search, bad
calls, a generate interrupted by Ctrl-C, sleeps, prefix-cache resets; each call's outputs are checked (one a prompt, in
order, finished), the engine is idle after it, and its completions and beams are compared with
their runs alone.

With --pooling a seed runs a pooling engine (runner="pooling", run_pooling_seed): an embedding model's embed
and token_embed requests, or a classifier's classify and token_classify (a head made of LM-head rows, as vLLM's
reranker recipe), with random options, bad requests, aborts and sleeps between steps; each request not aborted
is reported once, the engine ends idle, and each result is its prompt's result alone, in a fresh engine. A third
of those seeds pool the token tasks by STEP (random_step_pooling: a request's step tag one of its prompt's ids,
and at times its result's first column only).

    python tests/fuzz_engine.py [--llm | --pooling] [--seeds 0:50] [--arch qwen3_moe] [--device cuda --dtype bfloat16]
        [--tensor-parallel-size 2]
"""
import argparse
import functools
import importlib.util
import math
import random
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load_file

from nanovllm import LLM, EngineArgs, LLMEngine, PoolingParams, SamplingParams
from nanovllm.engine.output_processor import DETOKENIZE_CONTEXT
from nanovllm.layers import sampling_filters
from nanovllm.logits_processor import BatchUpdate, LogitsProcessor, apply_dict_updates
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import BeamSearchParams, RequestOutputKind, StructuredOutputsParams

HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None   # (structured outputs' optional dependency)
VOCAB_SIZE = 384   # (the tiny models' vocabulary, tests/conftest.py)
MAX_MODEL_LEN = 160
# Prompts the engine must refuse: an id outside the vocabulary, longer than max_model_len, no room
# left for an output token, empty
BAD_PROMPTS = {"vocabulary": [1, VOCAB_SIZE], "long": [1] * (MAX_MODEL_LEN + 1), "full": [1] * MAX_MODEL_LEN,
               "empty": []}
# Every fourth seed (3, 7, ...) lowers sampling_filters.SELECT_TOP_K_MAX to this, so that its rows with top_k 50
# take the sampler's sorted path, which the tiny vocabulary never reaches at 1,024 (on_sorted_path_every_fourth_seed)
SORTED_PATH_TOP_K_MAX = 16
WORDS = "The quick brown fox jumps over the lazy dog Hello world blocks , . !".split()   # (in its tokenizer's corpus)


def random_params(rng: random.Random, thinking: bool = False) -> SamplingParams:
    """thinking: the engine has a reasoning parser (so a thinking budget may be set)."""
    kw = dict(max_tokens=rng.randint(1, 40), output_kind=rng.choice(list(RequestOutputKind)))
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw |= dict(temperature=rng.choice([0.5, 1.0]), n=rng.choice([1, 1, 2, 3]),
                   seed=rng.choice([None, rng.randint(0, 100)]))
        kw |= {name: rng.choice(values) for name, values in
               (("top_k", [1, 5, 50]), ("top_p", [0.5, 0.9]), ("min_p", [0.1])) if rng.random() < 0.3}
    optional = [("min_tokens", rng.randint(0, kw["max_tokens"])), ("presence_penalty", 0.5),
                ("repetition_penalty", 1.2), ("logprobs", rng.choice([0, 3])), ("prompt_logprobs", rng.choice([0, 2])),
                ("stop", rng.choice([["o"], ["the", "og"], ["Hello world"]])), ("include_stop_str_in_output", True),
                ("ignore_eos", True), ("logit_bias", {5: 3.0}), ("frequency_penalty", 0.3),
                ("stop_token_ids", [rng.randrange(VOCAB_SIZE)]), ("bad_words", ["the", "fox jumps"]),
                ("allowed_token_ids", rng.sample(range(VOCAB_SIZE), 40)), ("flat_logprobs", True),
                ("logprob_token_ids", rng.sample(range(VOCAB_SIZE), 3)), ("truncate_prompt_tokens", rng.randint(1, 60)),
                ("skip_reading_prefix_cache", True), ("repetition_detection", {"max_pattern_size": 2, "min_count": 3}),
                ("detokenize", False)]
    kw |= {name: value for name, value in optional if rng.random() < 0.2}
    if not kw.get("detokenize", True):
        kw.pop("stop", None)   # (stop strings need the text)
    if thinking and rng.random() < 0.4:
        kw["thinking_token_budget"] = rng.randint(0, 8)
    if "allowed_token_ids" not in kw and rng.random() < 0.05 and HAS_XGRAMMAR:
        kw["structured_outputs"] = StructuredOutputsParams(**rng.choice([
            {"choice": ["yes", "no", "the lazy dog"]}, {"regex": "(fox|dog)( [a-z]+)?"}, {"json_object": True}]))
    return SamplingParams(**kw)


def random_token_ids(rng: random.Random, shared: list[int], think: list[int]) -> list[int]:
    """A prompt that begins with a part of shared (so that prompts hit the prefix cache), and
    half the time ends with think (the ids that open a model's thinking; none without a reasoning
    parser)."""
    own = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 100))]
    ids = (shared[:rng.randint(0, len(shared))] + own)[:120]
    return ids[:120 - len(think)] + think if think and rng.random() < 0.5 else ids


def thinking_ids(tokenizer, config: dict) -> list[int]:
    """The ids that open thinking, if the engine has a reasoning parser, else []."""
    return tokenizer.encode("<think>", add_special_tokens=False) if config["reasoning_parser"] else []


def random_bad_request(rng: random.Random, unfinished: list[str]) -> tuple[list[int], SamplingParams, str]:
    """A prompt, params and request id of which one is bad (the id of an unfinished request, if any)."""
    prompt, params, request_id = [1, 2, 3], SamplingParams(max_tokens=4), "bad"
    bad = rng.choice([*BAD_PROMPTS, "logprobs", "logit_bias"] + ["id"] * bool(unfinished))
    if bad in BAD_PROMPTS:
        prompt = BAD_PROMPTS[bad]
    elif bad == "id":
        request_id = rng.choice(unfinished)
    else:
        params = SamplingParams(logprobs=21) if bad == "logprobs" else SamplingParams(logit_bias={VOCAB_SIZE: 1.0})
    return prompt, params, request_id


def random_config(rng: random.Random, **engine_kwargs) -> dict:
    chunked_prefill = rng.random() < 0.8   # (without it a step must hold a whole prompt)
    config = dict(block_size=rng.choice([16, 16, 32]), num_kvcache_blocks=rng.choice([12, 24, 64]),
                  max_num_seqs=rng.choice([2, 4, 8]), scheduling_policy=rng.choice(["fcfs", "priority"]),
                  enable_chunked_prefill=chunked_prefill,
                  max_num_batched_tokens=rng.choice([32, 64, 256] if chunked_prefill else [MAX_MODEL_LEN, 256]),
                  max_model_len=MAX_MODEL_LEN, enable_prefix_caching=rng.choice([True, False]),
                  async_scheduling=rng.choice([True, False]), enforce_eager=rng.choice([True, False]),
                  kv_cache_dtype=rng.choice(["auto", "auto", "fp8"]), enable_sleep_mode=True,
                  reasoning_parser=rng.choice(["", "", "qwen3"]),
                  logprobs_mode=rng.choice(["raw_logprobs"] * 3 + ["raw_logits", "processed_logprobs",
                                                                   "processed_logits"]),
                  **engine_kwargs)
    if rng.random() < 0.3:   # n-gram speculative decoding
        config["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 5),
                                        "prompt_lookup_min": 1, "prompt_lookup_max": rng.randint(1, 4)}
        if rng.random() < 0.5:   # k by the number of running sequences
            small = rng.randint(1, 4)
            config["speculative_config"]["num_speculative_tokens_per_batch_size"] = [
                (1, small, rng.randint(0, 5)), (small + 1, 4096, rng.randint(0, 5))]
    return config


class BatchCheck(LogitsProcessor):
    """A custom logits processor that changes nothing and checks the engine's persistent batch: after each update
    the batch is indices 0 .. batch_size - 1, each one request's, and apply gets that many rows."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.params: dict[int, SamplingParams] = {}
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is not None:
            self.batch_size = batch_update.batch_size
            apply_dict_updates(self.params, batch_update, lambda params, prompt_ids, output_ids: params)
        assert sorted(self.params) == list(range(self.batch_size)), f"batch {sorted(self.params)}, {self.batch_size}"

    def apply(self, logits):
        assert logits.shape[0] == self.batch_size, f"{logits.shape[0]} rows for a batch of {self.batch_size}"
        return logits


def random_draft(seed: int, config: dict, model: str) -> dict:
    """In half the seeds with n-gram speculation at TP=1, drawn from an RNG of its own: the model as its own draft
    model instead (the same k; its drafts are accepted while its K/V mirrors each sequence's tokens)."""
    spec = config.get("speculative_config")
    if spec is None or config.get("tensor_parallel_size", 1) > 1 or random.Random(f"draft {seed}").random() < 0.5:
        return {}
    return {"speculative_config": {key: value for key, value in spec.items() if not key.startswith("prompt_lookup")}
            | {"method": "draft_model", "model": model}}


def random_quantization(seed: int, config: dict) -> dict:
    """quantization="fp8" (the projections' products in fp8) in a fifth of the seeds, drawn from an RNG of its
    own."""
    if random.Random(f"quantization {seed}").random() >= 0.2:
        return {}
    return {"quantization": "fp8"}


def random_processors(seed: int, config: dict) -> dict:
    """LLM(logits_processors=[BatchCheck]) in a third of the seeds without speculative decoding (which refuses
    them), drawn from an RNG of its own."""
    if "speculative_config" in config or random.Random(f"processors {seed}").random() >= 1 / 3:
        return {}
    return {"logits_processors": [BatchCheck]}


def random_embeds(seed: int, config: dict, model: str) -> tuple[dict, random.Random, torch.Tensor | None]:
    """enable_prompt_embeds in a fourth of the seeds without an adapter on the embedding, drawn from an RNG of its
    own -> (engine arguments, that RNG, the model's token embeddings in the engine's dtype; None without)."""
    rng = random.Random(f"embeds {seed}")
    targets = config.get("lora_target_modules")
    if config.get("enable_lora") and (targets is None or "embed_tokens" in targets) or rng.random() >= 0.25:
        return {}, rng, None
    table = load_file(f"{model}/model.safetensors")["model.embed_tokens.weight"]
    return {"enable_prompt_embeds": True}, rng, table.to(getattr(torch, config["dtype"]))


def as_embeds(rng: random.Random, ids: list[int], table: torch.Tensor) -> dict:
    """ids as an EmbedsPrompt of their embeddings, or in vLLM's mixed form (a random half of the positions ids)."""
    prompt = {"prompt_embeds": table[ids]}
    if rng.random() < 0.5:
        prompt |= {"prompt_token_ids": ids, "prompt_is_token_ids": [rng.random() < 0.5 for _ in ids]}
    return prompt


ADAPTERS: list[str] = []   # the tiny model's LoRA adapters (main() writes three)


def random_lora_config(seed: int) -> tuple[dict, random.Random, list[LoRARequest]]:
    """A seed's LoRA settings, from an RNG of their own -> (engine arguments, that RNG for the requests'
    adapters, the adapters); no LoRA in three seeds of five, or without adapters written."""
    rng = random.Random(f"lora {seed}")
    if not ADAPTERS or rng.random() < 0.6:
        return {}, rng, []
    config = dict(enable_lora=True, max_loras=rng.choice([1, 2]), max_lora_rank=8, max_cpu_loras=rng.choice([None, 3]))
    config["max_cpu_loras"] = config["max_cpu_loras"] or config["max_loras"]
    if rng.random() < 0.25:   # adapters on some modules only (each adapter keeps some: q/v and o are in)
        others = ["gate_up_proj", "down_proj", "experts", "embed_tokens", "lm_head"]
        config["lora_target_modules"] = ["qkv_proj", "o_proj", *rng.sample(others, rng.randint(0, len(others)))]
    return config, rng, [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(ADAPTERS)]


@dataclass
class Run:
    """What a seed's run has sent and been told, request by request."""
    requests: dict = field(default_factory=dict)    # request id -> (prompt token ids, SamplingParams)
    finished: dict = field(default_factory=dict)    # request id -> its finished RequestOutput
    completions: dict = field(default_factory=dict)  # (request id, index) -> (token ids, text) so far
    # (request id, index) -> a finished completion's (finish_reason, stop_reason)
    finish_reasons: dict = field(default_factory=dict)
    aborted: set = field(default_factory=set)
    config: dict = field(default_factory=dict)   # the engine's (random_config)
    eos_token_ids: set = field(default_factory=set)   # the engine's
    loras: dict = field(default_factory=dict)   # request id -> its LoRARequest (with LoRA on)
    embedded: dict = field(default_factory=dict)   # request id -> its prompt, where given as vectors (EmbedsPrompt)

    def unfinished(self) -> list[str]:
        return sorted(set(self.requests) - self.aborted - set(self.finished))

    def take(self, output):
        assert output.request_id not in self.aborted, f"{output.request_id}: an output after its abort"
        kind = self.requests[output.request_id][1].output_kind
        for completion in output.outputs:
            key = (output.request_id, completion.index)
            tokens, text = self.completions.get(key, ([], ""))
            if kind == RequestOutputKind.DELTA:
                tokens, text = tokens + list(completion.token_ids), text + completion.text
            else:
                assert list(completion.token_ids[:len(tokens)]) == tokens and completion.text.startswith(text), \
                    f"{key}: a cumulative output does not extend the one before"
                tokens, text = list(completion.token_ids), completion.text
            self.completions[key] = tokens, text
            if completion.logprobs:
                check_logprobs(completion, self.config["logprobs_mode"], key)
            if completion.finish_reason is not None:
                self.finish_reasons[key] = completion.finish_reason, completion.stop_reason
        if output.finished:
            assert output.request_id not in self.finished, f"{output.request_id} reported finished twice"
            self.finished[output.request_id] = output


def on_sorted_path_every_fourth_seed(run):
    """run(model, seed, ...) with SELECT_TOP_K_MAX at SORTED_PATH_TOP_K_MAX where seed % 4 == 3 (its runs
    alone too), and as it was otherwise; the seeds draw what they drew before."""
    @functools.wraps(run)
    def wrapped(model: str, seed: int, **engine_kwargs) -> int:
        saved = sampling_filters.SELECT_TOP_K_MAX
        if seed % 4 == 3:
            sampling_filters.SELECT_TOP_K_MAX = SORTED_PATH_TOP_K_MAX
        try:
            return run(model, seed, **engine_kwargs)
        finally:
            sampling_filters.SELECT_TOP_K_MAX = saved
    return wrapped


@on_sorted_path_every_fourth_seed
def run_seed(model: str, seed: int, **engine_kwargs) -> int:
    """One seed's run (see the module's docstring); raises AssertionError on a broken invariant
    -> the number of greedy or seeded completions that differ from their run alone."""
    rng = random.Random(seed)
    lora_config, lora_rng, loras = random_lora_config(seed)
    config = random_config(rng, **engine_kwargs) | lora_config
    config |= random_draft(seed, config, model)
    config |= random_processors(seed, config)
    config |= random_quantization(seed, config)
    embeds_config, embeds_rng, table = random_embeds(seed, config, model)
    config |= embeds_config
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **config))
    think = thinking_ids(engine.tokenizer, config)
    run = Run(config=config, eos_token_ids=engine.eos_token_ids)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(60)]
    for i in range(rng.randint(20, 80)):
        action = rng.random()
        if action < 0.3:
            prompt = random_token_ids(rng, shared, think)
            request_id, params = f"r{i}", random_params(rng, bool(think))
            salt = rng.choice([None, None, "a", "b"])
            priority = rng.randint(-2, 2) if config["scheduling_policy"] == "priority" else 0
            lora = lora_rng.choice([*loras, None]) if loras else None
            given = {"prompt_token_ids": prompt}
            if table is not None and embeds_rng.random() < 0.5:
                # (without what reads the prompt's ids, which such a prompt's run alone by its ids would see)
                given = as_embeds(embeds_rng, prompt, table)
                params = replace(params, prompt_logprobs=None, repetition_penalty=1.0, thinking_token_budget=None)
                run.embedded[request_id] = given
            engine.add_request(request_id, given | {"cache_salt": salt}, params, priority=priority, lora_request=lora)
            run.requests[request_id] = prompt, params
            run.loras[request_id] = lora
        elif action < 0.33:   # a request the engine must refuse, with nothing else changed
            prompt, params, request_id = random_bad_request(rng, run.unfinished())
            expect_refused(engine, request_id, prompt, params, request_id)
        elif action < 0.36 and run.unfinished():
            request_id = rng.choice(run.unfinished())
            engine.abort_request([request_id])
            run.aborted.add(request_id)
        elif action < 0.39:
            unfinished = set(run.unfinished())
            if random_sleep(rng, engine):
                run.aborted |= unfinished
        for output in engine.step():
            run.take(output)
        unfinished = len(run.unfinished())
        assert engine.get_num_unfinished_requests() == unfinished
        assert engine.has_unfinished_requests() == bool(unfinished)
    while engine.has_unfinished_requests():
        for output in engine.step():
            run.take(output)
    assert not run.unfinished(), f"never reported finished: {run.unfinished()}"
    check_idle(engine)
    tokenizer = engine.tokenizer
    engine.close()
    check_outputs(run, tokenizer)
    return count_differences_alone(model, config, run)


# A classifier's head made of LM-head rows (tokens of the test tokenizer's vocabulary): one label, or three
CLASSIFIERS = [{"classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"},
               {"classifier_from_token": ["a", "b", "The"], "method": "no_post_processing"}]


def random_pooling_config(rng: random.Random, **engine_kwargs) -> dict:
    pooling_type = rng.choice(["LAST", "LAST", "MEAN", "CLS"])   # (MEAN and CLS: no chunks, no prefix cache)
    whole = pooling_type != "LAST" or rng.random() < 0.2
    kind = dict(convert="classify", hf_overrides=rng.choice(CLASSIFIERS)) if rng.random() < 0.4 else {}
    return dict(runner="pooling", pooler_config={"pooling_type": pooling_type}, **kind,
                block_size=rng.choice([16, 16, 32]), num_kvcache_blocks=rng.choice([12, 24, 64]),
                max_num_seqs=rng.choice([2, 4, 8]), enable_chunked_prefill=not whole,
                max_num_batched_tokens=rng.choice([MAX_MODEL_LEN, 256] if whole else [32, 64, 256]),
                max_model_len=MAX_MODEL_LEN, enable_prefix_caching=rng.choice([True, False]),
                async_scheduling=rng.choice([True, False]), enforce_eager=rng.choice([True, False]),
                kv_cache_dtype=rng.choice(["auto", "auto", "fp8"]), enable_sleep_mode=True, **engine_kwargs)


def random_step_pooling(seed: int, config: dict) -> random.Random | None:
    """STEP pooling for the token tasks in a third of the pooling seeds (config's pooler_config set so), drawn from
    an RNG of its own, which then draws each request's step parameters (step_parameters); None in the others."""
    rng = random.Random(f"step {seed}")
    if rng.random() >= 1 / 3:
        return None
    config["pooler_config"] = {"seq_pooling_type": config["pooler_config"]["pooling_type"], "tok_pooling_type": "STEP"}
    return rng


def step_parameters(rng: random.Random | None, prompt: list[int]) -> dict:
    """A request's STEP pooling parameters: a step tag from its prompt (or none: every row), at times the first
    column only."""
    if rng is None:
        return {}
    return dict(step_tag_id=rng.choice(prompt) if rng.random() < 0.8 else None,
                returned_token_ids=[0] if rng.random() < 0.3 else None)


def run_pooling_seed(model: str, seed: int, **engine_kwargs) -> int:
    """One seed of a pooling engine's run (see the module's docstring); AssertionError on a broken
    invariant -> the number of results that differ from their prompt's alone by more than rounding."""
    rng = random.Random(seed)
    config = random_pooling_config(rng, **engine_kwargs)
    step_rng = random_step_pooling(seed, config)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **config))
    task, token_task = engine.get_supported_tasks()
    other_task = "embed" if task == "classify" else "classify"   # (the other kind of model's)
    requests, finished, aborted = {}, {}, set()
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(60)]
    unfinished = lambda: sorted(set(requests) - aborted - set(finished))
    for i in range(rng.randint(20, 60)):
        action = rng.random()
        if action < 0.35:
            prompt = (shared[:rng.randint(0, len(shared))] + [rng.randrange(VOCAB_SIZE)
                                                                for _ in range(rng.randint(1, 120))])[:MAX_MODEL_LEN]
            params = PoolingParams(task=rng.choice([task, task, token_task]),
                                   use_activation=rng.choice([None, True, False]))
            if params.task == token_task:
                params = replace(params, **step_parameters(step_rng, prompt))
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            requests[f"r{i}"] = prompt, params
        elif action < 0.4:   # a request the engine must refuse, with nothing else changed
            bad = rng.choice(["vocabulary", "long", "empty", "sampling", "task", "id"] if unfinished() else ["long"])
            prompt = BAD_PROMPTS.get(bad, [1, 2, 3])
            params = {"sampling": SamplingParams(), "task": PoolingParams(task=other_task)}.get(bad, PoolingParams())
            request_id = rng.choice(unfinished()) if bad == "id" else "bad"
            expect_refused(engine, request_id, prompt, params, bad)
        elif action < 0.44 and unfinished():
            request_id = rng.choice(unfinished())
            engine.abort_request([request_id])
            aborted.add(request_id)
        elif action < 0.47:
            before = set(unfinished())
            if random_sleep(rng, engine):
                aborted |= before
        for output in engine.step():
            assert output.request_id not in aborted and output.request_id not in finished and output.finished
            finished[output.request_id] = output
        assert engine.get_num_unfinished_requests() == len(unfinished())
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in aborted and output.request_id not in finished
            finished[output.request_id] = output
    assert not unfinished(), f"never reported finished: {unfinished()}"
    check_idle(engine)
    assert engine.in_flight is None and not engine.model_runner.pooler.chunks
    engine.close()
    alone = LLMEngine.from_engine_args(EngineArgs(model=model, **config))
    differing = 0
    for request_id, output in finished.items():
        prompt, params = requests[request_id]
        alone.add_request(request_id, {"prompt_token_ids": prompt}, params)
        outputs = []
        while alone.has_unfinished_requests():
            outputs += alone.step()
        [expected] = outputs
        got, want = output.outputs.data, expected.outputs.data
        assert got.shape == want.shape, f"{request_id}: result of shape {tuple(got.shape)}, alone {tuple(want.shape)}"
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-3):
            differing += 1
            print(f"seed {seed} {request_id}: differs alone by {(got - want).abs().max().item():.2e}")
    alone.close()
    return differing


def expect_refused(engine: LLMEngine, request_id: str, prompt: list[int], params, what: str):
    """add_request must raise ValueError for this bad request (what names it in the failure)."""
    try:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    except ValueError:
        return
    raise AssertionError(f"{what}: a bad request was taken")


def random_sleep(rng: random.Random, engine: LLMEngine) -> bool:
    """A sleep at a random level and mode, then the wake-up (and, after level 2, the weights loaded again)
    -> whether the sleep aborted the unfinished requests (mode "abort")."""
    level, mode = rng.choice([0, 1, 2]), rng.choice(["keep", "keep", "abort"])
    engine.sleep(level, mode)
    engine.wake_up()
    if level == 2:
        engine.collective_rpc("reload_weights")
    return mode == "abort"


def check_idle(engine: LLMEngine):
    assert not engine.has_unfinished_requests()
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks, f"{blocks.num_blocks - blocks.num_free_blocks} blocks leaked"
    assert engine.step() == []


def check_logprobs(completion, logprobs_mode: str, key):
    """Each token's logprobs entry holds the token; logprobs are at most 0; in the processed modes
    the token was drawn from the distribution reported, so it is not at -inf there."""
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry, f"{key}: token {token} missing from its logprobs {entry}"
        if logprobs_mode.endswith("logprobs"):
            assert all(lp.logprob <= 1e-5 for lp in entry.values()), f"{key}: a logprob above 0 in {entry}"
        if logprobs_mode.startswith("processed"):
            assert entry[token].logprob > float("-inf"), f"{key}: token {token} drawn at -inf ({logprobs_mode})"


def check_outputs(run: Run, tokenizer):
    for request_id, output in run.finished.items():
        prompt, params = run.requests[request_id]
        kept = prompt[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else prompt
        for index in range(params.n):
            tokens, text = run.completions[(request_id, index)]
            assert len(tokens) <= params.max_tokens, f"{request_id}: {len(tokens)} tokens > {params.max_tokens}"
            finish_reason, stop_reason = run.finish_reasons[(request_id, index)]
            check_finish(tokens, len(kept), finish_reason, stop_reason, params, run)
            if params.detokenize:   # (no context from a prompt given as vectors)
                context = [] if request_id in run.embedded else kept
                check_text(tokens, text, context, finish_reason, stop_reason, params, tokenizer)
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            assert len(output.outputs) == params.n
            for completion in output.outputs:
                if params.logprobs is not None:
                    assert len(completion.logprobs) == len(completion.token_ids), request_id
        placeholders = request_id in run.embedded and "prompt_token_ids" not in run.embedded[request_id]
        assert list(output.prompt_token_ids) == ([0] * len(kept) if placeholders else kept), request_id
        # prefix-cache hits: whole blocks before the last prompt token, none where the request may not read them
        reads_cache = run.config["enable_prefix_caching"] and not params.skip_reading_prefix_cache
        cached = output.num_cached_tokens
        assert cached % run.config["block_size"] == 0 and cached < len(kept) and (reads_cache or cached == 0), \
            f"{request_id}: {cached} cached prompt tokens of {len(kept)}"
        if params.prompt_logprobs is not None and output.prompt_logprobs is not None:
            assert len(output.prompt_logprobs) == len(kept), request_id
            first = {} if params.flat_logprobs else None   # (FlatLogprobs' None, as vLLM's)
            assert output.prompt_logprobs[0] == first and all(
                token in entry for token, entry in zip(kept[1:], output.prompt_logprobs[1:])), request_id
        for completion in output.outputs:
            assert params.detokenize or completion.text == ""
            if params.logprob_token_ids and completion.logprobs:
                assert all(set(params.logprob_token_ids) <= set(entry) for entry in completion.logprobs), request_id


def check_finish(tokens: list[int], num_prompt_tokens: int, finish_reason: str, stop_reason, params: SamplingParams,
                 run: Run):
    """Why a completion ended agrees with its tokens: "length" at max_tokens or max_model_len; "stop"
    not before min_tokens, on a stop token (its stop_reason), an EOS (None) or a stop string (its
    stop_reason); else a repetition, or a token its grammar refused ("error")."""
    where = f"{finish_reason} ({stop_reason!r}) after {len(tokens)} tokens: {tokens[-3:]}, {params}"
    if finish_reason == "length":
        assert (len(tokens) == params.max_tokens
                or num_prompt_tokens + len(tokens) >= run.config["max_model_len"]), where
    elif finish_reason == "stop":
        assert len(tokens) >= params.min_tokens, where
        if stop_reason is None:
            assert not params.ignore_eos and tokens[-1] in run.eos_token_ids, where
        elif isinstance(stop_reason, int):
            assert stop_reason in params.stop_token_ids and tokens[-1] == stop_reason, where
        else:
            assert stop_reason in params.stop, where
    else:
        assert (finish_reason, stop_reason) in (("repetition", "repetition_detected"), ("error", None)), where


def check_text(tokens: list[int], text: str, prompt: list[int], finish_reason: str, stop_reason,
               params: SamplingParams, tokenizer):
    """The text streamed (or returned) for a completion is what its tokens add to the decoded end of
    its prompt (the detokenizer's window), up to the stop string that ended it, or without the EOS or
    stop token that ended it (either kept with include_stop_str_in_output). Without a stop string,
    less a tail held back because it ends in an unfinished character, as vLLM's detokenizer holds it.
    Bytes that are not UTF-8 decode to more or fewer replacement characters ("\ufffd") in other
    windows, so where there are some, the text is compared without them."""
    options = dict(skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens)
    context = prompt[max(len(prompt) - DETOKENIZE_CONTEXT, 0):]
    if finish_reason == "stop" and stop_reason not in params.stop and not params.include_stop_str_in_output:
        tokens = tokens[:-1]
    before, after = tokenizer.decode(context, **options), tokenizer.decode(context + tokens, **options)
    whole = after[len(before):] if after.startswith(before) else tokenizer.decode(tokens, **options)
    where = f"text {text!r}, stop {stop_reason!r}, the tokens decode to {whole!r}"
    lossy = "\ufffd" in whole
    if lossy:
        text, whole = text.replace("\ufffd", ""), whole.replace("\ufffd", "")
    if stop_reason not in params.stop:   # (a stop token id, None, or repetition detection's reason)
        assert whole.startswith(text) if lossy else text == whole, where
    elif params.include_stop_str_in_output:
        assert text.endswith(stop_reason) and whole.startswith(text), where
    else:
        assert whole.startswith(text + stop_reason), where


def count_differences_alone(model: str, config: dict, run: Run) -> int:
    """Greedy and seeded requests run again one at a time, in the form they were given -> how many completions
    came out otherwise. Each difference is printed with the logprob by which the token alone led the other
    (a near tie says rounding): each alone run asks for every token's logprob, so that the lead is known
    wherever the other token was (logprob_token_ids or a top 20 would leave it out where masks or top-k
    made the choice), in the distribution the token was chosen from (processed: after logit_bias and
    penalties; a raw lead can be large where those decided). Where the other token was masked there
    (a lead of inf, e.g. under top_k=1), the request runs alone once more for its raw lead."""
    alone_config = {**config, "max_num_seqs": 1, "max_logprobs": -1}
    engines = {}

    def run_alone(mode: str, request_id: str, prompt: list[int], params: SamplingParams) -> list:
        if mode not in engines:
            engine_args = EngineArgs(model=model, **{**alone_config, "logprobs_mode": mode})
            engines[mode] = LLMEngine.from_engine_args(engine_args)
        engine = engines[mode]
        given = run.embedded.get(request_id, {"prompt_token_ids": prompt})   # (vectors alone too: no text context)
        engine.add_request(request_id, given, replace(
            params, output_kind=RequestOutputKind.FINAL_ONLY, logprobs=-1, logprob_token_ids=None),
            lora_request=run.loras.get(request_id))
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs = output.outputs
        return outputs

    differences = 0
    for request_id in run.finished:
        prompt, params = run.requests[request_id]
        if params.temperature > 0 and params.seed is None:
            continue
        alone = run_alone("processed_logprobs", request_id, prompt, params)
        for completion in alone:
            tokens, text = run.completions[(request_id, completion.index)]
            if (tokens, text) == (list(completion.token_ids), completion.text):
                continue
            differences += 1
            at = next((i for i, (a, b) in enumerate(zip(tokens, completion.token_ids)) if a != b), None)
            if at is None:
                print(f"  {request_id}.{completion.index}: {len(tokens)} tokens against {len(completion.token_ids)} "
                      f"alone, {text!r} against {completion.text!r} ({params})")
                continue
            lead = leads(completion, at, tokens[at])
            if math.isinf(lead):
                raw = run_alone("raw_logprobs", request_id, prompt, params)[completion.index]
                same = raw.token_ids[:at + 1] == completion.token_ids[:at + 1]
                lead = f"{lead} (raw logprobs: {f'by {leads(raw, at, tokens[at])}' if same else 'drawn otherwise'})"
            print(f"  {request_id}.{completion.index}: token {at} is {tokens[at]}, alone {completion.token_ids[at]}, "
                  f"which led it by {lead} ({params})")
    for engine in engines.values():
        engine.close()
    return differences


def leads(completion, at: int, other: int) -> float:
    """By how much the completion's token at `at` led `other` there, in its logprobs."""
    top = completion.logprobs[at]
    return top[completion.token_ids[at]].logprob - top[other].logprob


# ---- the LLM facade ---------------------------------------------------------------------------
def random_prompt(rng: random.Random, shared: list[int], think: list[int] = ()):
    """A prompt in one of the forms generate() takes: text or token ids (see random_token_ids),
    bare or in a dict."""
    if rng.random() < 0.4:
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
        return rng.choice([text, {"prompt": text}])
    ids = random_token_ids(rng, shared, list(think))
    return rng.choice([ids, {"prompt_token_ids": ids, "cache_salt": rng.choice([None, "a"])}])


def random_call(rng: random.Random, shared: list[int], think: list[int]
                ) -> tuple[list, SamplingParams | list[SamplingParams]]:
    """generate()'s prompts and sampling params: one SamplingParams for all, or one per prompt."""
    prompts = [random_prompt(rng, shared, think) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.5:
        return prompts, random_params(rng, bool(think))
    return prompts, [random_params(rng, bool(think)) for _ in prompts]


def unwrapped(prompt) -> str | list[int]:
    """A prompt's text or token ids (a dict's "prompt", else its "prompt_token_ids")."""
    return prompt.get("prompt", prompt.get("prompt_token_ids")) if isinstance(prompt, dict) else prompt


def as_conversation(prompt) -> list[dict]:
    """chat()'s form of a prompt: its text (or its first ids as words) as a user's message."""
    text = unwrapped(prompt)
    if not isinstance(text, str):
        text = " ".join(WORDS[i % len(WORDS)] for i in text[:30])
    return [{"role": "user", "content": text}]


class Interrupting:
    """generate()'s use_tqdm as a callable: a progress bar that raises KeyboardInterrupt at its
    after-th update (a user's Ctrl-C as a request finishes)."""

    def __init__(self, after: int):
        self.after, self.format_dict, self.postfix = after, {"elapsed": 1.0}, ""

    def __call__(self, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int):
        self.after -= n
        if self.after <= 0:
            raise KeyboardInterrupt


def take_outputs(run: Run, outputs: list, prompts: list, params, conversations: bool = False):
    """Check a call's outputs against its prompts (one each, in order, finished, n completions)
    and record them in run."""
    assert len(outputs) == len(prompts), f"{len(outputs)} outputs for {len(prompts)} prompts"
    params = params if isinstance(params, list) else [params] * len(prompts)
    for output, prompt, p in zip(outputs, prompts, params):
        assert output.finished and len(output.outputs) == p.n, output.request_id
        prompt = unwrapped(prompt)
        if conversations:
            assert prompt[-1]["content"] in output.prompt
        elif isinstance(prompt, str):
            assert output.prompt == prompt
        else:
            assert list(output.prompt_token_ids) == prompt[-(p.truncate_prompt_tokens or len(prompt)):]
        run.requests[output.request_id] = list(output.prompt_token_ids), p
        run.take(output)


def bad_call(rng: random.Random, llm: LLM, shared: list[int]):
    """A generate() or beam_search() call with one thing wrong: a ValueError, nothing added."""
    prompts = [random_prompt(rng, shared) for _ in range(rng.randint(1, 3))]
    params = SamplingParams(max_tokens=4)
    bad = rng.choice(["params count", "prompt", "params", "priority", "beam width", "beam prompt"])
    bad_prompt = rng.choice([*BAD_PROMPTS.values(), {"prompt_token_ids": []}, "",
                             {"prompt": "a", "multi_modal_data": {"image": 0}}])
    calls = {
        "params count": lambda: llm.generate(prompts, [params] * (len(prompts) + 1)),
        "prompt": lambda: llm.generate(prompts[:1] + [bad_prompt] + prompts[1:], params),
        "params": lambda: llm.generate(prompts, [params] * (len(prompts) - 1) + [SamplingParams(logprobs=21)]),
        "priority": lambda: llm.generate(prompts, params, priority=[0] * (len(prompts) + 1)),
        "beam width": lambda: llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=2)),
        "beam prompt": lambda: llm.beam_search(prompts + [bad_prompt], BeamSearchParams(beam_width=2, max_tokens=2)),
    }
    try:
        calls[bad]()
    except ValueError:
        return
    raise AssertionError(f"a bad call ({bad}) was taken")


def beam_search(rng: random.Random, llm: LLM, shared: list[int]) -> list[tuple]:
    """A beam search over a few prompts, its beams checked -> (prompt ids, params, each beam's
    tokens) a prompt, to compare with the prompt's search alone."""
    prompts = [random_prompt(rng, shared) for _ in range(rng.randint(1, 4))]
    params = BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 8),
                              ignore_eos=rng.random() < 0.3, length_penalty=rng.choice([1.0, 0.5]))
    results = llm.beam_search(prompts, params, concurrency_limit=rng.choice([None, 1, 2]))
    assert len(results) == len(prompts)
    searches = []
    for prompt, result in zip(prompts, results):
        prompt = unwrapped(prompt)
        ids = llm.get_tokenizer().encode(prompt) if isinstance(prompt, str) else prompt
        assert 1 <= len(result.sequences) <= params.beam_width
        for beam in result.sequences:
            assert beam.tokens[:len(ids)] == ids and 0 < len(beam.tokens) - len(ids) <= params.max_tokens
            assert beam.finish_reason in ("stop", "length") and len(beam.logprobs) == len(beam.tokens) - len(ids)
        searches.append((ids, params, [beam.tokens for beam in result.sequences]))
    return searches


def sleep(rng: random.Random, llm: LLM, mode: str):
    """A sleep of a random level, and the wake-up (with the weights reloaded after level 2)."""
    level = rng.choice([0, 1, 2])
    llm.sleep(level, mode)
    llm.wake_up()
    if level == 2:
        llm.collective_rpc("reload_weights")


@on_sorted_path_every_fourth_seed
def run_llm_seed(model: str, seed: int, **engine_kwargs) -> int:
    """One seed's run of LLM calls at random (generate, chat, enqueue / wait_for_completion with
    other calls between, beam_search, bad calls, a generate interrupted by Ctrl-C, sleeps, prefix
    cache resets), each call's outputs checked as it returns and the engine idle after it -> as
    run_seed."""
    rng = random.Random(seed)
    config = random_config(rng, **engine_kwargs)
    llm = LLM(model, **config)
    think = thinking_ids(llm.get_tokenizer(), config)
    # (a Run an LLM: a new one numbers its requests from 0 again)
    runs, searches = [Run(config=config, eos_token_ids=llm.llm_engine.eos_token_ids)], []
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(60)]

    def call(action: str, sleep_modes: list[str]):
        """One call that leaves nothing enqueued."""
        if action in ("generate", "chat"):
            prompts, params = random_call(rng, shared, think)
            if action == "chat":
                prompts = [as_conversation(prompt) for prompt in prompts]
                take_outputs(runs[-1], llm.chat(prompts, params, use_tqdm=False), prompts, params, conversations=True)
                return
            priority = [rng.randint(-2, 2) for _ in prompts] if config["scheduling_policy"] == "priority" else None
            take_outputs(runs[-1], llm.generate(prompts, params, use_tqdm=False, priority=priority), prompts, params)
        elif action == "beam search":
            searches.extend(beam_search(rng, llm, shared))
        elif action == "bad":
            bad_call(rng, llm, shared)
        elif action == "reset":
            assert llm.reset_prefix_cache()
        else:
            sleep(rng, llm, rng.choice(sleep_modes))

    for _ in range(rng.randint(4, 12)):
        action = rng.choice(["generate", "chat", "enqueue", "beam search", "bad", "interrupted", "sleep", "reset"])
        if action == "enqueue":   # requests enqueued, other calls, then wait_for_completion() returns them
            prompts, params = random_call(rng, shared, think)
            request_ids = llm.enqueue(prompts, params)
            for between in rng.sample(["generate", "chat", "bad", "beam search", "sleep", "reset"], rng.randint(0, 2)):
                call(between, ["keep"])
            outputs = llm.wait_for_completion(use_tqdm=False)
            assert [output.request_id for output in outputs] == request_ids
            take_outputs(runs[-1], outputs, prompts, params)
        elif action == "interrupted":
            prompts, params = random_call(rng, shared, think)
            try:
                outputs = llm.generate(prompts, params, use_tqdm=Interrupting(rng.randint(1, len(prompts) + 1)))
            except KeyboardInterrupt:
                if llm.closed:   # (with tensor parallelism the ranks end: the engine is made anew)
                    llm = LLM(model, **config)
                    runs.append(Run(config=config, eos_token_ids=llm.llm_engine.eos_token_ids))
            else:
                take_outputs(runs[-1], outputs, prompts, params)
        else:
            call(action, ["keep", "abort"])
        check_idle(llm.llm_engine)
    differences = 0
    for ids, params, tokens in searches:
        alone = [beam.tokens for beam in llm.beam_search([ids], params)[0].sequences]
        if alone != tokens:
            differences += 1
            print(f"  beam search of {ids}: {tokens} against {alone} alone ({params})")
    tokenizer = llm.get_tokenizer()
    llm.close()
    for run in runs:
        check_outputs(run, tokenizer)
        differences += count_differences_alone(model, config, run)
    return differences


def write_lora_adapters(model: str):
    """ADAPTERS: three random adapters of the tiny model (tests/test_lora.py's): every projection, the embedding
    and the LM head at rank 8, q/v at rank 4 with rsLoRA, o/down at rank 2."""
    import pathlib
    import tempfile
    from test_lora import ALL_TARGETS, MODEL_TARGETS, write_adapter
    shapes = [(ALL_TARGETS + MODEL_TARGETS, 8, False), (("q_proj", "v_proj"), 4, True),
              (("o_proj", "down_proj"), 2, False)]
    for i, (targets, rank, rslora) in enumerate(shapes):
        path = pathlib.Path(tempfile.mkdtemp())
        ADAPTERS.append(write_adapter(path, model, targets, rank=rank, seed=i + 1, use_rslora=rslora)[0])


def main():
    import tempfile

    import torch
    from conftest import build_model_dir, build_tokenizer
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:50", help="first:last (exclusive)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--llm", action="store_true", help="random calls of the LLM facade instead of engine steps")
    mode.add_argument("--pooling", action="store_true", help="an embedding engine's steps (runner='pooling')")
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama",
                                                            "mistral"], help="the tiny model's architecture")
    args = parser.parse_args()
    first, last = map(int, args.seeds.split(":"))
    sizes = {}
    if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available():
        from test_gpu import SIZES as sizes   # (the GPU kernels' head size; that module needs CUDA)
    model = build_model_dir(tempfile.mkdtemp(), args.arch, build_tokenizer(), **sizes)
    if not args.llm and not args.pooling:   # (on an MoE model the MLP targets are every expert's)
        write_lora_adapters(model)
    differing = 0
    for seed in range(first, last):
        run = run_llm_seed if args.llm else run_pooling_seed if args.pooling else run_seed
        differences = run(model, seed, dtype=args.dtype, device=args.device,
                          tensor_parallel_size=args.tensor_parallel_size)
        differing += differences
        what = "result(s)" if args.pooling else "greedy or seeded completion(s)"
        print(f"seed {seed}: invariants hold; {differences} {what} differ alone", flush=True)
    print(f"{last - first} seeds: invariants hold; {differing} {what} differ from their run alone")


if __name__ == "__main__":
    main()
