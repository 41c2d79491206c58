"""The thinking budget of reasoning models: vLLM's `reasoning_parser` / `reasoning_config` engine
arguments and SamplingParams.thinking_token_budget.

A reasoning model writes its thoughts between two markers (Qwen3: "<think>" and "</think>")
before it answers. A request with thinking_token_budget=B keeps at most B tokens after the
start marker: the step that would sample token B + 1 of the block samples the end marker's
first token instead, whatever the model prefers, and the next steps its other tokens (one a
step). Counting starts again at the next start marker. A prompt that ends inside a block (a
chat template that opens it) counts its tokens after the marker too, as vLLM does:

    | prompt ... <think> a b | c d  </think> ... |     budget 4: a b c d thought, then forced
                             | output            |
"""
from dataclasses import dataclass

from nanovllm.utils.validation import check_known_keys

# vLLM 0.26's reasoning parsers whose blocks lie between two strings: name -> (start, end).
REASONING_PARSERS = {name: ("<think>", "</think>") for name in ("qwen3", "deepseek_r1", "mimo", "ernie45")}
REASONING_CONFIG_FIELDS = ("reasoning_parser", "reasoning_start_str", "reasoning_end_str")


@dataclass
class ReasoningConfig:
    """vLLM's ReasoningConfig (`from nanovllm.config import ReasoningConfig`): the markers' strings,
    or the name of a parser that knows them (its strings win)."""
    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    @classmethod
    def parse(cls, value):
        """LLM(reasoning_config=...): None, a dict of the fields (made a ReasoningConfig), or a
        ReasoningConfig (ours or vLLM's, taken as it is)."""
        if not isinstance(value, dict):
            return value
        check_known_keys("reasoning_config", value, REASONING_CONFIG_FIELDS)
        return cls(**value)


def reasoning_markers(reasoning_parser: str, reasoning_config) -> tuple[str, str] | None:
    """The engine arguments -> the (start, end) marker strings, None if they name none.
    reasoning_config: None or a ReasoningConfig; its strings win over those of the parser it or
    reasoning_parser names."""
    parser = getattr(reasoning_config, "reasoning_parser", "") or reasoning_parser
    start = getattr(reasoning_config, "reasoning_start_str", "") or ""
    end = getattr(reasoning_config, "reasoning_end_str", "") or ""
    if parser:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {parser!r} is not supported; supported: "
                             f"{', '.join(REASONING_PARSERS)}, or give the markers as reasoning_config="
                             f"{{'reasoning_start_str': ..., 'reasoning_end_str': ...}}.")
        start, end = start or REASONING_PARSERS[parser][0], end or REASONING_PARSERS[parser][1]
    if not start and not end:
        return None
    for name, value in (("reasoning_start_str", start), ("reasoning_end_str", end)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"reasoning_config needs both reasoning_start_str and reasoning_end_str as "
                             f"non-empty strings, got {name}={value!r}.")
    return start, end


@dataclass(frozen=True)
class ThinkingMarkers:
    """The markers as token ids."""
    start: list[int]
    end: list[int]

    @classmethod
    def encode(cls, markers: tuple[str, str], tokenizer) -> "ThinkingMarkers":
        if tokenizer is None:
            raise ValueError("reasoning markers need a tokenizer, but the engine has none (skip_tokenizer_init=True).")
        start, end = (tokenizer.encode(text, add_special_tokens=False) for text in markers)
        if not start or not end:
            raise ValueError(f"reasoning markers {markers!r} encode to no tokens.")
        return cls(start, end)


class MarkerScan:
    """Where the latest start and end markers of a sequence's token ids lie. Each call to scan()
    searches only the ids added since the last."""

    def __init__(self, markers: ThinkingMarkers):
        self.markers = markers
        self.num_scanned = 0        # token_ids[:num_scanned] searched for markers
        self.opened_at = -1         # the index after the latest start marker (a block's first token); -1: none
        self.closed_at = -1         # the index after the latest end marker

    def scan(self, token_ids: list[int]):
        for marker, name in ((self.markers.start, "opened_at"), (self.markers.end, "closed_at")):
            n = len(marker)
            for i in range(max(0, self.num_scanned - n + 1), len(token_ids) - n + 1):
                if token_ids[i:i + n] == marker:
                    setattr(self, name, i + n)
        self.num_scanned = len(token_ids)

    @property
    def in_block(self) -> bool:
        return self.opened_at > self.closed_at

    @property
    def block_ended(self) -> bool:
        """An end marker after the latest start marker (vLLM's reasoning parsers' is_reasoning_end)."""
        return self.closed_at > self.opened_at


class ThinkingBudget:
    """One sequence's thinking budget. Every token id must be known (the engine reads pending
    tokens first for such a sequence)."""

    def __init__(self, markers: ThinkingMarkers, budget: int):
        self.markers = markers
        self.budget = budget
        self.scan = MarkerScan(markers)

    def forced_token(self, token_ids: list[int]) -> int | None:
        """The token the next step must sample, None if the model chooses."""
        self.scan.scan(token_ids)
        if not self.scan.in_block:
            return None
        num_thinking = len(token_ids) - self.scan.opened_at
        if num_thinking < self.budget:
            return None
        end = self.markers.end
        done = next(j for j in range(min(len(end) - 1, num_thinking), -1, -1)   # end's tokens already forced
                    if j == 0 or token_ids[-j:] == end[:j])
        return end[done]
