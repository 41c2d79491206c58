"""Sampling: seeds, top-k/top-p/min-p, penalties, logprobs against HF, min_tokens, stops, n > 1."""
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import check_within_top_k_top_p, hf_model, make_prompts, watch_overlap
from nanovllm import LLM, SamplingParams
from nanovllm.engine.penalty_counts import PenaltyCounts
from nanovllm.layers.sampler import Sampler
from nanovllm.layers.sampling_metadata import SamplingMetadata

PROMPTS = make_prompts()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_dir, request):
    return LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256, async_scheduling=request.param)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def ids(p):
    return {"prompt_token_ids": p}


# ---- end to end ---------------------------------------------------------------------------
def test_seed_gives_same_output_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([ids(PROMPTS[5])], sp, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate([ids(p) for p in PROMPTS[:5]] + [ids(PROMPTS[5])] + [ids(p) for p in PROMPTS[6:]],
                         [unseeded] * 5 + [sp] + [unseeded] * 10, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([ids(PROMPTS[5])], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_sampled_tokens_lie_within_top_k_and_top_p(llm):
    sp = SamplingParams(n=2, temperature=1.0, top_k=5, top_p=0.8, logprobs=5, seed=3, max_tokens=12,
                        ignore_eos=True)
    outs = llm.generate([ids(p) for p in PROMPTS], sp, use_tqdm=False)
    assert check_within_top_k_top_p(outs, top_k=5, top_p=0.8) == len(PROMPTS) * 2 * 12


def test_numpy_numbers_are_taken_as_python_numbers(llm):
    """Parameters computed with numpy (np.int64 seeds, counts, ids; np.float32 temperatures) work
    as their Python values do: same tokens, plain ints and floats in the params."""
    import numpy as np
    plain = SamplingParams(n=2, temperature=0.9, top_k=20, seed=11, max_tokens=6, min_tokens=2, logprobs=1,
                           stop_token_ids=[7], logit_bias={5: 2.0}, ignore_eos=True)
    numpy = SamplingParams(n=np.int64(2), temperature=np.float64(0.9), top_k=np.int32(20), seed=np.int64(11),
                           max_tokens=np.int64(6), min_tokens=np.int64(2), logprobs=np.int64(1),
                           stop_token_ids=[np.int64(7)], logit_bias={np.int64(5): np.float32(2.0)},
                           ignore_eos=np.bool_(True))
    assert repr(numpy) == repr(plain)
    assert type(numpy.seed) is int and type(numpy.stop_token_ids[0]) is int and type(numpy.temperature) is float
    outs = llm.generate([ids(PROMPTS[2])] * 2, [plain, numpy], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]


def test_top_k_1_equals_greedy(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)
    prompts = [ids(p) for p in PROMPTS]
    assert tokens(llm.generate(prompts, top1, use_tqdm=False)) == tokens(llm.generate(prompts, greedy, use_tqdm=False))


def test_greedy_rows_unaffected_by_sampled_rows(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    hot = SamplingParams(temperature=1.2, top_p=0.9, max_tokens=10, ignore_eos=True)
    prompts = [ids(p) for p in PROMPTS[:6]]
    alone = tokens(llm.generate(prompts, greedy, use_tqdm=False))
    mixed = tokens(llm.generate(prompts, [greedy, hot] * 3, use_tqdm=False))
    assert mixed[0::2] == alone[0::2]


@torch.no_grad()
def test_logprobs_equal_hf_log_softmax(llm, qwen3_dir):
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=6, logprobs=5, ignore_eos=True)
    prompts = PROMPTS[3:7]
    outs = llm.generate([ids(p) for p in prompts], sp, use_tqdm=False)
    model = hf_model(qwen3_dir)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        full = prompt + comp.token_ids
        ref = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
        assert len(comp.logprobs) == len(comp.token_ids)
        total = 0.0
        for t, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + t]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top_vals, top_ids = row.topk(5)
            for r, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), 1):
                assert entry[tid].logprob == pytest.approx(val, abs=1e-4)
                assert tid == token or entry[tid].rank == r
            assert len(entry) in (5, 6)
            total += entry[token].logprob
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_logprobs_minus_one_gives_every_token(qwen3_dir):
    """vLLM's logprobs=-1 / prompt_logprobs=-1: the whole vocabulary at each position, once
    max_logprobs=-1 lifts the cap (its default, 20, refuses them: test_api)."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_logprobs=-1)
    vocab_size = llm.llm_engine.config.hf_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=-1, prompt_logprobs=-1, ignore_eos=True)
    out = llm.generate([ids(PROMPTS[3])], sp, use_tqdm=False)[0]
    steps = out.outputs[0].logprobs
    assert [len(step) for step in steps] == [vocab_size] * 3
    assert out.prompt_logprobs[0] is None
    assert [len(p) for p in out.prompt_logprobs[1:]] == [vocab_size] * (len(PROMPTS[3]) - 1)
    for token, step in zip(out.outputs[0].token_ids, steps):
        assert step[token].rank == 1 and step[token].logprob == max(lp.logprob for lp in step.values())
        assert math.isclose(sum(math.exp(lp.logprob) for lp in step.values()), 1.0, rel_tol=1e-4)
    assert sp.logprobs == -1 and sp.prompt_logprobs == -1     # the caller's params are left as given


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
@torch.no_grad()
def test_logprobs_modes_report_vllms_values(qwen3_dir, mode):
    """vLLM's logprobs_mode, against HF's logits on the same tokens: the "raw" modes report the raw
    logits (or their log_softmax); the "processed" ones the distribution a token is drawn from:
    after logit_bias, and in a sampling row temperature and top-k (dropped tokens at -inf); greedy
    rows at temperature 1, beside sampling rows or not.
    Prompt tokens are scored raw in every mode: logits in the "_logits" ones."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_logprobs=-1,
              logprobs_mode=mode)
    model = hf_model(qwen3_dir)
    prompt = PROMPTS[4]
    bias = {7: 2.0}
    hot = SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=4, ignore_eos=True, logprobs=-1,
                         prompt_logprobs=2, logit_bias=bias)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=-1, logit_bias=bias)
    for sp, beside in ((hot, greedy), (greedy, hot), (greedy, greedy)):
        out = llm.generate([ids(prompt), ids(PROMPTS[5])], [sp, beside], use_tqdm=False)[0]
        comp = out.outputs[0]
        logits = model(torch.tensor([prompt + comp.token_ids])).logits[0].float()
        for t, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = logits[len(prompt) - 1 + t]
            if mode.startswith("processed"):
                row = row.clone()
                row[7] += 2.0
                if sp is hot:
                    row = row / 0.5
                    row[row < row.topk(3).values[-1]] = float("-inf")
            expected = row if mode.endswith("logits") else row.log_softmax(-1)
            got = torch.tensor([entry[i].logprob for i in range(len(row))])
            assert torch.allclose(got, expected, atol=1e-4), (mode, t)
            assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        if sp is hot:
            assert sum(math.isfinite(entry[i].logprob) for i in range(len(row))) == (3 if "processed" in mode
                                                                                   else len(row))
            for t, entry in enumerate(out.prompt_logprobs[1:], 1):   # raw in every mode
                target, row = prompt[t], logits[t - 1]
                raw = row if mode.endswith("logits") else row.log_softmax(-1)
                assert entry[target].logprob == pytest.approx(raw[target].item(), abs=1e-4)


def test_no_logprobs_means_none(llm):
    comp = llm.generate([ids(PROMPTS[3])], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is None


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    comp = llm.generate([ids(PROMPTS[3])], SamplingParams(max_tokens=3, logprobs=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in comp.logprobs] == [[t] for t in comp.token_ids]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [ids(PROMPTS[6])]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    first = free.token_ids[0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", first)
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                               stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


def test_stop_string_split_across_tokens(llm, tokenizer):
    prompt = [ids(PROMPTS[7])]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token's text and the start of the next one's.
    k = next(k for k in range(3, 20) if len(pieces[k]) >= 1 and len(pieces[k + 1]) >= 1
             and pieces[k].strip() and pieces[k + 1].strip())
    stop = pieces[k][-1] + pieces[k + 1][:2]
    index = free.text.find(stop)
    assert index >= 0
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:index], "stop", stop)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[:index + len(stop)]


def test_n_completions(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([ids(PROMPTS[4])], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in seqs}) == 3
    again = llm.generate([ids(PROMPTS[4])], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == seqs


def test_penalty_request_joins_a_batch_with_pending_tokens(qwen3_dir):
    """Async scheduling: C (with penalties) is admitted when A finishes, while B's latest token is
    still on the device (a placeholder on the host): its penalties must ignore B's placeholder."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256, async_scheduling=True,
              max_num_seqs=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 12)]
    params.append(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.5))
    mixed = llm.generate([ids(p) for p in PROMPTS[:3]], params, use_tqdm=False)
    alone = llm.generate([ids(PROMPTS[2])], params[2], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in mixed] == [2, 12, 6]
    assert mixed[2].outputs[0].token_ids == alone[0].outputs[0].token_ids


@torch.no_grad()
def test_all_three_penalties_match_a_reference_on_hf_logits(llm, qwen3_dir):
    """Greedy with presence, frequency and repetition penalties against a loop over HF's float32
    logits that applies vLLM's rules (repetition on prompt and output tokens, presence and
    frequency on output tokens): the counts the device keeps give the same tokens."""
    sp = SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.3,
                        max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[1:5]
    outs = llm.generate([ids(p) for p in prompts], sp, use_tqdm=False)
    plain = llm.generate([ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    model = hf_model(qwen3_dir)
    for p, out, unpenalised in zip(prompts, outs, plain):
        tokens = list(p)
        for _ in range(12):
            logits = model(torch.tensor([tokens])).logits[0, -1].clone()
            output = tokens[len(p):]
            for t in set(tokens):
                logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
            for t in set(output):
                logits[t] -= 0.9 * output.count(t) + 0.7
            tokens.append(int(logits.argmax()))
        assert out.outputs[0].token_ids == tokens[len(p):]
    assert any(o.outputs[0].token_ids != u.outputs[0].token_ids for o, u in zip(outs, plain))   # they bite


def test_penalised_requests_keep_async_scheduling_and_reuse_their_rows(qwen3_dir):
    """Penalties no longer make the engine read each step before launching the next: a step stays
    in flight. A finished sequence's row of token counts goes to the next one (12 + 12 requests,
    four at a time, fit the table's max_num_seqs rows, the size the KV cache's sizing leaves room for)."""
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=256, async_scheduling=True,
              max_num_seqs=4)
    sp = SamplingParams(temperature=0.8, seed=3, presence_penalty=1.0, repetition_penalty=1.2, max_tokens=6,
                        ignore_eos=True)
    engine = llm.llm_engine
    with watch_overlap(llm) as overlapped:
        engine.add_request("a", ids(PROMPTS[3]), sp)
        while engine.has_unfinished_requests():
            engine.step()
    assert overlapped == [False] + [True] * 5   # the prompt step, then five launched before the last is read
    for _ in range(2):
        outs = llm.generate([ids(p) for p in PROMPTS[:12]], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    counts = engine.model_runner.penalty_counts
    assert counts.table.shape[0] == 4 and len(counts.row_of) <= 4
    assert counts.reserved_bytes == counts.table.numel() * 4


def test_penalty_table_is_max_num_seqs_rows_and_grows_only_past_them():
    """The table the KV cache's sizing leaves room for (max_num_seqs rows), made at the first need;
    a sequence beyond them (preempted ones keep their rows) doubles it, its rows kept."""
    counts = PenaltyCounts(vocab_size=10, device=torch.device("cpu"), max_num_seqs=2)
    seqs = [SimpleNamespace(seq_id=i, num_pending_tokens=0, is_finished=False) for i in range(3)]
    assert counts.table.shape[0] == 0 and counts.reserved_bytes == 2 * 11 * 4
    rows, new = counts.rows(seqs[:2])
    assert rows.tolist() == [0, 1] and [r for r, _ in new] == [0, 1] and counts.table.shape == (2, 11)
    counts.table[1, 3] = 5
    rows, new = counts.rows(seqs)
    assert rows.tolist() == [0, 1, 2] and [r for r, _ in new] == [2] and counts.table.shape == (4, 11)
    assert counts.table[1, 3] == 5 and counts.table.sum() == 5


@torch.no_grad()
def test_repetition_penalty_matches_hf(llm, qwen3_dir):
    sp = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[2:6]
    outs = llm.generate([ids(p) for p in prompts], sp, use_tqdm=False)
    model = hf_model(qwen3_dir)
    model.generation_config.eos_token_id = None
    for p, out in zip(prompts, outs):
        x = torch.tensor([p])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=10,
                           repetition_penalty=1.8, pad_token_id=0)
        assert out.outputs[0].token_ids == y[0, len(p):].tolist()


# ---- the sampler on hand-made logits ------------------------------------------------------
def metadata(n, **kw) -> SamplingMetadata:
    base = dict(temperatures=torch.ones(n), is_greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False,
                any_greedy=False,
                top_k=None, top_p=None, min_p=None, row_seeds=[], banned_rows=None, banned_tokens=None)
    return SamplingMetadata(**(base | kw))


def draw(logits, md, times=200):
    sampler = Sampler(torch.Generator().manual_seed(0))
    return {tuple(sampler(logits.clone(), md).token_ids.tolist()) for _ in range(times)}


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seen = draw(probs.log(), metadata(1, top_p=torch.tensor([0.7])))
    assert seen == {(0,), (1,)}


def test_top_k_keeps_k_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert draw(logits, metadata(1, top_k=torch.tensor([2]))) == {(1,), (3,)}


def test_top_k_top_p_from_the_best_logits_equal_the_full_sort():
    """The select path (every row has a top_k <= SELECT_TOP_K_MAX) drops exactly the tokens the
    sort of the whole vocabulary drops, top-k alone and with top-p, per-row values; where top-p's
    cut falls inside a run of tied logits it keeps the whole run (the sort keeps part of it)."""
    from nanovllm.layers.sampling_filters import apply_top_k_top_p
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1000, generator=gen) * 3
    logits[5, :40] = 7.5                                            # 40 tied logits near the top
    top_k = torch.tensor([1, 2, 5, 20, 50, 20, 1000, 7])
    for top_p in (None, torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 0.8, 0.99, 0.05])):
        full = apply_top_k_top_p(logits, top_k, top_p)
        selected = apply_top_k_top_p(logits, top_k, top_p, max_top_k=int(top_k.max()))
        untied = [0, 1, 2, 3, 4, 6, 7]
        assert torch.equal(selected[untied].isinf(), full[untied].isinf())
        assert torch.equal(selected[~selected.isinf()], logits[~selected.isinf()])
        # the tied row: top-k 20 falls inside the run; either way all 40 are kept
        assert (~selected[5].isinf()).sum() == (logits[5] >= 7.5).sum() >= 40
    assert (~full[5].isinf()).sum() < 40                            # (the sort cut the run at top-p 0.8)


def test_a_row_with_nothing_left_to_draw_passes_top_k_and_top_p():
    """Where the request's own constraints leave no token (a grammar that wants only EOS while
    min_tokens forbids it), every logit is -inf: top-k and top-p keep the row as it is, and the
    other rows are filtered as alone, rather than an index -1 failing the whole step."""
    from nanovllm.layers.sampling_filters import apply_top_k_top_p
    logits = torch.tensor([[float("-inf")] * 4, [0.0, 3.0, 1.0, 2.0]])
    filtered = apply_top_k_top_p(logits, torch.tensor([1, 2]), torch.tensor([0.9, 0.9]), max_top_k=2)
    assert filtered[0].isinf().all()
    assert torch.equal(filtered[1], torch.tensor([float("-inf"), 3.0, float("-inf"), 2.0]))


def test_filter_logits_of_a_block_of_rows_equals_those_rows_of_the_whole():
    """The sorted path filters SORT_ROWS rows at a time on CUDA: filter_logits on rows a:b of the
    batch, given md's rows a:b, is those rows of the whole batch's result, to the bit."""
    from nanovllm.layers.sampling_filters import filter_logits
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 500, generator=gen) * 3
    md = metadata(7, top_k=torch.tensor([1, 500, 30, 499, 200, 7, 500]),
                  top_p=torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 0.8, 0.99]),
                  min_p=torch.tensor([0.0, 0.1, 0.0, 0.05, 0.2, 0.0, 0.01]))
    whole = filter_logits(logits, md)
    blocks = torch.cat([filter_logits(logits[rows], md, rows) for rows in (slice(0, 3), slice(3, 6), slice(6, 9))])
    assert torch.equal(blocks, whole)
    assert whole.isinf().any(1).all() and not whole.isinf().all(1).any()   # every row cut, none emptied


def test_token_logprobs_ranks_counted_by_blocks_of_rows(monkeypatch):
    """token_logprobs counts the ranks SORT_ROWS rows at a time (here 2, so a partial last block):
    each row's rank is 1 + its logprobs above the token's, ties not counted, whatever the block."""
    from nanovllm.layers import sampling_filters
    from nanovllm.layers.logprobs import token_logprobs
    monkeypatch.setattr(sampling_filters, "SORT_ROWS", 2)
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-3.0, -2.0, -1.0], [-2.0, -2.0, -0.5],
                             [-0.5, -1.5, -2.5], [-1.0, -1.0, -1.0]])
    out = token_logprobs(logprobs, torch.tensor([2, 2, 1, 1, 0]), num_top=1)
    assert out.ranks.tolist() == [3, 1, 2, 2, 1]
    assert out.logprobs.tolist() == [-3.0, -1.0, -2.0, -1.5, -1.0]
    assert out.top_ids[:, 0].tolist() == [0, 2, 2, 0, 0]
    row_blocks = sampling_filters.row_blocks
    assert row_blocks(0) == [slice(0, 2)] and row_blocks(4) == [slice(0, 2), slice(2, 4)]


def test_top_k_and_top_p_sampled_through_the_select_path():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    md = metadata(2, top_k=torch.tensor([3, 1]), max_top_k=3, top_p=torch.tensor([0.7, 1.0]))
    assert draw(probs.log(), md) == {(0, 3), (1, 3)}


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert draw(probs.log(), metadata(1, min_p=torch.tensor([0.5]))) == {(0,), (1,)}


@pytest.mark.parametrize("top_k", [None, 3])
def test_min_p_comes_before_top_p(top_k):
    """vLLM's order: min-p first, so top-p's mass is that of the tokens min-p keeps. min_p 0.3 keeps
    0.5 and 0.3 (0.625 and 0.375 of their mass), and top_p 0.6 then keeps 0.5 alone; top-p first
    would have kept 0.5 and 0.3 (0.8 of the whole). With a top_k (the select path) the same."""
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1]])
    k = dict(top_k=torch.tensor([top_k]), max_top_k=top_k) if top_k else {}
    md = metadata(1, min_p=torch.tensor([0.3]), top_p=torch.tensor([0.6]), **k)
    assert draw(probs.log(), md) == {(0,)}
    md = metadata(1, min_p=torch.tensor([0.3]), top_p=torch.tensor([0.7]), **k)   # 0.625 < 0.7: both
    assert draw(probs.log(), md) == {(0,), (1,)}


def test_min_p_cut_keeps_what_the_min_p_filter_keeps():
    """The fused sampler's min-p cut (unscaled logits, the row's temperature inside it) keeps
    exactly the tokens that filter_logits' min-p keeps on the scaled logits, temperature and
    min_p 0 (off) included."""
    from nanovllm.layers.sampling_filters import filter_logits, min_p_cut
    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0], [0.5, 0.5, 0.25, 0.0], [1.0, 2.0, 3.0, 4.0]])
    min_p, temps = torch.tensor([0.3, 0.9, 0.0]), torch.tensor([1.0, 0.5, 2.0])
    cut = min_p_cut(logits, min_p, temps)
    assert cut.tolist() == pytest.approx([4.0 + math.log(0.3), 0.5 + 0.5 * math.log(0.9), float("-inf")], rel=1e-6)
    filtered = filter_logits(logits / temps[:, None], metadata(3, min_p=min_p))
    assert (logits >= cut[:, None]).tolist() == filtered.isfinite().tolist() == [
        [True, True, False, False], [True, True, False, False], [True, True, True, True]]


def test_penalties_exact_values():
    """From the device-side token counts (2 x output count + 1 if in the prompt), in the
    penalised rows only; a new row is cleared and marked with its prompt first."""
    from nanovllm.layers.logit_edits import apply_penalties
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    table = torch.full((3, 5), 7, dtype=torch.int32)                  # stale counts of an earlier owner
    table[2] = torch.tensor([4, 2, 0, 0, 0], dtype=torch.int32)       # token 0 twice, token 1 once
    md = metadata(2, penalty_rows=torch.tensor([1]), presence_penalties=torch.tensor([0.5]),
                  frequency_penalties=torch.tensor([0.25]), repetition_penalties=torch.tensor([2.0]),
                  penalty_table=table, penalty_table_rows=torch.tensor([0]), new_table_rows=torch.tensor([0]),
                  new_prompt_ids=torch.tensor([[2, 4]]))                # token 2 in the prompt; 4: pad
    assert apply_penalties(logits.clone(), md).tolist() == [[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.25, 1.0]]
    assert table[0].tolist() == [0, 0, 1, 0, 1]
    md = replace(md, penalty_table_rows=torch.tensor([2]), new_table_rows=None, new_prompt_ids=None)
    # token 0: 2/2 - 0.25*2 - 0.5; token 1: -1*2 - 0.25 - 0.5; tokens 2 and 3 untouched
    assert apply_penalties(logits.clone(), md).tolist() == [[2.0, -1.0, 0.5, 1.0], [0.0, -2.75, 0.5, 1.0]]


def test_sampled_tokens_are_counted_on_the_device():
    from nanovllm.layers.logit_edits import count_sampled
    table = torch.zeros(3, 5, dtype=torch.int32)
    md = metadata(3, penalty_rows=torch.tensor([0, 2]), penalty_table=table, penalty_table_rows=torch.tensor([2, 0]))
    count_sampled(md, torch.tensor([3, 1, 1]))
    count_sampled(md, torch.tensor([3, 0, 0]))
    assert table.tolist() == [[2, 2, 0, 0, 0], [0] * 5, [0, 0, 0, 4, 0]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = probs.log().expand(4000, 3).clone()
    counts = torch.bincount(sampler(logits, metadata(4000)).token_ids, minlength=3) / 4000
    assert torch.allclose(counts, probs, atol=0.03)
    assert math.isclose(counts.sum().item(), 1.0)


# ---- prompt logprobs ----------------------------------------------------------------------
def check_prompt_logprobs(model, prompt, prompt_logprobs, num_top):
    """Entry j scores prompt token j given tokens < j, like HF's log_softmax; entry 0 is None."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for j in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[j], ref[j - 1], prompt[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_vals, top_ids = row.topk(num_top) if num_top else (torch.tensor([]), torch.tensor([], dtype=torch.long))
        for r, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), 1):
            assert entry[tid].logprob == pytest.approx(val, abs=1e-4)
            assert tid == token or entry[tid].rank == r
        assert set(entry) == {token} | set(top_ids.tolist())


@pytest.mark.parametrize("variant", [
    dict(),
    dict(max_num_batched_tokens=32),        # prompts scored chunk by chunk
    dict(max_num_seqs=5),                   # a step's prompt rows scored in logits passes of 5 rows
    dict(num_kvcache_blocks=14),            # preempted and recomputed: tokens are not scored twice
    # scores read a step late, with the sampled tokens (as on the GPU)
    dict(async_scheduling=True, max_num_batched_tokens=32),
    dict(async_scheduling=True, num_kvcache_blocks=14),
])
@torch.no_grad()
def test_prompt_logprobs_equal_hf_log_softmax(qwen3_dir, tokenizer, variant):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, **({"num_kvcache_blocks": 256} | variant))
    model = hf_model(qwen3_dir)
    prompts = PROMPTS[:12]
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    for call in range(2):               # the second call's prompts are all in the prefix cache
        outs = llm.generate([ids(p) for p in prompts], [scored, plain] * 6, use_tqdm=False)
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            if i % 2:
                assert out.prompt_logprobs is None
                continue
            check_prompt_logprobs(model, prompt, out.prompt_logprobs, 3)
            assert out.num_cached_tokens == 0      # as vLLM: a scored prompt is computed in full
            first = out.prompt_logprobs[1] if len(prompt) > 1 else {}
            assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in first.items())
        assert tokens(outs) == tokens(llm.generate([ids(p) for p in prompts], plain, use_tqdm=False))
    if "num_kvcache_blocks" in variant:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if "max_num_seqs" in variant:
        assert llm.llm_engine.model_runner.prompt_logits_rows == 5
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@torch.no_grad()
def test_prompt_logprobs_zero_gives_only_the_prompt_tokens(llm, qwen3_dir):
    prompt = PROMPTS[6]
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    check_prompt_logprobs(hf_model(qwen3_dir), prompt, out.prompt_logprobs, 0)


@torch.no_grad()
def test_prompt_scores_of_steps_that_only_score_are_read_a_step_late(qwen3_dir, monkeypatch):
    """With async scheduling a step that only scores prompt tokens (a long prompt's chunks) is not
    read at once: the engine launches the next step first. The scores are those of an engine that
    reads every step at once."""
    from nanovllm.engine.llm_engine import LLMEngine
    read_late = []
    resolve = LLMEngine._resolve
    monkeypatch.setattr(LLMEngine, "_resolve", lambda engine, step: read_late.append(
        step.host is None and engine.in_flight is not step) or resolve(engine, step))
    prompt, params = PROMPTS[7], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    outs = [LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=32,
                async_scheduling=asynchronous).generate([ids(prompt)], params, use_tqdm=False)[0]
            for asynchronous in (True, False)]
    assert sum(read_late) >= 3      # 150 prompt tokens in steps of 32
    scores = [[(t, e.logprob, e.rank) for position in out.prompt_logprobs[1:] for t, e in position.items()]
              for out in outs]
    assert scores[0] == scores[1] and len(outs[0].prompt_logprobs) == len(prompt)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


# ---- allowed_token_ids, logit_bias, truncate_prompt_tokens, detokenize -----------------------
@torch.no_grad()
def test_allowed_token_ids_restrict_sampling(llm, qwen3_dir):
    allowed = [7, 42, 99, 250]
    hot = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=allowed)
    outs = llm.generate([ids(p) for p in PROMPTS[:4]], [hot, greedy, hot, greedy], use_tqdm=False)
    assert all(set(t) <= set(allowed) for t in tokens(outs))
    logits = hf_model(qwen3_dir)(torch.tensor([PROMPTS[1]])).logits[0, -1]
    assert tokens(outs)[1] == [allowed[int(logits[allowed].argmax())]]     # the best allowed token


@torch.no_grad()
def test_logit_bias_changes_sampling_but_not_logprobs(llm, qwen3_dir):
    prompt = PROMPTS[5]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0, logit_bias={123: 100.0})
    comp = llm.generate([ids(prompt)], sp, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == [123] * 4
    raw = hf_model(qwen3_dir)(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    assert comp.logprobs[0][123].logprob == pytest.approx(raw[123].item(), abs=1e-4)   # raw, as vLLM reports
    free = llm.generate([ids(prompt)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={free[0]: -100.0})
    assert llm.generate([ids(prompt)], banned, use_tqdm=False)[0].outputs[0].token_ids != free[:1]


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    prompt = PROMPTS[7]                                    # 150 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate([ids(prompt)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                     truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-40:]
    assert out.outputs[0].token_ids == llm.generate([ids(prompt[-40:])], greedy, use_tqdm=False)[0].outputs[0].token_ids
    max_model_len = llm.llm_engine.config.max_model_len
    too_many = SamplingParams(max_tokens=5, truncate_prompt_tokens=max_model_len + 1)
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens value \({max_model_len + 1}\) is greater than "
                                         rf"max_model_len \({max_model_len}\)"):
        llm.generate([ids(prompt), ids(prompt)], [greedy, too_many], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_detokenize_false_gives_ids_only(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", block_size=16, num_kvcache_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with_text = llm.generate(["Hello world"], greedy, use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1,
                                                            detokenize=False), use_tqdm=False)[0].outputs[0]
    assert with_text.text and ids_only.text == "" and ids_only.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for entry in ids_only.logprobs for lp in entry.values())


def test_bad_words_are_never_generated(llm, tokenizer):
    hello, qu = (tokenizer.encode(w, add_special_tokens=False) for w in ("Hello", "qu"))
    assert len(hello) == 2 and len(qu) == 1
    pair = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True, allowed_token_ids=hello)
    free = tokens(llm.generate([ids(PROMPTS[4])], pair, use_tqdm=False))[0]
    bigrams = list(zip(free, free[1:]))
    assert tuple(hello) in bigrams                                 # would be generated...
    banned = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True, allowed_token_ids=hello,
                            bad_words=["Hello"])
    out = tokens(llm.generate([ids(PROMPTS[4])], banned, use_tqdm=False))[0]
    assert len(out) == 32 and tuple(hello) not in zip(out, out[1:])   # ...but its second token never follows
    one = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, allowed_token_ids=[qu[0], 320],
                         bad_words=("qu",))                       # a tuple, as the other list fields take
    assert tokens(llm.generate([ids(PROMPTS[4])], one, use_tqdm=False))[0] == [320] * 16
