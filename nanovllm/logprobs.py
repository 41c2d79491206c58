"""Per-token logprobs as vLLM returns them (vllm.logprobs): `Logprob`, one {token_id: Logprob}
dict a position, and `FlatLogprobs`, the same sequence of dicts kept as a few flat lists, which a
request asks for with SamplingParams(flat_logprobs=True)."""
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token under the raw model distribution, and its rank (1 = best).
    Slotted: a run with logprobs makes millions (56 bytes each instead of 152)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


class FlatLogprobs(Sequence):
    """A sequence of {token_id: Logprob} dicts, one a position, stored as six flat lists (each
    position's entries lie between its start and end index) and built when read: a run's logprobs
    as a handful of Python objects instead of a dict and 1 + N Logprobs a token, which the garbage
    collector would otherwise scan again and again. Read-only apart from appending, as vLLM's; a
    position appended as None reads as {} there too."""
    __slots__ = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self):
        self.start_indices: list[int] = []
        self.end_indices: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int | None] = []
        self.decoded_tokens: list[str | None] = []

    def append_position(self, token_ids: list[int], logprobs: list[float], ranks: list, decoded_tokens: list):
        """The next position's entries, as columns."""
        self.start_indices.append(len(self.token_ids))
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks
        self.decoded_tokens += decoded_tokens
        self.end_indices.append(len(self.token_ids))

    def append(self, position: LogprobsOnePosition | None):
        entries = (position or {}).items()
        self.append_position([token_id for token_id, _ in entries], [lp.logprob for _, lp in entries],
                             [lp.rank for _, lp in entries], [lp.decoded_token for _, lp in entries])

    def extend(self, positions):
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            out = FlatLogprobs()
            for start, end in zip(self.start_indices[index], self.end_indices[index]):
                out.append_position(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end],
                                    self.decoded_tokens[start:end])
            return out
        start, end = self.start_indices[index], self.end_indices[index]
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(start, end)}

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


# One entry per output token: {token_id: Logprob} holding the sampled token and the top-N.
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
# One entry per prompt token, the same way; the first is None (nothing comes before it; {} when flat).
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]
