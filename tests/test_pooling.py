"""Pooling models (runner="pooling"): embeddings equal to HF transformers' hidden states in float32,
with chunked prefill, prefix caching and preemption; vLLM's entry points (embed, encode, score),
its PoolingParams and PoolerConfig, sentence-transformers models, and bad input."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from conftest import as_prompts, assert_pooling_idle, log_lines, make_prompts
from nanovllm import (LLM, EmbeddingRequestOutput, EngineArgs, LLMEngine, PoolingParams, PoolingRequestOutput,
                      SamplingParams, ScoringRequestOutput)
from nanovllm.pooling_params import PoolerConfig

PROMPTS = make_prompts()
SMALL = dict(dtype="float32", block_size=16, num_kvcache_blocks=128, max_num_batched_tokens=64)
WHOLE = dict(dtype="float32", block_size=16, num_kvcache_blocks=128)   # for MEAN: a prompt a step, whole


@torch.no_grad()
def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's final hidden states (after the last norm), [tokens, hidden], from HF transformers."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_embed_equals_hf_last_token(model_dir, async_scheduling):
    """Every architecture: LLM.embed is the last token's final hidden state scaled to length 1, with
    prompts chunked (64 tokens a step) and, on a second call, their full blocks read from the prefix cache;
    with async scheduling a step's results are read after the next step is launched."""
    ref = [F.normalize(h[-1], dim=-1) for h in hf_hidden(model_dir, PROMPTS)]
    with LLM(model_dir, runner="pooling", async_scheduling=async_scheduling, **SMALL) as llm:
        assert llm.llm_engine.get_supported_tasks() == ("embed", "token_embed")
        assert llm.model_config.runner_type == "pooling" and llm.model_config.convert_type == "embed"
        assert llm.llm_engine.model_runner.model.lm_head is None
        for call in range(2):
            outs = llm.embed(as_prompts(PROMPTS), use_tqdm=False)
            assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
            assert [o.prompt_token_ids for o in outs] == PROMPTS
            for out, expected in zip(outs, ref):
                assert out.outputs.hidden_size == expected.numel()
                torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=2e-6, rtol=0)
            cached = [o.num_cached_tokens for o in outs]
            if call == 1:   # the full 16-token blocks, but never the last token
                assert cached == [min(len(p) - 1, 16 * (len(p) // 16)) // 16 * 16 for p in PROMPTS]
        assert_pooling_idle(llm)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_turn_chunking_and_caching_off(qwen3_dir, pooling_type):
    """As in vLLM: MEAN and CLS need one pass over the whole prompt, so the engine neither chunks
    prompts nor reads them from the prefix cache; MEAN is the rows' mean, CLS the first row."""
    hidden = hf_hidden(qwen3_dir, PROMPTS)
    pool = (lambda h: h.mean(0)) if pooling_type == "MEAN" else (lambda h: h[0])
    with LLM(qwen3_dir, runner="pooling", pooler_config={"pooling_type": pooling_type}, **WHOLE) as llm:
        config = llm.llm_engine.config
        assert not config.enable_chunked_prefill and not config.enable_prefix_caching
        assert config.max_num_batched_tokens >= config.max_model_len
        for _ in range(2):
            outs = llm.embed(as_prompts(PROMPTS), use_tqdm=False)
            for out, h in zip(outs, hidden):
                torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(pool(h), dim=-1),
                                           atol=2e-6, rtol=0)
                assert out.num_cached_tokens == 0
        raw = llm.embed(as_prompts(PROMPTS[:3]), pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for out, h in zip(raw, hidden):
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), pool(h), atol=1e-5, rtol=0)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_token_embed_across_chunks_and_preemption(qwen3_dir, async_scheduling):
    """encode(pooling_task="token_embed"): every prompt token's hidden state, kept across chunks of 32
    tokens, and begun again when the request is preempted part way (here by sleep(mode="keep"), which
    preempts every running request; a prompt-only workload is not preempted for blocks, since a
    running prompt only ever waits for the one ahead of it)."""
    hidden = hf_hidden(qwen3_dir, PROMPTS)
    with LLM(qwen3_dir, runner="pooling", dtype="float32", block_size=16, num_kvcache_blocks=12,
             max_num_batched_tokens=32, enable_sleep_mode=True, async_scheduling=async_scheduling) as llm:
        outs = llm.encode(as_prompts(PROMPTS), pooling_task="token_embed", use_tqdm=False)
        assert all(isinstance(o, PoolingRequestOutput) for o in outs)
        for out, h in zip(outs, hidden):
            assert out.outputs.data.dtype == torch.float32 and out.outputs.data.shape == h.shape
            torch.testing.assert_close(out.outputs.data, F.normalize(h, dim=-1), atol=2e-6, rtol=0)
        engine = llm.llm_engine
        engine.add_request("long", {"prompt_token_ids": PROMPTS[7]}, PoolingParams(task="token_embed"))
        engine.add_request("last", {"prompt_token_ids": PROMPTS[7]}, PoolingParams())
        for _ in range(3):   # 96 of its 150 tokens
            assert engine.step() == []
        assert len(engine.model_runner.pooler.chunks) == 1
        engine.sleep(level=1, mode="keep")
        assert engine.scheduler.num_preemptions == 1
        engine.wake_up()
        outputs = {}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step()}
        torch.testing.assert_close(outputs["long"].outputs.data, F.normalize(hidden[7], dim=-1), atol=2e-6, rtol=0)
        torch.testing.assert_close(outputs["last"].outputs.data, F.normalize(hidden[7][-1], dim=-1),
                                   atol=2e-6, rtol=0)
        assert_pooling_idle(llm)


def test_abort_while_a_result_is_in_flight(qwen3_dir):
    """With async scheduling a finished prompt's result is read a step later: aborting its request in
    between drops it, and the other requests run on."""
    [h] = hf_hidden(qwen3_dir, PROMPTS[7:8])
    with LLM(qwen3_dir, runner="pooling", async_scheduling=True, **SMALL) as llm:
        engine = llm.llm_engine
        engine.add_request("short", {"prompt_token_ids": PROMPTS[2]}, PoolingParams())
        engine.add_request("long", {"prompt_token_ids": PROMPTS[7]}, PoolingParams())
        assert engine.step() == []   # "short" done, its result in flight; "long" at 57 of 150 tokens
        assert engine.in_flight.seqs[0].request_id == "short"
        engine.abort_request("short")
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [o.request_id for o in outputs] == ["long"]
        torch.testing.assert_close(outputs[0].outputs.data, F.normalize(h[-1], dim=-1), atol=2e-6, rtol=0)
        assert engine.in_flight is None
        assert_pooling_idle(llm)


def test_matryoshka_dimensions(qwen3_dir):
    """dimensions keeps the first features, then normalizes (vLLM's order); only a Matryoshka model
    (hf_config.matryoshka_dimensions or is_matryoshka) takes it, each refusal in vLLM's words."""
    [h] = hf_hidden(qwen3_dir, PROMPTS[5:6])
    with LLM(qwen3_dir, runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]}, **SMALL) as llm:
        [out] = llm.embed(as_prompts(PROMPTS[5:6]), pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h[-1, :16], dim=-1),
                                   atol=2e-6, rtol=0)
        name = llm.model_config.served_model_name
        with pytest.raises(ValueError, match=rf"^Model '{name}' only supports Matryoshka dimensions \[16, 32\], "
                                             r"got 24\.$"):
            llm.embed("Hello", pooling_params=PoolingParams(dimensions=24), use_tqdm=False)
        with pytest.raises(ValueError, match=r"only supports dimensions in range \[1, 64\], got 65\.$"):
            llm.embed("Hello", pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
        assert_pooling_idle(llm)
    with LLM(qwen3_dir, runner="pooling", pooler_config={"dimensions": 8}, hf_overrides={"is_matryoshka": True},
             **SMALL) as llm:   # the engine's default dimensions
        assert llm.embed("Hello", use_tqdm=False)[0].outputs.hidden_size == 8
    with LLM(qwen3_dir, runner="pooling", **SMALL) as llm:
        with pytest.raises(ValueError, match=r"does not support Matryoshka embeddings; dimensions must be unset "
                                             r"\(received dimensions=16\)\.$"):
            llm.embed("Hello", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


def test_score_is_cosine_similarity_of_embeddings(qwen3_dir, tokenizer):
    """LLM.score for an embedding model: 1:1, 1:N and N:N pairs, each the cosine of the two embeddings,
    with vLLM's request ids, prompt tokens (joined by the pad token) and length checks."""
    texts = ["Hello world!", "The quick brown fox", "Paged attention stores keys", "A scheduler batches"]
    with LLM(qwen3_dir, runner="pooling", **SMALL) as llm:
        emb = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
        cos = lambda i, j: F.cosine_similarity(emb[i], emb[j], dim=0).item()
        [one] = llm.score(texts[0], texts[1], use_tqdm=False)
        assert isinstance(one, ScoringRequestOutput) and one.outputs.score == pytest.approx(cos(0, 1), abs=1e-6)
        first, second = tokenizer.encode(texts[0]), tokenizer.encode(texts[1])
        assert one.prompt_token_ids == first + [tokenizer.pad_token_id] + second
        a, b = one.request_id.split("_")
        assert int(b) == int(a) + 1
        many = llm.score(texts[0], texts[1:], use_tqdm=False)
        assert [o.outputs.score for o in many] == pytest.approx([cos(0, j) for j in (1, 2, 3)], abs=1e-6)
        pairs = llm.score(texts[:2], texts[2:], use_tqdm=False)
        assert [o.outputs.score for o in pairs] == pytest.approx([cos(0, 2), cos(1, 3)], abs=1e-6)
        with pytest.raises(ValueError, match="^Input lengths must be either 1:1, 1:N or N:N$"):
            llm.score(texts[:2], texts[1:], use_tqdm=False)
        with pytest.raises(ValueError, match="^At least one text_pair element must be given$"):
            llm.score(texts[0], [], use_tqdm=False)
        assert_pooling_idle(llm)


def test_score_of_a_token_embed_engine_is_max_sim(qwen3_dir):
    """An engine whose pooler_config.task is "token_embed" scores as vLLM's late interaction: for each of
    the first text's tokens, its best dot product with the second's tokens, summed."""
    texts = ["Hello world!", "The quick brown fox", "Paged attention stores keys"]
    with LLM(qwen3_dir, runner="pooling", pooler_config={"task": "token_embed"}, **SMALL) as llm:
        tokens = [o.outputs.data for o in llm.encode(texts, pooling_task="token_embed", use_tqdm=False)]
        scores = [o.outputs.score for o in llm.score(texts[0], texts[1:], use_tqdm=False)]
        expected = [sum(max(float(q @ d) for d in tokens[j]) for q in tokens[0]) for j in (1, 2)]
        assert scores == pytest.approx(expected, abs=1e-5)


def _sentence_transformers_dir(src, dst, pooling: dict, normalize: bool) -> str:
    """src as a sentence-transformers model: modules.json, the Pooling module's config, maybe Normalize."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False, **pooling}, f)
    return str(dst)


def test_sentence_transformers_model_is_a_pooling_model(qwen3_dir, tmp_path):
    """runner="auto" (the default) picks pooling for a model with a modules.json, and its pooling mode and
    Normalize module set the pooler (Qwen3-Embedding's files: last token, normalized); the user's
    pooler_config wins over them. A module nanovllm does not run (a Dense projection) is refused."""
    [h] = hf_hidden(qwen3_dir, PROMPTS[6:7])
    last = _sentence_transformers_dir(qwen3_dir, tmp_path / "last", {"pooling_mode_lasttoken": True}, True)
    with LLM(last, **SMALL) as llm:
        assert llm.model_config.runner_type == "pooling"
        pooler = llm.llm_engine.config.pooler_config
        assert (pooler.seq_pooling_type, pooler.use_activation) == ("LAST", True)
        [out] = llm.embed(as_prompts(PROMPTS[6:7]), use_tqdm=False)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h[-1], dim=-1), atol=2e-6, rtol=0)
    mean = _sentence_transformers_dir(qwen3_dir, tmp_path / "mean", {"pooling_mode_mean_tokens": True}, False)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(64\) is smaller than max_model_len \(512\): "
                                         r"MEAN pooling computes each prompt in one step\. Raise"):
        LLM(mean, **SMALL)
    with LLM(mean, **WHOLE) as llm:
        [out] = llm.embed(as_prompts(PROMPTS[6:7]), use_tqdm=False)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), h.mean(0), atol=1e-5, rtol=0)
    mine = PoolerConfig(seq_pooling_type="LAST", use_activation=True)
    with LLM(mean, pooler_config=mine, **SMALL) as llm:
        assert llm.llm_engine.config.pooler_config is not mine and mine.tok_pooling_type is None   # (not filled in)
        [out] = llm.embed(as_prompts(PROMPTS[6:7]), use_tqdm=False)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h[-1], dim=-1), atol=2e-6, rtol=0)
    dense = _sentence_transformers_dir(qwen3_dir, tmp_path / "dense", {"pooling_mode_lasttoken": True}, True)
    with open(os.path.join(dense, "modules.json")) as f:
        modules = json.load(f)
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(dense, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match=r"has module\(s\) \['sentence_transformers.models.Dense'\]; nanovllm runs"):
        LLM(dense, **SMALL)
    with pytest.raises(ValueError, match="does not support `--runner generate`"):
        LLM(_base_model_dir(qwen3_dir, tmp_path / "base"), runner="generate", **SMALL)


def _base_model_dir(src, dst) -> str:
    """src's weights saved as HF's base model (Qwen3Model: no LM head, tensors without the model. prefix)."""
    if not os.path.isdir(dst):
        AutoModel.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, safe_serialization=True)
        for name in os.listdir(src):
            if name.startswith(("tokenizer", "special_tokens", "generation")):
                shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def test_base_model_checkpoint_embeds(qwen3_dir, tmp_path):
    """A checkpoint of the model without its LM head (architectures ["Qwen3Model"]) is an embedding
    model under runner "auto", with the causal checkpoint's embeddings."""
    base = _base_model_dir(qwen3_dir, tmp_path / "base")
    with open(os.path.join(base, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    with LLM(qwen3_dir, convert="embed", **SMALL) as llm:
        expected = [o.outputs.embedding for o in llm.embed(as_prompts(PROMPTS), use_tqdm=False)]
    with LLM(base, **SMALL) as llm:
        assert llm.model_config.runner_type == "pooling" and llm.model_config.convert_type == "none"
        assert [o.outputs.embedding for o in llm.embed(as_prompts(PROMPTS), use_tqdm=False)] == expected


def test_bad_input_is_refused_and_engine_stays_usable(qwen3_dir):
    """Each a ValueError before anything runs; the next valid call works and nothing is left behind."""
    with LLM(qwen3_dir, runner="pooling", **SMALL) as llm:
        good = llm.embed("Hello", use_tqdm=False)[0].outputs.embedding
        cases = [
            (lambda: llm.encode("Hello", use_tqdm=False), "^pooling_task required for `LLM.encode`"),
            (lambda: llm.encode("Hello", pooling_task="classify", use_tqdm=False),
             r"^Classification API is not supported by this model\. Try converting the model using "
             r"`--convert classify`\.$"),
            (lambda: llm.classify("Hello", use_tqdm=False), r"^Classification API is not supported"),
            (lambda: llm.encode("Hello", pooling_task="reward", use_tqdm=False),
             r"^Unsupported task: 'reward' Supported tasks: \('embed', 'token_embed'\)$"),
            (lambda: llm.embed(["Hello", {"prompt_token_ids": [1, 999]}], use_tqdm=False),
             r"^prompt 1: token id 999 is out of vocabulary \(vocab_size=384\)\.$"),
            (lambda: llm.embed([{"prompt_token_ids": [5] * 513}], use_tqdm=False),
             r"^prompt 0 \(length 513\) is longer than the maximum model length of 512\.$"),
            (lambda: llm.embed(["a", "b"], pooling_params=SamplingParams(), use_tqdm=False),
             r"^pooling_params must be a PoolingParams or a list of them, got SamplingParams\.$"),
            (lambda: llm.embed(["a", "b"], pooling_params=[PoolingParams(), SamplingParams()], use_tqdm=False),
             r"^pooling_params\[1\] must be a PoolingParams for a pooling model \(runner='pooling'\), got "
             r"SamplingParams\.$"),
            (lambda: llm.embed(["a", "b"], pooling_params=[PoolingParams()], use_tqdm=False),
             r"^pooling_params has 1 entries but there are 2 prompts"),
            (lambda: llm.embed("a", pooling_params=PoolingParams(task="token_embed"), use_tqdm=False),
             r"^You cannot overwrite params.task='token_embed' with pooling_task='embed'!$"),
            (lambda: llm.generate("Hello"), r"^LLM.generate\(\) is only supported for generative models\. Try "
                                            r"passing `--runner generate` to use the model as a generative model\.$"),
            (lambda: llm.chat([{"role": "user", "content": "Hi"}]), r"^LLM.generate\(\) is only supported"),
        ]
        for call, message in cases:
            with pytest.raises(ValueError, match=message):
                call()
            assert_pooling_idle(llm)
        # a prompt of max_model_len tokens: no room for an output token is needed
        assert len(llm.embed([{"prompt_token_ids": [5] * 512}], use_tqdm=False)[0].outputs.embedding) == 64
        assert llm.embed("Hello", use_tqdm=False)[0].outputs.embedding == good
        assert_pooling_idle(llm)


@pytest.mark.parametrize("kwargs,message", [
    (dict(task="embed"), "LLM() got an unexpected keyword argument 'task' ('embed'): vLLM 0.26 makes an embedding "
                         "model with runner='pooling'; pass that instead."),
    (dict(pooler_config={"pooling_type": "NONE"}), "seq_pooling_type must be one of LAST, CLS, MEAN, got 'NONE'."),
    (dict(pooler_config={"tok_pooling_type": "MEAN"}), "tok_pooling_type must be one of ALL, STEP, got 'MEAN'."),
    (dict(pooler_config={"task": "classify"}), "pooler_config.task='classify' is not a task of this model "
                                               "(supported: embed, token_embed); try converting the model using "
                                               "`--convert classify`."),
    (dict(pooler_config={"task": "reward"}), "pooler_config.task must be one of 'embed', 'token_embed', 'classify', "
                                             "'token_classify', got 'reward'."),
    (dict(pooler_config={"normalize": True}), "Parameter `normalize` was removed; use `use_activation` instead."),
    (dict(pooler_config={"max_embed_len": 0}), "pooler_config.max_embed_len must be a positive int or None, got 0."),
    (dict(pooler_config={"enable_chunked_processing": "yes"}), "pooler_config.enable_chunked_processing must be a "
                                                               "bool, got 'yes'."),
    (dict(pooler_config={"step_tag_id": -1}), "pooler_config.step_tag_id must be a token id (an int >= 0) or None, "
                                              "got -1."),
    (dict(pooler_config={"logit_sigma": "2"}), "pooler_config.logit_sigma must be a number or None, got '2'."),
    (dict(pooler_config={"logit_sigma": 0}), "pooler_config.logit_sigma must not be 0."),
    (dict(pooler_config={"pooling_type": "MEAN", "seq_pooling_type": "LAST"}), "Cannot set both `pooling_type`"),
    (dict(pooler_config="MEAN"), "pooler_config must be a PoolerConfig or a dict of its fields, got 'MEAN'."),
])
def test_pooler_config_refusals(qwen3_dir, kwargs, message):
    with pytest.raises(ValueError) as error:
        LLM(qwen3_dir, runner="pooling", **SMALL, **kwargs)
    assert message in str(error.value)


def test_chunked_processing_is_taken_and_does_nothing_offline(qwen3_dir):
    """vLLM's enable_chunked_processing and max_embed_len act in its API server; its offline calls take them and
    still refuse an over-long prompt, as these do (with a warning that says so)."""
    with log_lines("nanovllm.config") as lines:
        llm = LLM(qwen3_dir, runner="pooling", pooler_config={"enable_chunked_processing": True, "max_embed_len": 4096},
                  **SMALL)
    assert any("act in vLLM's API server only" in line for line in lines)
    with llm:
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            llm.embed([{"prompt_token_ids": [5] * 513}], use_tqdm=False)
        assert len(llm.embed([{"prompt_token_ids": [5] * 512}], use_tqdm=False)) == 1


def test_pooling_params_refusals():
    for kwargs, message in [(dict(dimensions="8"), "dimensions must be an int or None, got '8'."),
                            (dict(use_activation=1), "use_activation must be a bool or None, got 1."),
                            (dict(step_tag_id="3"), "step_tag_id must be a token id (an int >= 0) or None, got '3'."),
                            (dict(returned_token_ids=[0, True]), "returned_token_ids must be a list of ints >= 0 or "
                                                                 "None, got [0, True]."),
                            (dict(task="reward"), "task must be one of 'embed', 'token_embed', 'classify', "
                                                  "'token_classify', got 'reward'."),
                            (dict(task="score"), "`score` task was removed; use `classify` instead."),
                            (dict(task="encode"), "`encode` task was removed; use `token_embed` or `token_classify` "
                                                  "instead.")]:
        with pytest.raises(ValueError) as error:
            PoolingParams(**kwargs)
        assert message in str(error.value)


def test_engine_add_request_and_cli_flags(qwen3_dir):
    """vLLM's LLMEngine with --runner pooling --pooler-config ...: add_request takes PoolingParams
    (task "embed" unless set), and step() returns each request's PoolingRequestOutput once it ends."""
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--model", qwen3_dir, "--runner", "pooling", "--pooler-config",
                              '{"pooling_type": "MEAN"}', "--dtype", "float32", "--block-size", "16",
                              "--num-gpu-blocks-override", "64"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    assert engine.config.pooler_config.seq_pooling_type == "MEAN"
    [h] = hf_hidden(qwen3_dir, PROMPTS[4:5])
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, PoolingParams())
    engine.add_request("b", {"prompt_token_ids": PROMPTS[4]}, PoolingParams(task="token_embed", use_activation=False))
    with pytest.raises(ValueError, match=r"^params must be a PoolingParams for a pooling model \(runner='pooling'\), "
                                         r"got SamplingParams\.$"):
        engine.add_request("c", "Hello", SamplingParams())
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outputs.values())
    torch.testing.assert_close(outputs["a"].outputs.data, F.normalize(h.mean(0), dim=-1), atol=2e-6, rtol=0)
    torch.testing.assert_close(outputs["b"].outputs.data, h, atol=1e-5, rtol=0)
    engine.close()


def test_tp2_embeddings_match_tp1(qwen3_dir):
    """Tensor parallelism (two gloo ranks): the same embeddings as one rank."""
    with LLM(qwen3_dir, runner="pooling", **SMALL) as llm:
        expected = [o.outputs.embedding for o in llm.embed(as_prompts(PROMPTS), use_tqdm=False)]
    with LLM(qwen3_dir, runner="pooling", tensor_parallel_size=2, **SMALL) as llm:
        got = [o.outputs.embedding for o in llm.embed(as_prompts(PROMPTS), use_tqdm=False)]
        tokens = llm.encode(as_prompts(PROMPTS[:2]), pooling_task="token_embed", use_tqdm=False)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert [t.outputs.data.shape[0] for t in tokens] == [len(p) for p in PROMPTS[:2]]
