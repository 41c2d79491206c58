"""The public API: vLLM's input forms and output shapes, bad input, and recovery after errors."""
import copy
import json
import os
import random
import re
import types

import numpy as np
import pytest
import torch

from conftest import VOCAB_SIZE, log_lines, make_prompts
from nanovllm import LLM, BeamSearchParams, CompletionOutput, RequestOutput, SamplingParams
from nanovllm.config import Config, batch_defaults
from nanovllm.vllm_only_arguments import IDLE_ARGUMENTS, IGNORED_ARGUMENTS
from nanovllm.engine.output_processor import OutputProcessor, TokenTexts
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestMetrics
from nanovllm.sampling_params import RequestOutputKind

PROMPTS = make_prompts()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_dir, request):
    return LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_model_len=256,
               async_scheduling=request.param)


def assert_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests and engine.in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_input_forms_and_output_shape(llm, tokenizer):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text = "Hello world! The quick brown fox"
    token_ids = tokenizer.encode(text)
    outs = llm.generate([text, {"prompt_token_ids": token_ids}, token_ids, {"prompt": text}], sp,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == [text, None, None, text]
    assert all(o.prompt_token_ids == token_ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    out = outs[0]
    assert out.finished and out.request_id != outs[1].request_id
    comp = out.outputs[0]
    assert (comp.index, comp.finish_reason, comp.stop_reason) == (0, "length", None)
    assert len(comp.token_ids) == 5 and comp.text == tokenizer.decode(comp.token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    # A single prompt (string or token list) is accepted too.
    assert len(llm.generate(text, sp, use_tqdm=False)) == 1
    assert llm.generate(token_ids, sp, use_tqdm=False)[0].prompt_token_ids == token_ids
    assert_idle(llm)


def test_progress_bar_reports_token_speeds_as_vllm(llm):
    """use_tqdm may be a tqdm-like class (as in vLLM); the bar counts finished requests, and its
    postfix gives their prompt and output tokens per second, vLLM's wording."""
    from tqdm import tqdm
    bars = []

    class Recorder(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=Recorder)
    (bar,) = bars
    assert (bar.desc, bar.n, bar.total) == ("Processed prompts", 2, 2)
    speeds = re.fullmatch(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", bar.postfix)
    assert speeds, bar.postfix
    prompt_tokens, output_tokens = len(PROMPTS[0]) + len(PROMPTS[1]), 3 + 5
    assert sum(len(o.outputs[0].token_ids) for o in outs) == output_tokens
    # Both rates divide by the same elapsed time.
    assert float(speeds[1]) / float(speeds[2]) == pytest.approx(prompt_tokens / output_tokens, rel=0.01)
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, kept", [
    (dict(truncate_prompt_tokens=4), slice(0, 4)),                  # the tokenizer's side: right
    (dict(truncate_prompt_tokens=4, truncation_side="left"), slice(-4, None)),
    (dict(truncate_prompt_tokens=4, truncation_side="right"), slice(0, 4)),
    (dict(truncation=True, max_length=5, truncation_side="left"), slice(-5, None)),
    (dict(truncate_prompt_tokens=-1), slice(None)),                 # max_model_len: all of these
    (dict(truncate_prompt_tokens=4, truncation="do_not_truncate"), slice(None)),
    (dict(truncate_prompt_tokens=40), slice(None)),
])
def test_tokenization_kwargs_truncate_prompts(llm, tokenizer, kwargs, kept):
    """vLLM's tokenization_kwargs cut text and token-id prompts alike, on truncation_side or the
    tokenizer's own (HF's default: right, keeping the first tokens)."""
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([text, ids], sp, use_tqdm=False, tokenization_kwargs=kwargs)
    assert [o.prompt_token_ids for o in outs] == [ids[kept]] * 2
    assert_idle(llm)


def test_tokenization_kwargs_add_special_tokens(llm, tokenizer):
    """add_special_tokens reaches the encoding of text prompts: True by default for generate(),
    False for chat() (the template writes its own), as in vLLM."""
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kwargs):
            seen.append(kwargs.get("add_special_tokens"))
            return tokenizer.encode(text, **kwargs)

    original = llm.get_tokenizer()
    llm.set_tokenizer(Recording())
    try:
        sp = SamplingParams(temperature=0, max_tokens=1)
        llm.generate(["Hello"], sp, use_tqdm=False)
        llm.generate(["Hello"], sp, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
        chat = [{"role": "user", "content": "Hello"}]
        llm.chat(chat, sp, use_tqdm=False)
        llm.chat(chat, sp, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})
    finally:
        llm.set_tokenizer(original)
    assert seen == [True, False, False, True]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenization_kwargs={"padding": "max_length"}), "tokenization_kwargs: 'padding' not supported"),
    (dict(tokenization_kwargs={"truncation_side": "middle"}),
     "truncation_side must be 'left' or 'right', got 'middle'."),
    (dict(tokenization_kwargs={"truncate_prompt_tokens": 300}),
     "truncate_prompt_tokens=300 cannot be greater than max_model_len=256."),
    (dict(tokenization_kwargs={"truncate_prompt_tokens": -3}), "must be an int >= 0, or -1 for max_model_len; got -3."),
    (dict(tokenization_kwargs={"truncation": "only_first"}), "truncation must be True, False, 'longest_first'"),
    (dict(tokenization_kwargs={"truncate_prompt_tokens": 0}), "prompt 0 is empty."),
    (dict(mm_processor_kwargs={"fps": 2}), "mm_processor_kwargs is not supported: nanovllm runs text-only models"),
])
def test_bad_tokenization_kwargs(llm, kwargs, message):
    with pytest.raises(ValueError) as e:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    assert message in str(e.value)
    assert_idle(llm)


def test_enqueue_then_wait_for_completion(llm):
    """vLLM's enqueue() adds requests without running them; wait_for_completion() runs them and
    returns their outputs by request id. A generate() in between runs them too, returns only its
    own, and leaves the others for wait_for_completion()."""
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 1, 2)]
    first = llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS[:3]], sp, use_tqdm=False)
    assert len(first) == 3 and llm.llm_engine.has_unfinished_requests()
    second = llm.enqueue([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    (between,) = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
    assert len(between.outputs[0].token_ids) == 4 and between.request_id not in first + second
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == first + second
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 2, 2]
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:4]
    assert llm.wait_for_completion(RequestOutput, use_tqdm=False) == []
    assert_idle(llm)
    with pytest.raises(ValueError, match="output_type must be RequestOutput"):
        llm.wait_for_completion(dict)


def test_reset_prefix_cache(llm):
    """After reset_prefix_cache() (vLLM's options accepted) a prompt computed before is a miss."""
    prompt = [9, 9] + list(range(150, 180))            # 32 tokens: two full 16-token blocks
    sp = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], sp, use_tqdm=False)
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 16   # the last block is recomputed
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=False) is True
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert_idle(llm)


def test_apply_model_and_collective_rpc(llm):
    """vLLM's apply_model(func) runs func on the model and collective_rpc(method) a runner method or
    a function of the runner, each returning one result per rank; an unknown method is refused."""
    assert llm.apply_model(lambda model: type(model).__name__) == ["QwenForCausalLM"]
    assert llm.apply_model(lambda model: model.model.layers[0].self_attn.num_kv_heads) == [2]
    assert llm.collective_rpc(lambda runner, a, b=0: (runner.num_kvcache_blocks, a + b), args=(1,),
                              kwargs={"b": 2}) == [(64, 3)]
    assert llm.collective_rpc("apply_model", args=(lambda model: model.lm_head.weight.shape[0],)) == [
        llm.llm_engine.config.hf_config.vocab_size]
    for name in ("no_such_method", "_device_inputs", "num_kvcache_blocks"):
        with pytest.raises(ValueError, match=f"method '{name}' is not implemented"):
            llm.collective_rpc(name)
    with pytest.raises(ZeroDivisionError):
        llm.apply_model(lambda model: 1 / 0)
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    assert_idle(llm)


def test_start_and_stop_profile_write_a_trace(qwen3_dir, tmp_path):
    """vLLM's profiler_config (a dict, or an object with its fields) and start_profile(prefix) /
    stop_profile(): a torch trace and the table of ops by time per rank. Without a profiler
    start_profile is a RuntimeError; a second start or a stop without start is ignored, as vLLM
    does."""
    settings = types.SimpleNamespace(profiler="torch", torch_profiler_dir=str(tmp_path / "traces"),
                                     torch_profiler_use_gzip=False, delay_iterations=0)
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=32, profiler_config=settings)
    llm.start_profile("run1")
    llm.start_profile()                                  # ignored (a warning)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.stop_profile()
    llm.stop_profile()                                   # ignored (a warning)
    files = sorted(os.listdir(tmp_path / "traces"))
    assert len(files) == 2 and files[0] == "profiler_out_0.txt"
    assert files[1].startswith("run1_tp0.") and files[1].endswith(".pt.trace.json")
    with open(tmp_path / "traces" / files[1]) as f:
        assert any("QwenForCausalLM" in e.get("name", "") or "aten::" in e.get("name", "")
                   for e in json.load(f)["traceEvents"])
    plain = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=32)
    with pytest.raises(RuntimeError, match="Profiling is not enabled"):
        plain.start_profile()
    assert len(plain.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_get_metrics_counts_what_ran(qwen3_dir, async_scheduling):
    """get_metrics() with stat logging on (vLLM's names, labels and types): token and request
    counters (each generated token once, also when steps overlap), queue and KV-cache gauges,
    per-request histograms; an aborted request counts as "abort". With stat logging off (the
    default) it is a RuntimeError."""
    from nanovllm.metrics import Counter, Gauge, Histogram
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, disable_log_stats=False,
              async_scheduling=async_scheduling)
    prompts = PROMPTS[:3]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    first = llm.enqueue([PROMPTS[3]], SamplingParams(max_tokens=4))
    llm.llm_engine.abort_request(first[0])
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert all(m.labels["model_name"] == qwen3_dir and m.labels["engine"] == "0" for m in metrics.values())
    value = lambda name, reason=None: metrics[name, reason].value
    assert value("vllm:prompt_tokens") == sum(map(len, prompts)) and value("vllm:generation_tokens") == 12
    assert [value("vllm:request_success", r) for r in ("stop", "length", "abort", "error")] == [0, 3, 1, 0]
    assert value("vllm:num_requests_running") == value("vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc") == 0.0 and value("vllm:num_preemptions") == 0
    assert value("vllm:prefix_cache_queries") == sum(map(len, prompts)) and value("vllm:prefix_cache_hits") == 0
    tokens = metrics["vllm:request_prompt_tokens", None]
    assert isinstance(tokens, Histogram) and tokens.count == 4 and tokens.sum == sum(map(len, PROMPTS[:4]))
    assert tokens.buckets["+Inf"] == 4 and tokens.buckets["1.0"] == sum(len(p) == 1 for p in PROMPTS[:4]) and list(tokens.buckets)[:3] == ["1.0", "2.0", "5.0"]
    generated = metrics["vllm:request_generation_tokens", None]
    assert (generated.count, generated.sum, generated.buckets["5.0"], generated.buckets["2.0"]) == (4, 12, 4, 1)
    ttft = metrics["vllm:time_to_first_token_seconds", None]
    assert ttft.count == 3 and 0 < ttft.sum and ttft.buckets["2560.0"] == 3
    assert isinstance(metrics["vllm:prompt_tokens", None], Counter)
    assert isinstance(metrics["vllm:num_requests_running", None], Gauge)
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=16).get_metrics()


def _freed(runner) -> tuple[bool, bool]:
    """Whether the runner's weights and KV cache have no memory (sleep mode frees their storages)."""
    weight = runner.model.model.layers[0].mlp.down_proj.weight
    return weight.untyped_storage().nbytes() == 0, runner.kv_cache.untyped_storage().nbytes() == 0


def test_sleep_and_wake_up(qwen3_dir):
    """vLLM's sleep mode: sleep(level=1) frees the weights (kept in host memory) and the KV cache,
    wake_up() brings them back and the same tokens follow; level 2 forgets the weights, which
    collective_rpc("reload_weights") loads again. The prefix cache is emptied; while asleep no
    request is taken; wake_up(tags) wakes one kind of memory at a time. Bad levels and tags are
    ValueErrors; sleeping without enable_sleep_mode a RuntimeError."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=32, enable_sleep_mode=True)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    expected = tokens()
    long_prompt = {"prompt_token_ids": list(range(100, 140))}
    llm.generate([long_prompt], params, use_tqdm=False)
    assert llm.generate([long_prompt], params, use_tqdm=False)[0].num_cached_tokens == 32
    llm.sleep()
    assert engine.is_sleeping() and _freed(runner) == (True, True)
    assert runner.hibernations["weights"].backups is not None     # level 1 keeps them on the host
    with pytest.raises(RuntimeError, match=r"the engine is sleeping \(weights and kv_cache freed\); call wake_up"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not engine.requests
    llm.sleep(level=2)                                   # already asleep: a warning, nothing freed again
    for tags in ("weights", ["weights", "kv"]):
        with pytest.raises(ValueError, match=re.escape(f"tags must be a list of 'weights', 'kv_cache', 'scheduling', "
                                                       f"got {tags!r}.")):
            llm.wake_up(tags)
    llm.wake_up(["weights"])
    assert engine.is_sleeping() and _freed(runner) == (False, True)
    llm.wake_up(["weights"])                             # not asleep: a warning
    llm.wake_up(["kv_cache"])
    assert not engine.is_sleeping() and _freed(runner) == (False, False)
    assert llm.generate([long_prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert tokens() == expected
    llm.wake_up()                                        # not asleep: a warning

    llm.sleep(level=2)
    assert runner.hibernations["weights"].backups is None
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert tokens() == expected
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match=re.escape("wake_up(tags=['weights']) before reload_weights()")):
        llm.collective_rpc("reload_weights")
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    assert tokens() == expected

    with pytest.raises(ValueError, match="level must be 0, 1 or 2, got 3."):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="mode must be one of 'abort', 'wait', 'keep', got 'pause'."):
        llm.sleep(mode="pause")
    # what becomes of enqueued requests: "abort" (vLLM's default) drops them, "wait" runs them to their
    # end first (their outputs kept for wait_for_completion), "keep" runs them after wake_up
    llm.enqueue([PROMPTS[0]], params)
    llm.sleep()
    llm.wake_up()
    assert llm.wait_for_completion() == [] and not engine.requests
    llm.enqueue(PROMPTS[:2], params)
    llm.sleep(mode="wait")
    assert not engine.requests
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == expected[:2]
    llm.enqueue(PROMPTS[:3], params)
    engine.step()                                        # the prompts computed: their blocks go with the cache
    engine.step()
    llm.sleep(mode="keep")
    assert len(engine.requests) == 3 and not engine.scheduler.running and engine.block_manager.num_free_blocks == 32
    assert engine.step() == []                           # nothing runs while asleep
    with pytest.raises(RuntimeError, match=r"the engine is sleeping \(weights and kv_cache freed\)"):
        llm.wait_for_completion()
    assert len(engine.requests) == 3
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == expected[:3]
    assert_idle(llm)
    plain = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=32)
    with pytest.raises(RuntimeError, match="Sleep mode is not enabled: create the LLM with enable_sleep_mode=True."):
        plain.sleep()

    # level 0 (no enable_sleep_mode needed): the scheduler paused, memory and prefix cache kept; "keep"
    # keeps a request's KV as it is
    plain.enqueue([PROMPTS[0]], params)
    plain.llm_engine.step()
    plain.sleep(level=0, mode="keep")
    assert plain.llm_engine.is_sleeping() and plain.llm_engine.step() == []
    with pytest.raises(RuntimeError, match=r"the engine is sleeping \(scheduling paused\); call wake_up"):
        plain.generate(PROMPTS[:1], params, use_tqdm=False)
    plain.sleep(level=0)                                 # already asleep: a warning
    plain.wake_up(tags=["scheduling"])
    assert not plain.llm_engine.is_sleeping()
    assert [o.outputs[0].token_ids for o in plain.wait_for_completion()] == expected[:1]
    with pytest.raises(ValueError, match="tags must be a list of 'weights', 'kv_cache', 'scheduling', got"):
        plain.wake_up(["kv"])


def test_enqueue_chat_renders_as_chat(llm):
    """enqueue_chat() queues what chat() would run, with chat()'s template options."""
    conversations = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Bye"}]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.chat(conversations, sp, use_tqdm=False, add_generation_prompt=False)
    ids = llm.enqueue_chat(conversations, sp, add_generation_prompt=False,
                           tokenization_kwargs={"truncate_prompt_tokens": 4, "truncation_side": "left"})
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.prompt_token_ids for o in outs] == [e.prompt_token_ids[-4:] for e in expected]
    assert [o.prompt for o in outs] == [e.prompt for e in expected]
    assert_idle(llm)


@pytest.mark.parametrize("method,named", [("encode", "encode"), ("embed", "encode"), ("classify", "encode"),
                                          ("score", "score")])
def test_pooling_entry_points_need_a_pooling_model(llm, method, named):
    """As in vLLM: a generative engine's encode / embed / classify / score name runner='pooling'; reward
    is not an LLM method of vLLM 0.26's, and its refusal says what is."""
    args = (["Hello"], ["Hi"]) if method == "score" else (["Hello"],)
    with pytest.raises(ValueError, match=f"^LLM.{named}\\(\\) is only supported for pooling models. Try passing "
                                         f"`--runner pooling` to use the model as a pooling model.$"):
        getattr(llm, method)(*args)
    with pytest.raises(ValueError, match=r"^LLM.reward\(\) is not one of vLLM 0.26's LLM methods: for rewards, use "
                                         r"LLM.encode\(\.\.\., pooling_task='classify'\)"):
        llm.reward(["Hello"])


@pytest.mark.parametrize("method", ["init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                                    "update_weights", "finish_weight_update"])
def test_weight_transfer_is_refused(llm, method):
    with pytest.raises(ValueError, match=f"LLM.{method}\\(\\) transfers weights from a trainer, which needs "
                                         f"weight_transfer_config; nanovllm has no weight transfer."):
        getattr(llm, method)({"update_info": {}})
    assert llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


def test_world_size_and_mm_cache(llm):
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    assert llm.reset_mm_cache() is None


def test_outputs_in_input_order_with_per_prompt_params(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:8]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:8]


def test_chat_uses_template(llm, tokenizer):
    messages = [{"role": "user", "content": "Hello world!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == expected
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_template_options(llm):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The quick"}]
    out = llm.chat(messages, sp, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe quick"
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(messages[:1], sp, chat_template=plain, add_generation_prompt=False, use_tqdm=False)[0]
    assert out.prompt == "[user] Hi\n"
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        llm.chat(messages, sp, continue_final_message=True, use_tqdm=False)


def test_chat_content_parts(llm):
    """OpenAI-style content parts: their texts joined by newlines for the template ("auto", "string"),
    the list itself with "openai"; a non-text part or an unknown format is a ValueError."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    joined = llm.chat([{"role": "user", "content": "Hello\nworld"}], sp, use_tqdm=False)[0].prompt
    assert llm.chat(parts, sp, use_tqdm=False)[0].prompt == joined
    assert llm.chat(parts, sp, use_tqdm=False, chat_template_content_format="string")[0].prompt == joined
    listing = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    out = llm.chat(parts, sp, use_tqdm=False, chat_template=listing, add_generation_prompt=False,
                   chat_template_content_format="openai")[0]
    assert out.prompt == "<Hello><world>"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ValueError, match="content part of type 'image_url' is not supported"):
        llm.chat(image, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be 'auto', 'string' or 'openai', "
                                         "got 'xml'"):
        llm.chat(parts, sp, use_tqdm=False, chat_template_content_format="xml")


@pytest.mark.parametrize("messages, message", [
    ("Hello", "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists; got 'Hello'."),
    ({"role": "user", "content": "Hi"}, "messages must be a list of"),
    ([[{"role": "user", "content": "Hi"}], "Hi"], "messages must be a list of"),
    ([{"content": "Hi"}], "each message must be a dict with a 'role' string, got {'content': 'Hi'}."),
])
def test_chat_bad_messages(llm, messages, message):
    with pytest.raises(ValueError) as e:
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert message in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_set_tokenizer(qwen3_dir):
    """set_tokenizer replaces the tokenizer for prompts and for the output text."""
    llm = LLM(qwen3_dir, dtype="float32", num_kvcache_blocks=16)
    original = llm.get_tokenizer()

    decoded = []

    class Shouting:
        def encode(self, text, **kwargs):
            return original.encode(text.upper(), **kwargs)

        def decode(self, ids, **kwargs):
            decoded.append(list(ids))
            return original.decode(ids, **kwargs).upper()

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.set_tokenizer(Shouting())
    out = llm.generate(["hello"], sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == original.encode("HELLO")
    assert decoded and out.outputs[0].text == out.outputs[0].text.upper()
    llm.set_tokenizer(original)
    assert llm.get_tokenizer() is original


def test_vllm_output_fields_for_what_nanovllm_does_not_do(llm):
    """Scripts written for vLLM read these; they hold vLLM's empty values."""
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params,
            out.ec_transfer_params) == (None,) * 5
    assert out.multi_modal_placeholders == {}
    assert (out.outputs[0].lora_request, out.outputs[0].routed_experts) == (None, None)


def test_outputs_take_vllms_positional_arguments():
    """Code that builds outputs itself (a test double, say) passes vLLM 0.26's positional order."""
    completion = CompletionOutput(1, "ab", [5, 6], -0.5, None, None, "stop", "b")
    assert (completion.index, completion.token_ids, completion.routed_experts, completion.finish_reason,
            completion.stop_reason, completion.finished()) == (1, [5, 6], None, "stop", "b", True)
    metrics = RequestMetrics(arrival_time=1.0)
    out = RequestOutput("r", "p", [1, 2], None, [completion], True, metrics, None, None, None, 16, 0)
    assert (out.metrics, out.num_cached_tokens, out.num_cache_creation_tokens) == (metrics, 16, 0)
    with pytest.raises(TypeError):
        RequestOutput("r", "p", [1, 2], None, [completion], True, metrics, None, None, None, 16, 0, None)


def test_prefix_cache_hits_and_writes_per_request(llm):
    """num_cached_tokens: the prompt tokens found in the prefix cache; num_cache_creation_tokens (vLLM
    0.26): those the request computed and left there, its full 16-token blocks past the hit."""
    prompt = [7, 7, 7] + list(range(200, 237))          # 40 tokens: two full blocks and 8 more
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first, again = (llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, first.num_cache_creation_tokens) == (0, 32)
    assert (again.num_cached_tokens, again.num_cache_creation_tokens) == (32, 0)
    longer = llm.generate([prompt + list(range(240, 250))], sp, use_tqdm=False)[0]   # 50 tokens: 3 blocks
    assert (longer.num_cached_tokens, longer.num_cache_creation_tokens) == (32, 16)


def test_prefix_cache_hits_of_a_request_with_several_completions(llm):
    """With n > 1 the first completion computes the prompt and the others find its full blocks cached:
    the request reports what they found (vLLM's count for completions that end together)."""
    prompt = [9, 9, 9] + list(range(300, 337))         # 40 tokens, not asked before
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert (out.num_cached_tokens, out.num_cache_creation_tokens) == (32, 32)


def test_token_ids_from_numpy_and_torch(llm):
    """Token ids may come as numpy integers, a 1-D numpy array or a 1-D torch tensor: taken as ints."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    for prompts in ([np.int64(5), 6, np.int32(7)], [np.array([5, 6, 7])], [torch.tensor([5, 6, 7])],
                    {"prompt_token_ids": torch.tensor([5, 6, 7])}):
        out = llm.generate(prompts, sp, use_tqdm=False)[0]
        assert out.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected


def test_vllm_prompt_types(llm):
    """vLLM's TextPrompt / TokensPrompt import from nanovllm and work; keys asking for what nanovllm
    does not do (multimodal data, prompt embeddings, encoder-decoder prompts), unless None, unknown keys
    and a bad cache_salt are ValueErrors, not ignored."""
    from nanovllm import TextPrompt, TokensPrompt
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    by_ids = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], sp, use_tqdm=False)[0]
    by_text = llm.generate([TextPrompt(prompt="Hello")], sp, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == [5, 6, 7] and by_text.prompt == "Hello"
    none_given = llm.generate([{"prompt_token_ids": [5, 6, 7], "multi_modal_data": None, "mm_processor_kwargs": None}],
                              sp, use_tqdm=False)[0]
    assert none_given.outputs[0].token_ids == by_ids.outputs[0].token_ids
    for prompt, message in (
            ({"prompt": "Hi", "multi_modal_data": {"image": None}},
             "prompt 1: 'multi_modal_data' is not supported: multimodal inputs (nanovllm runs text-only models)."),
            ({"prompt_token_ids": [5], "cache_salt": ""}, "prompt 1: cache_salt must be a non-empty string, got ''."),
            ({"prompt_embeds": torch.zeros(3, 64)},
             "You must set `enable_prompt_embeds=True` to input `prompt_embeds`."),
            ({"encoder_prompt": "a", "decoder_prompt": "b"}, "prompt 1: 'encoder_prompt' is not supported: "
                                                             "encoder-decoder prompts (nanovllm runs decoder-only"),
            ({"prompt_token_ids": [5], "prompt_ids": [6]}, "prompt 1: unknown key 'prompt_ids'")):
        with pytest.raises(ValueError) as e:
            llm.generate([[1, 2], prompt], sp, use_tqdm=False)
        assert message in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_cache_salt_isolates_prefix_cache_hits(qwen3_dir):
    """A salted prompt hits the prefix cache only for the same salt; the tokens do not change."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = PROMPTS[7][:70]                                  # 4 full blocks of 16, then 6 tokens

    def run(**salt):
        out = llm.generate([{"prompt_token_ids": ids, **salt}], sp, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = run(cache_salt="tenant-a")
    assert first[0] == 0
    assert run(cache_salt="tenant-a") == (64, first[1])    # the same salt hits every full block
    assert run(cache_salt="tenant-b") == (0, first[1])     # another salt does not
    assert run() == (0, first[1])                          # nor does no salt
    assert run() == (64, first[1])
    beams = llm.beam_search([{"prompt_token_ids": ids, "cache_salt": "tenant-c"}],
                            BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(beams[0].sequences) == 2


def test_skip_reading_prefix_cache(qwen3_dir):
    """vLLM's per-request opt-out of prefix-cache hits; on by default with prompt_logprobs."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64)
    ids = {"prompt_token_ids": PROMPTS[7][:70]}          # 4 full blocks of 16, then 6 tokens

    def cached(**params):
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, **params)
        return llm.generate([ids], sp, use_tqdm=False)[0].num_cached_tokens

    assert cached() == 0 and cached() == 64
    assert cached(skip_reading_prefix_cache=True) == 0
    assert cached(skip_reading_prefix_cache=None) == 64
    assert cached(prompt_logprobs=0) == 0
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
    with pytest.raises(ValueError, match="skip_reading_prefix_cache=False cannot be combined with prompt_logprobs"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)


def test_output_kind_and_logits_processors_as_in_vllm(llm):
    """As vLLM's LLM, generate() returns each request once, finished, whatever output_kind says;
    per-request logits processors are refused unless None (as vLLM V1 does)."""
    for kind in RequestOutputKind:
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=kind)
        out = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]
        assert out.finished and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="output_kind must be RequestOutputKind, got 'delta'."):
        SamplingParams(output_kind="delta")
    assert SamplingParams(logits_processors=None).logits_processors is None
    with pytest.raises(ValueError, match="logits_processors is not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])


def test_lora_request_must_be_a_lora_request(llm):
    """(tests/test_lora.py runs adapters)"""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    plain = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, sp, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids == plain
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None, got <object object"):
        llm.generate(prompt, sp, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None, got 'adapter'"):
        llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False, lora_request="adapter")
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([PROMPTS[6]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(PROMPTS[6]) + len(out.outputs[0].token_ids) == 256
    assert out.outputs[0].finish_reason == "length"


def test_default_sampling_params_come_from_generation_config(llm):
    assert llm.get_default_sampling_params().temperature == 1.0   # the fixture's config sets none
    assert len(llm.generate([PROMPTS[2]], use_tqdm=False)[0].outputs[0].token_ids) <= 16


def test_generation_config_and_its_overrides(qwen3_dir, tmp_path):
    """vLLM's generation_config ("auto", "vllm" or a folder) and override_generation_config decide
    what generate() samples with when given no SamplingParams."""
    from transformers import GenerationConfig
    GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=7).save_pretrained(tmp_path)

    def defaults(**kwargs):
        llm = LLM(qwen3_dir, dtype=torch.float32, block_size=16, num_kvcache_blocks=32, max_model_len=256, **kwargs)
        return llm, llm.get_default_sampling_params()

    llm, params = defaults(generation_config=str(tmp_path))
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 7)
    assert params.min_p == SamplingParams().min_p                    # not set there: SamplingParams' own
    assert len(llm.generate([PROMPTS[2]], use_tqdm=False)[0].outputs[0].token_ids) <= 7
    _, params = defaults(generation_config=str(tmp_path), override_generation_config={"temperature": 0.3})
    assert (params.temperature, params.top_k) == (0.3, 20)
    _, params = defaults(generation_config="vllm", override_generation_config={"top_k": 5})
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 5, SamplingParams().max_tokens)
    for kwargs, message in ((dict(generation_config="/no/such/folder"), "generation_config must be 'auto', 'vllm'"),
                            (dict(override_generation_config={"temp": 1}),
                             "override_generation_config has unknown key(s) ['temp']")):
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(qwen3_dir, **kwargs)


def test_sampler_kernels_warm_up_for_the_models_own_top_k_or_top_p(qwen3_dir, monkeypatch):
    """The sampler's kernels are compiled at start-up, with the defaults' top_k and top_p when
    the generation config (or its override) sets a top_k or a top_p (the plain path otherwise)."""
    from nanovllm.layers.sampler import Sampler
    calls = []
    monkeypatch.setattr(Sampler, "warm_up", lambda self, *args: calls.append(args) or False)
    sizes = dict(dtype=torch.float32, block_size=16, num_kvcache_blocks=32, max_model_len=256, max_num_seqs=8)
    LLM(qwen3_dir, generation_config="vllm", override_generation_config={"top_k": 20, "top_p": 0.95}, **sizes)
    LLM(qwen3_dir, generation_config="vllm", override_generation_config={"top_p": 0.9}, **sizes)
    assert [args[2:] for args in calls] == [(8, 20, 0.95), (8, 0, 0.9)]
    LLM(qwen3_dir, generation_config="vllm", override_generation_config={"temperature": 0.7}, **sizes)
    assert calls[2][2:] == (8, 0, 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5."),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
    (dict(top_k=-5), "top_k must be 0 (disable), or at least 1, got -5."),
    (dict(min_p=2.0), "min_p must be in [0, 1], got 2.0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling, got 2."),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be less than or equal to max_tokens=2, got 5."),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number greater than zero, got 0.0."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number greater than zero, got inf."),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be non-negative or -1, got -2."),
    (dict(bad_words=["ok", ""]), "bad_words must be a list of non-empty strings, got ['ok', '']."),
    (dict(logit_bias={"a": 1.0}), "logit_bias must map non-negative token ids to finite numbers, got {'a': 1.0}."),
    (dict(logit_bias={5: float("nan")}), "logit_bias must map non-negative token ids to finite numbers, got {5: nan}."),
    (dict(max_tokens=1.5), "max_tokens must be int or None, got 1.5."),
    (dict(stop=5), "stop must be str or list or None, got 5."),
    (dict(stop_token_ids=7), "stop_token_ids must be list or None, got 7."),
    (dict(temperature="0.5"), "temperature must be float, got '0.5'."),
    (dict(min_p=None), "min_p must be float, got None."),
    (dict(ignore_eos="yes"), "ignore_eos must be bool, got 'yes'."),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of non-negative token ids, got []."),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be at least 1, or -1 (max_model_len), got 0."),
    (dict(detokenize=False, stop="x"), "stop strings are only supported when detokenize is True."),
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs needs exactly one constraint of json, "
                                                          "regex, choice, grammar, json_object, structural_tag, got 2"),
    (dict(extra_args=["x"]), "extra_args must be dict or None, got ['x']."),
    (dict(logprob_token_ids=[3, -4]), "logprob_token_ids must be a list of non-negative token ids, got [3, -4]."),
    (dict(logprob_token_ids=list(range(129))), "Too many logprob_token_ids: 129. The max is 128."),
    (dict(thinking_token_budget=-3), "thinking_token_budget must be a non-negative integer or -1 for unlimited, "
                                     "got -3."),
    (dict(repetition_detection={"max_pattern_size": 4}), "min_count must be >= 2 with max_pattern_size > 0, got 0."),
    (dict(repetition_detection={"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}),
     "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size, got 2 and 3."),
    (dict(repetition_detection={"pattern": 2}), "repetition_detection takes max_pattern_size, min_pattern_size"),
    (dict(routed_experts_prompt_start=5), "routed_experts_prompt_start is not supported"),
    (dict(flat_logprobs="yes"), "flat_logprobs must be bool, got 'yes'."),
    (dict(max_tokens=True), "max_tokens must be int or None, got True."),
    (dict(temperature=False), "temperature must be float, got False."),
    (dict(seed=1.5), "seed must be int or None, got 1.5."),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_tiny_temperatures_are_raised_as_vllms():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (with a warning), so it samples, n > 1 too;
    below 1e-5 it was greedy before that."""
    with log_lines("nanovllm.sampling_params") as lines:
        params = SamplingParams(temperature=1e-6, n=2)
    assert (params.temperature, params.is_greedy, params.n) == (0.01, False, 2)
    assert lines == ["temperature 1e-06 is less than 0.01, which may cause numerical errors nan or inf in tensors. "
                     "We have maxed it out to 0.01."]
    assert SamplingParams(temperature=0.5).temperature == 0.5 and SamplingParams(temperature=0).is_greedy


def test_numpy_values_in_sampling_params_become_python_values():
    """As numbers from numpy arrive in scripts: converted, also inside lists; a plain int for a float
    field is kept as it is (the type checks pass plain values by without converting them)."""
    sp = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(3), seed=np.int32(7),
                        stop_token_ids=[np.int64(5), 6], top_p=1, ignore_eos=np.bool_(True))
    values = (sp.temperature, sp.max_tokens, sp.seed, *sp.stop_token_ids, sp.top_p, sp.ignore_eos)
    assert values == (0.5, 3, 7, 5, 6, 1, True)
    assert [type(v) for v in values] == [float, int, int, int, int, int, bool]


def test_decode_options_reach_the_tokenizer(llm, monkeypatch):
    """skip_special_tokens and spaces_between_special_tokens go to every decode of the output text
    (through tokenizer.decode for a tokenizer that cleans up spaces: other fast tokenizers are
    decoded by their Rust tokenizer directly, where the second option means nothing); extra_args
    is kept on the params."""
    tokenizer = llm.get_tokenizer()
    seen = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **options: seen.append(options) or decode(ids, **options))
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    llm.set_tokenizer(tokenizer)        # the decode path is chosen when the tokenizer is set
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, skip_special_tokens=False,
                            spaces_between_special_tokens=False, extra_args={"tag": 7})
    try:
        out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    finally:
        monkeypatch.undo()
        llm.set_tokenizer(tokenizer)
    assert seen and all(o == dict(skip_special_tokens=False, spaces_between_special_tokens=False) for o in seen)
    assert out.outputs[0].text and params.extra_args == {"tag": 7}


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_detokenizing_gives_what_tokenizer_decode_gives(llm, monkeypatch, skip_special_tokens):
    """The direct Rust decode against transformers' decode, on outputs with special tokens in them."""
    tokenizer = llm.get_tokenizer()
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                            skip_special_tokens=skip_special_tokens, logit_bias={special[0]: 3.0, special[1]: 3.0})
    prompts = [p[:12] for p in PROMPTS[:4]]
    fast = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)    # the tokenizer.decode path
    llm.set_tokenizer(tokenizer)
    try:
        slow = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        monkeypatch.undo()
        llm.set_tokenizer(tokenizer)
    assert fast == slow and any(fast)
    assert skip_special_tokens or any("<|im_start|>" in text or "<|im_end|>" in text for text in fast)


def test_sampling_params_from_optional():
    """vLLM's from_optional: None means the default for n, the penalties, temperature and top_p;
    logit_bias keys may be numeric strings and biases are clamped to [-100, 100]."""
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          frequency_penalty=None, repetition_penalty=None, max_tokens=5,
                                          logit_bias={"7": 250.0, 3: -1000, 4: 0.5})
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias == {7: 100.0, 3: -100.0, 4: 0.5}
    with pytest.raises(ValueError, match=r"logit_bias contains key\(s\) that cannot be converted to integer "
                                         r"token IDs: \['a'\]"):
        SamplingParams.from_optional(logit_bias={"a": 1.0})
    with pytest.raises(ValueError, match="temperature must be non-negative, got -1"):
        SamplingParams.from_optional(temperature=-1.0)


def test_sampling_params_normal_forms_are_vllms():
    """As vLLM's __post_init__ leaves them: stop and bad_words lists (None: []), seed -1 as no seed,
    logprobs=True and prompt_logprobs=True as 1."""
    params = SamplingParams(stop="x", seed=-1, logprobs=True, prompt_logprobs=True)
    assert (params.stop, params.bad_words, params.seed) == (["x"], [], None)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    assert (SamplingParams().stop, SamplingParams(stop=("a", "b")).stop) == ([], ["a", "b"])


def test_sampling_params_clone_is_deep():
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.logit_bias[3] = 2.0
    copy.stop.append("y")
    assert params.logit_bias == {3: 1.0} and params.stop == ["x"]
    shallow = SamplingParams(logit_bias={3: 1.0}, skip_clone=True).clone()   # vLLM's skip_clone: shallow
    assert shallow.logit_bias is not None and shallow.logit_bias is shallow.clone().logit_bias


def test_flat_logprobs_gives_the_same_per_token_dicts(llm):
    """vLLM's flat_logprobs=True returns FlatLogprobs: a sequence of the same per-token dicts, kept
    as flat lists (the first prompt position reads {} there, None in a list), with top-N logprobs,
    the sampled token among them or not, and logprob_token_ids' own ranks."""
    from nanovllm.logprobs import FlatLogprobs
    for extra in (dict(logprobs=2), dict(logprobs=0), dict(logprob_token_ids=[5, 9, 5])):
        params = dict(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1, **extra)
        plain, flat = (llm.generate([{"prompt_token_ids": list(range(3, 9))}], SamplingParams(**params, flat_logprobs=f),
                                    use_tqdm=False)[0] for f in (False, True))
        assert type(flat.outputs[0].logprobs) is FlatLogprobs and type(plain.outputs[0].logprobs) is list
        assert list(flat.outputs[0].logprobs) == plain.outputs[0].logprobs and len(flat.outputs[0].logprobs) == 3
        assert flat.prompt_logprobs[0] == {} and plain.prompt_logprobs[0] is None
        assert list(flat.prompt_logprobs)[1:] == plain.prompt_logprobs[1:] and len(flat.prompt_logprobs) == 6


def test_prompt_scores_give_the_same_entries_flat_and_as_dicts():
    """A step's prompt scores go into FlatLogprobs column by column and into dicts position by
    position: the same entries, for sequences asking fewer top tokens than the step scored (0 too),
    and with a token in its own top (listed once, at its own rank)."""
    from nanovllm.engine.prompt_logprobs import PromptScores
    from nanovllm.layers.sampling_metadata import SamplerOutput
    rng = np.random.default_rng(0)
    rows = 3 + 5 + 4
    token_ids = rng.integers(0, 50, rows)
    top_ids = np.stack([rng.permutation(50)[:3] for _ in range(rows)])
    ranks = rng.integers(4, 9, rows)
    top_ids[[1, 6, 9], [0, 2, 1]], ranks[[1, 6, 9]] = token_ids[[1, 6, 9]], [1, 3, 2]
    scores = SamplerOutput(*(torch.tensor(a) for a in (token_ids, -rng.random(rows, np.float32), ranks,
                                                        top_ids, -np.sort(rng.random((rows, 3), np.float32), 1))))
    outs = []
    for flat in (False, True):
        seqs = [Sequence("r", 0, list(range(9)), SamplingParams(prompt_logprobs=k, flat_logprobs=flat))
                for k in (2, 0, 3)]
        tokens = iter(token_ids.tolist())
        for seq, n in zip(seqs, (3, 5, 4)):
            seq.token_ids[1:1 + n] = [next(tokens) for _ in range(n)]
        spans = [(seq, 1, list(range(n))) for seq, n in zip(seqs, (3, 5, 4))]
        for chunk in PromptScores(spans, scores, None).chunks():
            OutputProcessor(None, set(), 100).append_prompt_logprobs(chunk)
        outs.append([list(seq.prompt_logprobs)[1:] for seq in seqs])
    assert outs[0] == outs[1]
    first = outs[0][0]
    assert len(first) == 3 and list(first[1]) == [token_ids[1]] + [t for t in top_ids[1, :2] if t != token_ids[1]]
    assert first[1][token_ids[1]].rank == 1 and len(first[1]) == 2   # its own top: listed once
    assert [len(p) for p in outs[0][1]] == [1] * 5 and [len(p) for p in outs[0][2]] == [4, 3, 4, 4]
    assert first[0][token_ids[0]].logprob == scores.logprobs[0].item()


def test_flat_logprobs_reads_as_a_list_of_dicts():
    """FlatLogprobs by itself: positions appended as columns or as dicts (None: {}), read by index
    (negative too), slice (a FlatLogprobs of those positions), iteration and len; no writes."""
    from nanovllm.logprobs import FlatLogprobs, Logprob
    flat = FlatLogprobs()
    flat.append_position([7, 3], [-0.1, -2.5], [1, 2], ["a", None])
    flat.append(None)
    flat.extend([{4: Logprob(-1.0, 3, "b")}, {}])
    positions = [{7: Logprob(-0.1, 1, "a"), 3: Logprob(-2.5, 2, None)}, {}, {4: Logprob(-1.0, 3, "b")}, {}]
    assert len(flat) == 4 and list(flat) == positions and flat[-2] == positions[2]
    assert list(flat[1:3]) == positions[1:3] and list(flat[::2]) == positions[::2] and len(flat[4:]) == 0
    assert "FlatLogprobs([{7: Logprob(logprob=-0.1" in repr(flat)
    with pytest.raises(IndexError):
        flat[4]
    with pytest.raises(TypeError):
        flat[0] = {}


def test_logprob_token_ids_give_those_ids_logprobs(qwen3_dir):
    """vLLM's logprob_token_ids: each output token's entry holds the sampled token and exactly those
    ids, with the logprobs and ranks that logprobs=-1 gives them, in a batch with top-N and plain
    requests."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_model_len=256, max_logprobs=-1)
    ids = [5, 200, 17, 383]
    common = dict(temperature=0, max_tokens=4, ignore_eos=True)
    everything, chosen, top, plain = llm.generate(
        [PROMPTS[0]] * 4, [SamplingParams(**common, logprobs=-1), SamplingParams(**common, logprob_token_ids=ids),
                           SamplingParams(**common, logprobs=2), SamplingParams(**common)], use_tqdm=False)
    assert chosen.outputs[0].token_ids == everything.outputs[0].token_ids == plain.outputs[0].token_ids
    completion = chosen.outputs[0]
    for full, entry, token in zip(everything.outputs[0].logprobs, completion.logprobs, completion.token_ids):
        assert set(entry) == set(ids) | {token}
        for t in entry:
            assert entry[t].rank == full[t].rank and entry[t].logprob == pytest.approx(full[t].logprob, abs=1e-5)
    assert chosen.outputs[0].cumulative_logprob == pytest.approx(everything.outputs[0].cumulative_logprob, abs=1e-5)
    assert all(len(entry) in (2, 3) for entry in top.outputs[0].logprobs) and plain.outputs[0].logprobs is None


def test_repetition_detection_stops_a_looping_completion(llm):
    """vLLM's repetition_detection: the completion stops (finish_reason "repetition", stop_reason
    "repetition_detected") at the first token where its output ends in a pattern of up to
    max_pattern_size tokens repeated min_count times, not before min_tokens."""
    from nanovllm.sampling_params import RepetitionDetectionParams
    detection = RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate(PROMPTS, free, use_tqdm=False)
    looping = [(prompt, out.outputs[0].token_ids) for prompt, out in zip(PROMPTS, outputs)
               if any(detection.repeats(out.outputs[0].token_ids[:n]) for n in range(1, 40))]
    assert looping, "no greedy completion of the test model repeats itself"
    prompt, tokens = looping[0]
    first = next(n for n in range(1, 49) if detection.repeats(tokens[:n]))
    later = next(n for n in range(first + 1, 49) if detection.repeats(tokens[:n])) if first < 40 else None
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                    repetition_detection=detection), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[:first]
    assert (stopped.finish_reason, stopped.stop_reason) == ("repetition", "repetition_detected")
    if later is not None:
        held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, min_tokens=first + 1,
                                                     repetition_detection={"max_pattern_size": 4, "min_count": 3}),
                            use_tqdm=False)[0].outputs[0]
        assert held.token_ids == tokens[:later] and held.finish_reason == "repetition"
    assert_idle(llm)


@pytest.mark.parametrize("prompts, params, message", [
    ([[1, 2], list(range(300))], None, "prompt 1 (length 300) is longer than the maximum model length of 256."),
    ([[1, 2], list(range(256))], None, "prompt 1 (length 256) plus the number of requested output tokens (at least 1) "
                                       "is longer than the maximum model length of 256."),
    ([[1, 2], [5, 99999]], None, "prompt 1: token id 99999 is out of vocabulary (vocab_size=384)."),
    ([[1, 2], {"prompt_token_ids": []}], None, "prompt 1 is empty."),
    ([[1, 2]], [SamplingParams(), SamplingParams()], "sampling_params has 2 entries but there are 1 prompts"),
    ([[1, 2]], SamplingParams(logprobs=25), "Requested sample logprobs of 25, which is greater than max allowed: 20."),
    ([[1, 2]], SamplingParams(prompt_logprobs=21), "Requested prompt logprobs of 21, which is greater than max allowed: 20."),
    ([[1, 2]], SamplingParams(logprobs=-1), "Requested sample logprobs of 384, which is greater than max allowed: 20."),
    ([[1, 2]], SamplingParams(prompt_logprobs=-1), "Requested prompt logprobs of 384, which is greater than max allowed: 20."),
    ([[1, 2]], SamplingParams(logit_bias={5: 1.0, 384: 2.0}), "logit_bias has out-of-vocabulary token id 384 (vocab_size=384)."),
    ([[1, 2]], SamplingParams(allowed_token_ids=[1, 999]), "allowed_token_ids has out-of-vocabulary token id 999"),
    ([[1, 2]], SamplingParams(logprob_token_ids=[1, 384]), "logprob_token_ids has out-of-vocabulary token id 384"),
    ([[1, 2], 3.5], None, "prompt 1 must be a string"),
    ([[1, 2]], {"max_tokens": 2}, "sampling_params must be a SamplingParams or a list of them, got dict."),
    ([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2),
     "sampling_params must be a SamplingParams or a list of them, got BeamSearchParams; beam search is LLM.beam_search."),
    ([[1, 2], [5, True]], None, "prompt 1: token ids must be ints, got True (bool)."),
    ([[1, 2], ["a", "b"]], None, "prompt 1: token ids must be ints, got 'a' (str)."),
    ([[1, 2], np.array([[5, 6]])], None, "prompt 1: token ids must be one-dimensional, got shape (1, 2)."),
    ([[1, 2], np.array([5.0, 6.0])], None, "prompt 1: token ids must be ints, got 5.0 (float)."),
    ([[1, 2], {"prompt_token_ids": "abc"}], None, "prompt 1: prompt_token_ids must be a list of ints, got 'abc'."),
])
def test_bad_requests_leave_engine_usable(llm, prompts, params, message):
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert message in str(e.value)
    assert_idle(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_request_larger_than_the_whole_cache_is_rejected(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=16, num_kvcache_blocks=4, max_model_len=512)
    with pytest.raises(ValueError, match=r"prompt 0 \(length 60\) with max_tokens=10 needs up to 70 tokens"):
        llm.generate([list(range(3, 63))], SamplingParams(max_tokens=10), use_tqdm=False)
    assert_idle(llm)
    assert llm.generate([list(range(3, 40))], SamplingParams(max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.run_step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "run_step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=20), use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert len(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)) == 2


def test_logprob_has_vllms_fields_and_defaults():
    """vllm.logprobs.Logprob's fields, rank and decoded_token optional; slotted (perf_notes row 96)."""
    import dataclasses
    from nanovllm.logprobs import Logprob
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)
    assert dataclasses.asdict(Logprob(-0.5, 2, "a")) == {"logprob": -0.5, "rank": 2, "decoded_token": "a"}
    assert not hasattr(Logprob(-0.5), "__dict__")


def test_logprob_texts_are_each_tokens_own_text(llm):
    """decoded_token is tokenizer.decode([id]) in every entry, as lists of dicts and as FlatLogprobs;
    after set_tokenizer the new tokenizer's texts, not the ones kept from the old (perf_notes row 98)."""
    original = llm.get_tokenizer()
    sp = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for flat in (False, True):
        out = llm.generate(PROMPTS[:2], SamplingParams(**sp, flat_logprobs=flat), use_tqdm=False)
        entries = [(t, lp) for o in out for position in o.outputs[0].logprobs for t, lp in position.items()]
        prompt_entries = [(t, lp) for o in out for position in list(o.prompt_logprobs)[1:]
                          for t, lp in position.items()]
        assert len(entries) >= 2 * 4 * 3 and len(prompt_entries) >= 3
        assert all(lp.decoded_token == original.decode([t]) for t, lp in entries + prompt_entries)

    class Marking:
        def encode(self, text, **kwargs):
            return original.encode(text, **kwargs)

        def decode(self, ids, **kwargs):
            return original.decode(ids, **kwargs) + "|"

    llm.set_tokenizer(Marking())
    try:
        out = llm.generate(PROMPTS[:2], SamplingParams(**sp), use_tqdm=False)
    finally:
        llm.set_tokenizer(original)
    assert all(lp.decoded_token == original.decode([t]) + "|"
               for o in out for position in o.outputs[0].logprobs + o.prompt_logprobs[1:] for t, lp in position.items())


def test_token_texts_decode_each_id_once():
    calls = []
    texts = TokenTexts(lambda ids: calls.append(ids) or f"<{ids[0]}>")
    assert [texts[7], texts[8], texts[7], texts[7]] == ["<7>", "<8>", "<7>", "<7>"]
    assert calls == [[7], [8]]


def test_generate_collects_garbage_less_often_and_restores_the_thresholds(llm, monkeypatch):
    """The engine loop runs with the collector's thresholds raised (utils/heap.py); afterwards,
    and after an interrupted loop, they are what they were."""
    import gc
    engine, before = llm.llm_engine, gc.get_threshold()
    real_step, seen = engine.run_step, []

    def step(fail=False):
        seen.append(gc.get_threshold())
        if fail:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "run_step", step)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert gc.get_threshold() == before and seen[0] == (max(before[0], 50_000), before[1], 10 * before[2])
    monkeypatch.setattr(engine, "run_step", lambda: step(fail=True))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    assert gc.get_threshold() == before
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be at least 1, got 0."),
    (dict(block_size=10), "block_size must be a positive multiple of 16, got 10."),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5."),
    (dict(dtype="int3"), "dtype must be 'auto' or one of"),
    (dict(max_model_len=100000), "max_model_len (100000) is greater than the model's max_position_embeddings (512)."),
    (dict(no_such_option=1), "LLM() got an unexpected keyword argument 'no_such_option': it is not one of vLLM's "
                             "engine arguments."),
    (dict(max_num_seq=8), "unexpected keyword argument 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    (dict(load_format="pickle"), "load_format must be 'auto', 'safetensors' or 'dummy', got 'pickle'."),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of 'auto', 'bfloat16', 'fp8', 'fp8_e4m3', "
                                  "'fp8_e5m2', got 'int4'."),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=100),
     "max_num_batched_tokens (100) is smaller than max_model_len (512): with enable_chunked_prefill=False"),
    (dict(quantization="awq"), "quantization='awq' is not supported: nanovllm loads unquantized checkpoints"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size must be 1 (nanovllm has tensor parallelism only), got 2."),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be None or 'mp' (worker "
                                               "processes), got 'ray'."),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode must be 'auto' or 'slow', got 'mistral'."),
    (dict(scheduling_policy="lifo"), "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'."),
    (dict(max_num_seqs="8"), "max_num_seqs must be int or None, got '8'."),
    (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}),
     "speculative_config method='eagle' (model=None) is not supported: nanovllm speculates by n-gram prompt lookup "
     "(method='ngram') or with a draft model (method='draft_model')."),
    (dict(runner="draft"), "runner must be 'auto', 'generate' or 'pooling', got 'draft'."),
    (dict(convert="reward"), "convert must be 'auto', 'none', 'embed' or 'classify', got 'reward'."),
    (dict(runner="generate", convert="embed"), "convert='embed' makes a pooling model: it needs runner 'pooling' "
                                               "or 'auto', got runner='generate'."),
    (dict(runner="generate", convert="classify"), "convert='classify' makes a pooling model"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config is for pooling models (runner='pooling'), got "
                                                   "{'pooling_type': 'MEAN'} with runner='generate'."),
    (dict(model_impl="transformers"), "model_impl must be 'auto' or 'vllm' (nanovllm runs its own model code), "
                                      "got 'transformers'."),
    (dict(enable_expert_parallel=True), "enable_expert_parallel=True is not supported: MoE experts are split"),
    (dict(logprobs_mode="processed"), "logprobs_mode must be one of 'raw_logprobs', 'raw_logits', "
                                      "'processed_logprobs', 'processed_logits', got 'processed'."),
    (dict(num_gpu_blocks_override=8, num_kvcache_blocks=9), "num_gpu_blocks_override (8) and num_kvcache_blocks (9) "
                                                              "name the same setting; give one."),
    (dict(tokenizer="/no/such/tokenizer"), "tokenizer must be a local directory or a Hugging Face hub id such as "
                                           "'Qwen/Qwen3-0.6B', got '/no/such/tokenizer': no such directory."),
    (dict(enforce_eager="yes"), "enforce_eager must be bool, got 'yes'."),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be float, got '0.5'."),
    (dict(kv_cache_memory_bytes=1.5), "kv_cache_memory_bytes must be int or None, got 1.5."),
    (dict(max_num_seqs=True), "max_num_seqs must be int or None, got True."),
    (dict(cpu_offload_gb=2), "cpu_offload_gb must be 0 (no CPU offloading), got 2."),
    (dict(swap_space=-1), "swap_space must be non-negative, got -1."),
    (dict(max_logprobs=-2), "max_logprobs must be non-negative or -1 (no cap), got -2."),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be at least 1, got 0."),
    (dict(hf_overrides="max_position_embeddings=8"), "hf_overrides must be dict or None, got 'max_position_embeddings=8'."),
    (dict(hf_overrides={"quantization_config": {"quant_method": "gptq"}}),
     "the checkpoint is quantized (quant_method 'gptq'); nanovllm loads unquantized checkpoints and fp8 ones "
     "(quant_method 'fp8' or 'compressed-tensors') only."),
    (dict(data_parallel_size=2), "data_parallel_size is not supported (tensor parallelism on one host only); "
                                 "leave it at 1."),
    (dict(limit_mm_per_prompt={"image": 1}), "limit_mm_per_prompt is not supported (text-only models); leave it at "
                                             "None."),
    (dict(spec_method="mtp", spec_tokens=1), "speculative_config method='mtp' (model=None) is not supported"),
    (dict(chat_template="no template here"), "chat_template must be a Jinja template or the path of a file "
                                             "holding one; 'no template here' is neither (no such file)."),
    (dict(profiler_config={"profiler": "nvtx"}), "profiler_config.profiler must be 'torch', 'cuda' or None, got 'nvtx'."),
    (dict(profiler_config={"profiler": "torch"}), "profiler_config.torch_profiler_dir must be set when profiler is 'torch'."),
    (dict(profiler_config={"torch_profiler_dir": "/tmp/t"}), "torch_profiler_dir is only applicable when profiler is "
                                                             "'torch', got profiler=None."),
    (dict(profiler_config={"profiler": "torch", "torch_profiler_dir": "/tmp/t", "max_iterations": 3}),
     "profiler_config.max_iterations is not supported (only 0)"),
    (dict(profiler_config={"profilr": "torch"}), "profiler_config: unknown field 'profilr'."),
])
def test_bad_engine_arguments(qwen3_dir, kwargs, message):
    with pytest.raises(ValueError) as e:
        LLM(qwen3_dir, **kwargs)
    assert message in str(e.value)


def test_model_config_reads_as_vllms(qwen3_dir):
    """LLM.model_config and LLMEngine.model_config: the settings vLLM scripts read (lm-eval takes
    llm.llm_engine.model_config.max_model_len), with dtype resolved; served_model_name names the
    metrics' model (the first of a list, as vLLM's)."""
    llm = LLM(qwen3_dir, max_model_len=128, num_kvcache_blocks=4, seed=7, served_model_name=["tiny", "alias"],
              disable_log_stats=False)
    config = llm.llm_engine.model_config
    assert llm.model_config is config
    assert (config.model, config.max_model_len, config.dtype, config.seed, config.max_logprobs) == (
        qwen3_dir, 128, torch.float32, 7, 20)
    assert (config.runner_type, config.is_multimodal_model, config.architecture, config.served_model_name) == (
        "generate", False, "Qwen3ForCausalLM", "tiny")
    assert config.hf_text_config is config.hf_config and config.hf_config.vocab_size == 384
    assert (config.get_vocab_size(), config.get_hidden_size(), config.get_head_size(), config.get_total_num_kv_heads(),
            config.get_num_kv_heads(None), config.get_num_attention_heads(None), config.get_num_layers(None),
            config.get_sliding_window()) == (384, 64, 16, 2, 2, 4, 2, None)
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert {m.labels["model_name"] for m in llm.get_metrics()} == {"tiny"}
    assert LLM(qwen3_dir, num_kvcache_blocks=4).model_config.served_model_name == qwen3_dir
    with pytest.raises(AttributeError):
        config.no_such_setting
    assert copy.deepcopy(config).max_model_len == 128


def test_seed_none_draws_a_random_seed(qwen3_dir):
    """LLM(seed=None), vLLM's "no fixed seed": each engine draws its own, so unseeded sampling differs."""
    sampled = []
    for _ in range(2):
        llm = LLM(qwen3_dir, dtype="float32", num_kvcache_blocks=16, seed=None)
        assert isinstance(llm.llm_engine.config.seed, int)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        sampled.append(out[0].outputs[0].token_ids)
    assert sampled[0] != sampled[1]


def test_missing_model_directory():
    with pytest.raises(ValueError, match="no such directory"):
        LLM("./no/such/model")


def test_unreachable_hub_id_says_how_to_download(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="huggingface-cli download some-org/some-model"):
        LLM("some-org/some-model")


def test_hub_id_is_fetched_at_the_revision_into_download_dir_with_the_token(monkeypatch, qwen3_dir, tmp_path):
    import huggingface_hub
    calls = []

    def fetch(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], kwargs["cache_dir"], kwargs["token"]))
        return qwen3_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    llm = LLM("some-org/some-model", revision="v1.0", download_dir=str(tmp_path), trust_remote_code=True,
              hf_token="hf_example", block_size=16, num_kvcache_blocks=16)
    assert calls == [("some-org/some-model", "v1.0", str(tmp_path), "hf_example")]
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_string_prompt_without_tokenizer(qwen3_dir):
    llm = LLM(qwen3_dir, skip_tokenizer_init=True, block_size=16, num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="prompt 0 is a string, but the engine has no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(bad_words=["x"]), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3


def test_dummy_weights_need_only_a_config(qwen3_dir, tmp_path):
    import shutil
    shutil.copy(f"{qwen3_dir}/config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, block_size=16, num_kvcache_blocks=16)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 4


# ---- output processing without a model ------------------------------------------------------
def test_eos_stops_unless_ignored_and_respects_min_tokens(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    proc = OutputProcessor(tokenizer, {eos}, max_model_len=100)
    hello = tokenizer.encode("Hello")
    seq = Sequence("r", 0, [1, 2], SamplingParams(max_tokens=10))
    for t in hello + [eos]:
        proc.append(seq, t)
    assert (seq.finish_reason, seq.stop_reason, seq.output_text) == ("stop", None, "Hello")
    seq = Sequence("r", 0, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    for t in [eos, eos, eos]:
        proc.append(seq, t)
    assert seq.finish_reason == "length"
    seq = Sequence("r", 0, [1, 2], SamplingParams(max_tokens=5, min_tokens=2))
    proc.append(seq, eos)
    assert seq.finish_reason is None
    proc.append(seq, eos)
    assert seq.finish_reason == "stop"


def test_incremental_detokenization_matches_full_decode(tokenizer):
    proc = OutputProcessor(tokenizer, set(), max_model_len=1000)
    text = "Stop strings may span several tokens, so detokenization is incremental. 0 1 2 ü ß"
    target = tokenizer.encode(text)
    seq = Sequence("r", 0, tokenizer.encode("Hello"), SamplingParams(max_tokens=len(target)))
    for t in target:
        proc.append(seq, t)
    assert seq.output_text == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_made_at_the_end_is_the_text_of_each_step(tokenizer, skip_special_tokens):
    """A completion whose text nobody reads before it ends (LLM.generate's, without stop strings) is
    detokenized once, at its end: the same text, token for token, as detokenizing after every token
    (a streamed one), on random ids: byte tokens that leave characters incomplete, special tokens,
    EOS left out or kept."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    proc = OutputProcessor(tokenizer, {eos}, max_model_len=1000)
    rng = random.Random(0)
    held_back_at_end = 0
    for case in range(200):
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip_special_tokens,
                                include_stop_str_in_output=case % 3 == 0, ignore_eos=case % 5 == 0)
        texts = []
        for streamed in (True, False):
            seq = Sequence("r", 0, tokenizer.encode("Hello there"), params)
            seq.streamed = streamed
            for t in ids:
                proc.append(seq, t)
                if seq.finish_reason is not None:
                    break
            texts.append((seq.output_text, seq.finish_reason, seq.num_output_tokens))
        assert texts[0] == texts[1], (case, ids)
        held_back_at_end += tokenizer.decode(ids[:texts[0][2]]).endswith("\ufffd")
    assert held_back_at_end > 10        # the token-by-token path at the end ran too


def test_text_made_at_the_end_takes_one_window(tokenizer, monkeypatch):
    """Two decodes for a whole completion made at its end, instead of two a token."""
    proc = OutputProcessor(tokenizer, set(), max_model_len=1000)
    text = "Stop strings may span several tokens, so detokenization is incremental."
    target = tokenizer.encode(text)
    calls = []
    decode = proc._decode
    monkeypatch.setattr(proc, "_decode", lambda ids, *args: calls.append(len(ids)) or decode(ids, *args))
    seq = Sequence("r", 0, tokenizer.encode("Hello"), SamplingParams(max_tokens=len(target)))
    for t in target:
        proc.append(seq, t)
    assert seq.output_text == text and len(calls) == 2
    seq = Sequence("r", 0, tokenizer.encode("Hello"), SamplingParams(max_tokens=len(target), stop=["never"]))
    for t in target:
        proc.append(seq, t)
    assert seq.output_text == text and len(calls) == 2 + 2 * len(target)


def test_attention_backend_choice(qwen3_dir):
    from nanovllm.layers.attention import TorchBackend
    llm = LLM(qwen3_dir, attention_backend="torch", block_size=16, num_kvcache_blocks=8)
    assert isinstance(llm.llm_engine.model_runner.backend, TorchBackend)
    for name in ("triton", "flash_attn"):
        with pytest.raises(ValueError, match=f"attention_backend '{name}' needs a CUDA device"):
            LLM(qwen3_dir, attention_backend=name, device="cpu", block_size=16, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="attention_backend must be 'auto', 'triton', 'flash_attn' or 'torch'"):
        LLM(qwen3_dir, attention_backend="xformers")


def test_fp8_cache_keeps_auto_off_flash_attn(monkeypatch):
    """flash-attn's kernels read only a cache in the model's dtype: 'auto' takes Triton instead,
    and asking for flash_attn with an fp8 cache is a clear error."""
    from nanovllm.layers import attention
    monkeypatch.setattr(attention, "has_flash_attn", lambda: True)
    cuda = torch.device("cuda")
    assert isinstance(attention.select_backend("auto", cuda, 256, fp8_cache=True), attention.TritonBackend)
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' does not read an fp8 KV cache"):
        attention.select_backend("flash_attn", cuda, 256, fp8_cache=True)


def test_vllm_engine_arguments_that_mean_our_behaviour_are_accepted(qwen3_dir):
    """A vLLM script's usual LLM() arguments run unchanged where their value is what we do anyway
    (every vLLM 0.26 engine argument nanovllm has no use for at vLLM's default; those that leave the
    outputs as they are, e.g. fully_sharded_loras, at any value, each logged as not used);
    num_gpu_blocks_override (vLLM's name for num_kvcache_blocks) sizes the cache."""
    ignored = {name: object() for name in IGNORED_ARGUMENTS}
    with log_lines("nanovllm.config") as lines:
        llm = LLM(qwen3_dir, tokenizer_mode="slow", quantization=None, swap_space=8, cpu_offload_gb=0,
                  pipeline_parallel_size=1, distributed_executor_backend="mp", disable_log_stats=True,
                  enable_lora=False, speculative_config=None, runner="generate", model_impl="vllm",
                  enable_expert_parallel=False, enable_sleep_mode=False, logprobs_mode="raw_logprobs", hf_token=None,
                  enable_prefix_caching=None, enable_chunked_prefill=None, attention_backend=None,
                  block_size=16, num_gpu_blocks_override=16, **ignored,
                  **{name: idle for name, (idle, _) in IDLE_ARGUMENTS.items()})
    assert len(lines) == len(IGNORED_ARGUMENTS) and all(" is not used: " in line for line in lines)
    assert any(line.startswith("fully_sharded_loras=<object object at ") and line.endswith(
        " is not used: each rank adds its shard's part of the adapters' products.") for line in lines)
    # vLLM's compile and CUDA-graph settings, as its examples pass them
    with log_lines("nanovllm.config") as lines:
        LLM(qwen3_dir, num_kvcache_blocks=4, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
            optimization_level=0)
    assert lines == ["compilation_config={'cudagraph_capture_sizes': [1, 2, 4]} is not used: the engine compiles "
                     "and captures CUDA graphs its own way; enforce_eager=True turns the graphs off.",
                     "optimization_level=0 is not used: the engine compiles and captures CUDA graphs its own way; "
                     "enforce_eager=True turns the graphs off."]
    config = llm.llm_engine.config   # vLLM's None: the engine's choice
    assert (config.enable_prefix_caching, config.enable_chunked_prefill, config.attention_backend) == (True, True, "auto")
    assert llm.llm_engine.block_manager.num_blocks == 16
    # vLLM's defaults are idle too where they are empty containers: None and {} alike
    LLM(qwen3_dir, num_kvcache_blocks=4, limit_mm_per_prompt={}, media_io_kwargs=None, cpu_offload_params=set())
    defaults = LLM(qwen3_dir, block_size=None, max_num_batched_tokens=None, max_num_seqs=None,
                   num_kvcache_blocks=4).llm_engine.config
    # vLLM's None: its defaults off a large GPU (batch_defaults), our block size
    assert (defaults.block_size, defaults.max_num_batched_tokens, defaults.max_num_seqs) == (256, 8192, 256)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


@pytest.mark.parametrize("name, gib, expected", [("NVIDIA H200", 139.8, (16384, 1024)),
                                                  ("NVIDIA H100 80GB HBM3", 79.1, (16384, 1024)),
                                                  ("NVIDIA A100-SXM4-80GB", 79.1, (8192, 256)),
                                                  ("NVIDIA L40S", 44.4, (8192, 256))])
def test_batch_defaults_follow_vllms_by_gpu(monkeypatch, name, gib, expected):
    props = types.SimpleNamespace(name=name, total_memory=int(gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert batch_defaults("cuda") == expected
    assert batch_defaults("cpu") == (8192, 256)


def test_unset_batch_limits_resolve_as_vllms(qwen3_dir):
    """Without chunked prefill a step holds a whole prompt; a step never holds more tokens than
    max_num_seqs full sequences, nor more sequences than tokens; set values stay as given."""
    def limits(**kwargs):
        config = Config(qwen3_dir, **kwargs)
        return config.max_num_batched_tokens, config.max_num_seqs
    assert limits() == (8192, 256)
    assert limits(max_num_seqs=16, enable_chunked_prefill=False, hf_overrides={"max_position_embeddings": 10000},
                  max_model_len=10000) == (10000, 16)
    assert limits(max_model_len=16, max_num_seqs=4) == (64, 4)
    assert limits(max_num_batched_tokens=100) == (100, 100)
    assert limits(max_num_batched_tokens=100, max_num_seqs=300) == (100, 300)


def test_chat_template_from_llm_argument(qwen3_dir, tmp_path):
    """LLM(chat_template=...) (the text, or a file holding it) renders chat() conversations unless a
    call gives its own template; without either the tokenizer's is used."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    chat = [{"role": "user", "content": "Hi"}]
    sp = SamplingParams(temperature=0, max_tokens=1)
    sizes = dict(block_size=16, num_kvcache_blocks=16)
    for given in (template, str(path), path):
        llm = LLM(qwen3_dir, chat_template=given, **sizes)
        assert llm.llm_engine.config.chat_template == template
        assert llm.chat(chat, sp, use_tqdm=False)[0].prompt == "<user>Hi"
        assert llm.chat(chat, sp, use_tqdm=False, chat_template="[{{ messages[0]['content'] }}]")[0].prompt == "[Hi]"
    own = LLM(qwen3_dir, **sizes).chat(chat, sp, use_tqdm=False)[0].prompt
    assert own.startswith("<|im_start|>user\nHi<|im_end|>")


def test_hf_overrides_change_the_model_config(qwen3_dir):
    llm = LLM(qwen3_dir, hf_overrides={"max_position_embeddings": 128}, block_size=16, num_kvcache_blocks=16)
    assert llm.llm_engine.config.max_model_len == 128


def test_kv_cache_memory_bytes_sizes_the_cache(qwen3_dir):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(qwen3_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_bytes = 2 * 16 * hf.num_key_value_heads * head_dim * hf.num_hidden_layers * 4   # K and V, float32
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, kv_cache_memory_bytes=10 * block_bytes + 5)
    assert llm.llm_engine.model_runner.num_kvcache_blocks == 10
    with pytest.raises(ValueError, match=f"no memory is left for the KV cache at kv_cache_memory_bytes=100 "
                                         f"\\(one block takes {block_bytes}\\)"):
        LLM(qwen3_dir, dtype="float32", block_size=16, kv_cache_memory_bytes=100)


def test_quantized_checkpoint_is_refused(qwen3_dir, tmp_path):
    import json
    import shutil
    path = tmp_path / "quantized"
    shutil.copytree(qwen3_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the checkpoint is quantized \\(quant_method 'awq'\\)"):
        LLM(str(path))


def test_stats_are_logged_when_asked(qwen3_dir):
    """disable_log_stats=False: vLLM's periodic line (here after every step: interval 0)."""
    with log_lines("nanovllm.engine.stat_logger") as lines:
        llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, disable_log_stats=False)
        llm.llm_engine.stat_logger.interval_s = 0.0
        prompt = {"prompt_token_ids": PROMPTS[-1]}
        llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert lines and all(line.startswith("Avg prompt throughput: ") for line in lines)
    assert "Running: 1 reqs, Waiting: 0 reqs" in lines[0] and lines[0].endswith("Prefix cache hit rate: 0.0%")
    num_tokens, num_cached = len(PROMPTS[-1]), (len(PROMPTS[-1]) - 1) // 16 * 16
    assert lines[-1].endswith(f"Prefix cache hit rate: {num_cached / (2 * num_tokens):.1%}")
    assert LLM(qwen3_dir, block_size=16, num_kvcache_blocks=8).llm_engine.stat_logger is None   # vLLM's LLM default


def test_priority_scheduling_runs_lower_values_first(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_num_seqs=1,
              scheduling_policy="priority")
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                        priority=[2, 0, 1])
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in PROMPTS[:3]]     # input order
    started = [o.metrics.first_scheduled_time for o in outs]
    assert started[1] <= started[2] <= started[0]
    for bad, message in (([0, 1], "priority must be one int per prompt (3), got [0, 1]."),
                         ([0, 1.5, 2], "priority must be an int, got 1.5.")):
        with pytest.raises(ValueError) as e:
            llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2), use_tqdm=False, priority=bad)
        assert message in str(e.value)
    assert_idle(llm)
    fcfs = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="priority 1 needs scheduling_policy='priority'; the scheduling policy is 'fcfs'."):
        fcfs.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0])
    assert len(fcfs.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0])) == 2


def test_heap_frozen_while_an_engine_lives_and_the_engine_freed_after_del(qwen3_dir):
    """The engine moves the start-up heap out of the garbage collector's view (freeze_heap); once
    the LLM is gone the heap is handed back and the model's memory is freed."""
    import gc
    import weakref
    gc.unfreeze()
    llm = LLM(qwen3_dir, block_size=16, num_kvcache_blocks=16, max_model_len=256)
    assert gc.get_freeze_count() > 0
    weight = weakref.ref(next(llm.llm_engine.model_runner.model.parameters()))
    del llm
    gc.collect()
    assert gc.get_freeze_count() == 0 and weight() is None
