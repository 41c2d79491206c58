"""The host-side step: flattened rows, slots from block tables, logits rows and pending tokens,
and how its arrays travel to the device in one copy."""
import numpy as np
import torch

from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.engine.shared_prefix import plan_shared_prefixes
from nanovllm.engine.step_inputs import build_step, prompt_spans, token_rows
from nanovllm.sampling_params import SamplingParams


def seq(token_ids, block_table, num_computed, prompt_logprobs=None):
    s = Sequence("r", 0, token_ids, SamplingParams(prompt_logprobs=prompt_logprobs))
    s.block_table, s.num_computed_tokens = block_table, num_computed
    return s


def test_build_step_flattens_a_mixed_batch():
    # block_size 4. a: decode of its 6th token; b: the first 3 of 5 prompt tokens (no sampling);
    # c: decode whose input token is still on the device (row 1 of the previous step's samples).
    a = seq([10, 11, 12, 13, 14, 15], [7, 3], 5)
    b = seq([20, 21, 22, 23, 24], [5, 6], 0)
    c = seq([30, 31, 32], [9], 3)
    c.append_pending()
    out = SchedulerOutput([a, b, c], [1, 3, 1])
    step = build_step(out, [a, c], {c.seq_id: 1}, block_size=4)
    batch = step.batch
    assert batch.input_ids.tolist() == [15, 20, 21, 22, PENDING_TOKEN]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3]
    assert batch.slot_mapping.tolist() == [3 * 4 + 1, 5 * 4, 5 * 4 + 1, 5 * 4 + 2, 9 * 4 + 3]
    assert batch.block_tables.tolist() == [[7, 3], [5, 6], [9, 0]]
    assert batch.query_start_loc == [0, 1, 4, 5] and batch.seq_lens == [6, 3, 4]
    assert (step.pending_rows, step.pending_sources) == ([4], [1])
    assert step.logits_rows == [0, 4] and step.num_sampling == 2


def test_pure_decode_samples_every_row():
    a, b = seq([1, 2, 3], [0], 2), seq([4, 5], [1], 1)
    step = build_step(SchedulerOutput([a, b], [1, 1]), [a, b], None, block_size=4)
    assert step.logits_rows is None and step.num_sampling == 2


def test_token_rows_give_each_token_its_context_up_to_itself():
    # block_size 4. a: its last token (position 9) and two drafts; b: a decode of position 4.
    a = seq(list(range(10, 20)), [7, 3, 8], 9)
    a.spec_token_ids = [90, 91]
    b = seq([20, 21, 22, 23, 24], [5, 6], 4)
    step = build_step(SchedulerOutput([a, b], [3, 1]), [a, b], None, block_size=4)
    rows = token_rows(step.batch)
    assert rows.input_ids.tolist() == [19, 90, 91, 24] and rows.positions.tolist() == [9, 10, 11, 4]
    assert rows.slot_mapping.tolist() == step.batch.slot_mapping.tolist() == [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 6 * 4]
    assert rows.block_tables.tolist() == [[7, 3, 8], [7, 3, 8], [7, 3, 8], [5, 6, 0]]
    assert rows.query_start_loc == [0, 1, 2, 3, 4] and rows.seq_lens == [10, 11, 12, 5]
    assert step.logits_rows == [0, 1, 2, 3]


def test_token_rows_of_one_sequence_read_its_full_pages_once():
    """A long sequence's last token and 4 drafts as token rows: the rows share the pages before their newest
    token's, so the decode step's shared-prefix plan reads those once for the five (engine/shared_prefix.py)."""
    a = seq(list(range(1000)), list(range(10, 14)), 999)
    a.spec_token_ids = [1, 2, 3, 4]
    rows = token_rows(build_step(SchedulerOutput([a], [5]), [a], None, block_size=256).batch)
    assert rows.seq_lens == [1000, 1001, 1002, 1003, 1004]
    plan = plan_shared_prefixes(rows.block_tables, rows.seq_lens, 256, seqs_per_tile=16)
    assert plan.prefix_lens.tolist() == [768] * 5 and plan.tiles.tolist() == [[0, 5, 768]]


def test_prompt_spans_score_each_prompt_token_once():
    """Row of position p scores prompt token p + 1; a chunk after a preemption skips what was scored."""
    a = seq(list(range(100, 110)), [0, 1, 2], 0, prompt_logprobs=1)    # 10 prompt tokens, chunk of 4
    b = seq(list(range(200, 206)), [3, 4], 0, prompt_logprobs=1)       # a 6-token prompt recomputed
    b.num_prompt_scored = 4                   # tokens 1..4 were scored before b was preempted
    out = SchedulerOutput([a, b], [4, 6])
    batch = build_step(out, [b], None, block_size=4).batch
    assert prompt_spans(out, batch) == [(a, 1, [0, 1, 2, 3]), (b, 5, [8])]


def test_packed_arrays_read_back_through_their_views():
    """One copy carries arrays of every dtype the engine uploads; each view gives its array back."""
    from nanovllm.engine.upload import ALIGN, packed, packed_offsets, views
    arrays = [np.arange(3, dtype=np.int64), np.array([[1, 2, 3], [4, 5, 6]], np.int32), np.zeros(0, np.int64),
              np.array([True, False, True]), np.array([0.5, -1.25], np.float32), np.array([-1], np.int64)]
    offsets, size = packed_offsets(arrays)
    assert offsets == [0, 32, 64, 64, 80, 96] and size == 112 and all(o % ALIGN == 0 for o in offsets)
    for array, view in zip(arrays, views(packed(arrays, pin_memory=False), arrays)):
        assert view.dtype == torch.from_numpy(array).dtype and view.shape == array.shape
        assert np.array_equal(view.numpy(), array)


def test_an_upload_into_a_buffer_leaves_its_bytes_past_the_arrays():
    """A buffer that outlives its uploads (the LoRA slots of a CUDA graph's padding rows) keeps its bytes past the
    last array's, though the packed copy pads that array to a multiple of ALIGN bytes."""
    from nanovllm.engine.upload import upload
    out = torch.full((64,), 0xAB, dtype=torch.uint8)
    ids, pairs = upload([np.array([7, -1], np.int64), np.arange(6, dtype=np.int32).reshape(3, 2)],
                        torch.device("cpu"), out=out)
    assert ids.tolist() == [7, -1] and pairs.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert out[16 + 24:].tolist() == [0xAB] * 24


def test_a_decode_graph_bucket_reads_the_same_bytes_whatever_the_pending_tokens():
    """The decode graphs capture views of one staged buffer: a step's upload, with any number of
    pending tokens, puts each input at the bytes its bucket's graph reads, fits the buffer sized
    for the largest bucket, and starts with the padding rows' values (slot -1, seq_len 0)."""
    from nanovllm.engine.cuda_graph import step_arrays
    from nanovllm.engine.upload import packed_offsets
    for bucket in (1, 16, 48):
        captured = packed_offsets(step_arrays(bucket))[0][:4]
        for num_pending in (1, bucket):
            offsets, size = packed_offsets(step_arrays(bucket, num_pending))
            assert offsets[:4] == captured and size <= packed_offsets(step_arrays(48, 48))[1]
    ids, positions, slots, seq_lens, rows, sources = step_arrays(4, num_pending=2)
    assert ids.tolist() == positions.tolist() == seq_lens.tolist() == [0] * 4 and slots.tolist() == [-1] * 4
    assert seq_lens.dtype == np.int32 and rows.shape == sources.shape == (2,)


def test_sampling_metadata_top_k_fields_for_a_batch_with_and_without_top_k():
    """top_k per row (the vocabulary size where a row has none; a top_k at or above it is none);
    max_top_k only when every row has one, max_set_top_k (the largest of those that do) whenever
    one has."""
    from nanovllm.engine.sampling_inputs import host_sampling_metadata
    seqs = [Sequence(str(i), i, [1, 2, 3], SamplingParams(top_k=k, top_p=0.9))
            for i, k in enumerate([20, 0, 5_000, -1, 7])]
    md = host_sampling_metadata(seqs, vocab_size=1_000, eos_token_ids=[0])
    assert md.top_k.tolist() == [20, 1_000, 1_000, 1_000, 7]
    assert (md.max_top_k, md.max_set_top_k) == (None, 20)
    md = host_sampling_metadata(seqs[:1] + seqs[4:], vocab_size=1_000, eos_token_ids=[0])
    assert (md.max_top_k, md.max_set_top_k) == (20, 20)
    md = host_sampling_metadata(seqs[1:4], vocab_size=1_000, eos_token_ids=[0])
    assert (md.top_k, md.max_top_k, md.max_set_top_k) == (None, None, None)


def test_sampling_metadata_of_rows_sampled_by_temperature_alone():
    """A batch whose every row samples by its temperature alone skips the passes for the other fields,
    with the metadata those passes would have made; a row with any of those fields set is not such a row."""
    from dataclasses import fields

    from nanovllm.engine.sampling_inputs import host_sampling_metadata
    seqs = [Sequence(str(i), 0, [1, 2, 3], SamplingParams(temperature=t, top_k=k, max_tokens=5))
            for i, (t, k) in enumerate([(0.0, 3), (0.6, 0), (1.0, -1)])]   # (a greedy row's top_k is dropped)
    assert all(seq.samples_by_temperature_alone for seq in seqs)
    fast = host_sampling_metadata(seqs, vocab_size=1_000, eos_token_ids=[0])
    for seq in seqs:
        seq.samples_by_temperature_alone = False
    slow = host_sampling_metadata(seqs, vocab_size=1_000, eos_token_ids=[0])
    for f in fields(fast):
        a, b = getattr(fast, f.name), getattr(slow, f.name)
        assert (a == b).all() if isinstance(a, np.ndarray) else a == b, f.name
    for options in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(seed=1), dict(min_tokens=2),
                    dict(bad_words=["x"]), dict(allowed_token_ids=[1]), dict(logit_bias={1: 1.0}),
                    dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.1),
                    dict(logprobs=0), dict(logprob_token_ids=[1]), dict(thinking_token_budget=4),
                    dict(structured_outputs={"regex": "a+"})):
        assert not SamplingParams(temperature=0.6, **options).samples_by_temperature_alone, options
