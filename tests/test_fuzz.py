"""A few seeds of tests/fuzz_engine.py's random workloads, in float32: greedy or seeded requests
come out as they do alone, and the engine's invariants hold.
- Engine steps: requests with random sampling options and output kinds, aborts and sleeps
  between steps, on small random engine configurations; and two seeds with LoRA adapters (1 or 2 slots).
- The LLM facade: generate, chat, enqueue / wait_for_completion, beam_search, bad calls, a
  generate interrupted by Ctrl-C, and sleeps, at random.
- A pooling engine (runner="pooling"), an embedding model or a classifier: its tasks' requests, bad
  requests, aborts and sleeps between steps; each result equals its prompt's alone."""
import pytest

import fuzz_engine
from fuzz_engine import run_llm_seed, run_pooling_seed, run_seed


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_the_engine_invariants(qwen3_dir, seed):
    assert run_seed(qwen3_dir, seed, dtype="float32") == 0


@pytest.mark.parametrize("seed", [5, 6])   # (the first seeds that enable LoRA: one slot, then two)
def test_random_workloads_with_lora_adapters_keep_the_engine_invariants(qwen3_dir, seed, monkeypatch):
    monkeypatch.setattr(fuzz_engine, "ADAPTERS", [])
    fuzz_engine.write_lora_adapters(qwen3_dir)
    assert fuzz_engine.random_lora_config(seed)[0]["max_loras"] == seed - 4
    assert run_seed(qwen3_dir, seed, dtype="float32") == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_llm_calls_keep_the_engine_invariants(qwen3_dir, seed):
    assert run_llm_seed(qwen3_dir, seed, dtype="float32") == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_pooling_workloads_keep_the_engine_invariants(qwen3_dir, seed):
    assert run_pooling_seed(qwen3_dir, seed, dtype="float32") == 0
