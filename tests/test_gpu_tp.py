"""Tensor parallelism on two GPUs (NCCL): TP=2 logprobs close to TP=1 in bf16 with CUDA graphs."""
import pytest
import torch

from test_gpu import SIZES, check_logprobs_close, run  # noqa: F401  (shared helpers)
from conftest import build_model_dir
from nanovllm import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory, tokenizer):
    return build_model_dir(tmp_path_factory.mktemp("qwen3_tp"), "qwen3", tokenizer, seed=2, **SIZES)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tp2_logprobs_close_to_tp1(tp_model_dir, enforce_eager):
    with LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16) as llm:
        ref, _ = run(llm)
    with LLM(tp_model_dir, dtype="bfloat16", max_model_len=1024, block_size=16, tensor_parallel_size=2,
             enforce_eager=enforce_eager) as llm:
        ours, _ = run(llm)
        assert (llm.llm_engine.model_runner.graphs is None) == enforce_eager
    assert check_logprobs_close(ours, ref) >= len(ref) // 2
