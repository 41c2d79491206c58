"""The README's main job, `python bench.py`, runs on the CPU path and reports its figures; the developer
tools in tests/ that reuse its workload and flags keep up with them."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_runs_on_the_cpu():
    proc = subprocess.run([sys.executable, "bench.py", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("No CUDA device: running a small workload on the CPU path")
    assert any(line.startswith("Total: 48tok, Time: ") for line in lines)
    result = json.loads(lines[-1])
    assert (result["engine"], result["device"], result["output_tokens"]) == ("nanovllm", "cpu", 48)
    assert (result["tokenizer"], result["output_chars"]) == (None, 0)    # a preset: ids only
    assert set(result["startup_breakdown_s"]) == {"load_s", "kv_cache_s"}
    assert result["attention_backend"] == "TorchBackend"


def test_bench_attention_backend_is_nanovllms_setting():
    proc = subprocess.run([sys.executable, "bench.py", "--attention-backend", "torch", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["attention_backend"] == "TorchBackend"
    bad = subprocess.run([sys.executable, "bench.py", "--engine", "vllm", "--attention-backend", "triton"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "leave it at auto with --engine vllm" in bad.stderr


def test_bench_runs_a_list_of_workloads_in_one_engine():
    proc = subprocess.run([sys.executable, "bench.py", "--workload", "prefix,latency", "--top-k", "20", "--top-p",
                           "0.9", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # the filters only where requests sample (latency is greedy); one start-up for both
    assert [r["workload"] for r in results] == ["prefix top_k=20 top_p=0.9", "latency"]
    assert results[0]["startup_s"] == results[1]["startup_s"]
    bad = subprocess.run([sys.executable, "bench.py", "--workload", "default,nope"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown workload 'nope'" in bad.stderr


@pytest.mark.parametrize("workload,line,size", [("embed", "Embedded", 1024), ("classify", "Classified", 1)])
def test_bench_pooling_workloads(workload, line, size):
    """--workload embed / classify: the model as an embedding model or as a one-label classifier (the preset
    with a dummy head), the default workload's prompts pooled; each runs alone (an engine of its own)."""
    proc = subprocess.run([sys.executable, "bench.py", "--workload", workload, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(out.startswith(f"{line}: 4 prompts, 158tok, Time: ") for out in proc.stdout.splitlines())
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["workload"], result["num_requests"], result["prompt_tokens"], result["output_size"]) == (
        workload, 4, 158, size)
    bad = subprocess.run([sys.executable, "bench.py", "--workload", f"{workload},default"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and f"{workload} runs alone" in bad.stderr


def test_bench_repeats_each_workload_in_one_engine():
    proc = subprocess.run([sys.executable, "bench.py", "--workload", "prefix,latency", "--repeat", "2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["workload"], r["run"]) for r in results] == [("prefix", 1), ("prefix", 2), ("latency", 1), ("latency", 2)]
    # the prefix cache is reset before each run: the second prefix run caches what the first did, no more
    assert results[0]["cached_prompt_tokens"] == results[1]["cached_prompt_tokens"]
    assert len({r["startup_s"] for r in results}) == 1
    bad = subprocess.run([sys.executable, "bench.py", "--repeat", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--repeat: must be at least 1, got 0" in bad.stderr


def test_bench_detokenizes_with_a_synthetic_tokenizer(tmp_path):
    """--tokenizer synthetic: a byte-level BPE of Qwen3's 151,936 ids, built locally, so that a preset's
    outputs are detokenized as a real model's are."""
    sys.path.insert(0, ROOT)
    from bench import synthetic_tokenizer
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(synthetic_tokenizer(str(tmp_path)))
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == 151935
    text = "Hello, world! 0123 \u00e9"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert all(tokenizer.decode([i]) for i in (0, 255, 256, 151934))
    proc = subprocess.run([sys.executable, "bench.py", "--tokenizer", "synthetic", "--logprobs", "2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["tokenizer"] == "synthetic" and result["output_chars"] > 0


def test_bench_scores_prompt_tokens():
    proc = subprocess.run([sys.executable, "bench.py", "--workload", "latency", "--prompt-logprobs", "2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["workload"] == "latency prompt_logprobs=2"


def test_bench_asks_for_chosen_ids_logprobs():
    proc = subprocess.run([sys.executable, "bench.py", "--workload", "latency", "--logprob-token-ids", "3,17", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["workload"] == "latency logprob_token_ids=[3, 17]"
    bad = subprocess.run([sys.executable, "bench.py", "--logprob-token-ids", "3,x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "argument --logprob-token-ids: invalid token_ids value: '3,x'" in bad.stderr


def test_bench_speculates_and_reports_the_drafts():
    """--speculative-config (n-gram drafts) prints the drafts the run proposed and accepted, in --json too."""
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    proc = subprocess.run([sys.executable, "bench.py", "--workload", "latency", "--speculative-config", config,
                           "--no-async-scheduling", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert 0 <= result["accepted_draft_tokens"] <= result["draft_tokens"]
    drafts = [line for line in proc.stdout.splitlines() if line.startswith("Drafts: ")]
    assert drafts == [f"Drafts: {result['accepted_draft_tokens']} of {result['draft_tokens']} draft tokens accepted "
                      f"({result['accepted_draft_tokens'] / max(result['draft_tokens'], 1):.1%})"]


def test_bench_runs_requests_with_lora_adapters():
    """--num-loras: the requests take turns among random adapters of --lora-rank (written once)."""
    proc = subprocess.run([sys.executable, "bench.py", "--num-loras", "2", "--lora-rank", "8", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["workload"], result["output_tokens"]) == ("default num_loras=2 lora_rank=8", 48)
    proc = subprocess.run([sys.executable, "bench.py", "--num-loras", "2", "--lora-rank", "8", "--lora-target-modules",
                           "qkv_proj", "o_proj", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left out (this engine adapts qkv_proj, o_proj)" in proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["workload"] == "default num_loras=2 lora_rank=8 lora_target_modules=qkv_proj,o_proj"
    for flags, message in ((["--num-loras", "-1"], "--num-loras: a non-negative count"),
                           (["--lora-target-modules", "o_proj"], "--lora-target-modules: only with --num-loras")):
        bad = subprocess.run([sys.executable, "bench.py", *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr


def test_profile_run_takes_bench_flags():
    """tests/profile_run.py builds its requests with bench.py's helpers from bench.py's own flags, so a
    flag bench.py gains cannot leave the tool behind (it did twice: --min-p, --logprob-token-ids)."""
    import bench
    import profile_run
    args = profile_run.parse_args(["--model", "qwen3-8b", "--min-p", "0.1", "--logprob-token-ids", "3,17",
                                   "--num-seqs", "8", "--logprobs-mode", "raw_logits", "--profile-steps", "5"])
    assert bench.sampling_filters(args) == {"min_p": 0.1}
    assert bench.request_options(args) == {"logprob_token_ids": [3, 17]}
    assert (args.num_seqs, args.logprobs_mode, args.profile_steps, args.seed) == (8, "raw_logits", 5, 0)
    prompts, settings = bench.make_workload(args, on_cpu=False)
    assert len(prompts) == len(settings) == 8


def test_profile_run_gives_each_request_its_adapter(qwen3_dir, tmp_path, monkeypatch):
    """--num-loras: profile_run's requests take turns among bench.py's adapters, as bench.py's do."""
    import bench
    import profile_run
    from nanovllm import LLM
    from nanovllm.lora.request import LoRARequest
    monkeypatch.setattr(bench.tempfile, "gettempdir", lambda: str(tmp_path))
    args = profile_run.parse_args(["--num-loras", "2", "--lora-rank", "8"])
    args.loras = bench.lora_requests(LoRARequest, qwen3_dir, args)   # (as profile_run's main makes them)
    assert bench.lora_engine_args(args) == dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", enforce_eager=True, max_model_len=64,
              **bench.lora_engine_args(args))
    try:
        _, finished = profile_run.run_steps(llm, [[1, 2, 3]] * 5, [(2, 0.0)] * 5, loras=bench.lora_plan(args, 5))
    finally:
        llm.close()
    assert [out.lora_request.lora_int_id for out in sorted(finished, key=lambda out: int(out.request_id))] == \
        [1, 2, 1, 2, 1]


def test_bench_host_runs_with_logprobs():
    """tests/bench_host.py stands in for the sampler and prompt scoring; its stand-ins must keep the
    engine's signatures (its prompt-score stand-in had lost logprobs_mode's as_logits)."""
    proc = subprocess.run([sys.executable, "tests/bench_host.py", "--num-seqs", "8", "--scale", "8", "--runs", "1",
                           "--logprobs", "2", "--prompt-logprobs", "1", "--tokenizer", "synthetic"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.fullmatch(r"run 1: \d+ steps in [\d.]+ s, [\d.]+ ms a step", proc.stdout.splitlines()[-1])


def test_bench_host_times_drafting_steps():
    """bench_host.py --speculative-config: with every sampled token 0 a sequence's output repeats, so its
    drafts are accepted and a step adds several tokens (the host's part of batch 1's drafting steps)."""
    proc = subprocess.run([sys.executable, "tests/bench_host.py", "--num-seqs", "1", "--scale", "2", "--runs", "1",
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                           '"prompt_lookup_max": 3}'],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.fullmatch(r"run 1: \d+ steps in [\d.]+ s, [\d.]+ ms a step, ([\d.]+) tokens a step",
                         proc.stdout.splitlines()[-1])
    assert found and float(found.group(1)) > 3
