"""A few seeds of tests/fuzz_engine.py's random workloads: requests with random sampling options
and output kinds, aborts and sleeps between steps, on small random engine configurations; the
engine's invariants hold and greedy or seeded requests come out as they do alone (float32)."""
import pytest

from fuzz_engine import run_seed


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_the_engine_invariants(qwen3_dir, seed):
    assert run_seed(qwen3_dir, seed, dtype="float32") == 0
