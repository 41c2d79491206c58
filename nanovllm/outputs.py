"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes."""
from dataclasses import dataclass, field

from nanovllm.logprobs import PromptLogprobs, SampleLogprobs


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
    lora_request: None = field(default=None, repr=False)     # vLLM's field; no LoRA here
    routed_experts: None = field(default=None, repr=False)   # vLLM's; MoE routing is not returned

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
    num_cached_tokens: int = 0            # prompt tokens found in the prefix cache
    num_cache_creation_tokens: int = 0    # prompt tokens computed and written to the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # vLLM's fields for what nanovllm does not do (LoRA, encoder-decoder models, multimodal
    # inputs, KV transfer), at their empty values, so that scripts reading them run
    lora_request: None = field(default=None, repr=False)
    encoder_prompt: None = field(default=None, repr=False)
    encoder_prompt_token_ids: None = field(default=None, repr=False)
    multi_modal_placeholders: dict = field(default_factory=dict, repr=False)
    kv_transfer_params: None = field(default=None, repr=False)
    ec_transfer_params: None = field(default=None, repr=False)
