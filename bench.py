"""Throughput / latency benchmark: nanovllm, or vLLM on the identical workload (--engine vllm).

    python bench.py                            # nano-vllm's workload, Qwen3-0.6B shape, dummy weights
    python bench.py --workload prefix          # 256 requests sharing a 2048-token prefix
    python bench.py --workload latency         # batch 1: 512-token prompt, 512 greedy tokens
    python bench.py --workload embed           # an embedding model (runner="pooling"): the prompts' embeddings
    python bench.py --workload classify        # a classifier (one label, a reranker's shape): the prompts' scores
    python bench.py --engine vllm              # the same through vLLM
    python bench.py --kv-cache-dtype fp8       # K/V cached in fp8 (half the bytes), either engine
    python bench.py --top-k 20 --top-p 0.95    # sampled requests also filtered (Qwen3's own defaults)
    python bench.py --logprobs 5               # every token also with its logprob and the 5 best
    python bench.py --logprobs 5 --logprobs-mode processed_logprobs   # ... of the distribution drawn from
    python bench.py --prompt-logprobs 1        # every prompt token scored too (as lm-eval's loglikelihood)
    python bench.py --logprob-token-ids 3,17   # every token also with the logprobs of ids 3 and 17
    python bench.py --num-seqs 64 --n 8        # parallel sampling: 8 completions of each prompt
    python bench.py --tokenizer synthetic      # outputs detokenized as a real model's are (no download)
    python bench.py --workload default,latency # several workloads, one engine start-up
    python bench.py --repeat 3                 # three timed runs of each workload, one start-up
    python bench.py --num-loras 4              # request i with random LoRA adapter i % 4 (rank 16), either engine
    python bench.py --num-loras 4 --lora-target-modules qkv_proj o_proj   # the adapters on attention only

Without CUDA it runs a small workload on the CPU path and says so.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

# The workloads of a pooling model (runner="pooling"): LLM's method -> the word of its result line
POOLING_WORKLOADS = {"embed": "Embedded", "classify": "Classified"}
# Real shapes of released checkpoints, built with random weights: nothing to download.
PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def preset_dir(name: str) -> str:
    from transformers import Qwen3Config, Qwen3MoeConfig
    moe = "num_experts" in PRESETS[name]
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"], **PRESETS[name])
    path = os.path.join(tempfile.gettempdir(), f"nanovllm-preset-{name}")
    config.save_pretrained(path)
    return path


def synthetic_tokenizer(path: str, vocab_size: int = 151936) -> str:
    """A byte-level BPE tokenizer of vocab_size ids (Qwen3's), written into path, for runs that detokenize
    as a user's real model does, with nothing downloaded: the 256 byte tokens, then tokens made by
    adding a printable ASCII byte or a space to an earlier such token (seeded, up to 8 bytes: like a real
    vocabulary's words and pieces, each valid text alone), the last id the end-of-text token
    (tokenizer.json, tokenizer_config.json; kept for the next run). -> path"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    rng = random.Random(0)
    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {piece: i for i, piece in enumerate(pieces)}, []
    ascii_pieces = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]   # printable bytes and the space, as mapped
    extendable = list(ascii_pieces)    # ASCII tokens shorter than 8 bytes
    while len(vocab) < vocab_size - 1:
        a, b = rng.choice(extendable), rng.choice(ascii_pieces)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            if len(a) < 7:
                extendable.append(a + b)
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            clean_up_tokenization_spaces=False).save_pretrained(path)
    return path


def tokenizer_options(tokenizer: str | None) -> dict:
    """The engine arguments for --tokenizer: none (ids only), 'synthetic', or a path or hub id."""
    if tokenizer is None:
        return dict(skip_tokenizer_init=True)
    if tokenizer == "synthetic":
        path = os.path.join(tempfile.gettempdir(), "nanovllm-synthetic-tokenizer-ascii")
        return dict(tokenizer=synthetic_tokenizer(path))
    return dict(tokenizer=tokenizer)


def make_workload(args, on_cpu: bool):
    """-> (prompts as token-id lists, per-request (max_tokens, temperature))."""
    random.seed(args.seed)
    if args.workload == "latency":
        n_in, n_out = (512, 512) if not on_cpu else (64, 32)
        return [[random.randint(0, 10000) for _ in range(n_in)]], [(n_out, 0.0)]
    if args.workload == "prefix":
        prefix_len, n = (2048, args.num_seqs) if not on_cpu else (128, 4)
        prefix = [random.randint(0, 10000) for _ in range(prefix_len)]
        prompts = [prefix + [random.randint(0, 10000) for _ in range(random.randint(64, 256) // (8 if on_cpu else 1))]
                   for _ in range(n)]
        return prompts, [(128 if not on_cpu else 16, 0.6)] * n
    n, lo_in, hi_in, lo_out, hi_out = args.num_seqs, args.min_input_len, args.max_input_len, \
        args.min_output_len, args.max_output_len
    if on_cpu:
        n, lo_in, hi_in, lo_out, hi_out = 4, 16, 64, 8, 16
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo_in, hi_in))] for _ in range(n)]
    if args.workload in POOLING_WORKLOADS:   # the default workload's prompts, each pooled (no output tokens)
        return prompts, []
    return prompts, [(random.randint(lo_out, hi_out), 0.6) for _ in range(n)]


def lora_adapters(model: str, num: int, rank: int) -> list[str]:
    """num random PEFT adapters of rank `rank` on every attention and MLP projection of model (a directory
    with its config.json; in a mixture of experts, every expert's), written once into the temp directory ->
    their directories."""
    import torch
    from transformers import AutoConfig
    from nanovllm.lora.adapter import (ATTENTION_TARGETS, MLP_TARGETS, layer_targets, peft_names, projection_shapes,
                                       save_adapter, target_shape)
    hf = AutoConfig.from_pretrained(model)
    shapes, targets = projection_shapes(hf), ATTENTION_TARGETS + MLP_TARGETS
    paths = []
    for i in range(num):
        path = os.path.join(tempfile.gettempdir(), f"nanovllm-bench-lora-{os.path.basename(model.rstrip('/'))}"
                                                   f"-r{rank}-{i}")
        paths.append(path)
        if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            continue
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(hf.num_hidden_layers):
            for target in layer_targets(hf, layer):
                in_features, out_features = target_shape(shapes, target)
                a_name, b_name = peft_names(layer, target)
                tensors[a_name] = (torch.randn(rank, in_features, generator=g) * 0.01).bfloat16()
                tensors[b_name] = (torch.randn(out_features, rank, generator=g) * 0.01).bfloat16()
        save_adapter(path, tensors, rank, 2 * rank, targets, task_type="CAUSAL_LM", lora_dropout=0.0,
                     base_model_name_or_path=model)
    return paths


def token_ids(text: str) -> list[int]:
    """--logprob-token-ids' value: comma-separated integers (a bad one is argparse's error naming the flag)."""
    return [int(i) for i in text.split(",")]


def add_workload_arguments(p: argparse.ArgumentParser):
    """The workload's size and lengths and the engine's batch limits (bench.py's flags, shared with the
    tools in tests/ that run its workload)."""
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--max-num-seqs", type=int, default=None, help="max_num_seqs (default: the engine's own)")


def add_lora_arguments(p: argparse.ArgumentParser):
    """The requests' LoRA adapters (bench.py's flags, shared with the tools in tests/ that run its workload;
    lora_engine_args and lora_requests read them)."""
    p.add_argument("--num-loras", type=int, default=0,
                   help="LoRA: requests take turns among this many random adapters (max_loras; 0: none)")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (max_lora_rank), with --num-loras")
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="with --num-loras: LLM(lora_target_modules=...), the modules that take the adapters (vLLM's "
                        "names, e.g. qkv_proj o_proj; the adapters' weights for others are left out)")


def lora_engine_args(args) -> dict:
    """The engine arguments of --num-loras and --lora-target-modules (none without --num-loras)."""
    if not args.num_loras:
        return {}
    kwargs = dict(enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.lora_rank)
    return kwargs | (dict(lora_target_modules=args.lora_target_modules) if args.lora_target_modules else {})


def lora_requests(LoRARequest, model: str, args) -> list:
    """--num-loras' random adapters of model, as requests of the engine's LoRARequest class (lora_plan hands them
    out to the prompts); none without --num-loras."""
    if not args.num_loras:
        return []
    return [LoRARequest(f"bench-lora-{i}", i + 1, path)
            for i, path in enumerate(lora_adapters(model, args.num_loras, args.lora_rank))]


def add_request_arguments(p: argparse.ArgumentParser):
    """The requests' sampling and logprobs options, and the tokenizer that detokenizes them (bench.py's
    flags, shared with the tools in tests/ that run its workload)."""
    p.add_argument("--top-k", type=int, default=0, help="SamplingParams.top_k of the sampled requests (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="SamplingParams.top_p of the sampled requests")
    p.add_argument("--min-p", type=float, default=0.0, help="SamplingParams.min_p of the sampled requests")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="SamplingParams.presence_penalty of every request")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="SamplingParams.frequency_penalty of every request")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="SamplingParams.repetition_penalty of every request")
    p.add_argument("--logprobs", type=int, default=None,
                   help="SamplingParams.logprobs of every request (default: none; 0: the sampled token's only)")
    p.add_argument("--logprobs-mode", default=None,
                   help="LLM(logprobs_mode=...): raw_logprobs (the engines' default), raw_logits, processed_logprobs "
                        "or processed_logits, what --logprobs reports")
    p.add_argument("--prompt-logprobs", type=int, default=None,
                   help="SamplingParams.prompt_logprobs of every request: each prompt token's logprob and the N best "
                        "(default: none)")
    p.add_argument("--n", type=int, default=1,
                   help="SamplingParams.n of every request: completions sampled from each prompt (parallel sampling)")
    p.add_argument("--logprob-token-ids", type=token_ids, default=None,
                   help="SamplingParams.logprob_token_ids of every request, comma-separated (e.g. 3,17,42): "
                        "those ids' logprobs at every token")
    p.add_argument("--flat-logprobs", action="store_true",
                   help="SamplingParams.flat_logprobs: the logprobs as FlatLogprobs (flat lists) instead of dicts")
    p.add_argument("--tokenizer", default=None,
                   help="detokenize with this tokenizer (a path or hub id), or 'synthetic': a byte-level BPE of "
                        "Qwen3's 151,936 ids built here (default: a preset runs without a tokenizer, ids only)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help=f"a path, a hub id, or a preset: {', '.join(PRESETS)}")
    p.add_argument("--engine", choices=["nanovllm", "vllm"], default="nanovllm")
    p.add_argument("--workload", default="default",
                   help="default, prefix or latency; a comma-separated list runs each in turn in one engine "
                        "(one start-up); or embed or classify alone: the model as an embedding model or a "
                        "classifier (runner='pooling'; a preset with a one-label head, as a reranker's)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs of each workload in the one engine (the prefix cache reset before each), "
                        "to see an engine's run-to-run spread without a start-up per run")
    add_workload_arguments(p)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--custom-all-reduce", choices=["default", "on", "off"], default="default",
                   help="TP > 1: the engine's own all-reduce kernels (on) or NCCL alone (off); default: "
                        "the engine's default (on for both)")
    p.add_argument("--attention-backend", choices=["auto", "triton", "flash_attn", "torch"], default="auto",
                   help="nanovllm's attention_backend (auto: flash-attn when installed, else Triton)")
    p.add_argument("--kv-cache-dtype", default="auto", help="'auto' (the model's dtype), 'fp8', 'fp8_e5m2', ...")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="quantization: 'fp8' runs the projections' products in fp8 (weights quantized as they load)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="LLM(async_scheduling=False): each step's tokens read before the next step is scheduled")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='LLM(speculative_config=...), JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3}\' (n-gram drafts), or \'{"model": "qwen3-0.6b", '
                        '"num_speculative_tokens": 4}\' (a draft model: a path, a hub id or a preset)')
    add_request_arguments(p)
    add_lora_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print one JSON line with the results")
    args = p.parse_args()
    workloads = args.workload.split(",")
    for name in workloads:
        if name not in ("default", "prefix", "latency", *POOLING_WORKLOADS):
            p.error(f"--workload: unknown workload {name!r} (default, prefix, latency, embed, classify)")
    pooling = set(workloads) & set(POOLING_WORKLOADS)
    if pooling and len(workloads) > 1:
        p.error(f"--workload: {pooling.pop()} runs alone (it needs an engine of its own, runner='pooling')")
    if args.repeat < 1:
        p.error(f"--repeat: must be at least 1, got {args.repeat}")
    if args.n < 1:
        p.error(f"--n: must be at least 1, got {args.n}")
    if args.num_loras < 0 or (args.num_loras and pooling):
        p.error(f"--num-loras: a non-negative count for the generative workloads, got {args.num_loras}")
    if args.lora_target_modules and not args.num_loras:
        p.error("--lora-target-modules: only with --num-loras")

    if args.engine == "vllm" and args.attention_backend != "auto":
        p.error("--attention-backend: nanovllm's setting; leave it at auto with --engine vllm")
    if args.engine == "vllm" and pooling and args.model in PRESETS and args.tokenizer is None:
        print(f"--workload {workloads[0]} --engine vllm: vLLM's pooling models need a tokenizer; using --tokenizer "
              f"synthetic.")
        args.tokenizer = "synthetic"

    import torch
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        print("No CUDA device: running a small workload on the CPU path (figures are not GPU figures).")
    model = preset_dir(args.model) if args.model in PRESETS else args.model
    kwargs = dict(max_model_len=args.max_model_len if not on_cpu else 1024, enforce_eager=args.enforce_eager,
                  tensor_parallel_size=args.tp, kv_cache_dtype=args.kv_cache_dtype)
    if args.attention_backend != "auto":
        kwargs["attention_backend"] = args.attention_backend
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.logprobs_mode is not None:
        kwargs["logprobs_mode"] = args.logprobs_mode
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    if args.speculative_config is not None:   # (with the metrics on, for the drafts' counters)
        spec = dict(args.speculative_config)
        if spec.get("model") in PRESETS:   # a draft model given as a preset (with the model's dummy weights' seed)
            spec["model"] = preset_dir(spec["model"])
        kwargs |= dict(speculative_config=spec, disable_log_stats=False)
    if args.custom_all_reduce != "default":
        kwargs["disable_custom_all_reduce"] = args.custom_all_reduce == "off"
    if args.model in PRESETS:
        kwargs["load_format"] = "dummy"
    if pooling:
        kwargs["runner"] = "pooling"
    kwargs |= lora_engine_args(args)
    if workloads == ["classify"] and args.model in PRESETS:   # the preset as a one-label classifier (dummy head)
        architecture = "Qwen3MoeForSequenceClassification" if "num_experts" in PRESETS[args.model] \
            else "Qwen3ForSequenceClassification"
        kwargs["hf_overrides"] = {"architectures": [architecture], "num_labels": 1}
    if args.model in PRESETS or args.tokenizer is not None:   # a preset has no tokenizer unless given one
        kwargs |= tokenizer_options(args.tokenizer)
    if args.engine == "vllm":
        # CUDA is already initialised here (the device check above): vLLM's engine process must be spawned.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    else:
        from nanovllm import LLM, SamplingParams
        from nanovllm.lora.request import LoRARequest
    args.loras = lora_requests(LoRARequest, model, args)

    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    startup = time.perf_counter() - start
    warm_up(llm, SamplingParams, args)
    for name in workloads:
        args.workload = name
        for run in range(1, args.repeat + 1):
            llm.reset_prefix_cache()   # (each workload's prompts start with the same seeded random ids)
            run_workload(llm, SamplingParams, args, on_cpu, startup, run)


def warm_up(llm, SamplingParams, args):
    """Untimed, sampling as the workloads do, at one sequence and at a batch (the top-k/top-p
    kernels differ by batch size), so that no kernel compiles inside a timed run."""
    if args.workload in POOLING_WORKLOADS:
        for num_prompts in (1, 32):
            getattr(llm, args.workload)([{"prompt_token_ids": [1, 2, 3]}] * num_prompts, use_tqdm=False)
        return
    params = SamplingParams(max_tokens=4, **sampling_filters(args), **request_options(args))
    for num_prompts in (1, 32):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * num_prompts, params, use_tqdm=False,
                     lora_request=lora_plan(args, num_prompts))


def lora_plan(args, num_prompts: int) -> list | None:
    """With --num-loras: request i's adapter, i % num_loras."""
    loras = getattr(args, "loras", None)   # (set by whoever made the engine: bench.py's main, profile_run's)
    return [loras[i % len(loras)] for i in range(num_prompts)] if loras else None


def sampling_filters(args) -> dict:
    """The top-k/top-p/min-p fields of the sampled requests' SamplingParams that are set."""
    values, off = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p), dict(top_k=0, top_p=1.0, min_p=0.0)
    return {name: value for name, value in values.items() if value != off[name]}


def request_options(args) -> dict:
    """The n, penalty and logprobs fields of every request's SamplingParams (none when all are off)."""
    values = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty)
    off = values == dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    return (({} if off else values) | ({} if args.n == 1 else dict(n=args.n))
            | ({} if args.logprobs is None else dict(logprobs=args.logprobs))
            | ({} if args.prompt_logprobs is None else dict(prompt_logprobs=args.prompt_logprobs))
            | ({} if args.logprob_token_ids is None else dict(logprob_token_ids=args.logprob_token_ids))
            | (dict(flat_logprobs=True) if args.flat_logprobs else {}))


def run_pooling_workload(llm, args, on_cpu: bool, startup: float, run: int = 1):
    """The embed or classify workload: every prompt's embedding or label probabilities; prompt tokens and
    requests per second."""
    import torch
    prompts, _ = make_workload(args, on_cpu)
    start = time.perf_counter()
    outputs = getattr(llm, args.workload)([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(len(ids) for ids in prompts)
    size = outputs[0].outputs.hidden_size if args.workload == "embed" else outputs[0].outputs.num_classes
    result = dict(engine=args.engine, model=args.model, workload=args.workload, tp=args.tp, num_requests=len(prompts),
                  prompt_tokens=num_in, output_size=size,
                  cached_prompt_tokens=sum(o.num_cached_tokens or 0 for o in outputs), time_s=round(elapsed, 3),
                  prompt_tok_s=round(num_in / elapsed, 2), req_s=round(len(prompts) / elapsed, 3),
                  startup_s=round(startup, 1), run=run, device="cpu" if on_cpu else torch.cuda.get_device_name())
    print(f"{POOLING_WORKLOADS[args.workload]}: {len(prompts)} prompts, {num_in}tok, Time: {elapsed:.2f}s, "
          f"Throughput: {num_in / elapsed:.2f}tok/s, Requests: {result['req_s']:.2f}req/s, Start-up: {startup:.1f}s")
    if args.json:
        print(json.dumps(result))
    sys.stdout.flush()


def draft_counts(llm) -> tuple[int, int] | None:
    """Speculative decoding's draft tokens and accepted draft tokens so far (get_metrics' counters; None
    without them)."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    counts = values.get("vllm:spec_decode_num_draft_tokens"), values.get("vllm:spec_decode_num_accepted_tokens")
    return None if None in counts else counts


def run_workload(llm, SamplingParams, args, on_cpu: bool, startup: float, run: int = 1):
    import torch
    if args.workload in POOLING_WORKLOADS:
        return run_pooling_workload(llm, args, on_cpu, startup, run)
    prompts, settings = make_workload(args, on_cpu)
    filters = sampling_filters(args) if any(t > 0 for _, t in settings) else {}
    params = [SamplingParams(temperature=t, ignore_eos=True, max_tokens=m, **(filters if t > 0 else {}),
                             **request_options(args)) for m, t in settings]
    inputs = [{"prompt_token_ids": ids} for ids in prompts]

    drafts_before = draft_counts(llm) if args.speculative_config else None
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_plan(args, len(inputs)))
    elapsed = time.perf_counter() - start
    completions = [c for o in outputs for c in o.outputs]   # (n of each request)
    num_out = sum(len(c.token_ids) for c in completions)
    num_in = sum(len(ids) for ids in prompts)
    num_cached = sum(o.num_cached_tokens or 0 for o in outputs)
    num_chars = sum(len(c.text or "") for c in completions)
    options = filters | request_options(args)
    options |= {} if args.logprobs_mode is None else dict(logprobs_mode=args.logprobs_mode)
    options |= {} if args.quantization is None else dict(quantization=args.quantization)
    options |= dict(num_loras=args.num_loras, lora_rank=args.lora_rank) if args.num_loras else {}
    options |= dict(lora_target_modules=",".join(args.lora_target_modules)) if args.lora_target_modules else {}
    workload = args.workload + "".join(f" {k}={v}" for k, v in options.items())
    result = dict(engine=args.engine, model=args.model, workload=workload, tp=args.tp,
                  custom_all_reduce=args.custom_all_reduce, kv_cache_dtype=args.kv_cache_dtype, num_requests=len(prompts),
                  tokenizer=args.tokenizer, prompt_tokens=num_in, output_tokens=num_out, output_chars=num_chars,
                  cached_prompt_tokens=num_cached,
                  time_s=round(elapsed, 3), output_tok_s=round(num_out / elapsed, 2),
                  total_tok_s=round((num_in + num_out) / elapsed, 2), req_s=round(len(prompts) / elapsed, 3),
                  startup_s=round(startup, 1), run=run, device="cpu" if on_cpu else torch.cuda.get_device_name())
    print(f"Total: {num_out}tok, Time: {elapsed:.2f}s, Throughput: {num_out / elapsed:.2f}tok/s")
    print(f"Total throughput: {result['total_tok_s']:.2f}tok/s (prompt {num_in}tok), "
          f"Requests: {result['req_s']:.2f}req/s, Cached prompt tokens: {num_cached}, Start-up: {startup:.1f}s")
    if args.engine == "nanovllm":
        from nanovllm.kernels import pdl, triton_skinny
        runner = llm.llm_engine.model_runner
        result["startup_breakdown_s"] = {k: round(v, 2) for k, v in runner.timings.items()}
        result["attention_backend"] = type(runner.backend).__name__
        result["pdl"] = pdl.enabled()      # on an sm_90+ GPU unless NANOVLLM_PDL=0
        result["skinny"] = triton_skinny.enabled()   # NANOVLLM_SKINNY=0 turns the small-batch projections off
    if args.workload == "latency":
        result["ms_per_token"] = round(elapsed * 1000 / num_out, 3)
        print(f"Latency: {result['ms_per_token']:.3f} ms/token (batch 1)")
    drafts_after = draft_counts(llm) if drafts_before is not None else None
    if drafts_after is not None:
        drafted, accepted = (after - before for after, before in zip(drafts_after, drafts_before))
        result |= dict(draft_tokens=drafted, accepted_draft_tokens=accepted)
        print(f"Drafts: {accepted} of {drafted} draft tokens accepted ({accepted / max(drafted, 1):.1%})")
    if args.json:
        print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
