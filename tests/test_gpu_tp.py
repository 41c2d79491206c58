"""Tensor parallelism on several GPUs (NCCL and the symmetric-memory all-reduce): the custom
all-reduce sums like NCCL at every size class, and TP=2/4/8 logprobs are close to TP=1 in bf16
with CUDA graphs on and off. Each case skips when the machine has too few GPUs."""
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from conftest import build_model_dir, check_logprobs_close
from test_gpu import SIZES, run
from nanovllm import LLM, SamplingParams, distributed
from nanovllm import custom_all_reduce as custom_all_reduce_module
from nanovllm.custom_all_reduce import BUFFER_BYTES

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
NUM_GPUS = torch.cuda.device_count()
if NUM_GPUS < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

# Head counts divisible by 8, so one model serves every TP size.
TP_SIZES = SIZES | dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64)
# bf16 elements: one-shot sizes, two-shot sizes (> 512 KiB), not 16-byte sized (NCCL), over the buffer (NCCL).
NUMELS = [8, 4096, 256 * 4096, 1_000_001, BUFFER_BYTES // 2, BUFFER_BYTES // 2 + 8]


def needs_gpus(n: int):
    return pytest.mark.skipif(NUM_GPUS < n, reason=f"needs {n} CUDA GPUs")


def part(rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=gen).to(torch.bfloat16)


def reduce_on_rank(port: int, rank: int, size: int, results):
    """One rank, in its own process: sum each NUMELS tensor; report (rank, custom on, numels wrong)."""
    device = torch.device("cuda", rank)
    group = distributed.connect(port, rank, size, device, custom_all_reduce=True)
    wrong = []
    for numel in NUMELS:
        x = part(rank, numel).to(device)
        group.all_reduce(x)
        parts = [part(r, numel).float() for r in range(size)]
        # bf16 additions round by up to 2^-8 of the partial sums (see custom_all_reduce._sums_correctly)
        bound = 2 ** -5 * sum(p.abs() for p in parts) + 1e-3
        if not ((x.float().cpu() - sum(parts)).abs() <= bound).all():
            wrong.append(numel)
    torch.cuda.synchronize()
    results.put((rank, group.custom_all_reduce is not None, wrong))


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=needs_gpus(4)), pytest.param(8, marks=needs_gpus(8))])
def test_custom_all_reduce_sums_like_nccl(size):
    # Every rank in a fresh process (this one only hosts the store): a hang is killed, not inherited.
    store = distributed.Rendezvous(size, torch.device("cpu"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=reduce_on_rank, args=(store.port, rank, size, results)) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        reports = sorted(results.get(timeout=120) for _ in range(size))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert reports == [(rank, True, []) for rank in range(size)]
    assert [proc.exitcode for proc in procs] == [0] * size


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory, tokenizer):
    return build_model_dir(tmp_path_factory.mktemp("qwen3_tp"), "qwen3", tokenizer, seed=2, **TP_SIZES)


@pytest.fixture(scope="module")
def tp1_reference(tp_model_dir):
    with LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16) as llm:
        return run(llm)[0]


@pytest.mark.parametrize("tp,enforce_eager,custom_all_reduce", [
    (2, False, True), (2, True, True), (2, False, False),
    pytest.param(4, False, True, marks=needs_gpus(4)), pytest.param(4, True, False, marks=needs_gpus(4)),
    pytest.param(8, False, True, marks=needs_gpus(8)),
], ids=lambda v: str(v))
def test_tp_logprobs_close_to_tp1(tp_model_dir, tp1_reference, tp, enforce_eager, custom_all_reduce):
    # Only the first engine of a process gets the symmetric-memory all-reduce (custom_all_reduce.py).
    expect_custom = custom_all_reduce and not custom_all_reduce_module._rendezvous_started
    with LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16, tensor_parallel_size=tp,
             enforce_eager=enforce_eager, disable_custom_all_reduce=not custom_all_reduce) as llm:
        ours, _ = run(llm)
        runner = llm.llm_engine.model_runner
        assert (runner.graphs is None) == enforce_eager
        assert (runner.tp.custom_all_reduce is not None) == expect_custom
    assert check_logprobs_close(ours, tp1_reference) >= len(tp1_reference) // 2


@pytest.mark.parametrize("enforce_eager,custom_all_reduce", [(False, False), (True, False), (False, True)],
                         ids=["graphs", "eager", "graphs-custom-all-reduce"])
def test_worker_killed_mid_generate_is_named(tp_model_dir, enforce_eager, custom_all_reduce):
    """NCCL waits for a dead peer until its own timeout, the symmetric-memory all-reduce's kernels
    for ever: the group is aborted and those kernels released, so the caller gets the rank named
    and rank 0's GPU drains."""
    if custom_all_reduce and custom_all_reduce_module._rendezvous_started:
        pytest.skip("one symmetric-memory group per process: run alone, -k graphs-custom-all-reduce")
    llm = LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16, tensor_parallel_size=2,
              enforce_eager=enforce_eager, disable_custom_all_reduce=not custom_all_reduce)
    engine = llm.llm_engine
    assert (engine.workers.group.custom_all_reduce is not None) == custom_all_reduce
    real_step, calls, pid = engine.run_step, [], engine.workers.procs[0].pid

    def step():
        calls.append(1)
        if len(calls) == 20:
            os.kill(pid, signal.SIGKILL)
        return real_step()

    engine.run_step = step
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        llm.generate([[1, 2, 3, i] for i in range(32)], SamplingParams(max_tokens=900, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - start < 30
    synced = threading.Thread(target=torch.cuda.synchronize, daemon=True)   # nothing left spinning
    synced.start()
    synced.join(30)
    assert not synced.is_alive()
