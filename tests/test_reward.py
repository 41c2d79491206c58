"""Reward models (vLLM's Qwen2ForRewardModel and Qwen2ForProcessRewardModel) and STEP pooling: every token's
score from the two-layer head over HF transformers' Qwen2Model hidden states, in float32, with chunked prefill,
preemption and tensor parallelism; STEP pooling's rows (step_tag_id) and columns (returned_token_ids), from the
engine's pooler_config or a request's PoolingParams; and bad input."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel

from conftest import as_prompts, assert_pooling_idle, make_prompts
from nanovllm import LLM, PoolingParams

PROMPTS = make_prompts()
SMALL = dict(dtype="float32", block_size=16, num_kvcache_blocks=128, max_num_batched_tokens=64)


def reward_dir(src, dst, architecture: str, num_labels: int) -> str:
    """src's Qwen2 weights (no LM head) with a random two-layer score head, as a reward model's checkpoint."""
    os.makedirs(dst)
    tensors = {name: t for name, t in load_state(src).items() if not name.startswith("lm_head.")}
    g = torch.Generator().manual_seed(3)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors |= {"score.0.weight": torch.randn(hidden, hidden, generator=g) * 0.15,
                "score.0.bias": torch.randn(hidden, generator=g) * 0.1,
                "score.2.weight": torch.randn(num_labels, hidden, generator=g) * 0.5,
                "score.2.bias": torch.randn(num_labels, generator=g) * 0.1}
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config | {"architectures": [architecture]}, f)
    for name in os.listdir(src):   # (the tokenizer's files)
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def load_state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


@torch.no_grad()
def reference_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits [tokens, labels]: HF's Qwen2Model, then the checkpoint's score head, in float32."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    state = load_state(path)
    out = []
    for ids in prompts:
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
        hidden = torch.relu(hidden @ state["score.0.weight"].T + state["score.0.bias"])
        out.append(hidden @ state["score.2.weight"].T + state["score.2.bias"])
    return out


@pytest.fixture(scope="module")
def prm_dir(qwen2_dir, tmp_path_factory):
    return reward_dir(qwen2_dir, tmp_path_factory.mktemp("prm") / "prm", "Qwen2ForProcessRewardModel", 2)


@pytest.fixture(scope="module")
def orm_dir(qwen2_dir, tmp_path_factory):
    return reward_dir(qwen2_dir, tmp_path_factory.mktemp("orm") / "orm", "Qwen2ForRewardModel", 1)


def common_token(prompts: list[list[int]]) -> int:
    """The token id found in most of the prompts (a step tag that several prompts have, some several times)."""
    counts = {}
    for ids in prompts:
        for t in set(ids):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: (counts[t], -t))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_process_reward_model_step_pooling(prm_dir, async_scheduling):
    """A process reward model pools by STEP by default (vLLM's, at token 151651): the softmax of the head's two
    logits at each prompt token that is the step tag, with prompts chunked (64 tokens a step); a request's
    step_tag_id and returned_token_ids replace the engine's; use_activation=False gives the logits."""
    tag = common_token(PROMPTS)
    logits = reference_logits(prm_dir, PROMPTS)
    rows = [[i for i, t in enumerate(ids) if t == tag] for ids in PROMPTS]
    assert sum(map(len, rows)) >= 8 and sum(1 for r in rows if not r) >= 1   # (some prompts have no tag)
    with LLM(prm_dir, async_scheduling=async_scheduling, **SMALL) as llm:
        config = llm.llm_engine.config.pooler_config
        assert (config.tok_pooling_type, config.step_tag_id) == ("STEP", 151651)
        assert llm.llm_engine.get_supported_tasks() == ("token_classify",)
        # the default tag is past this vocabulary: no rows
        outs = llm.encode(as_prompts(PROMPTS[:2]), pooling_task="token_classify", use_tqdm=False)
        assert [tuple(o.outputs.data.shape) for o in outs] == [(0, 2), (0, 2)]
        outs = llm.encode(as_prompts(PROMPTS), PoolingParams(step_tag_id=tag), pooling_task="token_classify",
                          use_tqdm=False)
        for out, expected, keep in zip(outs, logits, rows):
            torch.testing.assert_close(out.outputs.data, expected[keep].softmax(-1), atol=2e-6, rtol=0)
        # one column: its sigmoid (vLLM's activation for one label); raw logits without the activation
        params = [PoolingParams(step_tag_id=tag, returned_token_ids=[1]),
                  PoolingParams(step_tag_id=tag, use_activation=False, returned_token_ids=[])]   # ([]: every one)
        outs = llm.encode(as_prompts(PROMPTS[:2] * 2), params * 2, pooling_task="token_classify", use_tqdm=False)
        for i, out in enumerate(outs):
            expected = logits[i % 2][rows[i % 2]]
            expected = expected[:, [1]].sigmoid() if i % 2 == 0 else expected
            torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)
        assert_pooling_idle(llm)


def test_step_pooling_from_pooler_config_through_preemption(prm_dir):
    """The engine's pooler_config sets the step tag and the columns; a prompt preempted part-way (sleep mode
    "keep") drops its rows so far and computes them again; its result as without preemption."""
    ids = PROMPTS[7]   # (150 tokens: 96 computed before the preemption)
    tag = max(set(ids), key=lambda t: (ids.count(t), -t))
    keep = [i for i, t in enumerate(ids) if t == tag]
    assert len(keep) >= 2
    [logits] = reference_logits(prm_dir, [ids])
    with LLM(prm_dir, pooler_config={"step_tag_id": tag, "returned_token_ids": [0]}, enable_sleep_mode=True,
             **SMALL | dict(max_num_batched_tokens=32)) as llm:
        engine = llm.llm_engine
        engine.add_request("a", {"prompt_token_ids": ids}, PoolingParams())
        for _ in range(3):
            assert engine.step() == []
        engine.sleep(level=1, mode="keep")
        assert engine.scheduler.num_preemptions == 1
        engine.wake_up()
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        [out] = outputs
        torch.testing.assert_close(out.outputs.data, logits[keep][:, [0]].sigmoid(), atol=2e-6, rtol=0)
        assert_pooling_idle(llm)


def test_outcome_reward_model(orm_dir):
    """An outcome reward model gives every token's logit as it is (vLLM's default: no activation), by ALL
    pooling; it does no other task, and STEP's parameters need STEP pooling."""
    logits = reference_logits(orm_dir, PROMPTS)
    with LLM(orm_dir, **SMALL) as llm:
        assert llm.llm_engine.config.pooler_config.tok_pooling_type == "ALL"
        outs = llm.encode(as_prompts(PROMPTS), pooling_task="token_classify", use_tqdm=False)
        for out, expected in zip(outs, logits):
            torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)
        outs = llm.encode(as_prompts(PROMPTS[:1]), PoolingParams(use_activation=True), pooling_task="token_classify",
                          use_tqdm=False)
        torch.testing.assert_close(outs[0].outputs.data, logits[0].sigmoid(), atol=2e-6, rtol=0)
        for call, message in [
                (lambda: llm.classify(as_prompts(PROMPTS[:1]), use_tqdm=False),
                 "Classification API is not supported by this model."),
                (lambda: llm.encode(as_prompts(PROMPTS[:1]), PoolingParams(step_tag_id=5),
                                    pooling_task="token_classify", use_tqdm=False),
                 "Task token_classify only supports ['use_activation'] parameters, does not support "
                 "['step_tag_id'] parameters")]:
            with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
                call()
        assert_pooling_idle(llm)
        assert len(llm.encode(as_prompts(PROMPTS[:1]), pooling_task="token_classify", use_tqdm=False)) == 1


def test_step_pooling_refusals(prm_dir, qwen2_dir):
    with LLM(prm_dir, **SMALL) as llm:
        with pytest.raises(ValueError, match=r"returned_token_ids \[2\] are past the 2 labels of a token's result."):
            llm.encode(as_prompts(PROMPTS[:2]), PoolingParams(returned_token_ids=[0, 2]),
                       pooling_task="token_classify", use_tqdm=False)
        assert_pooling_idle(llm)
    for kwargs, message in [(dict(runner="generate"), "This model does not support `--runner generate`"),
                            (dict(convert="embed"), "runs with convert 'classify' or 'auto', got convert='embed'.")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            LLM(prm_dir, **SMALL, **kwargs)


def test_step_pooling_of_an_embedding_model(qwen2_dir):
    """STEP pooling on token_embed: the features returned_token_ids names, at the step tag's tokens, then
    scaled to length 1 (vLLM's order: the pooling method's rows and columns, then the head's normalization)."""
    tag = common_token(PROMPTS)
    with LLM(qwen2_dir, runner="pooling", **SMALL) as llm:
        whole = llm.encode(as_prompts(PROMPTS[:4]), PoolingParams(use_activation=False), pooling_task="token_embed",
                           use_tqdm=False)
    with LLM(qwen2_dir, runner="pooling", pooler_config={"tok_pooling_type": "STEP", "step_tag_id": tag},
             **SMALL) as llm:
        outs = llm.encode(as_prompts(PROMPTS[:4]), PoolingParams(returned_token_ids=[3, 1, 8]),
                          pooling_task="token_embed", use_tqdm=False)
        for out, full, ids in zip(outs, whole, PROMPTS):
            keep = [i for i, t in enumerate(ids) if t == tag]
            expected = torch.nn.functional.normalize(full.outputs.data[keep][:, [3, 1, 8]], dim=-1)
            torch.testing.assert_close(out.outputs.data, expected, atol=1e-6, rtol=0)


def test_tensor_parallel_process_reward_model(prm_dir):
    """Two gloo ranks: the head is whole on each rank, the pooler on rank 0; the results as on one."""
    tag = common_token(PROMPTS)
    logits = reference_logits(prm_dir, PROMPTS)
    with LLM(prm_dir, tensor_parallel_size=2, pooler_config={"step_tag_id": tag}, **SMALL) as llm:
        outs = llm.encode(as_prompts(PROMPTS), pooling_task="token_classify", use_tqdm=False)
        for out, expected, ids in zip(outs, logits, PROMPTS):
            keep = [i for i, t in enumerate(ids) if t == tag]
            torch.testing.assert_close(out.outputs.data, expected[keep].softmax(-1), atol=2e-6, rtol=0)
