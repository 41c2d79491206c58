"""Tensor parallelism on several GPUs (NCCL and the symmetric-memory all-reduce): the custom
all-reduce sums like NCCL at every size class, and TP=2/4/8 logprobs are close to TP=1 in bf16
with CUDA graphs on and off. Each case skips when the machine has too few GPUs."""
import multiprocessing as mp

import pytest
import torch

from test_gpu import SIZES, check_logprobs_close, run  # noqa: F401  (shared helpers)
from conftest import build_model_dir
from nanovllm import LLM, distributed
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


def reduce_on_worker(port: int, rank: int, size: int):
    device = torch.device("cuda", rank)
    group = distributed.connect(port, rank, size, device)
    for numel in NUMELS:
        group.all_reduce(part(rank, numel).to(device))
    torch.cuda.synchronize()


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=needs_gpus(4)), pytest.param(8, marks=needs_gpus(8))])
def test_custom_all_reduce_sums_like_nccl(size):
    rendezvous = distributed.Rendezvous(size, torch.device("cuda", 0))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=reduce_on_worker, args=(rendezvous.port, rank, size)) for rank in range(1, size)]
    for proc in procs:
        proc.start()
    try:
        group = rendezvous.join()
        assert group.custom_all_reduce is not None, "symmetric memory could not be set up (see the warning)"
        for numel in NUMELS:
            x = part(0, numel).cuda()
            group.all_reduce(x)
            parts = [part(rank, numel).float() for rank in range(size)]
            # bf16 additions round by up to 2^-8 of the partial sums (see custom_all_reduce._sums_correctly)
            bound = 2 ** -5 * sum(p.abs() for p in parts) + 1e-3
            assert ((x.float().cpu() - sum(parts)).abs() <= bound).all(), f"numel {numel}"
    except BaseException:
        for proc in procs:   # they wait in collectives rank 0 will not join
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * (size - 1)


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
    with LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16, tensor_parallel_size=tp,
             enforce_eager=enforce_eager, disable_custom_all_reduce=not custom_all_reduce) as llm:
        ours, _ = run(llm)
        runner = llm.llm_engine.model_runner
        assert (runner.graphs is None) == enforce_eager
        assert (runner.tp.custom_all_reduce is not None) == custom_all_reduce
    assert check_logprobs_close(ours, tp1_reference) >= len(tp1_reference) // 2
