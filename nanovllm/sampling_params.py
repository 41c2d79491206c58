"""SamplingParams: how to pick each next token and when to stop (vLLM's fields and defaults)."""
import copy
import math
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from enum import Enum

from nanovllm.logger import init_logger
from nanovllm.utils.validation import check_field_types

logger = init_logger(__name__)

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# A temperature above 0 and below this is raised to it, as vLLM does (its _MAX_TEMP): the logits
# divided by less could overflow.
MIN_TEMPERATURE = 1e-2
MAX_LOGPROB_TOKEN_IDS = 128   # vLLM's limit on logprob_token_ids
# vLLM 0.26's fields for what nanovllm does not do: name -> (the default, the only value taken; why).
UNSUPPORTED_FIELDS = {
    "routed_experts_prompt_start": (0, "nanovllm does not return MoE routing"),
}


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's: one constraint on a completion (engine/structured_output.py): a JSON schema (a dict
    or its text), a regex, a list of strings to choose from, an EBNF grammar, or any JSON object."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False      # JSON without optional whitespace
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None     # (vLLM's other backends')
    structural_tag: str | None = None         # not supported: a ValueError

    def __post_init__(self):
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one constraint of {', '.join(CONSTRAINTS)}, "
                             f"got {len(given)} ({', '.join(given) or 'none'}).")
        check_field_types(self)
        if self.structural_tag is not None:
            raise ValueError(f"structured_outputs structural_tag is not supported, got {self.structural_tag!r:.80}.")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs choice must be a list of non-empty strings, got {self.choice!r:.80}.")
        if self.json_object is False:
            raise ValueError("structured_outputs json_object must be True when given, got False.")

    @classmethod
    def parse(cls, value) -> "StructuredOutputsParams | None":
        """None, a dict of the fields, or a StructuredOutputsParams (ours or vLLM's)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            names = [f.name for f in dataclass_fields(cls)]
            value = {name: getattr(value, name) for name in names if hasattr(value, name)}
        try:
            return cls(**value)
        except TypeError:
            raise ValueError(f"structured_outputs takes {', '.join(f.name for f in dataclass_fields(cls))}, "
                             f"got {value!r:.120}.") from None

    @property
    def constraint(self) -> tuple[str, object]:
        """(its kind, its spec)."""
        return next((name, getattr(self, name)) for name in CONSTRAINTS if getattr(self, name) is not None)


@dataclass
class RepetitionDetectionParams:
    """vLLM's: stop a completion (finish_reason "repetition", stop_reason "repetition_detected")
    once its output ends in a pattern of min_pattern_size..max_pattern_size tokens repeated
    min_count times in a row. max_pattern_size 0: off."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0     # 0: 1
    min_count: int = 0            # at least 2 when max_pattern_size is set

    def __post_init__(self):
        if not (0 <= self.min_pattern_size <= self.max_pattern_size):
            raise ValueError(f"max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                             f"max_pattern_size, got {self.max_pattern_size} and {self.min_pattern_size}.")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"min_count must be >= 2 with max_pattern_size > 0, got {self.min_count}.")

    def repeats(self, token_ids: list[int]) -> bool:
        """Whether token_ids end in a pattern repeated min_count times."""
        for size in range(max(1, self.min_pattern_size), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > len(token_ids):
                return False
            tail = token_ids[-span:]
            if tail == tail[-size:] * self.min_count:
                return True
        return False


class RequestOutputKind(Enum):
    """vLLM's: what a streaming server returns for a request as it runs. LLM.generate returns each
    request once, finished, whatever SamplingParams.output_kind says, as vLLM's LLM does."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None            # a list after __post_init__ (None: [])
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True   # passed to the tokenizer's decode (fast tokenizers ignore it)
    logprobs: int | None = None         # top-N logprobs per output token (0: the sampled token only; -1: all)
    # The logprobs of exactly these ids (and the sampled token's) per output token, in place of the top-N
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (0: the prompt token only; -1: all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words: list[str] | None = None             # never generated (a word's last token banned after the rest)
    logit_bias: dict[int, float] | None = None     # added to the raw logits of those token ids
    allowed_token_ids: list[int] | None = None     # only these ids may be sampled
    truncate_prompt_tokens: int | None = None      # keep only the prompt's last k tokens (-1: max_model_len)
    detokenize: bool = True                        # False: token ids only, text stays ""
    structured_outputs: object | None = None       # StructuredOutputsParams (or a dict of its fields)
    logits_processors: list | None = None          # per-request logits processors: only None (as vLLM V1)
    extra_args: dict | None = None                 # kept for custom code, as vLLM (no built-in use)
    # True: the prompt is computed whole, no prefix-cache hits; None: True with prompt_logprobs (vLLM's)
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # accepted; generate() returns finals
    # vLLM's FlatLogprobs is a sequence of the same per-token dicts; ours are lists of them either way.
    flat_logprobs: bool = False
    skip_clone: bool = False                       # clone() then copies shallowly (vLLM's)
    # A reasoning model's thinking tokens at most (-1 or None: no limit); the engine needs its
    # reasoning_parser or reasoning_config (engine/reasoning.py)
    thinking_token_budget: int | None = None
    # vLLM's, not supported (a ValueError unless left at the default):
    routed_experts_prompt_start: int = 0           # MoE routing output, which nanovllm does not return
    # Stop a completion stuck repeating itself (RepetitionDetectionParams, or a dict of its fields)
    repetition_detection: RepetitionDetectionParams | dict | None = None

    def __post_init__(self):
        # vLLM's normal forms: -1 for no seed, True for one logprob (as the OpenAI API's logprobs)
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.structured_outputs = StructuredOutputsParams.parse(self.structured_outputs)
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
            except TypeError:
                raise ValueError(f"repetition_detection takes max_pattern_size, min_pattern_size and min_count, "
                                 f"got {self.repetition_detection!r:.120}.") from None
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(f"temperature {self.temperature} is less than {MIN_TEMPERATURE}, which may cause "
                           f"numerical errors nan or inf in tensors. We have maxed it out to {MIN_TEMPERATURE}.")
            self.temperature = MIN_TEMPERATURE
        if self.is_greedy and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if self.is_greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's constructor for settings from an API request: None for n, a penalty, temperature
        or top_p means its default; logit_bias keys may be numeric strings, and each bias is
        clamped to [-100, 100]."""
        for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p"):
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            bad = [token for token in bias if not _is_int_like(token)]
            if bad:
                raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
            kwargs["logit_bias"] = {int(token): min(100.0, max(-100.0, b)) if isinstance(b, (int, float)) else b
                                    for token, b in bias.items()}
        return cls(**kwargs)

    @property
    def num_logprobs(self) -> int | None:
        """Logprob entries per output token besides the sampled one's; None: no logprobs."""
        return len(self.logprob_token_ids) if self.logprob_token_ids is not None else self.logprobs

    def with_vocab_size(self, vocab_size: int) -> "SamplingParams":
        """These params with logprobs / prompt_logprobs of -1 (vLLM's "every token") as vocab_size."""
        if -1 not in (self.logprobs, self.prompt_logprobs):
            return self
        every = lambda n: vocab_size if n == -1 else n
        return replace(self, logprobs=every(self.logprobs), prompt_logprobs=every(self.prompt_logprobs))

    def clone(self) -> "SamplingParams":
        """A deep copy, or a shallow one with skip_clone (vLLM's SamplingParams.clone)."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def samples_by_temperature_alone(self) -> bool:
        """No top-k, top-p or min-p, seed, min_tokens, token bans, edits or penalties, logprobs, thinking
        budget or grammar: a row that needs nothing from the host's sampling metadata but its temperature."""
        return (self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0 and self.seed is None
                and self.min_tokens == 0 and not self.bad_words and self.allowed_token_ids is None
                and not self.logit_bias and not self.has_penalties and self.num_logprobs is None
                and self.thinking_token_budget is None and self.structured_outputs is None)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _validate(self):
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        check(not self.logits_processors, f"logits_processors is not supported (per-request logits processors; "
                                          f"vLLM V1 refuses them too: wrap them in an AdapterLogitsProcessor, "
                                          f"nanovllm.logits_processor, for LLM(logits_processors=[...])), got "
                                          f"{self.logits_processors!r:.80}.")
        for name, (default, why) in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            check(value == default, f"{name} is not supported ({why}), got {value!r:.80}.")
        check_field_types(self)   # the types first: the checks below test values only

        check(self.n >= 1, f"n must be at least 1, got {self.n}.")
        check(self.thinking_token_budget is None or self.thinking_token_budget >= -1,
              f"thinking_token_budget must be a non-negative integer or -1 for unlimited, "
              f"got {self.thinking_token_budget}.")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(0.0 < self.repetition_penalty < math.inf,   # (inf would turn a logit of 0 into NaN)
              f"repetition_penalty must be a finite number greater than zero, got {self.repetition_penalty}.")
        check(math.isfinite(self.temperature), f"temperature must be a finite number, got {self.temperature}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")   # (-1 as 0)
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0,
              f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
              f"got {self.min_tokens}.")
        check(self.logprobs is None or self.logprobs >= -1,
              f"logprobs must be non-negative or -1, got {self.logprobs}.")
        check(self.prompt_logprobs is None or self.prompt_logprobs >= -1,
              f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.")
        check(not (self.skip_reading_prefix_cache is False and self.prompt_logprobs is not None),
              "skip_reading_prefix_cache=False cannot be combined with prompt_logprobs: prompt logprobs need "
              "every prompt token computed.")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words or []),
              f"bad_words must be a list of non-empty strings, got {self.bad_words!r:.200}.")
        check(self.logit_bias is None or all(
            isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and math.isfinite(b)
            for t, b in self.logit_bias.items()),
              f"logit_bias must map non-negative token ids to finite numbers, got {self.logit_bias!r:.200}.")
        ids = self.logprob_token_ids
        check(ids is None or (isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)),
              f"logprob_token_ids must be a list of non-negative token ids, got {ids!r:.200}.")
        check(ids is None or len(ids) <= MAX_LOGPROB_TOKEN_IDS,
              f"Too many logprob_token_ids: {len(ids or ())}. The max is {MAX_LOGPROB_TOKEN_IDS}.")
        check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
              f"allowed_token_ids must be a non-empty list of non-negative token ids, "
              f"got {self.allowed_token_ids!r:.200}.")
        check(self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
              f"truncate_prompt_tokens must be at least 1, or -1 (max_model_len), got {self.truncate_prompt_tokens}.")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        check(all(isinstance(s, str) and s for s in stops),
              f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}.")
        check(self.detokenize or not stops,
              "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
              f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}.")


def _is_int_like(token) -> bool:
    try:
        int(token)
    except (TypeError, ValueError):
        return False
    return not isinstance(token, bool)


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's names and defaults). include_stop_str_in_output is
    accepted for vLLM's sake and has no effect: beam search stops only at EOS and max_tokens."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: object | None = None   # vLLM's; only None (no structured outputs in beam search)

    def __post_init__(self):
        if self.structured_outputs is not None:
            raise ValueError(f"structured_outputs is not supported in beam search, got {self.structured_outputs!r:.80}.")
        check_field_types(self)   # the types first: the checks below test values only
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}.")
