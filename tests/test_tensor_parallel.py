"""Tensor parallelism on the CPU (gloo): same greedy tokens as one rank, and the worker
processes' lifecycle (close, with, del, exception, Ctrl-C, interpreter exit, killed worker)."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import build_model_dir, fp8_checkpoints, hf_greedy, make_prompts
from nanovllm import LLM, SamplingParams

PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SMALL = dict(dtype="float32", block_size=16, num_kvcache_blocks=128)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:      # a zombie is not alive
        return f.read().split()[2] != "Z"


def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.llm_engine.workers.procs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_matches_tp1(model_dir, async_scheduling):
    expected = hf_greedy(model_dir, PROMPTS, 10)
    with LLM(model_dir, tensor_parallel_size=2, async_scheduling=async_scheduling, **SMALL) as llm:
        assert greedy(llm) == expected
    with LLM(model_dir, tensor_parallel_size=2, async_scheduling=async_scheduling,
             **(SMALL | dict(num_kvcache_blocks=14, max_num_batched_tokens=32))) as llm:
        assert greedy(llm) == expected          # with preemption and chunked prefill
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_tp2_fp8_checkpoint_matches_hf_on_its_weights(qwen3_dir, tmp_path):
    """Each rank dequantizes the fp8 weights before taking its shard (block scales: the shards' edges fall
    inside blocks)."""
    fp8_dir, ref_dir = fp8_checkpoints(qwen3_dir, tmp_path)
    with LLM(fp8_dir, tensor_parallel_size=2, **SMALL) as llm:
        assert greedy(llm, PROMPTS[:4]) == hf_greedy(ref_dir, PROMPTS[:4], 10)


def test_tp2_prompt_logprobs_match_tp1(qwen3_dir):
    """Prompt rows' logits are a collective too (vocabulary gathered to rank 0), in passes of
    max_num_seqs rows (here 3, several a step); TP=2 with async scheduling, as on GPUs (rank 0
    reads a step's scores a step late)."""
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[5:9]]
    results = []
    for tp in (1, 2):
        with LLM(qwen3_dir, tensor_parallel_size=tp, async_scheduling=tp == 2,
                 **(SMALL | dict(max_num_batched_tokens=32, max_num_seqs=3))) as llm:
            results.append([o.prompt_logprobs for o in llm.generate(prompts, sp, use_tqdm=False)])
    for tp1, tp2 in zip(*results):
        assert tp1[0] is None and tp2[0] is None and len(tp1) == len(tp2)
        for a, b in zip(tp1[1:], tp2[1:]):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) and a[t].rank == b[t].rank for t in a)


@pytest.mark.parametrize("tp, kv_heads", [(4, 4), (8, 8)])
def test_tp4_and_tp8(tmp_path, tokenizer, tp, kv_heads):
    """The sizes of the 4- and 8-GPU machines, on the CPU: every rank holds one or two heads."""
    path = build_model_dir(tmp_path, "qwen3", tokenizer, num_attention_heads=8, num_key_value_heads=kv_heads,
                           head_dim=8)
    with LLM(path, tensor_parallel_size=tp, **SMALL) as llm:
        assert greedy(llm, PROMPTS[:6]) == hf_greedy(path, PROMPTS[:6], 10)


def test_two_engines_at_once_and_close(qwen3_dir):
    shm_before = set(os.listdir("/dev/shm"))
    a = LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    b = LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    assert greedy(a, PROMPTS[:4]) == greedy(b, PROMPTS[:4])
    assert a.get_world_size() == 2
    ids = b.enqueue(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # vLLM's queueing
    assert [o.request_id for o in b.wait_for_completion(use_tqdm=False)] == ids
    pids = worker_pids(a) + worker_pids(b)
    watchdogs = [a.llm_engine.workers.watchdog, b.llm_engine.workers.watchdog]
    a.close()
    b.close()
    assert not any(alive(pid) for pid in pids)
    assert not any(w.is_alive() for w in watchdogs)
    assert set(os.listdir("/dev/shm")) == shm_before
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        a.generate([[1, 2, 3]], use_tqdm=False)


def test_with_and_del_end_workers(qwen3_dir):
    with LLM(qwen3_dir, tensor_parallel_size=2, **SMALL) as llm:
        pids = worker_pids(llm)
    assert not any(alive(pid) for pid in pids)
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    pids = worker_pids(llm)
    del llm
    import gc
    gc.collect()
    assert not any(alive(pid) for pid in pids)


def test_exception_in_generate_ends_workers(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    pids = worker_pids(llm)
    engine = llm.llm_engine
    real_step, calls = engine.run_step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "run_step", step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert not any(alive(pid) for pid in pids)


def test_rank0_failing_at_start_ends_workers(qwen3_dir, monkeypatch):
    """rank 0's own start-up error reaches the caller as is, and no worker is left behind."""
    import nanovllm.engine.llm_engine as llm_engine
    spawned = []
    real_workers = llm_engine.TPWorkers

    def workers(*args):
        spawned.append(real_workers(*args))
        return spawned[-1]

    def runner(*args, **kwargs):
        raise RuntimeError("rank 0 could not start")

    monkeypatch.setattr(llm_engine, "TPWorkers", workers)
    monkeypatch.setattr(llm_engine, "ModelRunner", runner)
    with pytest.raises(RuntimeError, match="rank 0 could not start"):
        LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    assert not any(alive(p.pid) for p in spawned[0].procs)


def test_bad_input_keeps_workers(qwen3_dir):
    with LLM(qwen3_dir, tensor_parallel_size=2, **SMALL) as llm:
        with pytest.raises(ValueError, match="out of vocabulary"):
            llm.generate([[1, 99999]], use_tqdm=False)
        assert len(greedy(llm, PROMPTS[:2])) == 2


def _tp_rank_and_shard(model):
    qkv = model.model.layers[0].self_attn.qkv_proj
    return qkv.tp_rank, tuple(qkv.weight.shape)


def _runner_rank_plus(runner, offset, rank_1_sleeps_s=0.0):
    if runner.tp.rank == 1:
        time.sleep(rank_1_sleeps_s)
    return runner.tp.rank + offset


def _fail_on_rank_1(runner):
    if runner.tp.rank == 1:
        raise KeyError("rank 1 fails")
    return "ok"


def test_apply_model_and_collective_rpc_reach_every_rank(qwen3_dir, tmp_path):
    """apply_model and collective_rpc run on both ranks and return their results by rank; a lambda
    cannot be sent to a worker (ValueError), a worker's exception reaches the caller, a call that
    times out raises TimeoutError, and in every case the engine goes on working. start_profile /
    stop_profile go through it: each rank writes its trace."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    with LLM(qwen3_dir, tensor_parallel_size=2, profiler_config=profiler, **SMALL) as llm:
        llm.start_profile()
        greedy(llm, PROMPTS[:1])
        llm.stop_profile()
        traces = sorted(name.split(".")[0] for name in os.listdir(tmp_path) if ".pt.trace.json" in name)
        assert traces == ["tp0", "tp1"] and os.path.exists(tmp_path / "profiler_out_1.txt")
        (rank0, shard0), (rank1, shard1) = llm.apply_model(_tp_rank_and_shard)
        assert (rank0, rank1) == (0, 1) and shard0 == shard1
        assert llm.collective_rpc(_runner_rank_plus, args=(10,)) == [10, 11]
        assert llm.collective_rpc("apply_model", args=(_tp_rank_and_shard,))[1][0] == 1
        with pytest.raises(ValueError, match="must be picklable"):
            llm.apply_model(lambda model: 0)
        with pytest.raises(KeyError, match="rank 1 fails"):
            llm.collective_rpc(_fail_on_rank_1)
        with pytest.raises(TimeoutError, match="worker rank 1 did not answer in time"):
            llm.collective_rpc(_runner_rank_plus, args=(0,), kwargs={"rank_1_sleeps_s": 1.0}, timeout=0.2)
        assert llm.collective_rpc(_runner_rank_plus, args=(5,)) == [5, 6]   # the late answer is dropped
        assert greedy(llm, PROMPTS[:2]) == greedy(llm, PROMPTS[:2])


def _storages_freed(runner) -> tuple[bool, bool]:
    weight = runner.model.model.layers[0].self_attn.qkv_proj.weight
    return weight.untyped_storage().nbytes() == 0, runner.kv_cache.untyped_storage().nbytes() == 0


def test_sleep_and_wake_up_on_every_rank(qwen3_dir):
    """sleep / wake_up reach the workers: each rank frees and refills its own shard and cache, and
    the same tokens follow (level 1, then level 2 with reload_weights)."""
    with LLM(qwen3_dir, tensor_parallel_size=2, enable_sleep_mode=True, **SMALL) as llm:
        expected = greedy(llm, PROMPTS[:2])
        llm.sleep(level=1)
        assert llm.collective_rpc(_storages_freed) == [(True, True), (True, True)]
        llm.wake_up(["weights"])
        assert llm.collective_rpc(_storages_freed) == [(False, True), (False, True)]
        llm.wake_up(["kv_cache"])
        assert greedy(llm, PROMPTS[:2]) == expected
        llm.sleep(level=2)
        llm.wake_up()
        llm.collective_rpc("reload_weights")
        assert greedy(llm, PROMPTS[:2]) == expected


def test_engine_api_streams_with_tensor_parallelism(qwen3_dir):
    """LLMEngine.from_engine_args with TP=2: add_request / step stream the same tokens as
    LLM.generate gives, and close() ends the workers."""
    from nanovllm import EngineArgs, LLMEngine
    from nanovllm.sampling_params import RequestOutputKind
    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, tensor_parallel_size=2, **SMALL))
    try:
        delta = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, delta)
        streamed = {str(i): [] for i in range(3)}
        while engine.has_unfinished_requests():
            for output in engine.step():
                streamed[output.request_id] += output.outputs[0].token_ids
        pids = [proc.pid for proc in engine.workers.procs]
    finally:
        engine.close()
    with LLM(qwen3_dir, **SMALL) as single:
        assert [streamed[str(i)] for i in range(3)] == greedy(single, PROMPTS[:3])
    assert not any(alive(pid) for pid in pids)


def test_thinking_budget_and_structured_outputs_with_tensor_parallelism(qwen3_dir):
    """Rank 0's sampler forces and constrains tokens; the other ranks follow its tokens: TP=2
    gives one rank's completions."""
    sps = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"}),
           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=2)]

    def completions(llm):
        start = llm.get_tokenizer().encode("<think>", add_special_tokens=False)
        prompts = [{"prompt_token_ids": PROMPTS[5]}, {"prompt_token_ids": PROMPTS[6] + start}]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]

    with LLM(qwen3_dir, tensor_parallel_size=2, reasoning_config={"reasoning_start_str": "<think>",
                                                                  "reasoning_end_str": "</think>"}, **SMALL) as tp2:
        ours = completions(tp2)
    with LLM(qwen3_dir, reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"},
             **SMALL) as single:
        tok = single.get_tokenizer()
        assert ours == completions(single)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", tok.decode(ours[0], skip_special_tokens=True))
    end = tok.encode("</think>", add_special_tokens=False)
    assert ours[1][2:2 + len(end)] == end


def test_killed_worker_is_named(qwen3_dir):
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **SMALL)
    greedy(llm, PROMPTS[:2])
    os.kill(worker_pids(llm)[0], signal.SIGKILL)
    workers = llm.llm_engine.workers
    workers.watchdog.join(5)                 # it saw the death and aborted the group (NCCL would wait)
    assert not workers.watchdog.is_alive() and not workers.closed
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        greedy(llm)
    assert time.monotonic() - start < 10


def test_bad_tensor_parallel_size(qwen3_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(qwen3_dir, tensor_parallel_size=3, **SMALL)


SCRIPT = """
import signal
import sys
from nanovllm import LLM, SamplingParams

if __name__ == "__main__":            # worker processes are spawned: the script re-imports
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even where the test runs with SIGINT
    # ignored (a job started with & by a non-interactive shell), which Python would keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", block_size=16, num_kvcache_blocks=128)
    print("PIDS", *[p.pid for p in llm.llm_engine.workers.procs], flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)                   # no close(): interpreter exit must end the workers
    while True:                       # until Ctrl-C
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["exit", "ctrl_c"])
def test_process_end_ends_workers(qwen3_dir, tmp_path, how):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), qwen3_dir, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    if how == "ctrl_c":
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
    # the workers' exits freed what their start-up held (Triton's bindings name what is left at exit)
    assert "leaked" not in proc.stderr.read()


def test_worker_dying_at_start_is_named(qwen3_dir, tmp_path):
    """A script without the `if __name__ == "__main__"` guard: its spawned worker fails at once."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import sys
        from nanovllm import LLM
        LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", block_size=16, num_kvcache_blocks=128)
    """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), qwen3_dir], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tensor-parallel worker rank 1 exited with code 1" in proc.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_linear_computes_into_the_all_reduce_input_buffer(bias):
    """With a buffer to compute into (the symmetric-memory all-reduce's), the row-parallel product
    is written there, with the bias, and the layer returns what the all-reduce makes of it."""
    import torch
    import torch.nn.functional as F
    from nanovllm.distributed import TPGroup
    from nanovllm.layers.linear import RowParallelLinear

    class BufferGroup(TPGroup):
        buffer = torch.full((8, 4), float("nan"))

        def all_reduce_input(self, shape, dtype):
            return self.buffer[:shape[0]]

        def all_reduce(self, x):
            assert x.data_ptr() == self.buffer.data_ptr()
            return x * 2                     # a new tensor, as the real one returns

    gen = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(6, 4, bias=bias, tp=BufferGroup())
    layer.weight.data = torch.randn(4, 6, generator=gen)
    if bias:
        layer.bias.data = torch.randn(4, generator=gen)
    x = torch.randn(3, 6, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    assert torch.allclose(layer(x), 2 * expected)
    assert torch.allclose(BufferGroup.buffer[:3], expected) and BufferGroup.buffer[3:].isnan().all()
