"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token under the raw model distribution, and its rank (1 = best)."""
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per output token: {token_id: Logprob} holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, the same way; the first is None (nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None      # "stop" or "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
