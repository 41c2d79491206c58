"""LLM.get_metrics(): vLLM's in-memory metrics, with its names, labels and types.

vLLM reads them from its Prometheus registry (vllm.v1.metrics.reader); here the engine keeps the
totals itself (EngineMetrics) and builds the same objects on request. Kept when
`LLM(disable_log_stats=False)`, as in vLLM. Of vLLM's metrics these exist: the token, request,
preemption and prefix-cache counters, the queue and KV-cache gauges, the per-request
histograms of time to first token, end-to-end latency, queue time and token counts, and with
speculative decoding its draft counters.
"""
from dataclasses import dataclass, field

# vLLM's buckets: time to first token, and request latencies (e2e, queue); token counts use
# 1-2-5 steps up to max_model_len.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """buckets: upper limit (Prometheus' spelling: "0.5", "+Inf") -> observations at or below it."""
    count: int
    sum: float
    buckets: dict[str, int]


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class DraftCounts:
    """Speculative decoding's drafts: sequences that had drafts in a step, their drafts, and the accepted
    ones (in all, and of each draft position)."""
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(init=False)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted_tokens: int):
        """One sequence's drafts in a step: how many, and how many of them (the first ones) it kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


class _Observations:
    def __init__(self, bounds):
        self.bounds, self.counts, self.count, self.sum = bounds, [0] * len(bounds), 0, 0.0

    def observe(self, value: float):
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def buckets(self) -> dict[str, int]:
        return {**{repr(float(b)): n for b, n in zip(self.bounds, self.counts)}, "+Inf": self.count}


class EngineMetrics:
    """Totals since the engine started, fed by the engine loop."""

    def __init__(self, model_name: str, max_model_len: int, num_speculative_tokens: int = 0):
        self.labels = {"model_name": model_name, "engine": "0"}
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.drafts = DraftCounts(num_speculative_tokens)
        self.num_finished = dict.fromkeys(FINISH_REASONS, 0)
        tokens = one_two_five_buckets(max_model_len)
        self.histograms = {"vllm:time_to_first_token_seconds": _Observations(TTFT_BUCKETS),
                           "vllm:e2e_request_latency_seconds": _Observations(LATENCY_BUCKETS),
                           "vllm:request_queue_time_seconds": _Observations(LATENCY_BUCKETS),
                           "vllm:request_prompt_tokens": _Observations(tokens),
                           "vllm:request_generation_tokens": _Observations(tokens)}

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int):
        """Tokens a step produced; a request's prompt counts whole (cached part too) with its first
        token, as vLLM counts it."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens

    def record_drafts(self, num_draft_tokens: int, num_accepted_tokens: int):
        self.drafts.record(num_draft_tokens, num_accepted_tokens)

    def record_finished(self, finish_reasons: list[str], num_prompt_tokens: int, num_generation_tokens: int,
                        metrics):
        """A request that ended: its sequences' finish reasons, and its RequestMetrics."""
        for reason in finish_reasons:
            self.num_finished[reason] += 1
        observe = lambda name, value: value is not None and self.histograms[name].observe(value)
        since_arrival = lambda t: None if t is None else t - metrics.arrival_time
        observe("vllm:time_to_first_token_seconds", since_arrival(metrics.first_token_time))
        observe("vllm:e2e_request_latency_seconds", since_arrival(metrics.finished_time))
        observe("vllm:request_queue_time_seconds", since_arrival(metrics.first_scheduled_time))
        observe("vllm:request_prompt_tokens", num_prompt_tokens)
        observe("vllm:request_generation_tokens", num_generation_tokens)

    def snapshot(self, num_running: int, num_waiting: int, kv_cache_usage: float, num_preemptions: int,
                 num_prefix_cache_queries: int, num_prefix_cache_hits: int) -> list[Metric]:
        labels = self.labels
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", dict(labels), num_running),
            Gauge("vllm:num_requests_waiting", dict(labels), num_waiting),
            Gauge("vllm:kv_cache_usage_perc", dict(labels), kv_cache_usage),
            Counter("vllm:num_preemptions", dict(labels), num_preemptions),
            Counter("vllm:prefix_cache_queries", dict(labels), num_prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", dict(labels), num_prefix_cache_hits),
            Counter("vllm:prompt_tokens", dict(labels), self.num_prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.num_generation_tokens),
        ]
        metrics += [Counter("vllm:request_success", labels | {"finished_reason": reason}, n)
                    for reason, n in self.num_finished.items()]
        metrics += [Histogram(name, dict(labels), h.count, h.sum, h.buckets()) for name, h in self.histograms.items()]
        drafts = self.drafts
        if drafts.num_speculative_tokens:
            metrics += [Counter("vllm:spec_decode_num_drafts", dict(labels), drafts.num_drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", dict(labels), drafts.num_draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), drafts.num_accepted_tokens),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                               list(drafts.num_accepted_tokens_per_pos))]
        return metrics
