"""LLM.beam_search against the same search run on HF transformers' float32 logprobs, the
extension/scoring rule on hand-made logprobs, and bad parameters."""
import pytest
import torch

from conftest import hf_model, make_prompts
from nanovllm import LLM, BeamSearchParams, Logprob, SamplingParams
from nanovllm.beam_search import BeamSearchSequence, extend


@torch.no_grad()
def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float):
    """The search written out on HF's full forward passes (EOS ignored): -> [(tokens, cum_logprob)]."""
    score = lambda beam: beam[1] / len(beam[0]) ** length_penalty
    beams = [(prompt, 0.0)]
    for _ in range(max_tokens):
        children = []
        for tokens, cum in beams:
            logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            values, ids = logprobs.topk(2 * width)
            children += [(tokens + [t], cum + v) for t, v in zip(ids.tolist(), values.tolist())]
        beams = sorted(children, key=score, reverse=True)[:width]
    return beams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, max_model_len=256, block_size=16) as llm:
        yield llm


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_equal_the_search_on_hf_logprobs(llm, qwen3_dir, width, length_penalty):
    prompts = make_prompts()[2:5]
    params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    model = hf_model(qwen3_dir)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        ref = reference_beam_search(model, prompt, width, 5, length_penalty)
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in ref]
        for beam, (_, cum) in zip(output.sequences, ref):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(beam.logprobs) == 5 and beam.finish_reason == "length"
            assert beam.text == tokenizer.decode(beam.tokens)


def test_concurrency_limit_runs_prompts_in_groups_with_the_same_beams(llm):
    """vLLM's concurrency_limit: at most that many prompts' beams at a time; the beams found are
    those of the search over all prompts at once, in input order."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:5]]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    seen = []
    real_generate = llm.generate
    llm.generate = lambda beams, *args, **kwargs: seen.append(len(beams)) or real_generate(beams, *args, **kwargs)
    try:
        grouped = llm.beam_search(prompts, params, concurrency_limit=2)
    finally:
        del llm.generate
    assert [[b.tokens for b in o.sequences] for o in grouped] == [[b.tokens for b in o.sequences] for o in together]
    assert max(seen) <= 2 * params.beam_width and len(seen) == 3 * params.max_tokens   # groups of 2, 2, 1


def test_greedy_is_beam_width_one(llm):
    prompt = make_prompts()[3]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    assert beam.sequences[0].tokens == prompt + greedy


def lp(value: float) -> Logprob:
    return Logprob(value, rank=0)


def test_extend_keeps_the_best_and_finishes_eos():
    eos = {9}
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    beams = [BeamSearchSequence([1, 2], cum_logprob=-1.0), BeamSearchSequence([1, 3], cum_logprob=-2.0)]
    tops = [{4: lp(-0.1), 9: lp(-0.2), 5: lp(-3.0)}, {6: lp(-0.5), 7: lp(-0.1)}]
    live, done = extend(beams, tops, params, eos)
    # scores: cum / len (len 3): [1,2,4] -1.1, [1,3,7] -2.1, [1,3,6] -2.5, [1,2,5] -4.0
    assert [(b.tokens, round(b.cum_logprob, 6)) for b in live] == [([1, 2, 4], -1.1), ([1, 3, 7], -2.1)]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in done] == [([1, 2, 9], "stop", 9)]
    assert live[0].logprobs == [tops[0]]
    # ignore_eos: EOS is one more token, and a final EOS does not count in the length
    # ([1,2,9]: -1.2 / 2 = -0.6 beats [1,3,7]: -2.1 / 3 = -0.7)
    live, done = extend(beams, tops, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), eos)
    assert done == [] and [b.tokens for b in live] == [[1, 2, 4], [1, 2, 9]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer of at least 1, got 0"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer of at least 1, got 0"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be non-negative, got -1.0"),
    (dict(beam_width=2, max_tokens=4, temperature=float("nan")), "temperature must be non-negative, got nan"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number, got nan"),
    (dict(beam_width=2, max_tokens=4, structured_outputs={"json": {}}),
     "structured_outputs is not supported in beam search"),
])
def test_bad_beam_search_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_bad_beam_search_calls_leave_engine_usable(llm):
    with pytest.raises(ValueError, match=r"beam_width must be at most max_logprobs / 2 = 10 .* got 11"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 1 \(length 297\) is longer than the maximum model length of 256"):
        llm.beam_search([[5, 6], list(range(3, 300))], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([[5, 6]], {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit must be a positive int or None, got 0"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None, got 'adapter'"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2), lora_request="adapter")
    out = llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    assert len(out) == 1 and len(out[0].sequences) == 2
    # beams stop at max_model_len (256): a 253-token prompt gets 3 of its 8 tokens
    out = llm.beam_search([list(range(3, 256))], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert [len(beam.tokens) for beam in out[0].sequences] == [256, 256]
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
