"""Custom logits processors, as vLLM's (`vllm.v1.sample.logits_processor`):
`LLM(model, logits_processors=[MyProcessor])` (classes, or their names as "package.module.Class" or
"package.module:Class") makes one of each at start-up, with (config, device, is_pin_memory); before each step
that samples, `update_state` hears how the batch of sampling requests changed (a `BatchUpdate`, or None for no
change), and `apply` gets that batch's logits, [batch_size, vocab] float32, one row per request at the index the
updates gave it, and returns them (changed in place or new). A request's per-request options reach a processor
through its `SamplingParams.extra_args`; `validate_params` may refuse them (a ValueError when the request is
added).

As in vLLM, those that may change the argmax (is_argmax_invariant() False) get the raw logits after
`allowed_token_ids`, `logit_bias`, bad words and `min_tokens`, before the penalties; argmax-invariant ones get
them after the penalties, divided by each row's temperature (1 for a greedy row; none run in a batch of greedy
rows only), before the filters. The engine's argument is nanovllm's `Config` (`LLM()`'s arguments as fields:
`max_num_seqs`, ...), where vLLM passes its `VllmConfig`. Not with speculative decoding or a pooling model (vLLM
refuses both too).

`AdapterLogitsProcessor` runs a per-request function (vLLM V0's form: `f(output_ids, logits_row)` or
`f(prompt_ids, output_ids, logits_row)`) for each request its `new_req_logits_processor(params)` gives one.
"""
import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from nanovllm.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()   # the request at the first index moves to the second, which was free
    SWAP = enum.auto()             # the two requests trade indices


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step, to be taken in this order: removed (indices now empty), added
    ((index, params, prompt token ids, output token ids) each: the output ids a live view that grows with the
    request's tokens; an added request may take a removed one's index, which then is not listed as removed), moved
    ((from, to, MoveDirectionality) each, closing the holes the removed ones left)."""
    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, SamplingParams, Sequence[int] | None, Sequence[int]]]
    moved: Sequence[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(ABC):
    """vLLM's interface: subclass it and pass the class to LLM(logits_processors=[...])."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        """ValueError for a request whose options this processor cannot take (called as it is added)."""

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, vocab], changed (in place or not)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """Whether it never changes a row's argmax (greedy tokens)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None):
        """Called before each sampling step: the batch's changes, or None if it is as in the step before."""
        raise NotImplementedError


def apply_dict_updates(entries: dict, batch_update: BatchUpdate | None, new_entry: Callable) -> dict:
    """entries (request index -> a processor's state) moved through batch_update: new_entry(params, prompt ids,
    output ids) for each added request (None: no entry), the removed ones dropped, the moved ones moved."""
    if batch_update is None:
        return entries
    for index in batch_update.removed:
        entries.pop(index, None)
    for index, params, prompt_ids, output_ids in batch_update.added:
        entry = new_entry(params, prompt_ids, output_ids)
        if entry is None:
            entries.pop(index, None)
        else:
            entries[index] = entry
    for a, b, direction in batch_update.moved:
        a_entry, b_entry = entries.pop(a, None), entries.pop(b, None)
        if a_entry is not None:
            entries[b] = a_entry
        if b_entry is not None and direction == MoveDirectionality.SWAP:
            entries[a] = b_entry
    return entries


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor made of per-request functions: subclass it, define is_argmax_invariant and
    new_req_logits_processor(params) -> f(output_ids, logits_row) or f(prompt_ids, output_ids, logits_row)
    returning the row (or None: nothing for this request)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> Callable | None:
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: Sequence[int] | None,
                   output_ids: Sequence[int]) -> Callable | None:
        function = self.new_req_logits_processor(params)
        if function is None:
            return None
        takes_prompt = len(inspect.signature(function).parameters) == 3
        return partial(function, prompt_ids, output_ids) if takes_prompt else partial(function, output_ids)

    def update_state(self, batch_update: BatchUpdate | None):
        apply_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, function in self.req_info.items():
            row = logits[index]
            new = function(row)
            if new is not row:
                logits[index] = new
        return logits


def resolve_processor(entry, where: str) -> type:
    """A logits_processors entry (a class, or its name "package.module.Class" / "package.module:Class") -> the
    class; ValueError naming the entry for anything else."""
    if isinstance(entry, str):
        module_name, _, name = entry.rpartition(":") if ":" in entry else entry.rpartition(".")
        try:
            entry = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{where}: cannot import {entry!r} ({e}).") from None
    if not (inspect.isclass(entry) and all(callable(getattr(entry, m, None))
                                           for m in ("apply", "update_state", "is_argmax_invariant"))):
        raise ValueError(f"{where} must be a LogitsProcessor class (nanovllm.logits_processor) or its name, "
                         f"got {entry!r:.80}.")
    return entry
