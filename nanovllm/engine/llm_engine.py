"""LLMEngine: the step loop. Requests in, one scheduled batch per step, finished outputs out."""
import time
from dataclasses import dataclass, field, replace
from itertools import count, repeat

import torch
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import GENERATION_FIELDS, Config
from nanovllm.distributed import SINGLE
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.model_runner import ModelRunner, runner_device
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.prompt_logprobs import PromptScores
from nanovllm.engine.reasoning import REASONING_PARSERS, ThinkingBudget, ThinkingMarkers
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sleep import SLEEP_MODES, SLEEP_TAGS
from nanovllm.engine.speculative import DraftModelProposer, NgramProposer, accepted_tokens
from nanovllm.engine.streaming import OutputStreamer
from nanovllm.engine.stat_logger import StatLogger
from nanovllm.engine.tp_workers import TPWorkers, resolve_method, run_method
from nanovllm.inputs import PromptType
from nanovllm.layers.pooler import PooledStep
from nanovllm.layers.sampling_metadata import SamplerOutput
from nanovllm.logger import init_logger
from nanovllm.lora.request import LoRARequest
from nanovllm.metrics import EngineMetrics, Metric
from nanovllm.model_config import ModelConfig
from nanovllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from nanovllm.pooling_params import CLASSIFY_TASKS, POOLING_TASKS, TOKEN_TASKS, PoolingParams
from nanovllm.sampling_params import RequestOutputKind, SamplingParams
from nanovllm.utils.heap import freeze_heap, unfreeze_heap

logger = init_logger(__name__)

# What a pooling request is to the scheduler, by task: a prompt that samples no token, reported when it ends;
# a token task needs every prompt row computed, so it reads nothing from the prefix cache. (Shared: made once.)
POOLING_SCHEDULES = {task: SamplingParams(max_tokens=1, skip_reading_prefix_cache=task in TOKEN_TASKS,
                                          output_kind=RequestOutputKind.FINAL_ONLY)
                     for task in POOLING_TASKS}


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams      # (of a pooling request: the scheduler's, one step, no token)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    lora_request: LoRARequest | None = None

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens and prompt scores the host has not read yet."""
    seqs: list[Sequence]            # the sequences that sampled, in row order (none: it scored prompts only)
    host: SamplerOutput | PooledStep | None   # the sampler's outputs (or a pooling step's), being copied to the host
    event: "torch.cuda.Event | None"  # recorded after the last copy; None on the CPU
    prompt_scores: PromptScores | None = None
    drafts: list[list[int]] | None = None   # each sequence's drafts, rows after its own (None: it did not draft)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.model_config = ModelConfig(config)   # vLLM's view of the model's settings
        tokenizer = (None if config.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            config.tokenizer, revision=config.tokenizer_revision, trust_remote_code=config.trust_remote_code,
            use_fast=config.tokenizer_mode != "slow", token=config.hf_token))
        self.generation_config = self._load_generation_config()
        self.eos_token_ids = self._eos_token_ids(tokenizer)
        self.thinking_markers = (None if config.reasoning_markers is None
                                 else ThinkingMarkers.encode(config.reasoning_markers, tokenizer))
        structured = config.structured_outputs_config   # its grammars wait for the end of thinking, or not
        self.grammar_waits_for = None
        if structured.reasoning_parser and not structured.enable_in_reasoning and tokenizer is not None:
            self.grammar_waits_for = ThinkingMarkers.encode(REASONING_PARSERS[structured.reasoning_parser], tokenizer)
        self.workers = None
        if config.tensor_parallel_size > 1:
            self.workers = TPWorkers(config, self.eos_token_ids, runner_device(config, 0))
        try:
            self.model_runner = ModelRunner(config, self.eos_token_ids,
                                            tp=self.workers.group if self.workers else SINGLE,
                                            workers=self.workers, sampling_defaults=self.default_sampling_params())
        except BaseException:
            if self.workers is not None:
                try:
                    self.workers.check_alive(grace_s=5.0)
                finally:
                    self.close()
            raise
        if self.workers is not None:   # NCCL cannot abort under live CUDA graphs (TPWorkers._watch)
            self.workers.abort_on_death = self.model_runner.graphs is None
        config.fit_to_kv_cache(self.model_runner.num_kvcache_blocks)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill, config.scheduling_policy,
                                   config.max_loras if config.enable_lora else 0)
        self.async_scheduling = config.async_scheduling
        spec = config.speculative_config
        self.proposer = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(spec, config.max_model_len)
        elif spec is not None:   # (drafts only where the draft model can embed their positions)
            self.proposer = DraftModelProposer(spec, self.model_runner.draft.max_model_len)
        num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.stat_logger = None if config.disable_log_stats else StatLogger(
            num_speculative_tokens=num_speculative_tokens)
        self.metrics = None if config.disable_log_stats else EngineMetrics(
            self.model_config.served_model_name, config.max_model_len, num_speculative_tokens)
        self.in_flight: InFlightStep | None = None
        self.paused = False   # sleep()'s: no step runs until wake_up()
        self.input_processor = InputProcessor(config, tokenizer, self.block_manager.num_blocks * config.block_size)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()
        self.just_finished: list[Request] = []   # the requests the latest step finished
        self.finished_asleep: list[Request] = []  # those sleep(mode="keep") finished: the next step reports them
        self.streamer = OutputStreamer()   # what step() has sent of each request
        freeze_heap()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context=None, stat_loggers=None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """vLLM's way to make an engine without the LLM facade (then add_request / step)."""
        return cls(engine_args.create_engine_config())

    @classmethod
    def from_vllm_config(cls, vllm_config: Config, usage_context=None, stat_loggers=None,
                         disable_log_stats: bool = False) -> "LLMEngine":
        """vLLM's: an engine of the settings EngineArgs.create_engine_config() made (here a Config);
        disable_log_stats turns stat logging off whatever the settings say."""
        return cls(replace(vllm_config, disable_log_stats=True) if disable_log_stats else vllm_config)

    def _load_generation_config(self) -> GenerationConfig | None:
        """The model's generation_config.json, or config.generation_config's folder's; None with
        "vllm" or without the file."""
        source = self.config.generation_config
        if source == "vllm":
            return None
        try:
            return GenerationConfig.from_pretrained(self.config.model_path if source == "auto" else source)
        except OSError:
            return None

    def _eos_token_ids(self, tokenizer) -> set[int]:
        ids = set()
        for source in (self.generation_config, self.config.hf_config, tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults the generation config sets (the fields it sets itself,
        not transformers' defaults) and config.override_generation_config's, as vLLM does."""
        fields = {}
        if self.generation_config is not None and self.generation_config.do_sample is not False:
            fields = self.generation_config.to_diff_dict()
        fields |= self.config.override_generation_config or {}
        return SamplingParams(**{name: fields[key] for key, name in GENERATION_FIELDS.items()
                                 if fields.get(key) is not None})

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer):
        self.input_processor.set_tokenizer(tokenizer)
        self.output_processor.tokenizer = tokenizer

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                    trace_headers=None, priority: int = 0, prompt_text: str | None = None) -> str:
        """vLLM's LLMEngine.add_request: one prompt in any of vLLM's forms, under the caller's
        request id; step() then reports it. A bad request is a ValueError and adds nothing.
        prompt_text: the text of a prompt given as token ids, for its outputs' prompt field."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r:.80}.")
        if request_id in self.requests or any(request.request_id == request_id for request in self.finished_asleep):
            raise ValueError(f"Request id {request_id} already running.")   # (or finished, not yet reported)
        [lora_request] = self.lora_requests(lora_request, 1)
        self.check_priority(priority)
        [prompt] = self.input_processor.parse_prompts([prompt], tokenization_kwargs)
        if self.config.runner_type == "pooling":
            self.check_pooling_params(params)
            params = self.resolve_pooling_params(params, params.task or self.config.pooling_tasks[0])
            self.input_processor.validate_pooling_request(0, prompt)
            text = prompt.text if prompt.text is not None else prompt_text
            return self.add_pooling_tokens(text, prompt.token_ids, params, priority, prompt.cache_salt, request_id,
                                           arrival_time, lora_request, prompt.embeds)
        prompt = self.input_processor.check_request(0, prompt, params)
        text = prompt.text if prompt.text is not None else prompt_text
        return self.add_tokens(text, prompt.token_ids, params, priority, prompt.cache_salt, request_id, arrival_time,
                               streamed=params.output_kind != RequestOutputKind.FINAL_ONLY, lora_request=lora_request,
                               prompt_embeds=prompt.embeds)

    def lora_requests(self, lora_request, num_prompts: int) -> list:
        """vLLM's lora_request argument (None, a LoRARequest for every prompt, or a list of one LoRARequest or
        None per prompt) -> one per prompt, each adapter read and checked (lora/adapter.py): a ValueError
        names what is wrong, and nothing is added."""
        requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * num_prompts
        if len(requests) != num_prompts:
            raise ValueError(f"lora_request must be one LoRARequest, or a list of one per prompt ({num_prompts}), "
                             f"got a list of {len(requests)}.")
        for request in requests:
            if request is None:
                continue
            if not isinstance(request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {request!r:.80}.")
            if not self.config.enable_lora:
                raise ValueError(f"lora_request {request.lora_name!r}: LoRA is not enabled; "
                                 f"create the LLM with enable_lora=True.")
            self.model_runner.adapters.get(request)
        return list(requests)

    @staticmethod
    def check_pooling_params(params, index: int | None = None):
        """A pooling engine's requests take PoolingParams (a generative engine's: InputProcessor.check_request)."""
        if not isinstance(params, PoolingParams):
            where = "params" if index is None else f"pooling_params[{index}]"
            raise ValueError(f"{where} must be a PoolingParams for a pooling model (runner='pooling'), "
                             f"got {type(params).__name__}.")

    def resolve_pooling_params(self, params: PoolingParams, task: str) -> PoolingParams:
        """params for one request of task (one of get_supported_tasks()), the engine's defaults filled in."""
        if task not in self.config.pooling_tasks:   # (vLLM's words)
            api, convert = ("Classification", "classify") if task in CLASSIFY_TASKS else ("Embedding", "embed")
            raise ValueError(f"{api} API is not supported by this model. Try converting the model using "
                             f"`--convert {convert}`.")
        return params.resolved(task, self.config.pooler_config, self.model_config)

    def add_pooling_tokens(self, prompt: str | None, prompt_token_ids: list[int], params: PoolingParams,
                           priority: int = 0, cache_salt: str | None = None, request_id: str | None = None,
                           arrival_time: float | None = None, lora_request=None, prompt_embeds=None) -> str:
        """Add a pooling engine's request (resolve_pooling_params'; validate_pooling_request passed) -> its id.
        It runs its prompt once and finishes with the pooler's result (engine/llm_engine.py: _finish_pooled)."""
        request_id = self.add_tokens(prompt, prompt_token_ids, POOLING_SCHEDULES[params.task], priority, cache_salt,
                                     request_id, arrival_time, lora_request=lora_request, prompt_embeds=prompt_embeds)
        self.requests[request_id].seqs[0].pooling_params = params
        return request_id

    def check_priority(self, priority: int):
        """A ValueError unless priority is an int, and 0 where the scheduling policy is not "priority"."""
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r:.80}.")
        policy = self.config.scheduling_policy
        if priority and policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority'; the scheduling policy "
                             f"is {policy!r}.")

    def add_tokens(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                   priority: int = 0, cache_salt: str | None = None, request_id: str | None = None,
                   arrival_time: float | None = None, streamed: bool = False, lora_request=None,
                   prompt_embeds=None) -> str:
        """Add a request that InputProcessor.check_request passed -> its id (the next number when
        none is given).
        cache_salt: the request's blocks hit in the prefix cache only for requests with the same salt.
        lora_request: its LoRA adapter (one that lora_requests() passed), or None.
        prompt_embeds: an EmbedsPrompt's vectors (inputs.PromptEmbeds), prompt_token_ids then placeholders.
        streamed: step() reports its text before it finishes; if not (LLM.generate's requests), a completion
        without stop strings is detokenized once, when it ends.
        RuntimeError while the engine sleeps."""
        self.check_awake()
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self.requests:   # taken by a caller of add_request
                request_id = str(next(self._request_ids))
        params = params.with_vocab_size(self.config.hf_config.vocab_size)
        request = Request(request_id, prompt, list(prompt_token_ids), params, lora_request=lora_request)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        bad_words_token_ids = self.input_processor.bad_words_token_ids(params.bad_words or [])
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:   # distinct, reproducible completions
                child_params = replace(params, seed=params.seed + index)
            seq = Sequence(request_id, index, prompt_token_ids, child_params, priority, cache_salt, lora_request)
            seq.bad_words_token_ids = bad_words_token_ids
            seq.prompt_embeds = prompt_embeds
            seq.streamed = streamed
            if params.thinking_token_budget is not None:
                seq.thinking_budget = ThinkingBudget(self.thinking_markers, params.thinking_token_budget)
            if params.structured_outputs is not None:
                seq.grammar = self.input_processor.grammars.state(params.structured_outputs, self.grammar_waits_for)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def abort_request(self, request_ids: str | list[str], internal: bool = False):
        """End these requests (vLLM's takes a list of ids; one id is taken too); unknown ids are
        skipped. Their outputs are dropped. internal: vLLM's (ids of its own making); the same here."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._abort(request_id)
        self.streamer.forget([*self.requests.values(), *self.finished_asleep])   # (those not reported yet)

    def _abort(self, request_id: str):
        request = self.requests.pop(request_id, None)
        if request is not None:
            aborted = [seq for seq in request.seqs if not seq.is_finished]
            for seq in aborted:
                self.scheduler.finish(seq)
                if self.model_runner.pooler is not None:
                    self.model_runner.pooler.forget(seq.seq_id)
            self._record_finished(request, ["abort"] * len(aborted))

    def _record_finished(self, request: Request, reasons: list[str]):
        """Count request's end into the metrics (with stat logging): one reason per sequence that ended."""
        if self.metrics is not None:
            self.metrics.record_finished(reasons, len(request.prompt_token_ids),
                                         sum(len(seq.output_token_ids) for seq in request.seqs), request.metrics)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.finished_asleep)

    def has_unfinished_requests_dp(self, has_unfinished: bool) -> bool:
        """vLLM's: whether any data-parallel rank has unfinished requests; with one rank, this one's."""
        return has_unfinished

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self.finished_asleep)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """vLLM's LLMEngine.step: run one step -> a RequestOutput for each request with new
        output, as its SamplingParams.output_kind asks (engine/streaming.py)."""
        finished, _ = self.run_step()
        return self.streamer.outputs(self.requests.values(), self.just_finished, finished, self._make_output)

    def run_step(self) -> tuple[list[RequestOutput], StepStats]:
        """Schedule and launch one batch; return the requests that finished.

        With async scheduling the host reads a step's sampled tokens only after it has launched
        the next step, so the GPU never waits for the host's bookkeeping. The next step takes
        its input ids straight from the GPU; a sequence that turns out to have stopped wastes
        one token of work. Requests with multi-token bad words, a thinking budget or a grammar
        need every output token on the host to sample the next (Sequence.needs_output_ids_on_host):
        when such a sequence samples with its last token still in flight, the engine launches the
        step's forward pass first and reads the step before while it runs, then prepares the
        sampling (vLLM's order: the grammar bitmask is filled while the model runs). Penalties
        count their tokens on the device and need nothing from the host."""
        done, self.finished_asleep = self.finished_asleep, []   # the requests this step finishes
        if self.paused:   # (requests that sleep(mode="keep") kept wait for wake_up)
            return self._report(done), StepStats()
        drafting = self.proposer is not None and self.proposer.should_draft(len(self.scheduler.running))
        if drafting and self.in_flight is not None:
            done += self._resolve_in_flight()   # (drafts follow each sequence's last token: read it first)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, drafting)
        out = self.scheduler.schedule()
        stats = StepStats()
        if out.is_empty:   # everything left is waiting for its pending token, or just finished (or none left)
            assert self.in_flight is not None or done or not self.scheduler.has_unfinished(), \
                "no sequence could be scheduled"
            return self._report(done + self._resolve_in_flight()), stats
        sampling_seqs = out.sampling_seqs
        now = time.time()
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            if n == 1 + len(seq.spec_token_ids) and seq.num_output_tokens:
                stats.num_decode_tokens += n
            else:
                stats.num_prefill_tokens += n
        if self.model_runner.pooler is not None:
            return self._report(done + self._pooling_step(out, stats)), stats

        previous = self.in_flight
        pending = None if previous is None else {seq.seq_id: i for i, seq in enumerate(previous.seqs)}

        def read_previous():   # (execute calls it while this step's forward pass runs)
            nonlocal previous
            done.extend(self._resolve(previous))
            previous = None

        needs_previous = previous is not None and any(   # (custom logits processors read every output id)
            (seq.needs_output_ids_on_host or self.config.logits_processors) and seq.num_pending_tokens
            for seq in sampling_seqs)
        sampled, prompt_scores = self.model_runner.execute(
            out, sampling_seqs, pending, before_sampling=read_previous if needs_previous else None)
        self.scheduler.update_computed(out)
        self.in_flight = None
        if sampled is not None:
            for seq in sampling_seqs:
                if not seq.is_finished:   # (read_previous may have stopped it: its token here is wasted)
                    seq.append_pending()
            host, event = self.model_runner.copy_to_host(sampled)
            drafts = [seq.spec_token_ids for seq in sampling_seqs] if drafting else None
            self.in_flight = InFlightStep(sampling_seqs, host, event, prompt_scores, drafts)
        elif prompt_scores is not None:
            self.in_flight = InFlightStep([], None, prompt_scores.event, prompt_scores)
        if previous is not None:   # (not read before sampling)
            done += self._resolve(previous)
        if self.in_flight is not None and (not self.async_scheduling or any(self.in_flight.drafts or ()) or (
                self.in_flight.seqs and all(seq.is_finished for seq in self.in_flight.seqs))):
            # (with async scheduling, a step with drafts: how many tokens each sequence gets is needed to
            # schedule the next; a step whose sequences all stopped while it ran: nothing to overlap it
            # with, and the engine is idle after it; one that only scored prompts is followed by the steps
            # that go on with them)
            done += self._resolve_in_flight()
        if self.stat_logger is not None:
            self.stat_logger.record(stats.num_prefill_tokens, len(sampling_seqs), self.scheduler, self.block_manager)
        return self._report(done), stats

    def _pooling_step(self, out, stats: StepStats) -> list[Request]:
        """A pooling engine's step: launch the scheduled prompt tokens. The prompts it completes leave the
        scheduler at once (their blocks are free for the next step, which the GPU runs after this one);
        with async scheduling their results are read after the next step is launched, so that the host's
        work for a step overlaps the GPU's for the one before -> the requests whose results were read."""
        finishing = out.sampling_seqs
        pooled, _ = self.model_runner.execute(out, finishing)
        self.scheduler.update_computed(out)
        for seq in finishing:
            self.scheduler.finish(seq)
        previous, self.in_flight = self.in_flight, InFlightStep(finishing, pooled, pooled.event)
        done = [] if previous is None else self._resolve(previous)
        if not self.async_scheduling or not self.scheduler.has_unfinished():
            done += self._resolve_in_flight()
        if self.stat_logger is not None:
            self.stat_logger.record(stats.num_prefill_tokens, 0, self.scheduler, self.block_manager)
        return done

    def _finish_pooled(self, step: "InFlightStep") -> list[Request]:
        """A pooling step's results, read (its event has passed): each finishes its request -> those."""
        now = time.time()
        finished = []
        results = step.host.results()
        for seq in step.seqs:
            request = self.requests.pop(seq.request_id, None)
            if request is None:   # aborted while its step ran
                continue
            seq.pooled, seq.finish_reason = results[seq.seq_id], "stop"
            request.metrics.first_token_time = request.metrics.last_token_time = request.metrics.finished_time = now
            if self.metrics is not None:
                self.metrics.record_tokens(len(request.prompt_token_ids), 0)
            self._record_finished(request, ["stop"])
            finished.append(request)
        return finished

    def _report(self, done: list[Request]) -> list[RequestOutput]:
        """Keep the requests a step finished (step() streams them) -> their final outputs."""
        self.just_finished = done
        return [self._make_output(request) for request in done]

    def _resolve_in_flight(self) -> list[Request]:
        """Read the launched step, if any (_resolve), and forget it -> the requests it finished."""
        step, self.in_flight = self.in_flight, None
        return [] if step is None else self._resolve(step)

    def _resolve(self, step: "InFlightStep") -> list[Request]:
        """Read a launched step's prompt scores and sampled tokens: replace the placeholders, check
        stops -> the requests it finished."""
        if step.event is not None:
            try:
                if self.workers is None:
                    step.event.synchronize()
                else:
                    self.workers.wait(step.event)   # ends early if a worker dies
            finally:
                if self.workers is not None:   # a dead worker aborts the group (TPWorkers._watch):
                    self.workers.check_alive()  # name it, rather than use what the aborted step left
        if isinstance(step.host, PooledStep):
            return self._finish_pooled(step)
        if step.prompt_scores is not None:   # (before the tokens: a completion's first output carries them)
            for chunk in step.prompt_scores.chunks():
                self.output_processor.append_prompt_logprobs(chunk)
        sampled = step.host
        if sampled is None:
            return []
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        ranks = sampled.ranks.tolist() if sampled.ranks is not None else None
        top = None
        if sampled.top_ids is not None:   # per row: (ids, logprobs[, ranks]), best first
            columns = [sampled.top_ids, sampled.top_logprobs, sampled.top_ranks]
            top = list(zip(*(column.tolist() for column in columns if column is not None)))
        now = time.time()
        finished = []
        row = 0   # each sequence's first row; a sequence with drafts has a row for each after it
        num_accepted = 0
        for seq, drafts in zip(step.seqs, step.drafts or repeat(())):
            first, row = row, row + 1 + len(drafts)
            if seq.is_finished:   # stopped, or aborted, while this step ran
                continue
            tokens = accepted_tokens(drafts, token_ids[first:row]) if drafts else (token_ids[first],)
            if drafts:   # the rejected drafts' KV is written over by the next steps
                seq.num_computed_tokens -= len(drafts) + 1 - len(tokens)
                num_accepted += len(tokens) - 1
                for counts in (self.metrics, self.stat_logger):
                    if counts is not None:
                        counts.record_drafts(len(drafts), len(tokens) - 1)
            request = self.requests[seq.request_id]
            num_prompt_tokens = 0 if request.metrics.first_token_time else len(request.prompt_token_ids)
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            num_pending = seq.pop_pending()     # this step's token first, then any later ones
            for i, token_id in enumerate(tokens, first):
                self.output_processor.append(
                    seq, token_id,
                    logprob=logprobs[i] if logprobs else None, rank=ranks[i] if ranks else None,
                    top=top[i] if top else None)
                if seq.finish_reason is not None:
                    break
            if self.metrics is not None:
                self.metrics.record_tokens(num_prompt_tokens, i + 1 - first)
            if seq.finish_reason is None:
                for _ in range(num_pending - 1):   # (later steps' tokens: counted when those are read)
                    seq.append_pending()
                continue
            self.scheduler.finish(seq)
            if request.is_finished:
                request.metrics.finished_time = now
                self._record_finished(request, [s.finish_reason for s in request.seqs])
                finished.append(self.requests.pop(seq.request_id))
        if step.drafts is not None:
            self.proposer.record(len(step.seqs), num_accepted)
        return finished

    def get_metrics(self) -> list[Metric]:
        if self.metrics is None:
            raise RuntimeError("get_metrics() needs stat logging: LLM(..., disable_log_stats=False).")
        scheduler, blocks = self.scheduler, self.block_manager
        return self.metrics.snapshot(len(scheduler.running), len(scheduler.waiting),
                                     1 - blocks.num_free_blocks / blocks.num_blocks, scheduler.num_preemptions,
                                     scheduler.num_prefix_cache_queries, scheduler.num_prefix_cache_hits)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """method (a ModelRunner method's name, or a function taking the runner first) on every
        rank -> the results by rank. Workers get the call first, so that a method that uses the
        group's collectives finds every rank in it."""
        kwargs = kwargs or {}
        deadline = None if timeout is None else time.monotonic() + timeout
        if isinstance(method, str):
            resolve_method(self.model_runner, method)       # an unknown name is refused before any rank runs
        number = self.workers.start_rpc(method, args, kwargs) if self.workers is not None else None
        try:
            results = [run_method(self.model_runner, method, args, kwargs)]
        finally:
            if number is not None:
                results_of_workers = self.workers.finish_rpc(number, deadline)
        return results if number is None else results + results_of_workers

    def apply_model(self, func) -> list:
        """vLLM's: func(model) on every rank (the model is this rank's shard) -> the results by rank.
        Return small values: tensors come back through pickling."""
        return self.collective_rpc("apply_model", args=(func,))

    # ---- sleep mode (engine/sleep.py) -----------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort"):
        """vLLM's: pause the scheduler, and on every rank free the weights' and the KV cache's
        memory (level 1 keeps the weights in host memory, level 2 forgets them, level 0 frees
        nothing; levels 1-2 need enable_sleep_mode and empty the prefix cache). No step runs until
        wake_up(). mode says what becomes of unfinished requests: "abort" ends them (vLLM's
        default), "keep" keeps them to go on after wake_up() (at levels 1-2 their KV is computed
        again; a launched step's tokens are read first, and the next step() reports what they
        finished), "wait" needs none left (LLM.sleep runs them to their end first; here step() them)."""
        self.check_sleep(level, mode)
        if self.model_runner.sleeping_tags or (self.paused and level == 0):
            logger.warning("The engine is already sleeping.")
            return
        if self.has_unfinished_requests():
            if mode == "wait":
                raise ValueError(f"mode='wait' with {self.get_num_unfinished_requests()} unfinished request(s): "
                                 f"step() them to their end first, or sleep with mode 'abort' or 'keep'.")
            if mode == "keep":   # a launched step's tokens: read them now
                self.finished_asleep += self._resolve_in_flight()
            if mode == "abort":   # (a launched step's tokens, if any, are dropped with their requests)
                self.abort_in_flight()
                self.abort_request(list(self.requests))
            elif level > 0:   # their blocks go with the KV cache: computed again after wake_up, as after a preemption
                self.scheduler.preempt_all()
        self.paused = True
        if level == 0:
            return
        self.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        freed = self.collective_rpc("sleep", kwargs={"level": level})[0]
        logger.info(f"It took {time.perf_counter() - start:.2f} seconds to fall asleep (level {level}); "
                    f"{freed / 2**30:.2f} GiB of weights and KV cache freed on each rank.")

    def check_sleep(self, level: int, mode: str):
        if level not in (0, 1, 2):
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}.")
        if level > 0 and not self.config.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled: create the LLM with enable_sleep_mode=True.")
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, SLEEP_MODES))}, got {mode!r}.")

    def wake_up(self, tags: list[str] | None = None):
        """vLLM's: allocate the tagged memory again on every rank ("weights", "kv_cache"; None:
        both), and let steps run again once none is asleep ("scheduling" alone: only that). After a
        level-2 sleep, load the weights with collective_rpc("reload_weights")."""
        known = (*SLEEP_TAGS, "scheduling")
        if tags is not None and (isinstance(tags, str) or any(tag not in known for tag in tags)):
            raise ValueError(f"tags must be a list of {', '.join(map(repr, known))}, got {tags!r}.")
        if not self.is_sleeping():
            logger.warning("The engine is not sleeping.")
            return
        memory = None if tags is None else [tag for tag in tags if tag != "scheduling"]
        sleeping = self.model_runner.sleeping_tags
        if sleeping and memory != []:
            awake = [tag for tag in memory or () if tag not in sleeping]
            if awake:
                logger.warning(f"Tag {awake[0]!r} is not in the sleeping tags {sleeping}.")
                return
            start = time.perf_counter()
            self.collective_rpc("wake_up", kwargs={"tags": memory})
            logger.info(f"It took {time.perf_counter() - start:.2f} seconds to wake up {memory or sleeping}.")
        self.paused = bool(self.model_runner.sleeping_tags)   # (vLLM's: steps once all memory is back)

    def is_sleeping(self) -> bool:
        return self.paused

    def check_awake(self):
        if self.paused:
            sleeping = self.model_runner.sleeping_tags
            state = f"{' and '.join(sleeping)} freed" if sleeping else "scheduling paused"
            raise RuntimeError(f"the engine is sleeping ({state}); call wake_up() before generating.")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached prompt blocks; True once done (vLLM's return value). Running requests
        keep their blocks, and there is no KV connector, so vLLM's two options change nothing here."""
        self.block_manager.reset_prefix_cache()
        return True

    def reset_mm_cache(self):
        """vLLM's; a text-only engine keeps no multimodal or encoder cache: nothing to clear."""

    reset_encoder_cache = reset_mm_cache

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.config.pooling_tasks if self.config.runner_type == "pooling" else ("generate",)

    def do_log_stats(self):
        """Log the stats line now (vLLM's; with disable_log_stats=False, else nothing)."""
        if self.stat_logger is not None:
            self.stat_logger.log(self.scheduler, self.block_manager)

    def do_log_stats_with_interval(self):
        """Log the stats line if its interval has passed since the last one."""
        if self.stat_logger is not None:
            self.stat_logger.record(0, 0, self.scheduler, self.block_manager)

    # vLLM's LoRA adapter management: the adapters read on the host (up to max_cpu_loras, the least
    # recently used dropped first unless pinned)
    def add_lora(self, lora_request) -> bool:
        """Read and check an adapter ahead of its requests -> True."""
        self.lora_requests(lora_request, 1)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter lora_id, and free its slot -> whether it was known. (Its unfinished requests keep
        their LoRARequest: their next step reads the adapter again.)"""
        runner = self.model_runner
        if runner.adapters is None:
            return False
        runner.lora_slot_table.forget(lora_id)
        return runner.adapters.remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep adapter lora_id read whatever max_cpu_loras -> True; a ValueError if it is not known."""
        adapters = self.model_runner.adapters
        if adapters is None or lora_id not in adapters.adapters:
            raise ValueError(f"LoRA adapter {lora_id!r} is not known: add_lora() it first.")
        adapters.pinned.add(lora_id)
        return True

    def list_loras(self) -> set[int]:
        adapters = self.model_runner.adapters
        return set() if adapters is None else set(adapters.adapters)

    def start_profile(self, profile_prefix: str | None = None):
        self.collective_rpc("start_profile", args=(profile_prefix,))

    def stop_profile(self):
        self.collective_rpc("stop_profile")

    def abort_in_flight(self):
        self.in_flight = None

    def close(self):
        """End the tensor-parallel workers, if any, and give the frozen heap back to the garbage
        collector (so that this engine, once unreferenced, is freed even if it holds a cycle).
        Idempotent."""
        unfreeze_heap()
        if self.workers is None:
            return
        runner = getattr(self, "model_runner", None)
        if runner is not None and runner.graphs is not None and self.workers.any_dead():
            runner.graphs.reset()    # the group's abort waits until no CUDA graph holds its collectives
            runner.graphs = None
        self.workers.close()

    def _make_output(self, request: Request, seqs: list[Sequence] | None = None) -> RequestOutput:
        """request's output so far, of all its sequences or of seqs: the tokens the host has read
        (a pooling request's: its PoolingRequestOutput, once finished)."""
        if request.seqs[0].pooling_params is not None:
            return PoolingRequestOutput(request.request_id, PoolingOutput(request.seqs[0].pooled),
                                        request.prompt_token_ids, request.seqs[0].num_cached_tokens,
                                        request.is_finished)
        outputs = [CompletionOutput(
            index=seq.index, text=seq.output_text,
            token_ids=seq.token_ids[seq.num_prompt_tokens:seq.num_resolved_tokens],
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, lora_request=request.lora_request)
            for seq in seqs or request.seqs]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, prompt_logprobs=request.seqs[0].prompt_logprobs,
            outputs=outputs, finished=request.is_finished, num_cached_tokens=self._num_cached_tokens(request),
            num_cache_creation_tokens=self._num_cache_creation_tokens(request), metrics=request.metrics,
            lora_request=request.lora_request)

    @staticmethod
    def _num_cached_tokens(request: Request) -> int:
        """The prompt tokens the request found in the prefix cache: with n > 1 completions, the most any
        of them found (the first computes the prompt, the others find it there), which is what vLLM
        reports for a request whose completions end together."""
        return max(seq.num_cached_tokens for seq in request.seqs)

    def _num_cache_creation_tokens(self, request: Request) -> int:
        """The prompt tokens this request computed and left in the prefix cache (vLLM's count): its
        full prompt blocks past its own cache hit; 0 without prefix caching."""
        if not self.config.enable_prefix_caching:
            return 0
        block_size = self.config.block_size
        full = len(request.prompt_token_ids) // block_size * block_size
        return max(0, full - request.seqs[0].num_cached_tokens)
