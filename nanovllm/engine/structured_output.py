"""Structured outputs (vLLM's SamplingParams.structured_outputs): a completion held to a JSON
schema, a regex, one of several strings or an EBNF grammar, by xgrammar, as vLLM does it
(an optional dependency: `pip install "nanovllm[structured]"`).

Each such sequence gets a grammar matcher, which takes each token as the output processor appends
it; a token it refuses (drawn where other options left the grammar nothing to allow) ends the
completion with finish_reason "error", as in vLLM. Before a step samples, the batch's matchers fill
a bitmask of the tokens that may come next (bit j of word w: token 32 w + j), all rows at once on
several threads (on every core when a fill is slow). The sampler sets every other logit to -inf
before it takes logprobs, as vLLM's model runner does before its sampler. Once the grammar is
complete, only a stop token may follow, so the completion ends there (with ignore_eos, the tokens
after it are free). When a reasoning parser is named
(LLM(reasoning_parser="qwen3")), the grammar starts only after the model's thinking block has
ended, as in vLLM; structured_outputs_config={"enable_in_reasoning": True} starts it at once.
"""
import functools
import json
import os
import re
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from nanovllm.engine.reasoning import MarkerScan, ThinkingMarkers
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.utils.validation import check_known_keys


@dataclass
class StructuredOutputsConfig:
    """vLLM's StructuredOutputsConfig (LLM(structured_outputs_config=...), or a dict of its fields)."""
    backend: str = "auto"                     # "auto" or "xgrammar": xgrammar either way
    disable_fallback: bool = False            # (no other backend to fall back to)
    disable_any_whitespace: bool = False      # JSON without optional whitespace
    disable_additional_properties: bool = False   # (as vLLM's xgrammar backend: not used)
    reasoning_parser: str = ""                # the grammar waits for the end of thinking; LLM's own if empty
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False         # the grammar holds from the first token, thinking or not

    @classmethod
    def parse(cls, value) -> "StructuredOutputsConfig":
        """None, a dict of the fields, or a StructuredOutputsConfig (ours or vLLM's)."""
        names = [f.name for f in fields(cls)]
        if value is None:
            value = {}
        elif not isinstance(value, dict):
            value = {name: getattr(value, name) for name in names if hasattr(value, name)}
        check_known_keys("structured_outputs_config", value, names)
        config = cls(**value)
        if config.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config backend must be 'auto' or 'xgrammar' (nanovllm uses "
                             f"xgrammar), got {config.backend!r}.")
        if config.reasoning_parser_plugin:
            raise ValueError("structured_outputs_config reasoning_parser_plugin is not supported; name one of the "
                             "built-in reasoning parsers.")
        return config


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError('structured_outputs needs xgrammar: pip install "nanovllm[structured]" '
                         '(or pip install xgrammar).') from None
    return xgrammar


def choice_as_grammar(choice: list[str]) -> str:
    """The strings of a choice as an EBNF grammar of alternatives (vLLM's choice_as_grammar)."""
    return "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", c) + '"' for c in choice)


class GrammarCompiler:
    """One engine's compiler, made at the first structured request (xgrammar reads the whole
    vocabulary once); compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer, vocab_size: int, config: StructuredOutputsConfig):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    @functools.cached_property
    def _compiler(self):
        xgr = import_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams):
        """-> xgrammar's CompiledGrammar; ValueError naming the constraint if it does not compile."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, but the engine has none "
                             "(skip_tokenizer_init=True).")
        kind, spec = params.constraint
        compiler = self._compiler
        any_whitespace = not (self.config.disable_any_whitespace or params.disable_any_whitespace)
        try:
            if kind in ("json", "json_object"):
                schema = spec if kind == "json" else {"type": "object"}
                return compiler.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                    any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_as_grammar(spec))
            return compiler.compile_grammar(spec)
        except Exception as e:   # xgrammar's parse errors come as several types
            raise ValueError(f"structured_outputs {kind} does not compile: {str(e).strip()[:300]}") from None

    def state(self, params: StructuredOutputsParams, reasoning: ThinkingMarkers | None) -> "GrammarState":
        """A sequence's matcher. reasoning: the markers the grammar waits for the end of (None:
        it holds from the first output token)."""
        return GrammarState(import_xgrammar().GrammarMatcher(self.compile(params)), reasoning)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, reasoning: ThinkingMarkers | None):
        self.matcher = matcher
        self.reasoning = None if reasoning is None else MarkerScan(reasoning)
        self.num_fed: int | None = None   # token_ids[:num_fed] are behind the matcher; None: not started
        self.broken = False               # the grammar refused a sampled token (its request ends)

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Feed the matcher the tokens since the last call -> whether the grammar constrains the
        next token (False while thinking, once complete, or once broken). Tokens after the grammar's
        end (EOS with ignore_eos) are free: they are not fed to the matcher. A refused token (one
        the sampler had to draw from a row that other constraints left empty) sets broken."""
        if self.broken or self.matcher.is_terminated():
            return False
        if self.num_fed is None:
            if self.reasoning is not None:
                self.reasoning.scan(token_ids)
                if not self.reasoning.block_ended:
                    return False
                self.num_fed = max(num_prompt_tokens, self.reasoning.closed_at)
            else:
                self.num_fed = num_prompt_tokens
        for token in token_ids[self.num_fed:]:
            if not self.matcher.accept_token(token):
                self.broken = True
                return False
        self.num_fed = len(token_ids)
        return not self.matcher.is_terminated()


class BitmaskFiller:
    """Fills many rows' bitmasks at once, with xgrammar's batch matcher: on half the cores
    (xgrammar's default) while a fill is short enough to hide under the step's forward pass on the
    GPU, and on every core after a fill that took longer than SLOW_FILL_S. Each thread count loses
    where the other wins (default workload held to a grammar, H200 machine of 16 cores): every core
    makes a JSON string's run (a fill of microseconds a row) 0.2-0.6 s slower, and a regex's (~1 ms
    a row, as xgrammar has no cached masks for it) 4-8 s faster (docs/perf_notes.md row 73)."""
    SLOW_FILL_S = 0.005

    def __init__(self):
        self.last_fill_s = 0.0

    @functools.cached_property
    def by_cores(self) -> dict:
        """every core? -> xgrammar's batch matcher (made at the first fill: xgrammar is optional)"""
        xgr = import_xgrammar()
        return {False: xgr.BatchGrammarMatcher(), True: xgr.BatchGrammarMatcher(os.cpu_count() or 1)}

    def fill(self, matchers: list, bitmask: torch.Tensor):
        start = time.perf_counter()
        self.by_cores[self.last_fill_s > self.SLOW_FILL_S].batch_fill_next_token_bitmask(matchers, bitmask)
        self.last_fill_s = time.perf_counter() - start


def grammar_bitmask(seqs: list, vocab_size: int, filler: BitmaskFiller | None,
                    pin_memory: bool = False) -> tuple[np.ndarray, torch.Tensor] | None:
    """For the sequences whose grammar (seq.grammar) constrains their next token -> (their rows,
    their bitmasks [rows, ceil(vocab_size / 32)] int32, in pinned memory if pin_memory), None if
    there are none. (xgrammar writes whole rows: the tensor needs no initial value.)"""
    rows = [i for i, seq in enumerate(seqs)
            if seq.grammar is not None and seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), -(-vocab_size // 32), dtype=torch.int32, pin_memory=pin_memory)
    assert filler is not None, "sequences held to grammars, but no bitmask filler"
    filler.fill([seqs[i].grammar.matcher for i in rows], bitmask)
    return np.asarray(rows, np.int64), bitmask
