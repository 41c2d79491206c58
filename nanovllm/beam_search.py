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

from tqdm.auto import tqdm

from nanovllm.logprobs import Logprob
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


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


def search(generate, prompts: list, params: BeamSearchParams, eos_token_ids: set[int], max_model_len: int,
           tokenizer, use_tqdm: bool) -> list[BeamSearchOutput]:
    """Beam search over these prompts (inputs.Prompt, validated), all at once; generate is
    LLM.generate. -> one BeamSearchOutput per prompt, in order."""
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)
    live = [[BeamSearchSequence(prompt.token_ids)] for prompt in prompts]
    salts = [{"cache_salt": p.cache_salt} if p.cache_salt is not None else {} for p in prompts]
    finished = [[] for _ in prompts]
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        for i, prompt_beams in enumerate(live):   # beams at max_model_len end here
            finished[i] += [b for b in prompt_beams if len(b.tokens) >= max_model_len]
            live[i] = [b for b in prompt_beams if len(b.tokens) < max_model_len]
        beams = [{"prompt_token_ids": b.tokens, **salts[i]} for i, prompt_beams in enumerate(live)
                 for b in prompt_beams]
        if not beams:
            break
        outputs = iter(generate(beams, step, use_tqdm=False))
        for i, prompt_beams in enumerate(live):
            tops = [next(outputs).outputs[0].logprobs[0] for _ in prompt_beams]
            live[i], done = extend(prompt_beams, tops, params, eos_token_ids)
            finished[i] += done
    results = []
    for prompt_live, prompt_finished in zip(live, finished):
        top = ranked(prompt_finished + prompt_live, params, eos_token_ids)
        for beam in top:   # the ones that did not end with EOS ran out of tokens
            beam.finish_reason = beam.finish_reason or "length"
            beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)
        results.append(BeamSearchOutput(top))
    return results
