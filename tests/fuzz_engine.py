"""Random engine workloads, checked against the engine's invariants (a developer tool;
tests/test_fuzz.py runs a few seeds in CI).

A seed picks a small engine configuration (KV blocks, max_num_seqs, token budget, prefix caching,
async scheduling, CUDA graphs, scheduling policy) and a random run of requests (random sampling
options, among them penalties, stops, bad words, allowed ids, logprobs and, with xgrammar, a
choice grammar; output kinds, priorities and cache salts), requests it must refuse, aborts and
sleeps (levels 0-2, modes "keep" and "abort") between step() calls. Checked:
- a bad request (out-of-vocabulary id, a prompt too long, an unfinished request's id, ...) is a
  ValueError and changes nothing else;
- every request that is not aborted is reported finished exactly once; streamed CUMULATIVE
  outputs extend the ones before, DELTA outputs add up to the completion;
- no completion is longer than max_tokens; logprobs have an entry a token, prompt logprobs one a
  prompt token;
- once idle, every KV block is free and step() returns [];
- greedy and seeded requests give the tokens and text they give alone, in a fresh engine. On the
  CPU in float32 that is exact; on the GPU other batch sizes round otherwise (bf16, and float32
  through TF32 products), so a near tie may flip: differences are counted and printed with the
  logprob lead at the first differing token, not raised.

    python tests/fuzz_engine.py [--seeds 0:50] [--device cuda --dtype bfloat16] [--tensor-parallel-size 2]
"""
import argparse
import importlib.util
import random
from dataclasses import dataclass, field, replace

from nanovllm import EngineArgs, LLMEngine, SamplingParams
from nanovllm.sampling_params import RequestOutputKind, StructuredOutputsParams

HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None   # (structured outputs' optional dependency)
VOCAB_SIZE = 384   # (the tiny models' vocabulary, tests/conftest.py)
MAX_MODEL_LEN = 160


def random_params(rng: random.Random) -> SamplingParams:
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
                ("allowed_token_ids", rng.sample(range(VOCAB_SIZE), 40))]
    kw |= {name: value for name, value in optional if rng.random() < 0.2}
    if "allowed_token_ids" not in kw and rng.random() < 0.05 and HAS_XGRAMMAR:
        kw["structured_outputs"] = StructuredOutputsParams(choice=["yes", "no", "the lazy dog"])
    return SamplingParams(**kw)


def random_bad_request(rng: random.Random, unfinished: list[str]) -> tuple[list[int], SamplingParams, str]:
    """A prompt, params and request id of which one is bad (the id of an unfinished request, if any)."""
    prompt, params, request_id = [1, 2, 3], SamplingParams(max_tokens=4), "bad"
    bad = rng.choice(["vocabulary", "long", "full", "empty", "logprobs", "logit_bias"] + ["id"] * bool(unfinished))
    if bad in ("vocabulary", "long", "full", "empty"):
        prompt = {"vocabulary": [1, VOCAB_SIZE], "long": [1] * (MAX_MODEL_LEN + 1), "full": [1] * MAX_MODEL_LEN,
                  "empty": []}[bad]
    elif bad == "id":
        request_id = rng.choice(unfinished)
    else:
        params = SamplingParams(logprobs=21) if bad == "logprobs" else SamplingParams(logit_bias={VOCAB_SIZE: 1.0})
    return prompt, params, request_id


def random_config(rng: random.Random, **engine_kwargs) -> dict:
    return dict(block_size=16, num_kvcache_blocks=rng.choice([12, 24, 64]), max_num_seqs=rng.choice([2, 4, 8]),
                scheduling_policy=rng.choice(["fcfs", "priority"]),
                max_num_batched_tokens=rng.choice([32, 64, 256]), max_model_len=MAX_MODEL_LEN,
                enable_prefix_caching=rng.choice([True, False]), async_scheduling=rng.choice([True, False]),
                enforce_eager=rng.choice([True, False]), enable_sleep_mode=True, **engine_kwargs)


@dataclass
class Run:
    """What a seed's run has sent and been told, request by request."""
    requests: dict = field(default_factory=dict)    # request id -> (prompt token ids, SamplingParams)
    finished: dict = field(default_factory=dict)    # request id -> its finished RequestOutput
    completions: dict = field(default_factory=dict)  # (request id, index) -> (token ids, text) so far
    aborted: set = field(default_factory=set)

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
        if output.finished:
            assert output.request_id not in self.finished, f"{output.request_id} reported finished twice"
            self.finished[output.request_id] = output


def run_seed(model: str, seed: int, **engine_kwargs) -> int:
    """One seed's run (see the module's docstring); raises AssertionError on a broken invariant
    -> the number of greedy or seeded completions that differ from their run alone."""
    rng = random.Random(seed)
    config = random_config(rng, **engine_kwargs)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **config))
    run = Run()
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(60)]   # prompts begin with parts of it (prefix hits)
    for i in range(rng.randint(20, 80)):
        action = rng.random()
        if action < 0.3:
            own = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 100))]
            prompt = (shared[:rng.randint(0, 60)] + own)[:120]
            request_id, params = f"r{i}", random_params(rng)
            salt = rng.choice([None, None, "a", "b"])
            priority = rng.randint(-2, 2) if config["scheduling_policy"] == "priority" else 0
            engine.add_request(request_id, {"prompt_token_ids": prompt, "cache_salt": salt}, params, priority=priority)
            run.requests[request_id] = prompt, params
        elif action < 0.33:   # a request the engine must refuse, with nothing else changed
            prompt, params, request_id = random_bad_request(rng, run.unfinished())
            try:
                engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            except ValueError:
                pass
            else:
                raise AssertionError(f"{request_id}: a bad request was taken")
        elif action < 0.36 and run.unfinished():
            request_id = rng.choice(run.unfinished())
            engine.abort_request([request_id])
            run.aborted.add(request_id)
        elif action < 0.39:
            level, mode = rng.choice([0, 1, 2]), rng.choice(["keep", "keep", "abort"])
            engine.sleep(level, mode)
            if mode == "abort":
                run.aborted |= set(run.unfinished())
            engine.wake_up()
            if level == 2:
                engine.collective_rpc("reload_weights")
        for output in engine.step():
            run.take(output)
    while engine.has_unfinished_requests():
        for output in engine.step():
            run.take(output)
    assert not run.unfinished(), f"never reported finished: {run.unfinished()}"
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks, f"{blocks.num_blocks - blocks.num_free_blocks} blocks leaked"
    assert engine.step() == []
    engine.close()
    check_outputs(run)
    return count_differences_alone(model, config, run)


def check_outputs(run: Run):
    for request_id, output in run.finished.items():
        prompt, params = run.requests[request_id]
        for index in range(params.n):
            tokens, _ = run.completions[(request_id, index)]
            assert len(tokens) <= params.max_tokens, f"{request_id}: {len(tokens)} tokens > {params.max_tokens}"
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            assert len(output.outputs) == params.n
            for completion in output.outputs:
                if params.logprobs is not None:
                    assert len(completion.logprobs) == len(completion.token_ids), request_id
        if params.prompt_logprobs is not None and output.prompt_logprobs is not None:
            assert len(output.prompt_logprobs) == len(prompt), request_id


def count_differences_alone(model: str, config: dict, run: Run) -> int:
    """Greedy and seeded requests run again one at a time -> how many completions came out
    otherwise. Each difference is printed with the logprob by which the token alone led the other
    (a near tie says rounding)."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **{**config, "max_num_seqs": 1}))
    differences = 0
    for request_id in run.finished:
        prompt, params = run.requests[request_id]
        if params.temperature > 0 and params.seed is None:
            continue
        engine.add_request(request_id, {"prompt_token_ids": prompt},
                           replace(params, output_kind=RequestOutputKind.FINAL_ONLY, logprobs=20))
        while engine.has_unfinished_requests():
            for output in engine.step():
                alone = output.outputs
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
            top = completion.logprobs[at]
            lead = top[completion.token_ids[at]].logprob - top[tokens[at]].logprob if tokens[at] in top else None
            print(f"  {request_id}.{completion.index}: token {at} is {tokens[at]}, alone {completion.token_ids[at]}, "
                  f"which led it by {lead} ({params})")
    engine.close()
    return differences


def main():
    import tempfile

    import torch
    from conftest import build_model_dir, build_tokenizer
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:50", help="first:last (exclusive)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    first, last = map(int, args.seeds.split(":"))
    sizes = {}
    if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available():
        from test_gpu import SIZES as sizes   # (the GPU kernels' head size; that module needs CUDA)
    model = build_model_dir(tempfile.mkdtemp(), "qwen3", build_tokenizer(), **sizes)
    differing = 0
    for seed in range(first, last):
        differences = run_seed(model, seed, dtype=args.dtype, device=args.device,
                               tensor_parallel_size=args.tensor_parallel_size)
        differing += differences
        print(f"seed {seed}: invariants hold; {differences} greedy or seeded completion(s) differ alone", flush=True)
    print(f"{last - first} seeds: invariants hold; {differing} completion(s) differ from their run alone")


if __name__ == "__main__":
    main()
