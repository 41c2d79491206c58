"""vLLM's engine API without the LLM facade: EngineArgs (from code or the command line),
LLMEngine.from_engine_args, add_request(request_id, prompt, params), step() streaming each
request's outputs as its output_kind asks, abort_request."""
import re
import subprocess
import sys
import weakref

import pytest

from conftest import build_model_dir, log_lines, make_prompts
from nanovllm import LLM, EngineArgs, LLMEngine, SamplingParams
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = make_prompts()
SETTINGS = dict(dtype="float32", block_size=16, num_kvcache_blocks=64, max_model_len=256)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(qwen3_dir, request):
    return LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, async_scheduling=request.param, **SETTINGS))


def run_to_end(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests_dp(engine.has_unfinished_requests()):   # (vLLM's data-parallel loop)
        outputs += engine.step()
    return outputs


def assert_idle(engine):
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.streamer.sent
    assert engine.step() == []   # (vLLM's step() with nothing to run)


def test_the_vllm_engine_example_runs(qwen3_dir, tokenizer):
    """vLLM's offline LLMEngine example: engine arguments from the command line (either flag
    spelling), requests added while stepping, finished outputs printed; the tokens are those
    LLM.generate gives."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", qwen3_dir, "--dtype", "float32", "--block_size", "16",
                              "--num-kvcache-blocks=64", "--no-enable-prefix-caching", "--max-model-len", "256",
                              "--hf-overrides", '{"rms_norm_eps": 1e-06}', "--served-model-name", "tiny", "alias"])
    # vLLM's JSON arguments key by key, and -O
    dotted = parser.parse_args(["--hf-overrides.rope_theta", "1e6", "--hf_overrides.rope_parameters.factor=4.0",
                                "-cc.mode", "none", "-O3", "--max_num_seqs=8"])
    assert dotted.hf_overrides == {"rope_theta": 1e6, "rope_parameters": {"factor": 4.0}}
    assert (dotted.compilation_config, dotted.optimization_level, dotted.max_num_seqs) == ({"mode": "none"}, 3, 8)
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.block_size, engine_args.enable_prefix_caching, engine_args.max_num_seqs) == (16, False, None)
    engine = LLMEngine.from_engine_args(engine_args)
    assert engine.config.hf_config.rms_norm_eps == 1e-6 and not engine.config.enable_prefix_caching
    assert engine.model_config.served_model_name == "tiny"
    assert engine.stat_logger is not None and EngineArgs().disable_log_stats is False   # vLLM's EngineArgs default
    hf_tokens = [parser.parse_args(flags).hf_token for flags in (["--hf-token"], ["--hf-token", "hf_x"])]
    assert hf_tokens == [True, "hf_x"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pending = [("Hello world", params), (PROMPTS[1], params), ({"prompt_token_ids": PROMPTS[2]}, params)]
    finished, request_id = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, sampling_params = pending.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["0", "1", "2"]
    expected = LLM(qwen3_dir, **SETTINGS).generate(["Hello world", PROMPTS[1], PROMPTS[2]], params, use_tqdm=False)
    assert [finished[str(i)].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in expected]
    assert finished["0"].prompt == "Hello world" and finished["0"].prompt_token_ids == tokenizer.encode("Hello world")
    assert engine.get_tokenizer() is engine.tokenizer


@pytest.mark.parametrize("flat_logprobs", [False, True])
def test_output_kinds_stream_as_in_vllm(engine, flat_logprobs):
    """CUMULATIVE: an output per new token, each the completion so far; DELTA: only the new
    token and text each time, adding up to the completion; FINAL_ONLY: one output at the end.
    The logprobs come as lists or, with flat_logprobs, as FlatLogprobs of the same positions."""
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
             "final": RequestOutputKind.FINAL_ONLY}
    for name, kind in kinds.items():
        engine.add_request(name, {"prompt_token_ids": PROMPTS[3]},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, output_kind=kind,
                                          flat_logprobs=flat_logprobs))
    by_request = {name: [] for name in kinds}
    for output in run_to_end(engine):
        by_request[output.request_id].append(output)
    final = by_request["final"]
    assert len(final) == 1 and final[0].finished
    tokens, text = final[0].outputs[0].token_ids, final[0].outputs[0].text
    assert len(tokens) == 8

    cumulative = by_request["cumulative"]
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 9))
    assert [o.finished for o in cumulative] == [False] * 7 + [True]
    assert all(o.outputs[0].token_ids == tokens[:i + 1] and len(o.outputs[0].logprobs) == i + 1
               for i, o in enumerate(cumulative))
    assert cumulative[-1].outputs[0].text == text and cumulative[-1].outputs[0].finish_reason == "length"

    delta = by_request["delta"]
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in tokens]
    assert "".join(o.outputs[0].text for o in delta) == text
    assert all(len(o.outputs[0].logprobs) == 1 for o in delta) and delta[-1].finished
    assert [p for o in delta for p in o.outputs[0].logprobs] == list(final[0].outputs[0].logprobs)
    assert all(type(o.outputs[0].logprobs).__name__ == ("FlatLogprobs" if flat_logprobs else "list")
               for o in cumulative + delta + final)
    merged = delta[0]                                      # vLLM's RequestOutput.add: the deltas add up
    for output in delta[1:]:
        merged.add(output, aggregate=True)
    completion = merged.outputs[0]
    assert (completion.token_ids, completion.text, completion.finish_reason, merged.finished) == (
        tokens, text, "length", True)
    assert list(completion.logprobs) == list(final[0].outputs[0].logprobs)
    assert_idle(engine)


def test_stop_string_is_never_streamed(engine):
    """With a stop string, the last characters that could begin it are held back until the
    completion ends, so the streamed text never shows what the stop string cuts."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("free", {"prompt_token_ids": PROMPTS[4]}, params)
    [free] = [o for o in run_to_end(engine) if o.finished]
    text = free.outputs[0].text
    cut = next(i for i in range(6, len(text) - 3) if text.index(text[i:i + 3]) == i)   # its first occurrence
    stop = text[cut:cut + 3]
    engine.add_request("stopped", {"prompt_token_ids": PROMPTS[4]},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                      output_kind=RequestOutputKind.DELTA))
    deltas = [o.outputs[0].text for o in run_to_end(engine)]
    assert "".join(deltas) == text[:cut] and all(stop not in d for d in deltas) and len(deltas) > 2
    assert_idle(engine)


def test_n_completions_stream_one_by_one(engine):
    """As in vLLM, with n > 1 each completion streams as its own output (its index tells which),
    and the request is reported finished once, by its last output, even where its completions end
    in one step; FINAL_ONLY gives them together."""
    streamed = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=5, ignore_eos=True)
    engine.add_request("streamed", {"prompt_token_ids": PROMPTS[5]}, streamed)
    engine.add_request("together", {"prompt_token_ids": PROMPTS[5]},
                       SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=5, ignore_eos=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = run_to_end(engine)
    [together] = [o for o in outputs if o.request_id == "together"]
    streamed_outputs = [o for o in outputs if o.request_id == "streamed"]
    assert all(len(o.outputs) == 1 for o in streamed_outputs)
    last = {o.outputs[0].index: o.outputs[0].token_ids for o in streamed_outputs}
    assert last == {c.index: c.token_ids for c in together.outputs} and len(last) == 2
    assert [o.finished for o in streamed_outputs] == [False] * (len(streamed_outputs) - 1) + [True]
    merged = streamed_outputs[0]                           # RequestOutput.add: each completion's latest
    for output in streamed_outputs[1:]:
        merged.add(output, aggregate=False)
    assert {c.index: c.token_ids for c in merged.outputs} == last and merged.finished
    assert_idle(engine)


def test_bad_requests_and_aborts_leave_the_engine_usable(engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    with pytest.raises(ValueError, match="Request id a already running."):
        engine.add_request("a", PROMPTS[1], params)
    for request_id, prompt, kwargs, message in [
            (7, PROMPTS[1], {}, "request_id must be a str, got 7."),
            ("b", [1, 10 ** 6], {}, "prompt 0: token id 1000000 is out of vocabulary"),
            ("b", PROMPTS[1], {"lora_request": object()}, "lora_request must be a LoRARequest or None"),
            ("b", PROMPTS[1], {"priority": 1}, "priority 1 needs scheduling_policy='priority'"),
            ("b", PROMPTS[1], {"tokenization_kwargs": {"padding": True}},
             "tokenization_kwargs: 'padding' not supported")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params, **kwargs)
    with pytest.raises(ValueError, match="sampling_params\\[0\\] must be a SamplingParams"):
        engine.add_request("b", PROMPTS[1], {"max_tokens": 3})
    assert list(engine.requests) == ["a"]
    engine.add_request("c", PROMPTS[2], params)
    engine.step()
    engine.abort_request(["a", "no-such-id"])
    assert engine.get_num_unfinished_requests() == 1
    outputs = run_to_end(engine)
    assert {o.request_id for o in outputs} == {"c"} and outputs[-1].finished
    assert_idle(engine)


def test_vllm_only_engine_arguments_come_from_the_command_line(qwen3_dir):
    """vLLM's flags for what nanovllm has no use for parse as vLLM's do: at vLLM's default (or, for
    those that leave the outputs alone, any value) the engine starts; otherwise the engine's
    ValueError names the argument. EngineArgs reads them as vLLM's defaults."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    idle = ["--data-parallel-size", "1", "--enable-dbo", "--limit-mm-per-prompt", "{}", "--worker-cls", "auto",
            "--kv-transfer-config", "null", "--max-lora-rank", "64", "--prefix-caching-hash-algo", "xxhash",
            "--fully-sharded-loras", "--no-disable-cascade-attn", "--compilation-config", '{"cudagraph_mode": "NONE"}',
            "--cudagraph-capture-sizes", "1", "2", "4", "--disable-hybrid-kv-cache-manager",
            "-tp", "1", "-O3", "-dp", "1"]
    args = parser.parse_args(["--model", qwen3_dir, "--block-size", "16", "--num-kvcache-blocks", "8", *idle])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.data_parallel_size, engine_args.enable_dbo, engine_args.max_lora_rank) == (1, True, 64)
    assert (engine_args.fully_sharded_loras, engine_args.disable_cascade_attn) == (True, False)
    assert engine_args.compilation_config == {"cudagraph_mode": "NONE"}
    assert (engine_args.cudagraph_capture_sizes, engine_args.disable_hybrid_kv_cache_manager) == ([1, 2, 4], True)
    assert (engine_args.tensor_parallel_size, engine_args.optimization_level) == (1, 3)   # vLLM's short flags
    assert LLMEngine.from_engine_args(engine_args).block_manager.num_blocks == 8
    llm = LLM.from_engine_args(engine_args)              # vLLM's LLM.from_engine_args too
    assert (llm.llm_engine.config.model, llm.llm_engine.block_manager.num_blocks) == (qwen3_dir, 8)
    plain = LLM(qwen3_dir, num_kvcache_blocks=8)       # LLM()'s own default: no stats
    assert llm.llm_engine.stat_logger is not None and plain.llm_engine.stat_logger is None
    config = EngineArgs(model=qwen3_dir, num_kvcache_blocks=8).create_engine_config()   # (stats logged by default)
    for disable, stats in ((False, True), (True, False)):   # and LLMEngine.from_vllm_config
        engine = LLMEngine.from_vllm_config(config, disable_log_stats=disable)
        assert engine.block_manager.num_blocks == 8 and (engine.stat_logger is not None) == stats
    assert (EngineArgs().data_parallel_size, EngineArgs().worker_cls) == (1, "auto")
    assert (EngineArgs().optimization_level, EngineArgs().max_lora_rank, EngineArgs().use_tqdm_on_load) == (2, 16, True)
    for flags, message in [(["--data-parallel-size", "2"], "data_parallel_size is not supported"),
                           (["--allowed-media-domains", "a.org", "b.org"], "allowed_media_domains is not supported"),
                           (["--mamba-backend", "flashinfer"], "mamba_backend is not supported (no Mamba")]:
        engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", qwen3_dir, *flags]))
        with pytest.raises(ValueError, match=re.escape(message)):
            LLMEngine.from_engine_args(engine_args)


def test_flags_read_as_vllm_reads_them(tmp_path):
    """vLLM's forms beyond one flag and its value: human-readable numbers (16k, 2K; max_model_len auto),
    --config FILE.yaml (its flags before the command line's, which win; false as --no-x), and a dotted
    key's list (-cc.sizes+ 1,2). A config file that cannot be used is a ValueError."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--max-model-len", "32k", "--max-num-batched-tokens", "2K", "--kv-cache-memory-bytes",
                              "1.5g", "-cc.sizes+", "1,2", "-cc.sizes+=4", "--hf-overrides.a", "8k"])
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (32000, 2048, 1_500_000_000)
    assert (args.compilation_config, args.hf_overrides) == ({"sizes": ["1", "2", "4"]}, {"a": 8000})
    lengths = [parser.parse_args(["--max-model-len", text]).max_model_len for text in ("auto", "-1", "512")]
    assert lengths == [-1, -1, 512]
    with pytest.raises(SystemExit):   # (argparse's error: Decimals are not allowed with binary suffixes like K)
        parser.parse_args(["--max-model-len", "1.5K"])
    config = tmp_path / "engine.yaml"
    config.write_text("max_num_seqs: 8\nmax-model-len: 1k\nenable_prefix_caching: false\nenforce-eager: true\n"
                      "served-model-name: [a, b]\nhf-overrides:\n  rope_theta: 1000000\n")
    args = parser.parse_args(["--config", str(config), "--max-num-seqs", "4"])
    assert (args.max_num_seqs, args.max_model_len) == (4, 1000)
    assert (args.enable_prefix_caching, args.enforce_eager) == (False, True)
    assert (args.served_model_name, args.hf_overrides) == (["a", "b"], {"rope_theta": 1000000})
    (tmp_path / "list.yaml").write_text("- 1\n")
    for flags, message in [(["--config", str(config), "--config", str(config)], "More than one config file specified!"),
                           (["--max-num-seqs", "4", "--config"], "No config file specified!"),
                           (["--config", "engine.json"], "Config file must be of a yaml/yml type. json supplied"),
                           (["--config", str(tmp_path / "none.yaml")], "cannot be read: [Errno 2] No such file"),
                           (["--config", str(tmp_path / "list.yaml")], "must hold a mapping of flags to values")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parser.parse_args(flags)


def test_max_model_len_auto_fits_the_kv_cache(qwen3_dir):
    """max_model_len=-1 (vLLM's auto-fit): the model's length (512), cut to what the KV cache holds;
    a request longer than that is refused, a shorter one runs."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, max_model_len=-1, block_size=16,
                                                   num_kvcache_blocks=4))
    assert engine.model_config.max_model_len == 64 and engine.scheduler.max_model_len == 64
    too_long = "prompt 0 (length 65) is longer than the maximum model length of 64."
    with pytest.raises(ValueError, match=re.escape(too_long)):
        engine.add_request("long", {"prompt_token_ids": [1] * 65}, SamplingParams(max_tokens=1))
    engine.add_request("fits", {"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in run_to_end(engine) if o.finished] == [4]
    assert_idle(engine)
    roomy = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, max_model_len=-1, block_size=16,
                                                  num_kvcache_blocks=64))
    assert roomy.model_config.max_model_len == 512
    with pytest.raises(ValueError, match=re.escape("max_model_len must be at least 1, or -1 (what the KV cache "
                                                   "holds), got -2.")):
        EngineArgs(model=qwen3_dir, max_model_len=-2).create_engine_config()


def test_engine_methods_as_vllms(qwen3_dir):
    """vLLM's LLMEngine methods beside the step loop: the supported tasks, the stats line on demand,
    LoRA calls (LoRA off: no adapters), cache resets with vLLM's options, apply_model, a token prompt's
    prompt_text and abort_request's internal flag."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, dtype="float32", block_size=16,
                                                   num_kvcache_blocks=32, disable_log_stats=False))
    assert engine.get_supported_tasks() == ("generate",) and engine.list_loras() == set()
    with log_lines("nanovllm.engine.stat_logger") as lines:
        engine.do_log_stats()
        engine.do_log_stats_with_interval()   # (its 10 s have not passed)
    assert len(lines) == 1 and lines[0].startswith("Avg prompt throughput: 0.0 tokens/s")
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None"):
        engine.add_lora(object())
    with pytest.raises(ValueError, match="lora_request 'a': LoRA is not enabled"):
        engine.add_lora(LoRARequest("a", 1, qwen3_dir))
    assert engine.remove_lora(1) is False
    with pytest.raises(ValueError, match="LoRA adapter 1 is not known"):
        engine.pin_lora(1)
    assert engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert engine.reset_mm_cache() is None and engine.reset_encoder_cache() is None
    assert engine.apply_model(lambda model: type(model).__name__) == ["QwenForCausalLM"]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params, prompt_text="the prompt")
    engine.add_request("b", PROMPTS[1], params)
    engine.abort_request(["b"], internal=True)
    outputs = run_to_end(engine)
    assert [(o.request_id, o.prompt) for o in outputs if o.finished] == [("a", "the prompt")]
    assert_idle(engine)


@pytest.mark.parametrize("level", [0, 1])
def test_sleep_with_a_step_in_flight(qwen3_dir, level):
    """With async scheduling a launched step's tokens are read during the next step. sleep(mode="keep")
    reads them first: the next step() reports them, asleep or not, with the request they finished, and the
    others go on after wake_up to the tokens of an uninterrupted run. Mode "abort" drops them with the
    aborted requests, and the engine goes on whole."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, dtype="float32", block_size=16,
                                                   num_kvcache_blocks=32, async_scheduling=True,
                                                   enable_sleep_mode=level > 0))
    lengths = (8, 2, 8)
    reference = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=32).generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:3]],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    for i, n in enumerate(lengths):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                              output_kind=RequestOutputKind.DELTA))
    outputs = engine.step() + engine.step()
    assert engine.in_flight is not None and engine.get_num_unfinished_requests() == 3
    with pytest.raises(ValueError, match=re.escape("mode='wait' with 3 unfinished request(s): step() them")):
        engine.sleep(level=level, mode="wait")
    engine.sleep(level=level, mode="keep")
    assert engine.in_flight is None and engine.is_sleeping() and engine.get_num_unfinished_requests() == 3
    engine.abort_request("no such request")            # (what was sent of the unreported request is kept)
    with pytest.raises(ValueError, match="Request id 1 already running."):   # (finished, not yet reported)
        engine.add_request("1", PROMPTS[1], SamplingParams())
    reported = engine.step()
    assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in reported] == [
        ("0", 1, False), ("2", 1, False), ("1", 1, True)]
    assert engine.step() == [] and engine.get_num_unfinished_requests() == 2
    engine.wake_up()
    tokens = {}
    for output in outputs + reported + run_to_end(engine):
        tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    assert [tokens[str(i)] for i in range(3)] == [o.outputs[0].token_ids for o in reference]
    assert_idle(engine)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], params)
    engine.step()
    engine.step()
    engine.sleep(level=0)
    assert engine.in_flight is None and not engine.requests and engine.is_sleeping()
    engine.wake_up()
    engine.add_request("again", PROMPTS[0], params)
    outputs = run_to_end(engine)
    assert [o.outputs[0].token_ids for o in outputs if o.finished] == [reference[0].outputs[0].token_ids]
    assert_idle(engine)


def test_engine_args_read_as_config_defaults_and_are_checked(qwen3_dir):
    args = EngineArgs(model=qwen3_dir, max_num_seqs=8)
    assert (args.model, args.max_num_seqs, args.gpu_memory_utilization) == (qwen3_dir, 8, 0.92)
    with pytest.raises(AttributeError, match="EngineArgs has no argument 'no_such_arg'"):
        args.no_such_arg
    with pytest.raises(ValueError, match="unexpected keyword argument 'max_num_seq' \\(did you mean 'max_num_seqs'"):
        LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, max_num_seq=8))
    assert EngineArgs().model == "Qwen/Qwen3-0.6B"


def test_a_dropped_engine_is_freed_at_once(qwen3_dir):
    """No reference cycle keeps a stepped engine (and its KV cache) alive once dropped: the garbage
    collector does not see the engine's start-up objects (gc.freeze), so only reference counts free it."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, **SETTINGS))
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA))
    assert run_to_end(engine)[-1].finished
    dropped = weakref.ref(engine)
    del engine
    assert dropped() is None


def test_example_script_runs(tmp_path, tokenizer):
    """example.py (generate, chat, streaming through the engine) runs end to end on a tiny model."""
    path = build_model_dir(tmp_path, "qwen3", tokenizer, max_position_embeddings=4096)
    root = __file__.rsplit("/tests/", 1)[0]
    done = subprocess.run([sys.executable, "example.py", str(path)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("Completion: ") == 2 and "Chat reply: " in done.stdout
    streamed = done.stdout.split("Streamed: Once upon a time,", 1)[1]
    assert len(streamed.strip()) > 0
