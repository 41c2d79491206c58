"""Classifiers (runner="pooling", convert="classify"): LLM.classify, encode(pooling_task="token_classify")
and cross-encoder LLM.score equal to HF transformers' *ForSequenceClassification in float32, with
chunked prefill, prefix caching and preemption; a causal LM made a reranker from its LM head's rows
(vLLM's Qwen3-Reranker recipe); the head's activation as the config says; and bad input."""
import json
import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from conftest import as_prompts, assert_pooling_idle, hf_model, make_prompts
from nanovllm import (LLM, ClassificationRequestOutput, EngineArgs, LLMEngine, PoolingParams, PoolingRequestOutput,
                      ScoringRequestOutput)
from nanovllm.layers.classifier import activation_name

PROMPTS = make_prompts()
SMALL = dict(dtype="float32", block_size=16, num_kvcache_blocks=128, max_num_batched_tokens=64)
# Qwen3-Reranker's hf_overrides, with two tokens of the test tokenizer's vocabulary standing for "no" and "yes"
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b"],
            "is_original_qwen3_reranker": True}
TEXTS = ["Hello world!", "The quick brown fox", "Paged attention stores keys", "A scheduler batches"]


def seq_cls_dir(src, dst, num_labels: int) -> str:
    """src's weights as a *ForSequenceClassification checkpoint with a random score head of num_labels."""
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=num_labels, dtype=torch.float32)
    torch.nn.init.normal_(model.score.weight, std=0.2)
    model.config.pad_token_id = None   # (HF then pools a one-prompt batch's last token, as LAST does)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), dst)
    return str(dst)


@torch.no_grad()
def hf_scores(path, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt's logits from HF transformers' classifier: (the last token's [labels], every token's
    [tokens, labels])."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    last, tokens = [], []
    for ids in prompts:
        last.append(model(torch.tensor([ids])).logits[0])
        tokens.append(model.score(model.model(torch.tensor([ids])).last_hidden_state[0]))
    return last, tokens


@torch.no_grad()
def hf_yes_probability(path, prompts: list[list[int]], no: int, yes: int) -> list[float]:
    """A causal LM's probability of `yes` against `no` as the next token (a reranker's score)."""
    model = hf_model(path)
    return [torch.softmax(model(torch.tensor([ids])).logits[0, -1, [no, yes]], -1)[1].item() for ids in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_classify_equals_hf(model_dir, tmp_path, async_scheduling):
    """Every architecture as a *ForSequenceClassification checkpoint (three labels): LLM.classify gives the
    softmax of HF's logits (the last token's hidden state through score), and with use_activation=False
    the logits, with prompts chunked (64 tokens a step) and, on a second call, read from the prefix cache."""
    path = seq_cls_dir(model_dir, tmp_path / "cls", num_labels=3)
    logits, _ = hf_scores(path, PROMPTS)
    with LLM(path, async_scheduling=async_scheduling, **SMALL) as llm:
        assert llm.model_config.runner_type == "pooling" and llm.model_config.convert_type == "classify"
        assert llm.llm_engine.get_supported_tasks() == ("classify", "token_classify")
        assert llm.llm_engine.model_runner.model.lm_head is None
        for call in range(2):
            outs = llm.classify(as_prompts(PROMPTS), use_tqdm=False)
            assert all(isinstance(o, ClassificationRequestOutput) and o.finished for o in outs)
            assert [o.prompt_token_ids for o in outs] == PROMPTS
            for out, expected in zip(outs, logits):
                assert out.outputs.num_classes == 3
                torch.testing.assert_close(torch.tensor(out.outputs.probs), expected.softmax(-1), atol=2e-6, rtol=0)
            if call == 1:
                assert sum(o.num_cached_tokens for o in outs) > 0
        raw = llm.classify(as_prompts(PROMPTS), pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for out, expected in zip(raw, logits):
            torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=5e-6, rtol=0)
        assert_pooling_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_token_classify_across_chunks_and_preemption(qwen3_dir, tmp_path, async_scheduling):
    """encode(pooling_task="token_classify"): every prompt token's label probabilities, kept across chunks
    of 32 tokens and begun again after a preemption (sleep mode "keep")."""
    path = seq_cls_dir(qwen3_dir, tmp_path / "cls", num_labels=2)
    last, tokens = hf_scores(path, PROMPTS)
    with LLM(path, dtype="float32", block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=32,
             enable_sleep_mode=True, async_scheduling=async_scheduling) as llm:
        outs = llm.encode(as_prompts(PROMPTS), pooling_task="token_classify", use_tqdm=False)
        for out, expected in zip(outs, tokens):
            assert isinstance(out, PoolingRequestOutput) and out.outputs.data.shape == expected.shape
            torch.testing.assert_close(out.outputs.data, expected.softmax(-1), atol=2e-6, rtol=0)
        engine = llm.llm_engine
        engine.add_request("long", {"prompt_token_ids": PROMPTS[7]},
                           PoolingParams(task="token_classify", use_activation=False))
        engine.add_request("last", {"prompt_token_ids": PROMPTS[7]}, PoolingParams())   # (task "classify")
        for _ in range(3):   # 96 of its 150 tokens
            assert engine.step() == []
        engine.sleep(level=1, mode="keep")
        assert engine.scheduler.num_preemptions == 1
        engine.wake_up()
        outputs = {}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step()}
        torch.testing.assert_close(outputs["long"].outputs.data, tokens[7], atol=5e-6, rtol=0)
        torch.testing.assert_close(outputs["last"].outputs.data, last[7].softmax(-1), atol=1e-6, rtol=0)
        assert_pooling_idle(llm)


def test_cross_encoder_score(qwen3_dir, tmp_path, tokenizer):
    """LLM.score of a one-label classifier (a cross-encoder): each pair of texts is one prompt, tokenized
    as a pair, its score the sigmoid of HF's logit; 1:1, 1:N and N:N, as vLLM."""
    path = seq_cls_dir(qwen3_dir, tmp_path / "ce", num_labels=1)
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[0], TEXTS[2]), (TEXTS[1], TEXTS[3])]
    ids = [tokenizer(text=q, text_pair=d)["input_ids"] for q, d in pairs]
    logits, _ = hf_scores(path, ids)
    expected = [torch.sigmoid(logit).item() for logit in logits]
    with LLM(path, **SMALL) as llm:
        assert llm.llm_engine.config.classifier.use_sep_token
        [one] = llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)
        assert isinstance(one, ScoringRequestOutput) and one.prompt_token_ids == ids[0]
        assert one.outputs.score == pytest.approx(expected[0], abs=1e-6)
        many = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
        assert [o.outputs.score for o in many] == pytest.approx(expected[:2], abs=1e-6)
        both = llm.score([TEXTS[0], TEXTS[1]], [TEXTS[1], TEXTS[3]], use_tqdm=False)
        assert [o.outputs.score for o in both] == pytest.approx([expected[0], expected[2]], abs=1e-6)
        raw = llm.score(TEXTS[0], TEXTS[1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        assert raw[0].outputs.score == pytest.approx(logits[0].item(), abs=2e-6)
        cut = llm.score(TEXTS[0], TEXTS[1], tokenization_kwargs={"truncate_prompt_tokens": 3}, use_tqdm=False)
        assert cut[0].prompt_token_ids == ids[0][:3]
        for call, message in [
            (lambda: llm.score(TEXTS[0], [{"prompt_token_ids": [1, 2]}], use_tqdm=False),
             r"^data_2\[0\] must be a str: a cross-encoder scores pairs of texts, got dict\.$"),
            (lambda: llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False), "^Input lengths must be either 1:1, 1:N or N:N$"),
            (lambda: llm.score(TEXTS[0], TEXTS[1], pooling_params=PoolingParams(task="token_classify"),
                               use_tqdm=False),
             r"^You cannot overwrite params.task='token_classify' with pooling_task='classify'!$"),
            (lambda: llm.score(TEXTS[0], TEXTS[1], chat_template="{{ messages[5]['content'] }}", use_tqdm=False),
             "^chat_template could not render a query and a document"),
        ]:
            with pytest.raises(ValueError, match=message):
                call()
            assert_pooling_idle(llm)
    with LLM(seq_cls_dir(qwen3_dir, tmp_path / "three", num_labels=3), **SMALL) as llm:
        with pytest.raises(ValueError, match=r"^Scoring API is only enabled for num_labels == 1\.$"):
            llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_reranker_from_lm_head_rows(request, arch, tokenizer):
    """vLLM's Qwen3-Reranker recipe: a causal LM with hf_overrides naming its "no" and "yes" tokens is a
    one-label classifier whose head is the LM head's "yes" row minus its "no" row (from the embedding when
    they are tied, as Qwen3's; from lm_head.weight when not, as this Qwen2's), so its score is the LM's
    probability of "yes" against "no"; score() joins query and document (no separator), or renders them
    with a chat_template."""
    path = request.getfixturevalue(f"{arch}_dir")
    no, yes = tokenizer.convert_tokens_to_ids(RERANKER["classifier_from_token"])
    expected = hf_yes_probability(path, PROMPTS, no, yes)
    with LLM(path, hf_overrides=RERANKER, **SMALL) as llm:
        classifier = llm.llm_engine.config.classifier
        assert (classifier.num_labels, classifier.from_token_ids, classifier.use_sep_token) == (1, [no, yes], False)
        assert llm.llm_engine.config.hf_config.num_labels == 1
        outs = llm.classify(as_prompts(PROMPTS), use_tqdm=False)
        assert [o.outputs.probs[0] for o in outs] == pytest.approx(expected, abs=1e-6)
        scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        joined = [tokenizer(TEXTS[0] + d)["input_ids"] for d in TEXTS[1:]]
        assert [o.prompt_token_ids for o in scores] == joined
        assert [o.outputs.score for o in scores] == pytest.approx(hf_yes_probability(path, joined, no, yes), abs=1e-6)
        template = "<|im_start|>{{ messages[0]['content'] }}<|im_end|>{{ messages[1]['content'] }}"
        [rendered] = llm.score(TEXTS[0], TEXTS[1], chat_template=template, use_tqdm=False)
        ids = tokenizer(f"<|im_start|>{TEXTS[0]}<|im_end|>{TEXTS[1]}")["input_ids"]
        assert rendered.prompt_token_ids == ids
        assert rendered.outputs.score == pytest.approx(hf_yes_probability(path, [ids], no, yes)[0], abs=1e-6)
        assert_pooling_idle(llm)


def test_reranker_head_rounds_its_rows_to_the_model_dtype(qwen3_dir, tokenizer):
    """A float32 checkpoint run in bf16: the head is made of the LM head's rows as the model holds them (rounded
    to bf16), then in float32, as vLLM makes it from the loaded LM head; not of the checkpoint's float32 rows."""
    from safetensors.torch import load_file
    weights = load_file(f"{qwen3_dir}/model.safetensors")["model.embed_tokens.weight"]   # (tied, as Qwen3's)
    assert weights.dtype == torch.float32
    no, yes = tokenizer.convert_tokens_to_ids(RERANKER["classifier_from_token"])
    with LLM(qwen3_dir, hf_overrides=RERANKER, **(SMALL | dict(dtype="bfloat16"))) as llm:
        head = llm.llm_engine.model_runner.model.score.weight
        assert head.dtype == torch.float32
        assert torch.equal(head[0], weights[yes].bfloat16().float() - weights[no].bfloat16().float())
        assert not torch.equal(head[0], weights[yes] - weights[no])


def test_no_post_processing_keeps_a_label_a_token(qwen3_dir, tokenizer):
    """method "no_post_processing": one label a named token, its logit the LM's logit of that token."""
    tokens = ["a", "b", "The"]
    ids = tokenizer.convert_tokens_to_ids(tokens)
    with torch.no_grad():
        model = hf_model(qwen3_dir)
        expected = [model(torch.tensor([p])).logits[0, -1, ids] for p in PROMPTS[:4]]
    overrides = {"classifier_from_token": tokens, "method": "no_post_processing"}
    with LLM(qwen3_dir, convert="classify", hf_overrides=overrides, **SMALL) as llm:
        outs = llm.classify(as_prompts(PROMPTS[:4]), pooling_params=PoolingParams(use_activation=False),
                            use_tqdm=False)
        for out, logits in zip(outs, expected):
            torch.testing.assert_close(torch.tensor(out.outputs.probs), logits, atol=2e-6, rtol=0)


def test_activation_and_calibration(qwen3_dir, tmp_path):
    """The activation after the head, as vLLM reads the config: softmax for several labels (sigmoid for one),
    none for problem_type "regression", sigmoid for "multi_label_classification", a sentence-transformers
    cross-encoder's activation_fn; pooler_config's logit_mean and logit_sigma first calibrate the logits."""
    path = seq_cls_dir(qwen3_dir, tmp_path / "cls", num_labels=3)
    logits, _ = hf_scores(path, PROMPTS[:4])
    cases = [({"problem_type": "regression"}, None, lambda x: x),
             ({"problem_type": "multi_label_classification"}, None, torch.sigmoid),
             ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, None, torch.tanh),
             ({}, {"logit_mean": 0.5, "logit_sigma": 2.0}, lambda x: ((x - 0.5) / 2.0).softmax(-1))]
    for overrides, pooler_config, expect in cases:
        with LLM(path, hf_overrides=overrides, pooler_config=pooler_config, **SMALL) as llm:
            outs = llm.classify(as_prompts(PROMPTS[:4]), use_tqdm=False)
            for out, logit in zip(outs, logits):
                torch.testing.assert_close(torch.tensor(out.outputs.probs), expect(logit), atol=5e-6, rtol=0)
    config = AutoConfig.from_pretrained(path)
    config.sbert_ce_default_activation_function = "os.system"
    with pytest.raises(ValueError, match="restricted to torch.nn.modules for security reasons, got 'os.system'"):
        activation_name(config)
    for name in ("torch.nn.modules.nothing.Tanh", "torch.nn.modules.activation.Nothing"):
        config.sbert_ce_default_activation_function = name
        with pytest.raises(ValueError, match=f"activation_fn '{name}' is not a torch.nn.modules class"):
            activation_name(config)
    config.sbert_ce_default_activation_function = "torch.nn.modules.activation.Identity"
    assert activation_name(config) == "identity"


def test_bad_input_is_refused_and_engine_stays_usable(qwen3_dir, tmp_path):
    """Each a ValueError before anything runs; the next valid call works and nothing is left behind."""
    path = seq_cls_dir(qwen3_dir, tmp_path / "cls", num_labels=2)
    with LLM(path, **SMALL) as llm:
        good = llm.classify("Hello", use_tqdm=False)[0].outputs.probs
        for call, message in [
            (lambda: llm.embed("Hello", use_tqdm=False),
             r"^Embedding API is not supported by this model\. Try converting the model using `--convert embed`\.$"),
            (lambda: llm.encode("Hello", pooling_task="token_embed", use_tqdm=False), "^Embedding API is not"),
            (lambda: llm.classify("Hello", pooling_params=PoolingParams(dimensions=1), use_tqdm=False),
             r"^Task 'classify' only supports \['use_activation'\] parameters, does not support \['dimensions'\] "
             r"parameters$"),
            (lambda: llm.classify(["a", {"prompt_token_ids": [999]}], use_tqdm=False),
             r"^prompt 1: token id 999 is out of vocabulary"),
            (lambda: llm.generate("Hello"), r"^LLM.generate\(\) is only supported for generative models"),
        ]:
            with pytest.raises(ValueError, match=message):
                call()
            assert_pooling_idle(llm)
        assert llm.classify("Hello", use_tqdm=False)[0].outputs.probs == good


@pytest.mark.parametrize("kwargs,message", [
    (dict(runner="generate"), "This model does not support `--runner generate`"),
    (dict(convert="embed"), "a classifier checkpoint (architectures ['Qwen3ForSequenceClassification']) runs with "
                            "convert 'classify' or 'auto', got convert='embed'."),
    (dict(pooler_config={"task": "embed"}), "pooler_config.task='embed' is not a task of this model (supported: "
                                            "classify, token_classify); try converting the model using "
                                            "`--convert embed`."),
    (dict(hf_overrides={"head_dtype": "int8"}), "head_dtype must be 'model' or one of float32, bfloat16, float16, "
                                                "got 'int8'."),
])
def test_classifier_config_refusals(qwen3_dir, tmp_path, kwargs, message):
    path = seq_cls_dir(qwen3_dir, tmp_path / "cls", num_labels=2)
    with pytest.raises(ValueError) as error:
        LLM(path, **SMALL, **kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides,message", [
    ({"classifier_from_token": ["a", "zzz"], "method": "from_2_way_softmax"},
     "classifier_from_token ['zzz'] not in the tokenizer's vocabulary"),
    ({"is_original_qwen3_reranker": True}, "is_original_qwen3_reranker needs classifier_from_token, the two tokens"),
    ({"classifier_from_token": ["a"], "method": "from_2_way_softmax"},
     "method 'from_2_way_softmax' needs two classifier_from_token, [false, true], got ['a']."),
    ({"classifier_from_token": ["a", "b"], "method": "mean"},
     "method must be one of from_2_way_softmax, no_post_processing, got 'mean'."),
    ({"classifier_from_token": ["a", "b"]}, "needs both classifier_from_token and method"),
])
def test_reranker_override_refusals(qwen3_dir, overrides, message):
    with pytest.raises(ValueError) as error:
        LLM(qwen3_dir, convert="classify", hf_overrides=overrides, **SMALL)
    assert message in str(error.value)


def test_convert_classify_needs_a_head(qwen3_dir, tmp_path):
    """A causal LM with convert="classify" and no way to make the head: the checkpoint lacks score.weight;
    a base model has no head to convert."""
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): score\.weight; a causal LM's classifier head is "
                                         r"made of LM-head rows when hf_overrides name its classifier_from_token"):
        LLM(qwen3_dir, convert="classify", **SMALL)
    base = tmp_path / "base"
    shutil.copytree(qwen3_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3Model"]}))
    with pytest.raises(ValueError, match="convert='classify' needs a causal LM or a classifier checkpoint"):
        LLM(str(base), convert="classify", **SMALL)


def test_engine_add_request_and_cli_flags(qwen3_dir):
    """vLLM's flags (--convert classify --hf-overrides ...) and LLMEngine: add_request's PoolingParams take the
    engine's first task, "classify", unless they name one."""
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--model", qwen3_dir, "--runner", "pooling", "--convert", "classify",
                              "--hf-overrides", json.dumps(RERANKER), "--dtype", "float32", "--block-size", "16",
                              "--num-gpu-blocks-override", "64"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    no, yes = engine.tokenizer.convert_tokens_to_ids(["a", "b"])
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, PoolingParams())
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    assert outputs["a"].outputs.data.tolist() == pytest.approx(hf_yes_probability(qwen3_dir, PROMPTS[4:5], no, yes),
                                                               abs=1e-6)
    engine.close()


def test_tp2_matches_tp1(qwen3_dir, tmp_path):
    """Tensor parallelism (two gloo ranks): the same probabilities as one rank (the head is whole on each)."""
    path = seq_cls_dir(qwen3_dir, tmp_path / "cls", num_labels=3)
    with LLM(path, **SMALL) as llm:
        expected = [o.outputs.probs for o in llm.classify(as_prompts(PROMPTS), use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **SMALL) as llm:
        outs = llm.classify(as_prompts(PROMPTS), use_tqdm=False)
        for out, probs in zip(outs, expected):
            assert out.outputs.probs == pytest.approx(probs, abs=1e-6)


@pytest.mark.parametrize("kind", ["embedding", "cross-encoder", "three labels", "process reward", "outcome reward"])
def test_example_script_runs_pooling_models(qwen3_dir, qwen2_dir, tmp_path, kind):
    """example.py on a pooling model: an embedding model embeds and scores, a one-label classifier scores
    documents against a query, a classifier of several labels gives each document's probabilities, a reward
    model scores a solution's steps (its step tag, 151651, is past the test vocabulary: no steps) or the whole."""
    import subprocess
    import sys
    path = tmp_path / kind
    shutil.copytree(qwen2_dir if kind.endswith("reward") else qwen3_dir, path)
    overrides = {"max_position_embeddings": 4096} | ({"architectures": ["Qwen3Model"]} if kind == "embedding" else {})
    (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | overrides))
    if kind.endswith("reward"):
        from test_reward import reward_dir
        process = kind == "process reward"
        path = reward_dir(path, tmp_path / "rm", "Qwen2ForProcessRewardModel" if process else "Qwen2ForRewardModel",
                          2 if process else 1)
    elif kind != "embedding":
        path = seq_cls_dir(path, tmp_path / "cls", num_labels=1 if kind == "cross-encoder" else 3)
    root = __file__.rsplit("/tests/", 1)[0]
    done = subprocess.run([sys.executable, "example.py", str(path)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if kind.endswith("reward"):
        expected = "P(step is right): []" if kind == "process reward" else "reward: "
        assert sum(line.startswith(expected) for line in lines) == 1, done.stdout
        return
    prefix = "probabilities [" if kind == "three labels" else "score "
    assert sum(line.startswith(prefix) for line in lines) == 2, done.stdout
