"""Sequence: the state of one completion as it moves through the engine (no torch here)."""
from enum import Enum, auto
from itertools import count

from nanovllm.logprobs import FlatLogprobs, PromptLogprobs, SampleLogprobs
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# Stands in token_ids for a token that was sampled on the GPU but not yet read by the host.
PENDING_TOKEN = -1


class Sequence:
    """One prompt plus the tokens generated for it so far.

    Token regions, left to right:

        | prompt | output            |               token_ids (num_tokens)
        | cached | computed |  scheduled  |          num_cached_tokens <= num_computed_tokens
        |<-- KV written -->|<- this step ->|
                            ... | pending |          num_pending_tokens placeholders at the end

    `num_computed_tokens` counts tokens whose KV is in the cache. A step computes the next
    `num_scheduled` tokens; when that reaches `num_tokens`, the step also samples a new token
    (with speculative decoding, the scheduled tokens may run on into `spec_token_ids`, drafts
    that are not in token_ids: the step samples after each of them too).
    With async scheduling the sampled token is appended as PENDING_TOKEN and replaced once the
    host reads it, one step later; the next step takes its input id straight from the GPU.
    """
    _ids = count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                 lora_request=None):
        self.seq_id = next(Sequence._ids)        # also the arrival order
        self.request_id = request_id
        self.priority = priority                 # with the "priority" policy: lower runs first
        self.index = index                       # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.samples_by_temperature_alone = sampling_params.samples_by_temperature_alone   # (read every step)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0               # prefix-cache hit at the first admission
        self.is_first_admission = True
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []        # chained hashes of the full blocks of token_ids
        self.cache_salt = cache_salt             # mixed into the first block's hash (inputs.py)
        self.lora_request = lora_request         # its LoRA adapter (lora/), or None; in the first block's hash too
        self.prompt_embeds = None                # an EmbedsPrompt's vectors (inputs.PromptEmbeds); in block hashes too
        self.num_pending_tokens = 0              # PENDING_TOKEN placeholders at the end of token_ids
        self.spec_token_ids: list[int] = []      # drafts the next step checks (engine/speculative.py)
        self.num_draft_computed = 0              # tokens whose draft-model K/V is written (engine/draft_model.py)
        # Output state, owned by the engine (detokenizer and stop checks).
        self.output_text = ""
        self.prefix_offset = 0                   # incremental detokenization window
        self.read_offset = 0
        self.streamed = False                    # step() reports its text before it ends (LLMEngine.add_request)
        wants_logprobs = sampling_params.num_logprobs is not None
        container = FlatLogprobs if sampling_params.flat_logprobs else list
        self.logprobs: SampleLogprobs | None = container() if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        # Entry j: {token_id: Logprob} for prompt token j given the ones before it; None for token 0 ({} if flat).
        self.prompt_logprobs: PromptLogprobs | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = container()
            self.prompt_logprobs.append(None)
        self.num_prompt_scored = 0               # prompt tokens scored so far, their scores read or in flight
        self.finish_reason: str | None = None
        self.pooling_params = None    # a pooling engine's request: its PoolingParams (pooling_params.py)
        self.pooled = None            # ...and its result, a host tensor, once its prompt has run
        self.stop_reason: int | str | None = None
        self.bad_words_token_ids: list[list[int]] = []   # set by the engine from sampling_params.bad_words
        self.thinking_budget = None   # engine/reasoning.py's ThinkingBudget, set by the engine for a budget
        self.grammar = None           # engine/structured_output.py's GrammarState, for structured outputs

    @property
    def lora_int_id(self) -> int:
        """Its LoRA adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def known_prompt_token_ids(self) -> list[int]:
        """The prompt's token ids less the placeholders of positions given as vectors (prompt_embeds)."""
        prompt = self.token_ids[:self.num_prompt_tokens]
        if self.prompt_embeds is None:
            return prompt
        given = self.prompt_embeds.is_token_ids
        return [] if given is None else [t for t, known in zip(prompt, given) if known]

    @property
    def needs_output_ids_on_host(self) -> bool:
        """Sampling looks at the ids of earlier output tokens on the host (multi-token bad words, a
        thinking budget, a grammar). Penalties do not: their counts stay on the device
        (engine/penalty_counts.py)."""
        return (self.thinking_budget is not None or self.grammar is not None
                or any(len(ids) > 1 for ids in self.bad_words_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose ids the host knows."""
        return len(self.token_ids) - self.num_pending_tokens

    def reached_length_limit(self, max_model_len: int) -> bool:
        """max_tokens or max_model_len reached, pending tokens included: nothing more to generate."""
        max_tokens = self.sampling_params.max_tokens
        return ((max_tokens is not None and self.num_output_tokens >= max_tokens)
                or self.num_tokens >= max_model_len)

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def append_pending(self):
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def pop_pending(self) -> int:
        """Drop every placeholder; returns how many there were."""
        n = self.num_pending_tokens
        if n:
            del self.token_ids[-n:]
            self.num_pending_tokens = 0
        return n

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
