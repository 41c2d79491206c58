"""LLM's entry points for pooling models (runner="pooling"; vLLM's PoolingOfflineMixin): encode, and
embed, classify and score over it. An embedding model's results are vectors (pooling_params.py), a
classifier's label probabilities (layers/classifier.py); score pairs texts by either."""
import torch.nn.functional as F

from nanovllm.config import load_chat_template
from nanovllm.inputs import Tokenization, one_per_prompt
from nanovllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from nanovllm.pooling_params import POOLING_TASKS, PoolingParams

ENCODE_TASK = """pooling_task required for `LLM.encode`.
Please use one of the more specific methods or set the pooling_task when using `LLM.encode`:
  - For embeddings, use `LLM.embed(...)` or `pooling_task="embed"`.
  - For classification logits, use `LLM.classify(...)` or `pooling_task="classify"`.
  - For similarity scores, use `LLM.score(...)`.
  - For rewards, `pooling_task="classify"` or `pooling_task="token_classify"`.
  - For token classification, use `pooling_task="token_classify"`.
  - For multi-vector retrieval, use `pooling_task="token_embed"`."""


def pair_score(a, b) -> float:
    """Two embeddings' cosine similarity (vLLM's bi-encoder score)."""
    return F.cosine_similarity(a, b, dim=0).item()


def max_sim_score(a, b) -> float:
    """Two prompts' token embeddings [tokens, hidden]: the sum over a's tokens of their largest dot product
    with b's (vLLM's late-interaction score, ColBERT's MaxSim)."""
    return (a @ b.T).amax(dim=-1).sum().item()


def pair_tokens(tokenizer, query: str, document: str, template: str | None, tokenization: Tokenization,
                use_sep_token: bool) -> list[int]:
    """A cross-encoder's prompt for one pair (vLLM's): the pair rendered by template, else tokenized
    as a pair (use_sep_token: the tokenizer's separators between them) or as one joined text."""
    add = tokenization.add_special_tokens
    if template is not None:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        except Exception as e:   # (jinja's errors: a template that does not render these messages)
            raise ValueError(f"chat_template could not render a query and a document: {e}") from None
        ids = tokenizer(text, add_special_tokens=add)["input_ids"]
    elif use_sep_token:
        ids = tokenizer(text=query, text_pair=document, add_special_tokens=add)["input_ids"]
    else:
        ids = tokenizer(text=query + document, add_special_tokens=add)["input_ids"]
    return tokenization.truncate(ids, tokenizer)


class PoolingMixin:
    """The pooling entry points of LLM (llm.py), which owns llm_engine, _run_engine and _unclaimed."""

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *, use_tqdm=True,
               lora_request=None, pooling_task: str | None = None, tokenization_kwargs: dict | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's: run each prompt through a pooling model -> one PoolingRequestOutput a prompt, in input
        order, its outputs.data a float32 CPU tensor: pooling_task "embed" one vector, "token_embed"
        one a prompt token; "classify" the label probabilities [num_labels], "token_classify" a prompt
        token's. Prompts as generate() takes them; one PoolingParams for all or one each."""
        self._check_pooling("encode")
        if pooling_task is None:
            raise ValueError(ENCODE_TASK)
        if pooling_task not in POOLING_TASKS:
            supported = self.llm_engine.get_supported_tasks()
            raise ValueError(f"Unsupported task: {pooling_task!r} Supported tasks: {supported}")
        engine = self.llm_engine
        parsed = engine.input_processor.parse_prompts(prompts, tokenization_kwargs)
        if pooling_params is None:
            pooling_params = PoolingParams()
        pooling_params = one_per_prompt(pooling_params, PoolingParams, "pooling_params", len(parsed))
        # Check the whole call before any request is added: a bad prompt leaves no trace.
        for i, (prompt, params) in enumerate(zip(parsed, pooling_params)):
            engine.check_pooling_params(params, i)
            engine.input_processor.validate_pooling_request(i, prompt)
        resolved_of = {id(params): engine.resolve_pooling_params(params, pooling_task) for params in pooling_params}
        resolved = [resolved_of[id(params)] for params in pooling_params]   # (one PoolingParams for all: resolved once)
        loras = engine.lora_requests(lora_request, len(parsed))
        request_ids = [engine.add_pooling_tokens(prompt.text, prompt.token_ids, params, cache_salt=prompt.cache_salt,
                                                 lora_request=lora, prompt_embeds=prompt.embeds)
                       for prompt, params, lora in zip(parsed, resolved, loras)]
        outputs = self._run_engine(use_tqdm)
        result = [outputs.pop(request_id) for request_id in request_ids]
        self._unclaimed.update(outputs)
        return result

    def embed(self, prompts, *, use_tqdm=True, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding (outputs.embedding, a list of floats) a prompt, in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                              pooling_task="embed", tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts, *, pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm=True,
                 lora_request=None, tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's, for classifiers: each prompt's label probabilities (outputs.probs; with
        PoolingParams(use_activation=False) their logits), in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                              pooling_task="classify", tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(self, data_1, data_2, /, *, use_tqdm=True, pooling_params: PoolingParams | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None, chat_template: str | None = None
              ) -> list[ScoringRequestOutput]:
        """vLLM's: a score for each pair of data_1 and data_2, one to one, one to N or N to N.
        - A classifier with one label (a cross-encoder or reranker): each pair of texts is one prompt
          (tokenized as a pair, or joined for an LM used as a reranker; with chat_template, rendered from
          the messages [{"role": "query", ...}, {"role": "document", ...}]), its score the label's probability.
        - An embedding model: the cosine similarity of the two embeddings, or, for an engine whose
          pooler_config.task is "token_embed" (late interaction, as ColBERT), the sum over the first's
          tokens of their best dot product with the second's. The data are texts (or prompts as
          generate() takes them)."""
        self._check_pooling("score")
        first = data_1 if isinstance(data_1, list) else [data_1]
        second = data_2 if isinstance(data_2, list) else [data_2]
        if len(first) > 1 and len(first) != len(second):
            raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
        if not first:
            raise ValueError("At least one text element must be given")
        if not second:
            raise ValueError("At least one text_pair element must be given")
        if self.llm_engine.config.convert_type == "classify":
            prompts = self._cross_encoder_prompts(first, second, chat_template, tokenization_kwargs)
            outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                                  pooling_task="classify")
            return [ScoringRequestOutput.from_base(output) for output in outputs]
        if chat_template is not None:
            raise ValueError("chat_template is for cross-encoder scoring; an embedding model scores texts as "
                             f"they are, got {chat_template!r:.80}.")
        task = self.llm_engine.config.pooler_config.task or "embed"
        embeddings = self.encode(first + second, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                                 pooling_task=task, tokenization_kwargs=tokenization_kwargs)
        queries, documents = embeddings[:len(first)], embeddings[len(first):]
        if len(queries) == 1:
            queries = queries * len(documents)
        pad = getattr(self.llm_engine.tokenizer, "pad_token_id", None)
        padding = [] if pad is None else [pad]
        similarity = pair_score if task == "embed" else max_sim_score
        return [ScoringRequestOutput(
            f"{a.request_id}_{b.request_id}", ScoringOutput(similarity(a.outputs.data, b.outputs.data)),
            a.prompt_token_ids + padding + b.prompt_token_ids, a.num_cached_tokens + b.num_cached_tokens, True)
            for a, b in zip(queries, documents)]

    def _cross_encoder_prompts(self, first: list, second: list, chat_template: str | None,
                               tokenization_kwargs: dict | None) -> list[dict]:
        """Each pair of texts as one prompt of token ids, as vLLM's cross-encoder makes it."""
        config, tokenizer = self.llm_engine.config, self.llm_engine.tokenizer
        if config.classifier.num_labels != 1:
            raise ValueError("Scoring API is only enabled for num_labels == 1.")
        if tokenizer is None:
            raise ValueError("LLM.score() of a cross-encoder tokenizes each pair of texts, and this engine has no "
                             "tokenizer (skip_tokenizer_init=True).")
        for name, texts in (("data_1", first), ("data_2", second)):
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"{name}[{i}] must be a str: a cross-encoder scores pairs of texts, got "
                                     f"{type(text).__name__}.")
        tokenization = Tokenization.from_kwargs(tokenization_kwargs, config.max_model_len, add_special_tokens=True)
        template = None if chat_template is None else load_chat_template(chat_template)
        queries = first * len(second) if len(first) == 1 else first
        return [{"prompt_token_ids": pair_tokens(tokenizer, query, document, template, tokenization,
                                                 config.classifier.use_sep_token)}
                for query, document in zip(queries, second)]

    def _check_pooling(self, method: str):
        if self.closed:
            raise RuntimeError("this LLM is closed; create a new one.")
        if self.llm_engine.config.runner_type != "pooling":
            raise ValueError(f"LLM.{method}() is only supported for pooling models. Try passing `--runner pooling` "
                             f"to use the model as a pooling model.")
