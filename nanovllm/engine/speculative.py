"""Speculative decoding, as vLLM's `speculative_config` (no torch here): by n-gram prompt lookup
({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}), or
by a draft model ({"model": a smaller model of the same vocabulary, "num_speculative_tokens": k}: method
"draft_model", engine/draft_model.py proposes).

Before each step, a decoding sequence whose tokens end with an n-gram (prompt_lookup_min <= n <=
prompt_lookup_max) that also occurs earlier in its tokens proposes, as drafts, the up to k tokens that
followed the earliest such occurrence (the longest n that occurs wins); with a draft model, it asks for k
drafts here, and the draft model makes them once the step is scheduled. The step computes the sequence's
last token and its drafts together, one logits row each, and samples a token from every row:

    tokens   ... a b c | d          drafts  e f g        (d: the last token, its KV not yet written)
    rows               | d  e  f  g
    sampled            | s0 s1 s2 s3

Draft i is accepted while the drafts before it were and s[i-1] equals it. The sequence gets the
accepted drafts, then the first sampled token that differs from its draft (or s3 when all were
accepted): 1 to k + 1 tokens from one step, and the KV of the rejected drafts is written over later.

vLLM's num_speculative_tokens_per_batch_size sets k by the number of running sequences.

Every row samples from the sequence's own distribution at its position (logit edits, temperature,
min-p, top-k, top-p; a seeded request its noise for that output position). For a draft that is a
single token, "sample, accept if equal" is rejection sampling: a draft is accepted with its target
probability, and on a rejection the token is a sample of the target without the draft. So the outputs
are distributed as without drafts, and with a seed they are the same tokens.

Sequences whose sampling reads their earlier output tokens (penalties, a grammar, multi-token bad
words, a thinking budget) get no drafts: they decode a token a step beside the others.

A step that carries drafts runs as a decode step of a row a token (step_inputs.token_rows), in the
decode graphs. Drafts still cost where they are not accepted: the step computes their rows, it is read
before the next step is scheduled (the next step's tokens depend on how many were accepted), and the
step that proposes them reads the step in flight first (the drafts follow each sequence's last token).
So the engine drafts only while drafts pay: while the tokens they added per sequence, on average over
the recent steps that drafted, are at least MIN_GAIN, and otherwise in one step of PROBE_STEPS, to
notice text that starts repeating. The other steps overlap the host's work with the GPU's under async
scheduling, as without speculation (vLLM turns async scheduling off for n-gram drafts instead).
"""
from array import array
from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence
from nanovllm.utils.validation import check_known_keys

SPECULATIVE_CONFIG_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                             "num_speculative_tokens_per_batch_size", "draft_tensor_parallel_size")
METHODS = ("ngram", "draft_model")
# Drafting pays when drafts add about this many tokens per sequence to a step: a step with drafts took ~40%
# longer than one without at 256 sequences on an H100 (docs/perf_notes.md rows 133-135).
MIN_GAIN = 0.5
# Of each drafting step in the running average: from 1 it takes ~11 steps whose drafts add nothing to fall
# below MIN_GAIN, and ~30 from a gain of ~3 tokens a step (one sequence's repeating text), where 1/4 took 7
# and lost drafts a repetition later would have accepted (docs/perf_notes.md row 136).
GAIN_WEIGHT = 1 / 16
PROBE_STEPS = 32     # below MIN_GAIN, one step in this many still drafts


@dataclass
class SpeculativeConfig:
    """vLLM's SpeculativeConfig for its "ngram" method (`method="ngram"`, or `model="[ngram]"`) and its
    "draft_model" method (`model=<directory or hub id>`)."""
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # (range_start, range_end, k) entries, inclusive ranges of a step's sequences starting at 1: the drafts a
    # sequence proposes at that batch size (num_drafts_for), at most num_speculative_tokens
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    draft_tensor_parallel_size: int | None = None   # the draft model's: 1 (or None), on the first rank
    # the draft model's files, config and fp8 layout if any (draft_model; set by Config)
    draft_path: str | None = field(default=None, init=False, repr=False)
    draft_hf_config: object = field(default=None, init=False, repr=False)
    draft_fp8_checkpoint: object = field(default=None, init=False, repr=False)

    @classmethod
    def from_engine_args(cls, value, spec_method: str | None = None, spec_model: str | None = None,
                         spec_tokens: int | None = None) -> "SpeculativeConfig | None":
        """LLM(speculative_config=..., spec_method=..., ...): None, a dict of the fields (keys with "-"
        or "_"), or a SpeculativeConfig; vLLM's flags --spec-method, --spec-model and --spec-tokens add
        their field to it."""
        if isinstance(value, cls):
            value = {name: getattr(value, name) for name in SPECULATIVE_CONFIG_FIELDS}
        elif value is not None and not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of its fields, got {value!r:.80}.")
        value = None if value is None else {key.replace("-", "_"): v for key, v in value.items()}
        for flag, key, given in (("--spec-method", "method", spec_method), ("--spec-model", "model", spec_model),
                                 ("--spec-tokens", "num_speculative_tokens", spec_tokens)):
            if given is None:
                continue
            value = {} if value is None else value
            if key in value:
                raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
            value[key] = given
        if value is None:
            return None
        check_known_keys("speculative_config", value, SPECULATIVE_CONFIG_FIELDS)
        return cls(**value)

    def __post_init__(self):
        if self.method is None and self.model in ("ngram", "[ngram]"):
            self.method = "ngram"
        elif self.method is None and self.model is not None:   # (vLLM's reading of a model it has no method for)
            self.method = "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} (model={self.model!r}) is not supported: "
                             f"nanovllm speculates by n-gram prompt lookup (method='ngram') or with a draft model "
                             f"(method='draft_model').")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}.")
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = batch_size_schedule(self.num_speculative_tokens_per_batch_size)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config method='draft_model' needs model (the draft model's directory "
                                 f"or hub id), got {self.model!r}.")
            if self.draft_tensor_parallel_size not in (None, 1):
                raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 (the draft model runs on "
                                 f"the first rank's GPU), got {self.draft_tensor_parallel_size!r}.")
            return
        self.model = "ngram"
        # vLLM's defaults: 5 and 5, or the one given for both
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {n!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def num_drafts_for(self, batch_size: int) -> int:
        """The drafts a sequence proposes in a step of batch_size sequences: num_speculative_tokens, or with
        num_speculative_tokens_per_batch_size the k of the range that holds batch_size (in a gap between
        ranges or past the last, the k of the range before), at most num_speculative_tokens."""
        k = self.num_speculative_tokens
        for start, _, tokens in self.num_speculative_tokens_per_batch_size or ():
            if start > batch_size:
                break
            k = min(tokens, self.num_speculative_tokens)
        return k


def batch_size_schedule(entries) -> list[tuple[int, int, int]]:
    """num_speculative_tokens_per_batch_size checked as vLLM checks it (its messages), sorted by range."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of "
                         "(range_start, range_end, num_speculative_tokens) entries.")
    schedule = []
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
                isinstance(value, int) and not isinstance(value, bool) for value in entry):
            raise ValueError("Each num_speculative_tokens_per_batch_size entry must be a 3-item sequence of "
                             f"integers: (range_start, range_end, num_speculative_tokens), got {entry!r:.80}.")
        start, end, tokens = entry
        if start <= 0 or end <= 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size: Batch-size range ({start}, {end}) must be "
                             f"positive.")
        if start > end:
            raise ValueError(f"num_speculative_tokens_per_batch_size: Batch-size range start must be <= end for "
                             f"({start}, {end}, {tokens}).")
        if tokens < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size values must be >= 0, got {tokens} "
                             f"for ({start}, {end}).")
        schedule.append((start, end, tokens))
    schedule.sort()
    if any(start <= end for (_, end, _), (start, _, _) in zip(schedule, schedule[1:])):
        raise ValueError(f"num_speculative_tokens_per_batch_size: Batch-size ranges must be non-overlapping and "
                         f"sorted, got {schedule}.")
    if schedule[0][0] != 1:
        raise ValueError("num_speculative_tokens_per_batch_size: The first batch-size range must start at 1 so "
                         f"every runtime batch size has a defined schedule, got {schedule}.")
    return schedule


def ngram_drafts(token_ids: list[int] | array, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens that follow the earliest earlier occurrence of the longest n-gram
    (min_n <= n <= max_n) that ends token_ids; [] when none occurs. (vLLM's ngram proposer.)
    The search runs over the ids as 4-byte words (an array("i") is taken as it is), by bytes.find,
    a word boundary at a time."""
    ids = token_ids if isinstance(token_ids, array) else array("i", token_ids)
    words = ids.tobytes()
    end = 4 * (len(ids) - 1)   # an occurrence ends before the last token: not the suffix itself

    def earliest(n: int) -> int:   # the first token of the last n tokens' earliest earlier occurrence, or -1
        suffix = words[-4 * n:]
        start = words.find(suffix, 0, end)
        while start != -1 and start % 4:   # (a match across token boundaries: look further)
            start = words.find(suffix, start + 1, end)
        return start // 4 if start != -1 else -1

    # The shortest first: where it does not occur (most steps), no longer one does.
    if len(ids) <= min_n or (start := earliest(min_n)) == -1:
        return []
    n = min_n
    for longer in range(min(max_n, len(ids) - 1), min_n, -1):
        if (found := earliest(longer)) != -1:
            start, n = found, longer
            break
    return ids[start + n:start + n + k].tolist()


def can_draft(seq: Sequence) -> bool:
    """seq's sampling needs nothing of its earlier output tokens but their number (which a draft row
    adds its offset to): no penalties, grammar, multi-token bad words or thinking budget; and its prompt's
    ids are known (a prompt given as vectors, prompt_embeds, has placeholders, which no method drafts from)."""
    return not (seq.needs_output_ids_on_host or seq.sampling_params.has_penalties or seq.prompt_embeds is not None)


class Proposer:
    """What the methods share: whether a step drafts (while drafts pay, and as a probe), and how many drafts each
    sequence may take."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.gain = 1.0              # running average of the tokens drafts added per sequence in a drafting step
        self.steps_since_drafting = 0

    def should_draft(self, batch_size: int) -> bool:
        """Whether the next step, of about batch_size sequences, drafts: where that size has drafts, while
        they pay or as a probe."""
        if not self.config.num_drafts_for(batch_size):
            return False
        return self.gain >= MIN_GAIN or self.steps_since_drafting + 1 >= PROBE_STEPS

    def record(self, num_seqs: int, num_accepted_tokens: int):
        """A drafting step's outcome: num_accepted_tokens drafts kept over its num_seqs sampling sequences."""
        self.gain += GAIN_WEIGHT * (num_accepted_tokens / max(num_seqs, 1) - self.gain)

    def propose(self, seqs: list[Sequence], drafting: bool = True):
        """Set spec_token_ids of each of seqs (the running sequences): none unless drafting; else drafts for
        one that decodes next and may speculate, at most room_for(seq, the batch size's k) (num_drafts_for)."""
        if not drafting:
            self.steps_since_drafting += 1
            for seq in seqs:
                if seq.spec_token_ids:
                    seq.spec_token_ids = []
            return
        self.steps_since_drafting = 0
        k = self.config.num_drafts_for(len(seqs))
        for seq in seqs:
            room = self.room_for(seq, k)
            seq.spec_token_ids = self.drafts(seq, room) if room > 0 else []
        self.proposed(seqs)

    def room_for(self, seq: Sequence, k: int) -> int:
        """The drafts seq may take: none unless it decodes next and may speculate; else k, or fewer where its
        max_tokens or max_model_len leave less room after the step's own token."""
        if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_pending_tokens or not can_draft(seq):
            return 0
        room = min(k, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        raise NotImplementedError

    def proposed(self, seqs: list[Sequence]):
        """After a drafting step's proposals (seqs: the running sequences)."""


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        # seq_id -> (its token ids as an array("i"), each id's first position), extended by the tokens
        # each step adds: made once a sequence. Most steps' last token occurs nowhere before (so no n-gram
        # ending with it does), which the positions tell without searching.
        self.known: dict[int, tuple[array, dict[int, int]]] = {}

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        # (a sequence's tokens only grow between its steps: the known ones are kept)
        ids, first = self.known.get(seq.seq_id) or (array("i"), {})
        self.known[seq.seq_id] = ids, first
        for position in range(len(ids), seq.num_tokens):
            first.setdefault(seq.token_ids[position], position)
        ids.extend(seq.token_ids[len(ids):])
        return ngram_drafts(ids, self.min_n, self.max_n, room) if first[ids[-1]] < len(ids) - 1 else []

    def proposed(self, seqs: list[Sequence]):
        running = {seq.seq_id for seq in seqs}   # (those of sequences that finished, or were aborted, dropped)
        self.known = {seq_id: entry for seq_id, entry in self.known.items() if seq_id in running}


# What a draft model's drafts are until it makes them (engine/draft_model.py), once the step is scheduled
DRAFT_PLACEHOLDER = 0


class DraftModelProposer(Proposer):
    """Asks for a draft model's drafts: each sequence that may speculate takes room_for placeholders, of which the
    scheduler keeps what fits the step; the model runner's draft model makes them (engine/draft_model.py)."""

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * room


class DraftRow:
    """The sampler's row for draft position `offset` of seq: seq's sampling state, `offset` output
    tokens further on (its seed's noise, min_tokens)."""

    def __init__(self, seq: Sequence, offset: int):
        self.seq, self.offset = seq, offset

    def __getattr__(self, name):
        return getattr(self.seq, name)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.offset


def sampling_rows(seqs: list[Sequence]) -> list[Sequence | DraftRow]:
    """The sampler's rows for seqs: each sequence, followed by its draft positions."""
    rows = []
    for seq in seqs:
        rows.append(seq)
        rows += [DraftRow(seq, i) for i in range(1, len(seq.spec_token_ids) + 1)]
    return rows


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step gives a sequence: sampled[0..a], where the first a drafts each equal the
    token sampled at the row before them (sampled has len(drafts) + 1 tokens)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return sampled[:a + 1]
