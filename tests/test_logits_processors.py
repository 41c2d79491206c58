"""Custom logits processors, as vLLM's (LLM(logits_processors=[...]), nanovllm/logits_processor.py): the batch
updates keep every request at one index of a batch 0 .. n - 1 while requests come, finish and are preempted,
each row of apply's logits is the request at that index, the output ids handed with a request grow live, and bad
processors or options are ValueErrors."""
import argparse

import pytest
import torch

from conftest import as_prompts, make_prompts
from nanovllm import LLM, EngineArgs, SamplingParams
from nanovllm.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, apply_dict_updates

PROMPTS = make_prompts(num=12)
# Many requests through a few rows, chunked prompts, a cache small enough for preemptions
BUSY = dict(dtype="float32", block_size=16, num_kvcache_blocks=14, max_num_seqs=4, max_num_batched_tokens=48)


class ForceTarget(LogitsProcessor):
    """vLLM's example processor: a request with extra_args {"target_token": t} samples only t. It also keeps an
    entry for every request and checks that the batch is 0 .. batch_size - 1, each index one request."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int | None] = {}   # index -> its target token (None: none)
        self.batch_size = 0
        self.updates = 0

    @classmethod
    def validate_params(cls, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an int, got {target!r}.")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is not None:
            self.updates += 1
            self.batch_size = batch_update.batch_size
            apply_dict_updates(self.req_info, batch_update, lambda params, _, __: [
                (params.extra_args or {}).get("target_token")])
        assert sorted(self.req_info) == list(range(self.batch_size)), (self.req_info, self.batch_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size
        for index, (target,) in self.req_info.items():
            if target is not None:
                logits[index] = force(logits[index], target)
        return logits


class CountUp(AdapterLogitsProcessor):
    """Per-request functions: with extra_args {"count_from": c} the i-th output token is c + i (read from the
    live output ids), or, with "echo_prompt", the prompt's tokens again (the three-argument form)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = params.extra_args or {}
        if "count_from" in args:
            return lambda output_ids, row: force(row, args["count_from"] + len(output_ids))
        if args.get("echo_prompt"):
            return lambda prompt_ids, output_ids, row: force(row, prompt_ids[len(output_ids) % len(prompt_ids)])
        return None


def force(row: torch.Tensor, token: int) -> torch.Tensor:
    out = torch.full_like(row, float("-inf"))
    out[token] = 0.0
    return out


def test_each_row_is_its_requests_and_the_batch_stays_whole(qwen3_dir):
    """Twelve requests through four rows (finishing at different lengths, chunked, preempted, n=2): the ones with
    a target sample only it, the others their tokens without processors; the batch is 0 .. n - 1 at every step."""
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * (i % 5), ignore_eos=True,
                             extra_args={"target_token": 10 + i} if i % 2 else None) for i in range(12)]
    params[4] = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=6, ignore_eos=True,
                               extra_args={"target_token": 99})
    with LLM(qwen3_dir, logits_processors=[ForceTarget], **BUSY) as llm:
        outputs = llm.generate(as_prompts(PROMPTS), params, use_tqdm=False)
        processor = llm.llm_engine.model_runner.logits_processors.processors[0]
        assert llm.llm_engine.scheduler.num_preemptions > 0 and processor.updates > 5
    with LLM(qwen3_dir, **BUSY) as plain:
        reference = plain.generate(as_prompts(PROMPTS), params, use_tqdm=False)
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        for completion, ref_completion in zip(ours.outputs, ref.outputs):
            target = (params[i].extra_args or {}).get("target_token")
            expected = [target] * params[i].max_tokens if target is not None else ref_completion.token_ids
            assert list(completion.token_ids) == expected, i


def test_per_request_functions_see_their_outputs_grow(qwen3_dir):
    """AdapterLogitsProcessor (by its name, "module:Class"): each function reads the request's output ids as they
    grow (with async scheduling: the step's tokens read before the next is sampled) and its prompt ids; requests
    without one run as without processors."""
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, extra_args={"count_from": 20 + i})
              for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, extra_args={"echo_prompt": True}),
               SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    prompts = PROMPTS[2:7]
    with LLM(qwen3_dir, logits_processors=[f"{__name__}:CountUp"], async_scheduling=True, **BUSY) as llm:
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(as_prompts(prompts), params, use_tqdm=False)]
        plain = list(llm.generate(as_prompts(prompts[4:]), params[4:], use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[:3] == [list(range(20 + i, 27 + i)) for i in range(3)]
    assert outputs[3] == [prompts[3][j % len(prompts[3])] for j in range(5)]
    with LLM(qwen3_dir, **BUSY) as reference:
        assert outputs[4] == plain == list(reference.generate(as_prompts(prompts[4:]), params[4:],
                                                              use_tqdm=False)[0].outputs[0].token_ids)


class Probe(LogitsProcessor):
    """Records the logits it is handed, by step (changing nothing); Varying may change the argmax, Invariant may
    not."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.seen: dict[int, torch.Tensor] = {}   # step -> its logits
        self.step = 0

    def update_state(self, batch_update):
        self.step += 1

    def apply(self, logits):
        self.seen[self.step] = logits.clone()
        return logits


def tempered_pairs(varying: Probe, invariant: Probe) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (before the penalties, after the temperature) logits of each step both probes saw."""
    return [(varying.seen[step], logits) for step, logits in invariant.seen.items()]


class Varying(Probe):
    def is_argmax_invariant(self):
        return False


class Invariant(Probe):
    def is_argmax_invariant(self):
        return True


def test_argmax_invariant_processors_see_the_tempered_logits(qwen3_dir):
    """As in vLLM: processors that may change the argmax see the logits before the penalties and the temperature,
    argmax-invariant ones the logits divided by each row's temperature (a greedy row's by 1), and none in a batch
    of greedy rows only."""
    with LLM(qwen3_dir, logits_processors=[Varying, Invariant], dtype="float32", num_kvcache_blocks=32) as llm:
        params = [SamplingParams(temperature=0.25, seed=1, max_tokens=2), SamplingParams(temperature=0.0, max_tokens=2)]
        llm.generate(as_prompts(PROMPTS[3:5]), params, use_tqdm=False)
        varying, invariant = llm.llm_engine.model_runner.logits_processors.processors
        assert len(varying.seen) == len(invariant.seen) == 2
        for before, tempered in tempered_pairs(varying, invariant):
            torch.testing.assert_close(tempered, before / torch.tensor([[0.25], [1.0]]))
        llm.generate(as_prompts(PROMPTS[3:5]), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        assert len(varying.seen) == 4 and len(invariant.seen) == 2


def test_tensor_parallel_ranks_need_no_processor_classes(qwen3_dir):
    """With two ranks only rank 0 makes the processors: a class defined in a function (which does not pickle)
    works."""
    class Ban(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            logits[:, 5:] = float("-inf")   # every request samples among tokens 0-4
            return logits

    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    with LLM(qwen3_dir, logits_processors=[Ban], tensor_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate(as_prompts(PROMPTS[:3]), params, use_tqdm=False)
    assert all(t < 5 for o in outputs for t in o.outputs[0].token_ids)


def test_bad_processors_and_options_are_value_errors(qwen3_dir):
    """A processor's validate_params refuses a request's options (the engine goes on); entries that are not
    processor classes, names that do not import, a pooling model and speculative decoding are refused as the
    engine is made."""
    with LLM(qwen3_dir, logits_processors=[ForceTarget], dtype="float32", num_kvcache_blocks=32) as llm:
        with pytest.raises(ValueError, match="target_token must be an int, got 'x'"):
            llm.generate(as_prompts(PROMPTS[:2]), SamplingParams(max_tokens=2, extra_args={"target_token": "x"}),
                         use_tqdm=False)
        ok = llm.generate(as_prompts(PROMPTS[:1]), SamplingParams(max_tokens=2, extra_args={"target_token": 7}),
                          use_tqdm=False)
        assert list(ok[0].outputs[0].token_ids) == [7, 7]
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())   # (vLLM's flag: names)
    assert EngineArgs.from_cli_args(parser.parse_args(["--logits-processors", f"{__name__}:ForceTarget", "a.B"])
                                    ).logits_processors == [f"{__name__}:ForceTarget", "a.B"]
    with pytest.raises(ValueError, match=r"logits_processors\[1\] must be a LogitsProcessor class"):
        LLM(qwen3_dir, logits_processors=[ForceTarget, object()])
    with pytest.raises(ValueError, match=r"logits_processors\[0\]: cannot import 'no_such_module.Processor'"):
        LLM(qwen3_dir, logits_processors=["no_such_module.Processor"])
    with pytest.raises(ValueError, match="pooling models .* do not support custom logits processors"):
        LLM(qwen3_dir, runner="pooling", logits_processors=[ForceTarget])
    with pytest.raises(ValueError, match="not supported when speculative decoding is enabled"):
        LLM(qwen3_dir, logits_processors=[ForceTarget],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
