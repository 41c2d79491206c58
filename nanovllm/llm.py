"""LLM: the offline entry point, vLLM's `LLM.generate` / `LLM.chat` (a pooling model's encode, embed, classify
and score: llm_pooling.py)."""
import weakref
from functools import partial

from tqdm.auto import tqdm

from nanovllm.beam_search import BeamSearchOutput, search
from nanovllm.chat import render_chat
from nanovllm.config import Config
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import Tokenization, one_per_prompt, parse_prompts
from nanovllm.llm_pooling import PoolingMixin
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams
from nanovllm.utils.heap import fewer_collections

REWARD = ("is not one of vLLM 0.26's LLM methods: for rewards, use LLM.encode(..., pooling_task='classify') or "
          "pooling_task='token_classify' with a classifier (runner='pooling').")
WEIGHT_TRANSFER = ("transfers weights from a trainer, which needs weight_transfer_config; nanovllm has no weight "
                   "transfer. Load a checkpoint's weights again with collective_rpc('reload_weights').")


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


class LLM(PoolingMixin):
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
        lower first, with LLM(scheduling_policy="priority"). lora_request: a LoRARequest for every prompt, or a
        list of one (or None) per prompt, with LLM(enable_lora=True).
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
        loras = engine.lora_requests(lora_request, len(parsed))
        return [engine.add_tokens(prompt.text, prompt.token_ids, params, rank, prompt.cache_salt, lora_request=lora,
                                  prompt_embeds=prompt.embeds)
                for prompt, params, rank, lora in zip(parsed, sampling_params, priority, loras)]

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

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (beam_search.py): one generate() call per output token, over every
        live beam of every prompt, or of concurrency_limit prompts at a time. -> one
        BeamSearchOutput per prompt, in input order. lora_request: one LoRARequest for every prompt, or None."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        if isinstance(lora_request, (list, tuple)):
            raise ValueError("beam_search takes one lora_request for all its prompts (or None), got a list.")
        self.llm_engine.lora_requests(lora_request, 1)
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
            if prompt.embeds is not None:
                raise ValueError(f"prompt {i}: beam_search takes text or token-id prompts, not prompt_embeds.")
            engine.input_processor.validate_request(i, prompt.token_ids, whole)
        limit = concurrency_limit or max(len(parsed), 1)
        return [output for start in range(0, len(parsed), limit)
                for output in search(partial(self.generate, lora_request=lora_request), parsed[start:start + limit],
                                     params, engine.eos_token_ids,
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
