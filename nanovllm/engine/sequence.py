"""Sequence: the state of one completion as it moves through the engine (no torch here)."""
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One prompt plus the tokens generated for it so far.

    Token regions, left to right:

        | prompt | output |                         token_ids (num_tokens)
        | cached | computed |  scheduled  |          num_cached_tokens <= num_computed_tokens
        |<-- KV written -->|<- this step ->|

    `num_computed_tokens` counts tokens whose KV is in the cache. A step computes the next
    `num_scheduled` tokens; when that reaches `num_tokens`, the step also samples a new token.
    """
    _ids = count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index                       # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0               # prefix-cache hit at the first admission
        self.is_first_admission = True
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []        # chained hashes of the full blocks of token_ids
        # Output state, owned by the engine (detokenizer and stop checks).
        self.output_text = ""
        self.prefix_offset = 0                   # incremental detokenization window
        self.read_offset = 0
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if sampling_params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

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
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
