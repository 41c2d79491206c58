"""Beam search, vLLM's `LLM.beam_search`: built on generate() one token at a time.

Each step asks the engine for one token of every live beam with the top 2 x beam_width logprobs
(prefix caching keeps the beams' shared tokens cached, so a step mostly computes one token per
beam); every beam is extended by each of those tokens, and the beam_width best extensions by
score survive. An extension ending in EOS is finished (unless ignore_eos). After max_tokens
steps the live beams join the finished ones, and the beam_width best of all are returned.
Score: cumulative logprob / length ** length_penalty, the length counting the prompt and not a
final EOS (vLLM's rule).
"""
from dataclasses import dataclass, field

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam: tokens holds the prompt and then the generated tokens; logprobs has one entry
    (the step's top logprobs) per generated token; text is the decoded tokens, prompt included."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None      # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length ** length_penalty


def ranked(beams: list[BeamSearchSequence], params: BeamSearchParams,
           eos_token_ids: set[int]) -> list[BeamSearchSequence]:
    """The beam_width best of beams by score, best first."""
    by_score = sorted(beams, key=lambda b: beam_score(b, eos_token_ids, params.length_penalty), reverse=True)
    return by_score[:params.beam_width]


def extend(beams: list[BeamSearchSequence], step_logprobs: list[dict[int, Logprob]], params: BeamSearchParams,
           eos_token_ids: set[int]) -> tuple[list[BeamSearchSequence], list[BeamSearchSequence]]:
    """One step for one prompt: each beam extended by each token of its step's logprobs.
    -> (the beam_width best live extensions, the extensions that ended with EOS)."""
    live, finished = [], []
    for beam, top in zip(beams, step_logprobs):
        for token_id, logprob in top.items():
            child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [top],
                                       beam.cum_logprob + logprob.logprob)
            if token_id in eos_token_ids and not params.ignore_eos:
                child.finish_reason, child.stop_reason = "stop", token_id
                finished.append(child)
            else:
                live.append(child)
    return ranked(live, params, eos_token_ids), finished
