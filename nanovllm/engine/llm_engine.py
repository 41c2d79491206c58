"""LLMEngine: the step loop. Requests in, one scheduled batch per step, finished outputs out."""
import time
from dataclasses import dataclass, field, replace
from itertools import count

from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = (None if config.skip_tokenizer_init
                          else AutoTokenizer.from_pretrained(config.tokenizer))
        self.generation_config = self._load_generation_config()
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config, self.eos_token_ids)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()

    def _load_generation_config(self) -> GenerationConfig | None:
        try:
            return GenerationConfig.from_pretrained(self.config.model_path)
        except OSError:
            return None

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.generation_config, self.config.hf_config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults, as vLLM does."""
        overrides = {}
        if self.generation_config is not None and self.generation_config.do_sample is not False:
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                value = getattr(self.generation_config, name, None)
                if value is not None:
                    overrides[name] = value
        return SamplingParams(**overrides)

    # ---- requests -----------------------------------------------------------------------
    def validate_request(self, index: int, prompt_token_ids: list[int], params: SamplingParams):
        """Raise ValueError if this request could never run. Changes nothing."""
        cfg = self.config
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"prompt {index} is empty.")
        vocab_size = cfg.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]!r} is out of vocabulary "
                             f"(vocab_size={vocab_size}).")
        if n > cfg.max_model_len:
            raise ValueError(f"prompt {index} (length {n}) is longer than the maximum model "
                             f"length of {cfg.max_model_len}.")
        max_len = min(n + (params.max_tokens or cfg.max_model_len), cfg.max_model_len)
        capacity = self.block_manager.num_blocks * cfg.block_size
        if max_len > capacity:
            raise ValueError(f"prompt {index} (length {n}) with max_tokens={params.max_tokens} needs "
                             f"up to {max_len} tokens of KV cache, more than the whole cache holds "
                             f"({capacity} tokens); lower max_tokens or max_model_len.")
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {params.logprobs}, which is greater "
                             f"than max allowed: {cfg.max_logprobs}.")

    def add_request(self, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> str:
        request_id = str(next(self._request_ids))
        request = Request(request_id, prompt, list(prompt_token_ids), params)
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:   # distinct, reproducible completions
                child_params = replace(params, seed=params.seed + index)
            seq = Sequence(request_id, index, prompt_token_ids, child_params)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def abort_request(self, request_id: str):
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        out = self.scheduler.schedule()
        assert not out.is_empty, "no sequence could be scheduled"
        sampling_seqs = out.sampling_seqs
        now = time.time()
        stats = StepStats()
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            if seq.num_computed_tokens + n == seq.num_tokens and n == 1 and seq.num_output_tokens:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_tokens += n

        sampled = self.model_runner.execute(out, sampling_seqs)
        self.scheduler.update_computed(out)
        if sampled is None:
            return [], stats

        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        ranks = sampled.ranks.tolist() if sampled.ranks is not None else None
        top = (list(zip(sampled.top_ids.tolist(), sampled.top_logprobs.tolist()))
               if sampled.top_ids is not None else None)
        now = time.time()
        finished = []
        for i, (seq, token_id) in enumerate(zip(sampling_seqs, token_ids)):
            request = self.requests[seq.request_id]
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            self.output_processor.append(
                seq, token_id,
                logprob=logprobs[i] if logprobs else None, rank=ranks[i] if ranks else None,
                top=list(zip(*top[i])) if top else None)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                if request.is_finished:
                    request.metrics.finished_time = now
                    finished.append(self._make_output(self.requests.pop(seq.request_id)))
        return finished, stats

    @staticmethod
    def _make_output(request: Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason) for seq in request.seqs]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=outputs, finished=True,
            num_cached_tokens=request.seqs[0].num_cached_tokens, metrics=request.metrics)
