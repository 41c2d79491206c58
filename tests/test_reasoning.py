"""The thinking budget: reasoning_parser / reasoning_config and SamplingParams.thinking_token_budget."""
import re
from types import SimpleNamespace

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import ReasoningConfig
from nanovllm.engine.reasoning import ThinkingBudget, ThinkingMarkers, reasoning_markers

START, END = [7, 8], [5, 6, 9]   # marker token ids for the unit tests (any ids)


def forced(tokens: list[int], budget: int, markers=ThinkingMarkers(START, END)) -> int | None:
    return ThinkingBudget(markers, budget).forced_token(tokens)


# ---- the budget on token ids ------------------------------------------------------------
def test_no_block_forces_nothing():
    assert forced([1, 2, 3, 4], 0) is None
    assert forced([1, 7, 2, 8], 0) is None                  # the start marker's tokens apart


def test_block_forces_the_end_marker_once_its_budget_is_spent():
    assert forced([1, 7, 8, 2, 3], 3) is None               # two thinking tokens of three
    assert forced([1, 7, 8, 2, 3, 4], 3) == 5               # three: the end marker's first token
    assert forced([1, 7, 8, 2, 3, 4, 5], 3) == 6            # ... then its next tokens
    assert forced([1, 7, 8, 2, 3, 4, 5, 6], 3) == 9
    assert forced([1, 7, 8, 2, 3, 4, 5, 6, 9], 3) is None   # closed: the model chooses again


def test_budget_zero_closes_a_block_at_once():
    assert forced([1, 7, 8], 0) == 5
    assert forced([7, 8, 5], 0) == 6


def test_a_closed_block_and_a_new_one():
    assert forced([7, 8, 1, 5, 6, 9, 2, 3], 1) is None      # closed by the model itself
    assert forced([7, 8, 1, 5, 6, 9, 2, 7, 8, 3], 1) == 5   # a second block counts from its own start


def test_a_partial_end_marker_is_completed_not_restarted():
    # the model wrote the end marker's first token itself, within budget: the rest is forced
    assert forced([7, 8, 1, 5], 2) == 6
    assert forced([7, 8, 1, 5], 3) is None


def test_tokens_are_scanned_once_as_they_grow():
    budget = ThinkingBudget(ThinkingMarkers(START, END), 2)
    tokens = [1, 7]
    assert budget.forced_token(tokens) is None
    tokens += [8, 2]                                        # the start marker across two calls
    assert budget.forced_token(tokens) is None
    tokens += [3]
    assert budget.forced_token(tokens) == 5
    assert budget.scan.num_scanned == len(tokens)


# ---- configuration -----------------------------------------------------------------------
def markers(parser: str, config) -> tuple[str, str] | None:
    return reasoning_markers(parser, ReasoningConfig.parse(config))


def test_markers_from_a_parser_name_or_strings():
    assert markers("", None) is None
    assert markers("qwen3", None) == ("<think>", "</think>")
    assert markers("", {"reasoning_parser": "deepseek_r1"}) == ("<think>", "</think>")
    assert markers("", {"reasoning_start_str": "<a>", "reasoning_end_str": "</a>"}) == ("<a>", "</a>")
    vllm_like = SimpleNamespace(reasoning_parser="", reasoning_start_str="[T]", reasoning_end_str="[/T]")
    assert markers("", vllm_like) == ("[T]", "[/T]")
    assert markers("", ReasoningConfig(reasoning_parser="qwen3")) == ("<think>", "</think>")
    assert markers("qwen3", {"reasoning_end_str": "</b>"}) == ("<think>", "</b>")
    assert markers("", {"reasoning_parser": "qwen3", "reasoning_start_str": "<a>"}) == ("<a>", "</think>")


@pytest.mark.parametrize("parser, config, message", [
    ("gptoss", None, "reasoning_parser 'gptoss' is not supported; supported: qwen3, deepseek_r1"),
    ("", {"reasoning_start_str": "<a>"}, "needs both reasoning_start_str and reasoning_end_str as non-empty "
                                         "strings, got reasoning_end_str=''."),
    ("", {"start": "<a>"}, "reasoning_config has unknown key(s) ['start']"),
])
def test_bad_markers_are_value_errors(parser, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        markers(parser, config)


@pytest.mark.parametrize("budget, message", [
    (1.5, "thinking_token_budget must be int or None, got 1.5."),
    (True, "thinking_token_budget must be int or None, got True."),
])
def test_bad_budgets_are_value_errors(budget, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(thinking_token_budget=budget)


def test_budget_of_minus_one_is_no_budget():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0


# ---- end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_dir, request):
    # the test tokenizer spells "<think>" and "</think>" in several tokens each
    return LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, reasoning_parser="qwen3",
               async_scheduling=request.param)


def greedy(llm, prompt_ids: list[int], max_tokens: int, budget: int | None = None) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, thinking_token_budget=budget)
    return llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_budget_closes_a_block_the_prompt_opened(llm):
    tok = llm.get_tokenizer()
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    prompt = tok.encode("The quick brown fox") + start
    free = greedy(llm, prompt, 12)
    assert not set(end) & set(free[:3])      # the model alone would not close it early (random weights)
    out = greedy(llm, prompt, 12, budget=3)
    assert out[:3] == free[:3]
    assert out[3:3 + len(end)] == end
    # after the block the model chooses again: what it says given everything before
    k = 3 + len(end)
    assert out[k:] == greedy(llm, prompt + out[:k], 12 - k)


def test_budget_counts_thinking_tokens_in_the_prompt(llm):
    tok = llm.get_tokenizer()
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    prompt = start + tok.encode(" Paged attention")
    thought = len(prompt) - len(start)
    assert greedy(llm, prompt, len(end), budget=thought)[:len(end)] == end
    assert greedy(llm, prompt, len(end), budget=0) == end
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=len(end), thinking_token_budget=0)
    assert llm.generate([{"prompt_token_ids": prompt}], sampled, use_tqdm=False)[0].outputs[0].token_ids == end


def test_budget_without_a_block_changes_nothing(llm):
    prompt = llm.get_tokenizer().encode("Hello world! Stop strings")
    assert greedy(llm, prompt, 10, budget=0) == greedy(llm, prompt, 10)


def test_budget_beside_other_requests(llm):
    tok = llm.get_tokenizer()
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    thinking = tok.encode("A scheduler") + start
    plain = tok.encode("Numbers 0 1 2")
    sps = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, thinking_token_budget=2),
           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": thinking}, {"prompt_token_ids": plain}], sps, use_tqdm=False)
    assert outs[0].outputs[0].token_ids[2:2 + len(end)] == end
    assert outs[1].outputs[0].token_ids == greedy(llm, plain, 10)


def test_budget_needs_reasoning_markers(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64)
    with pytest.raises(ValueError, match="thinking_token_budget is set but reasoning_config is not configured"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4, thinking_token_budget=8), use_tqdm=False)
    assert len(llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="reasoning_parser 'nope' is not supported"):
        LLM(qwen3_dir, dtype="float32", reasoning_parser="nope")


def test_each_of_n_completions_has_its_own_budget(llm):
    tok = llm.get_tokenizer()
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=2 + len(end), thinking_token_budget=2)
    out = llm.generate([{"prompt_token_ids": tok.encode("Hello world!") + start}], sp, use_tqdm=False)[0]
    assert [c.token_ids[2:] for c in out.outputs] == [end] * 3
    assert len({tuple(c.token_ids[:2]) for c in out.outputs}) > 1   # the thoughts themselves differ
