"""What structured outputs cost a large batch (a developer tool, not a test): bench.py's default
workload (256 requests of 100-1,024 random prompt ids and 100-1,024 output tokens, temperature
0.6, the Qwen3-0.6B shape with dummy weights) with every request held to a grammar, against the
same requests unconstrained, and as bench.py sends them (ignore_eos instead of min_tokens), one
after the other in one process.

bench.py's presets have no tokenizer, which xgrammar needs: this tool saves a stand-in beside the
preset's config, a byte-level BPE vocabulary of the model's 151,936 ids (the byte symbols, the
quote only as '"a', then lowercase words of two to four letters, with and without a leading space,
then the end tokens), so that the grammar's work per token is what a real vocabulary of that size
costs. (The tests' 384-token BPE padded to 151,936 ids made each accepted token ~25x dearer:
xgrammar's cost grows with the number of special ids.) Two grammars (--grammar): a JSON string
(`{"type": "string"}`: a token that may stand in a JSON string; on the CPU machine xgrammar fills
256 rows in ~2 ms and accepts a token in ~4 us) and the regex `[a-m ]+` (about a tenth of the
vocabulary; ~1.1 ms a row, since xgrammar has no cached masks for it). Neither ends: '"a' opens a
string and cannot close one. Every request runs to its max_tokens (min_tokens = max_tokens keeps
the end token out) without detokenization, so every run makes the same tokens' worth of work apart
from the grammar's. Each timed run starts from an empty prefix cache, as in bench.py (the figures
in docs/benchmarks.md before 2026-12-03's twenty-second session are from runs that, but for the
first, found their prompts cached: ~0.1-0.3 s less, in either engine).

    PYTHONPATH=. python3 tests/bench_structured.py [--grammar json-string | regex] [--repeat 2] [--num-seqs 256]
                                                   [--engine vllm]   # the same through vLLM
"""
import argparse
import cProfile
import itertools
import json
import os
import pstats
import shutil
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bench import make_workload, preset_dir

REGEX = "[a-m ]+"
GRAMMARS = {"json-string": {"json": {"type": "string"}}, "regex": {"regex": REGEX}}


def stand_in_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of vocab_size tokens: byte symbols, lowercase words, three end tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # No token holds a quote but '"a', which may open a JSON string and so cannot close one.
    symbols = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - {'"'}) + ['"a']
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    words = ("".join(letters) for n in (2, 3, 4) for letters in itertools.product(string.ascii_lowercase, repeat=n))
    for word in words:
        for token in (word, "\u0120" + word):             # \u0120: the byte-level symbol of a space
            if len(vocab) < vocab_size - len(specials):
                vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def model_dir() -> str:
    """The qwen3-0.6b preset's config with the stand-in tokenizer, its end token the config's."""
    source = preset_dir("qwen3-0.6b")
    path = source + "-with-tokenizer"
    shutil.copytree(source, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tokenizer = stand_in_tokenizer(config["vocab_size"])
    tokenizer.save_pretrained(path)
    config.update(eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--grammar", choices=list(GRAMMARS), default="json-string")
    p.add_argument("--profile", action="store_true", help="also run each kind once under cProfile: the host's "
                   "heaviest functions")
    p.add_argument("--engine", choices=["nanovllm", "vllm"], default="nanovllm")
    args = p.parse_args()
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
    else:
        from nanovllm import LLM, SamplingParams
        from nanovllm.sampling_params import StructuredOutputsParams
    start = time.perf_counter()
    llm = LLM(model_dir(), load_format="dummy", max_model_len=4096)
    print(f"start-up {time.perf_counter() - start:.1f}s")
    workload = argparse.Namespace(workload="default", seed=0, num_seqs=args.num_seqs, min_input_len=100,
                                  max_input_len=1024, min_output_len=100, max_output_len=1024)
    prompts, settings = make_workload(workload, on_cpu=False)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]

    def params(kind: str, settings=settings) -> list[SamplingParams]:
        """kind: "held" (to the grammar), "free" (the same without it), or "bench" (bench.py's:
        ignore_eos, no min_tokens)."""
        if kind == "bench":
            return [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, detokenize=False) for m, t in settings]
        held = StructuredOutputsParams(**GRAMMARS[args.grammar]) if kind == "held" else None
        return [SamplingParams(temperature=t, max_tokens=m, min_tokens=m, detokenize=False, structured_outputs=held)
                for m, t in settings]

    kinds = ("bench", "free", "held")
    for kind in kinds:   # untimed: compiles the kernels and the grammar
        llm.generate(inputs[:32], params(kind, [(4, 0.6)] * 32), use_tqdm=False)
    for run in range(1, args.repeat + 1):
        for kind in kinds:
            llm.reset_prefix_cache()   # every run prefills its prompts (they are the same in each)
            start = time.perf_counter()
            outs = llm.generate(inputs, params(kind), use_tqdm=False)
            elapsed = time.perf_counter() - start
            num_out = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{kind} #{run}: Total: {num_out}tok, Time: {elapsed:.2f}s, Throughput: {num_out / elapsed:.2f}tok/s",
                  flush=True)
    if args.profile:
        import torch
        for kind in ("free", "held"):
            profile = cProfile.Profile()
            profile.runcall(llm.generate, inputs, params(kind), use_tqdm=False)
            print(f"== {kind} under cProfile, by own time")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        short = [(32, t) for _, t in settings]
        for kind in ("free", "held"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(inputs, params(kind, short), use_tqdm=False)
            print(f"== {kind}, 32 tokens each, under torch.profiler")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
