"""LLM: the offline entry point, vLLM's `LLM.generate` / `LLM.chat`."""
import weakref

import torch.nn.functional as F
from tqdm.auto import tqdm

from nanovllm.beam_search import BeamSearchOutput, search
from nanovllm.chat import render_chat
from nanovllm.config import Config, load_chat_template
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.engine.input_processor import check_no_lora
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import Tokenization, parse_prompts
from nanovllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from nanovllm.pooling_params import POOLING_TASKS, PoolingParams
from nanovllm.sampling_params import BeamSearchParams, SamplingParams
from nanovllm.utils.heap import fewer_collections

REWARD = ("is not one of vLLM 0.26's LLM methods: for rewards, use LLM.encode(..., pooling_task='classify') or "
          "pooling_task='token_classify' with a classifier (runner='pooling').")
ENCODE_TASK = """pooling_task required for `LLM.encode`.
Please use one of the more specific methods or set the pooling_task when using `LLM.encode`:
  - For embeddings, use `LLM.embed(...)` or `pooling_task="embed"`.
  - For classification logits, use `LLM.classify(...)` or `pooling_task="classify"`.
  - For similarity scores, use `LLM.score(...)`.
  - For rewards, `pooling_task="classify"` or `pooling_task="token_classify"`.
  - For token classification, use `pooling_task="token_classify"`.
  - For multi-vector retrieval, use `pooling_task="token_embed"`."""
WEIGHT_TRANSFER = ("transfers weights from a trainer, which needs weight_transfer_config; nanovllm has no weight "
                   "transfer. Load a checkpoint's weights again with collective_rpc('reload_weights').")


def one_per_prompt(params, kind: type, name: str, num_prompts: int):
    """A call's params (SamplingParams or PoolingParams, kind): one for every prompt, or a list of one a
    prompt -> one a prompt. Anything else is a ValueError naming the argument (name)."""
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        hint = "; beam search is LLM.beam_search" if isinstance(params, BeamSearchParams) else ""
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(params).__name__}{hint}.")
    if len(params) != num_prompts:
        raise ValueError(f"{name} has {len(params)} entries but there are {num_prompts} prompts; pass one "
                         f"{kind.__name__} or one per prompt.")
    return params


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


class _Refused:
    """An LLM method of vLLM's for what nanovllm does not do: calling it is a ValueError
    "LLM.<its name>() <why>"."""
    def __init__(self, why: str):
        self.why = why

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, llm, owner=None):
        def refuse(*args, **kwargs):
            raise ValueError(f"LLM.{self.name}() {self.why}")
        return refuse


class LLM:
    """An LLM and its engine. `LLM("Qwen/Qwen3-0.6B")`; keyword arguments are those of Config."""

    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine(Config.from_kwargs(model, **kwargs))
        self.model_config = self.llm_engine.model_config
        # Tensor-parallel workers end with this object: close(), `with`, `del`, or interpreter exit.
        self._finalizer = weakref.finalize(self, self.llm_engine.close)
        self.closed = False
        self._unclaimed: dict[str, RequestOutput] = {}   # finished enqueued requests not yet returned

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's: an LLM of these engine arguments (the ones given; the rest keep their defaults)."""
        return cls(engine_args.model, **engine_args.kwargs)

    def close(self):
        self.closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def set_tokenizer(self, tokenizer):
        """Use another tokenizer for text prompts, chat and detokenizing (vLLM's set_tokenizer)."""
        self.llm_engine.tokenizer = tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached prompt blocks; True once done (vLLM's return value). Nothing runs
        between calls and there is no KV connector, so vLLM's two options change nothing here."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def get_world_size(self, include_dp: bool = True) -> int:
        """The processes that run the model: tensor_parallel_size (no pipeline or data parallelism)."""
        return self.llm_engine.config.tensor_parallel_size

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: run `method` on every tensor-parallel rank -> the results by rank. method: the name
        of a ModelRunner method, or a function called as method(runner, *args, **kwargs); with
        tensor_parallel_size > 1 it and its arguments are pickled to the workers (so a module-level
        function, not a lambda). timeout: seconds to wait for the workers (TimeoutError)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        """vLLM's: func(model) on every rank (the model is this rank's shard) -> the results by rank.
        Return small values: tensors come back through pickling."""
        return self.llm_engine.apply_model(func)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: start the profiler that LLM(profiler_config=...) set up, on every rank; trace files
        are named <profile_prefix>_tp<rank>... (engine/profiler.py). RuntimeError without one."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """vLLM's: stop the profiler on every rank and write its traces."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list:
        """vLLM's: the engine's metrics now (nanovllm/metrics.py: Counter, Gauge and Histogram objects
        with vLLM's names and labels). Kept only with LLM(..., disable_log_stats=False)."""
        return self.llm_engine.get_metrics()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode: no request runs until wake_up(). Level 0 only pauses; levels 1-2, with
        LLM(enable_sleep_mode=True), free the GPU memory of the weights and the KV cache (level 1 keeps
        the weights in host memory, level 2 forgets them) and empty the prefix cache. Enqueued
        requests not yet finished are aborted (mode "abort"), run to their end first, their outputs
        kept for wait_for_completion() ("wait"), or kept to run after wake_up() ("keep")."""
        self.llm_engine.check_sleep(level, mode)
        if mode == "wait" and not self.llm_engine.is_sleeping():
            self._unclaimed.update(self._run_engine(use_tqdm=False))
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: allocate "weights" and/or "kv_cache" again (None: both; ["scheduling"] after a
        level-0 sleep); requests run again once nothing is asleep. After a level-2 sleep:
        wake_up(["weights"]), collective_rpc("reload_weights"), then wake_up(["kv_cache"])."""
        self.llm_engine.wake_up(tags)

    def reset_mm_cache(self) -> None:
        """vLLM's; a text-only engine keeps no multimodal cache, so there is nothing to clear."""
        self.llm_engine.reset_mm_cache()

    # vLLM's entry points for what nanovllm does not do: each a ValueError that names it and says why
    reward = _Refused(REWARD)
    init_weight_transfer_engine = _Refused(WEIGHT_TRANSFER)
    start_weight_update = _Refused(WEIGHT_TRANSFER)
    start_draft_weight_update = _Refused(WEIGHT_TRANSFER)
    update_weights = _Refused(WEIGHT_TRANSFER)
    finish_weight_update = _Refused(WEIGHT_TRANSFER)

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm=True, lora_request=None, priority: list[int] | None = None, *,
                 tokenization_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order. priority: one int per prompt,
        lower first, with LLM(scheduling_policy="priority"). lora_request: vLLM's; only None.
        use_tqdm: show a progress bar; a callable is used in place of tqdm (as in vLLM).
        tokenization_kwargs: as vLLM's (inputs.Tokenization): add_special_tokens, truncation."""
        request_ids = self.enqueue(prompts, sampling_params, lora_request, priority,
                                   tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        outputs = self._run_engine(use_tqdm)
        result = [outputs.pop(request_id) for request_id in request_ids]
        self._unclaimed.update(outputs)   # requests enqueued before this call: wait_for_completion's
        return result

    def enqueue(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                lora_request=None, priority: list[int] | None = None, use_tqdm=True, *,
                tokenization_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[str]:
        """Add requests without running them (vLLM's); -> their request ids. wait_for_completion()
        runs them. generate()'s arguments; use_tqdm is accepted (no bar while adding)."""
        if self.closed:
            raise RuntimeError("this LLM is closed; create a new one.")
        if self.llm_engine.config.runner_type != "generate":
            raise ValueError("LLM.generate() is only supported for generative models. Try passing `--runner "
                             "generate` to use the model as a generative model.")
        check_no_lora(lora_request)
        if mm_processor_kwargs is not None:
            raise ValueError(f"mm_processor_kwargs is not supported: nanovllm runs text-only models, "
                             f"got {mm_processor_kwargs!r:.80}.")
        engine = self.llm_engine
        parsed = engine.input_processor.parse_prompts(prompts, tokenization_kwargs)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        sampling_params = one_per_prompt(sampling_params, SamplingParams, "sampling_params", len(parsed))
        priority = self._check_priority(priority, len(parsed))
        # Check the whole call before any request is added: a bad prompt leaves no trace.
        parsed = [engine.input_processor.check_request(i, prompt, params)
                  for i, (prompt, params) in enumerate(zip(parsed, sampling_params))]
        return [engine.add_tokens(prompt.text, prompt.token_ids, params, rank, prompt.cache_salt)
                for prompt, params, rank in zip(parsed, sampling_params, priority)]

    def wait_for_completion(self, output_type=None, *, use_tqdm=True) -> list[RequestOutput]:
        """Run every enqueued request to its end (vLLM's) -> their outputs, by request id.
        output_type: vLLM's; RequestOutput (or None) only."""
        if output_type not in (None, RequestOutput) and output_type != (RequestOutput,):
            raise ValueError(f"output_type must be RequestOutput: nanovllm runs generative models only, "
                             f"got {output_type!r}.")
        outputs = self._run_engine(use_tqdm)
        outputs.update(self._unclaimed)
        self._unclaimed = {}
        return sorted(outputs.values(), key=lambda output: int(output.request_id))

    def _check_priority(self, priority: list[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
            raise ValueError(f"priority must be one int per prompt ({num_prompts}), got {priority!r:.80}.")
        for value in priority:
            self.llm_engine.check_priority(value)
        return list(priority)

    def _run_engine(self, use_tqdm) -> dict[str, RequestOutput]:
        """Step the engine until every request (enqueued ones too) has finished. The progress bar
        counts finished requests and, as vLLM's does, their prompt and output tokens per second so
        far. If a step raises (or on Ctrl-C), every unfinished request is dropped, so that the
        engine is idle and whole for the next call."""
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            engine.check_awake()   # (requests kept by sleep(mode="keep") wait for wake_up)
        outputs = {}
        progress_bar = use_tqdm if callable(use_tqdm) else tqdm
        speed = "est. speed input: {:.2f} toks/s, output: {:.2f} toks/s"
        try:
            with progress_bar(total=len(engine.requests), desc="Processed prompts", dynamic_ncols=True,
                              postfix=speed.format(0, 0), disable=not use_tqdm) as pbar, fewer_collections():
                prompt_tokens = output_tokens = 0
                while engine.has_unfinished_requests():
                    finished, _ = engine.run_step()
                    for output in finished:
                        outputs[output.request_id] = output
                        if use_tqdm:
                            completions = output.outputs if isinstance(output, RequestOutput) else []
                            prompt_tokens += len(output.prompt_token_ids) * max(len(completions), 1)
                            output_tokens += sum(len(o.token_ids) for o in completions)
                            elapsed = pbar.format_dict["elapsed"] or 1e-9
                            pbar.postfix = speed.format(prompt_tokens / elapsed, output_tokens / elapsed)
                        pbar.update(1)
        except BaseException:
            engine.abort_in_flight()
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
            engine.block_manager.reset_prefix_cache()   # the interrupted step may not have written its K/V
            if engine.workers is not None:
                self.close()   # the ranks may be mid-collective: end them rather than risk a hang
            raise
        return outputs

    # ---- pooling models (runner="pooling": embeddings; pooling_params.py) --------------------
    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *, use_tqdm=True,
               lora_request=None, pooling_task: str | None = None, tokenization_kwargs: dict | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's: run each prompt through a pooling model -> one PoolingRequestOutput a prompt, in input
        order, its outputs.data a float32 CPU tensor: pooling_task "embed" one vector, "token_embed"
        one a prompt token. Prompts as generate() takes them; one PoolingParams for all or one each."""
        self._check_pooling("encode")
        if pooling_task is None:
            raise ValueError(ENCODE_TASK)
        if pooling_task not in POOLING_TASKS:
            supported = self.llm_engine.get_supported_tasks()
            raise ValueError(f"Unsupported task: {pooling_task!r} Supported tasks: {supported}")
        check_no_lora(lora_request)
        engine = self.llm_engine
        parsed = engine.input_processor.parse_prompts(prompts, tokenization_kwargs)
        if pooling_params is None:
            pooling_params = PoolingParams()
        pooling_params = one_per_prompt(pooling_params, PoolingParams, "pooling_params", len(parsed))
        # Check the whole call before any request is added: a bad prompt leaves no trace.
        for i, (prompt, params) in enumerate(zip(parsed, pooling_params)):
            engine.check_pooling_params(params, i)
            engine.input_processor.validate_pooling_request(i, prompt.token_ids)
        resolved_of = {id(params): engine.resolve_pooling_params(params, pooling_task) for params in pooling_params}
        resolved = [resolved_of[id(params)] for params in pooling_params]   # (one PoolingParams for all: resolved once)
        request_ids = [engine.add_pooling_tokens(prompt.text, prompt.token_ids, params, cache_salt=prompt.cache_salt)
                       for prompt, params in zip(parsed, resolved)]
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

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (beam_search.py): one generate() call per output token, over every
        live beam of every prompt, or of concurrency_limit prompts at a time. -> one
        BeamSearchOutput per prompt, in input order. lora_request: vLLM's; only None."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        check_no_lora(lora_request)
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive int or None, got {concurrency_limit!r}.")
        engine = self.llm_engine
        if 2 * params.beam_width > engine.config.logprobs_cap:
            raise ValueError(f"beam_width must be at most max_logprobs / 2 = {engine.config.logprobs_cap // 2} "
                             f"(each step asks for 2 x beam_width logprobs), got {params.beam_width}.")
        parsed = parse_prompts(prompts, self.llm_engine.input_processor.encode)
        whole = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True)
        for i, prompt in enumerate(parsed):
            engine.input_processor.validate_request(i, prompt.token_ids, whole)
        limit = concurrency_limit or max(len(parsed), 1)
        return [output for start in range(0, len(parsed), limit)
                for output in search(self.generate, parsed[start:start + limit], params, engine.eos_token_ids,
                                     engine.config.max_model_len, engine.tokenizer, use_tqdm)]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm=True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}, ...]) or a list of them.
        continue_final_message: the reply continues the last (assistant) message instead of starting
        a new one; chat_template replaces LLM(chat_template=...), which replaces the tokenizer's;
        tools go to the template. A content given as OpenAI-style parts ([{"type": "text", "text":
        ...}, ...]) reaches the template as one string, the texts joined by newlines ("auto",
        "string"), or as the list itself ("openai"). tokenization_kwargs: as generate()'s, but the
        rendered text gets no special tokens unless add_special_tokens=True (vLLM's default for chat)."""
        prompts, truncation = self._render_chat(messages, chat_template, chat_template_content_format,
                                                add_generation_prompt, continue_final_message, tools,
                                                chat_template_kwargs, tokenization_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, tokenization_kwargs=truncation,
                             mm_processor_kwargs=mm_processor_kwargs)

    def enqueue_chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                     use_tqdm=True, lora_request=None, priority: list[int] | None = None,
                     mm_processor_kwargs: dict | None = None, **chat_options) -> list[str]:
        """chat() without running the requests (vLLM's): -> their request ids, for
        wait_for_completion(). chat_options: chat()'s template and tokenization arguments."""
        prompts, truncation = self._render_chat(messages, **chat_options)
        return self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm,
                            tokenization_kwargs=truncation, mm_processor_kwargs=mm_processor_kwargs)

    def _render_chat(self, messages, chat_template: str | None = None, chat_template_content_format: str = "auto",
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                     tokenization_kwargs: dict | None = None) -> tuple[list[dict], dict]:
        """The conversations as token-id prompts (with their text), and the tokenization_kwargs
        left to apply to them (the truncation)."""
        config = self.llm_engine.config
        tokenization = Tokenization.from_kwargs(tokenization_kwargs, config.max_model_len, add_special_tokens=False)
        prompts = render_chat(self.llm_engine.tokenizer, messages, chat_template or config.chat_template,
                              chat_template_content_format, add_generation_prompt, continue_final_message, tools,
                              chat_template_kwargs, tokenization.add_special_tokens)
        truncation = {k: v for k, v in (tokenization_kwargs or {}).items() if k != "add_special_tokens"}
        return prompts, truncation
