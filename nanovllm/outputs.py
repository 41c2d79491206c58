"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes."""
from dataclasses import KW_ONLY, dataclass, field
from typing import ClassVar

import torch

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
    """One completion of a request; vLLM's fields, in vLLM's order."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    routed_experts: None = field(default=None, repr=False)   # vLLM's; MoE routing is not returned
    finish_reason: str | None = None      # "stop", "length", "repetition", or "error" (a token its grammar refused)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    lora_request: object = field(default=None, repr=False)   # the request's LoRARequest, or None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's output; vLLM's fields, the positional ones in vLLM's order. vLLM's fields for what
    nanovllm does not do (encoder-decoder models, multimodal inputs, KV transfer) hold their
    empty values, so that scripts reading them run."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    lora_request: object = field(default=None, repr=False)   # the request's LoRARequest, or None
    encoder_prompt: None = field(default=None, repr=False)
    encoder_prompt_token_ids: None = field(default=None, repr=False)
    num_cached_tokens: int | None = None            # prompt tokens found in the prefix cache
    num_cache_creation_tokens: int | None = None    # prompt tokens computed and written to the prefix cache
    _: KW_ONLY
    kv_transfer_params: None = field(default=None, repr=False)
    ec_transfer_params: None = field(default=None, repr=False)
    multi_modal_placeholders: dict = field(default_factory=dict, repr=False)   # (vLLM before 0.26)

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """vLLM's: merge a later output of this request into this one. Each of its completions
        replaces the one with its index, or with aggregate (outputs of RequestOutputKind.DELTA)
        appends its new text, tokens and logprobs to it; a completion of a new index is added."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            i = next((i for i, old in enumerate(self.outputs) if old.index == new.index), None)
            if i is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                old.text += new.text
                old.token_ids = [*old.token_ids, *new.token_ids]
                if new.logprobs:
                    old.logprobs.extend(new.logprobs)
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason


# ---- pooling models (runner="pooling"): vLLM's output classes --------------------------------
@dataclass
class PoolingOutput:
    """One pooling request's result: a float32 CPU tensor, [hidden] for "embed" (or [dimensions]),
    [prompt tokens, hidden] for "token_embed"."""
    data: torch.Tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolingOutput) and bool((self.data == other.data).all())


@dataclass
class PoolingRequestOutput:
    """vLLM's: what LLM.encode returns for one prompt (outputs is one PoolingOutput, not a list)."""
    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    output_type: ClassVar = None   # a task's subclass: what its outputs are (made by output_type.from_base)

    @classmethod
    def from_base(cls, output: "PoolingRequestOutput") -> "PoolingRequestOutput":
        """vLLM's: encode()'s output for one prompt as this task's output."""
        return cls(output.request_id, cls.output_type.from_base(output.outputs), output.prompt_token_ids,
                   output.num_cached_tokens, output.finished)


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding as a list of floats."""
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's label probabilities (or logits) as a list of floats."""
    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "ClassificationOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """vLLM's: the score of one pair of texts."""
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> "ScoringOutput":
        """A cross-encoder's result, its one label's probability."""
        data = output.data.squeeze()
        if data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(data.item())


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's: what LLM.embed returns for one prompt."""
    output_type = EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's: what LLM.classify returns for one prompt."""
    output_type = ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's: what LLM.score returns for one pair (an embedding model's request_id is "<first's id>_<second's
    id>"; a cross-encoder's, the pair's own request's)."""
    output_type = ScoringOutput
