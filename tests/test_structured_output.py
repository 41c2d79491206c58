"""Structured outputs: SamplingParams.structured_outputs held by xgrammar (engine/structured_output.py)."""
import json
import re
import time

import pytest
import torch

from conftest import log_lines, watch_overlap
from nanovllm import LLM, SamplingParams
from nanovllm.engine.structured_output import BitmaskFiller, choice_as_grammar
from nanovllm.layers.logit_edits import apply_token_bitmask
from nanovllm.sampling_params import StructuredOutputsParams

PROMPTS = ["Hello world!", "The quick brown fox", "A scheduler batches sequences;", "Numbers 0 1 2 3"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_dir, request):
    return LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=128, async_scheduling=request.param)


def texts(llm, structured: dict, temperature: float = 0.8, n: int = 1, max_tokens: int = 48) -> list:
    sp = SamplingParams(temperature=temperature, n=n, max_tokens=max_tokens, structured_outputs=structured)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [c.text for c in completions]   # grammar complete
    return [c.text for c in completions]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice(llm, temperature):
    choices = ["yes", "no", "maybe so"]
    out = texts(llm, {"choice": choices}, temperature, n=1 if temperature == 0.0 else 2)   # (greedy: n=1 only)
    assert set(out) <= set(choices)
    assert temperature == 0.0 or len(set(out)) > 1   # sampling picks among them


def test_regex(llm):
    for text in texts(llm, {"regex": r"[0-9]{3}-(ab|cd)"}):
        assert re.fullmatch(r"[0-9]{3}-(ab|cd)", text), text


def test_json_schema(llm):
    for text in texts(llm, {"json": SCHEMA, "disable_any_whitespace": True}):
        value = json.loads(text)
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in SCHEMA[
            "properties"]["color"]["enum"], text
    # the schema as text; without optional whitespace (a random model writes much of it)
    assert json.loads(texts(llm, {"json": json.dumps(SCHEMA), "disable_any_whitespace": True})[0])["color"] in (
        "red", "green", "blue")


def test_ebnf_grammar(llm):
    for text in texts(llm, {"grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'}):
        assert re.fullmatch(r"(yes|no), [0-9]{1,2}", text), text


def test_structured_beside_free_requests(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[1:3], free, use_tqdm=False)
    sps = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}), free, free]
    outs = llm.generate(PROMPTS[:3], sps, use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no")
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in alone]


def test_constrained_steps_overlap_and_give_the_sync_tokens(qwen3_dir):
    """With async scheduling a step with grammars launches before the step before is read: the
    engine reads that one while the forward pass runs, then fills the bitmasks (vLLM's order).
    The greedy tokens are those of synchronous scheduling."""
    sps = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": SCHEMA,
                                                                               "disable_any_whitespace": True}),
           SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": r"[0-9]{3}-(ab|cd)"}),
           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    outs = {}
    for async_scheduling in (False, True):
        llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=128, async_scheduling=async_scheduling)
        with watch_overlap(llm) as overlapped:
            outs[async_scheduling] = [o.outputs[0] for o in llm.generate(PROMPTS[:3], sps, use_tqdm=False)]
        assert overlapped.count(False) == (len(overlapped) if not async_scheduling else 1), overlapped
    assert [c.token_ids for c in outs[True]] == [c.token_ids for c in outs[False]]
    assert json.loads(outs[True][0].text)["color"] in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-(ab|cd)", outs[True][1].text)


def test_bad_constraints_are_value_errors_and_add_nothing(llm):
    for structured, message in (({"regex": "(ab"}, "structured_outputs regex does not compile"),
                                ({"json": "{not json"}, "structured_outputs json does not compile"),
                                ({"grammar": "root ::= "}, "structured_outputs grammar does not compile")):
        good = SamplingParams(max_tokens=4)
        bad = SamplingParams(max_tokens=4, structured_outputs=structured)
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("structured, message", [
    ({}, "structured_outputs needs exactly one constraint of json, regex, choice, grammar, json_object, "
         "structural_tag, got 0 (none)."),
    ({"regex": "a", "choice": ["a"]}, "got 2 (regex, choice)."),
    ({"choice": ["a", ""]}, "structured_outputs choice must be a list of non-empty strings, got ['a', '']."),
    ({"structural_tag": "{}"}, "structured_outputs structural_tag is not supported"),
    ({"regexp": "a"}, "structured_outputs takes json, regex, choice"),
])
def test_bad_structured_outputs_params(structured, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=structured)


def test_structured_outputs_params_object_and_choice_grammar():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=['say "hi"', "a\\b"]))
    assert params.structured_outputs.constraint == ("choice", ['say "hi"', "a\\b"])
    assert choice_as_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


@pytest.mark.parametrize("config, message", [
    ({"backend": "guidance"}, "structured_outputs_config backend must be 'auto' or 'xgrammar'"),
    ({"enable_reasoning": True}, "structured_outputs_config has unknown key(s) ['enable_reasoning']"),
])
def test_bad_structured_outputs_config(qwen3_dir, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(qwen3_dir, dtype="float32", structured_outputs_config=config)


def test_token_bitmask_sets_other_logits_to_minus_inf():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101                  # tokens 0 and 2
    bitmask[1, 2] = 1 << 5                 # token 69
    bitmask[1, 1] = -(1 << 31)             # token 63 (the sign bit)
    apply_token_bitmask(logits, torch.tensor([0, 2]), bitmask)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[0, 2], list(range(70)), [63, 69]]


def test_bitmask_filler_takes_every_core_after_a_slow_fill(tokenizer):
    """A fill longer than SLOW_FILL_S sends the next one to the every-core matcher, a short one
    back to xgrammar's default; both fill the same bits."""
    xgr = pytest.importorskip("xgrammar")
    filler = BitmaskFiller()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    grammar = xgr.GrammarCompiler(info).compile_regex("[a-m ]+")
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(3)]
    masks = {}
    for every_core, batch in filler.by_cores.items():
        masks[every_core] = torch.empty(3, -(-len(tokenizer) // 32), dtype=torch.int32)
        batch.batch_fill_next_token_bitmask(matchers, masks[every_core])
    assert torch.equal(masks[False], masks[True]) and (masks[True] != -1).any()

    class Timed:   # stands in for a batch matcher whose fill takes `seconds`
        def __init__(self, every_core: bool, seconds: float):
            self.every_core, self.seconds = every_core, seconds

        def batch_fill_next_token_bitmask(self, matchers, bitmask):
            used.append(self.every_core)
            time.sleep(self.seconds)

    used = []
    filler.SLOW_FILL_S = 0.05
    filler.by_cores = {False: Timed(False, 0.1), True: Timed(True, 0.0)}
    for _ in range(4):
        filler.fill(matchers, masks[True])
    assert used == [False, True, False, True]


# ---- with a reasoning model: the grammar waits for the end of thinking, as in vLLM ---------
@pytest.fixture(scope="module")
def thinking_llm(qwen3_dir):
    return LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=128, reasoning_parser="qwen3",
               async_scheduling=True)


def test_grammar_starts_after_thinking(thinking_llm):
    tok = thinking_llm.get_tokenizer()
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    prompts = [{"prompt_token_ids": tok.encode(p) + start} for p in PROMPTS]
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=40, thinking_token_budget=3,
                        structured_outputs={"choice": ["yes", "no"]})
    for out in thinking_llm.generate(prompts, sp, use_tqdm=False):
        ids = out.outputs[0].token_ids
        assert ids[3:3 + len(end)] == end, ids                            # thought 3 tokens, then closed
        assert tok.decode(ids[3 + len(end):], skip_special_tokens=True) in ("yes", "no")


def test_grammar_waits_while_no_thinking_ended(thinking_llm):
    # no end marker in the prompt or the output: vLLM's reasoning parser says thinking goes on
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    held = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs={"choice": ["yes"]})
    prompt = {"prompt_token_ids": thinking_llm.get_tokenizer().encode(PROMPTS[0])}
    assert (thinking_llm.generate([prompt], held, use_tqdm=False)[0].outputs[0].token_ids
            == thinking_llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].token_ids)


def test_grammar_in_reasoning_holds_from_the_start(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, reasoning_parser="qwen3",
              structured_outputs_config={"enable_in_reasoning": True})
    assert set(texts(llm, {"choice": ["yes", "no"]})) <= {"yes", "no"}


def test_json_object(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64,
              structured_outputs_config={"disable_any_whitespace": True})
    sp = SamplingParams(temperature=0.8, max_tokens=64, structured_outputs={"json_object": True})
    completions = [o.outputs[0] for o in llm.generate(PROMPTS + ["A", "B"], sp, use_tqdm=False)]
    assert all(c.text.startswith("{") for c in completions)
    done = [c.text for c in completions if c.finish_reason == "stop"]   # (a random model writes long keys)
    assert done and all(isinstance(json.loads(text), dict) for text in done), done


def test_tokens_past_a_completed_grammar_are_free(llm):
    """With ignore_eos a completion goes on past the EOS that completes its grammar: the tokens
    after it are not constrained, and not refused by the grammar (vLLM 0.26 ends such a
    completion with finish_reason "error" at the first token after the EOS)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            structured_outputs={"choice": ["yes", "no"]})
    tokenizer = llm.get_tokenizer()
    with log_lines("nanovllm.engine.output_processor") as warnings:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        token_ids = list(output.outputs[0].token_ids)
        assert output.outputs[0].finish_reason == "length" and len(token_ids) == 12
        assert tokenizer.eos_token_id in token_ids
        assert tokenizer.decode(token_ids[:token_ids.index(tokenizer.eos_token_id)]) in ("yes", "no")
    assert warnings == []


def test_a_token_the_grammar_refuses_ends_the_completion_with_error(llm):
    """min_tokens forbids the EOS that is all the grammar allows after "yes", so every logit is
    -inf and the sampler draws a token the grammar refuses: as in vLLM, the completion ends there
    with finish_reason "error", that token its last; the engine goes on with the others."""
    held = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, structured_outputs={"choice": ["yes"]})
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with log_lines("nanovllm.engine.output_processor") as warnings:
        refused, other = llm.generate(PROMPTS[:2], [held, free], use_tqdm=False)
    completion = refused.outputs[0]
    assert completion.finish_reason == "error" and completion.stop_reason is None
    assert completion.text.startswith("yes") and len(completion.token_ids) < 6
    assert len(warnings) == 1 and "grammar rejected token" in warnings[0]
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 12
    assert not llm.llm_engine.has_unfinished_requests()
