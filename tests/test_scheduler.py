"""Scheduler unit tests: token budget, chunked prefill, admission order and preemption."""
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, prefix_caching=True):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len=1000), bm


def seq_of(n, start=0):
    return Sequence("r", 0, list(range(start, start + n)), SamplingParams())


def run_step(sched):
    """Schedule, pretend the model ran, append token 1 to each sampling sequence."""
    out = sched.schedule()
    plan = [(s.seq_id, n) for s, n in zip(out.seqs, out.num_scheduled_tokens)]
    sampling = out.sampling_seqs
    sched.update_computed(out)
    for seq in sampling:
        seq.append_token(1)
    return plan, [s.seq_id for s in sampling]


def test_chunked_prefill_shares_budget_across_sequences():
    sched, _ = make(budget=8)
    a, b = seq_of(10), seq_of(10, 100)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == ([(a.seq_id, 8)], [])
    assert run_step(sched) == ([(a.seq_id, 2), (b.seq_id, 6)], [a.seq_id])
    # a decodes (1 token), b finishes its prompt (4 tokens) in the same batch.
    assert run_step(sched) == ([(a.seq_id, 1), (b.seq_id, 4)], [a.seq_id, b.seq_id])
    assert run_step(sched) == ([(a.seq_id, 1), (b.seq_id, 1)], [a.seq_id, b.seq_id])


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits():
    bm = BlockManager(16, 4, True)
    sched = Scheduler(bm, 8, 12, max_model_len=1000, chunked_prefill=False)
    a, b = seq_of(10), seq_of(6, 100)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == ([(a.seq_id, 10)], [a.seq_id])          # b's 6 tokens do not fit the 2 left
    assert run_step(sched) == ([(a.seq_id, 1), (b.seq_id, 6)], [a.seq_id, b.seq_id])


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_num_seqs=2)
    seqs = [seq_of(3, 10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan, _ = run_step(sched)
    assert [sid for sid, _ in plan] == [seqs[0].seq_id, seqs[1].seq_id]
    assert list(sched.waiting) == [seqs[2]]


def test_preemption_frees_latest_and_requeues_it_first():
    # 4 blocks of 4 tokens. a and b each hold 2 blocks after their prompts.
    sched, bm = make(num_blocks=4, budget=64)
    a, b = seq_of(7), seq_of(8, 100)
    sched.add(a)
    sched.add(b)
    run_step(sched)                      # both prefilled, both sampled: a has 8 tokens, b 9
    assert bm.num_free_blocks == 0
    plan, _ = run_step(sched)            # a fits in its block; b needs a 3rd block: b is preempted
    assert plan == [(a.seq_id, 1)]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.num_preemptions == 1


def test_preempted_sequence_recomputes_from_prefix_cache():
    sched, bm = make(num_blocks=4, budget=64)
    a, b = seq_of(7), seq_of(8, 100)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)                      # b preempted; its 2 full blocks stay cached
    assert sched.num_preemptions == 1
    sched.finish(a)
    plan, _ = run_step(sched)            # b readmitted: its 2 full blocks are hits, 1 token recomputed
    assert plan == [(b.seq_id, 1)]
    assert b.num_cached_tokens == 0      # reported from the first admission only


def test_waiting_sequence_reports_cached_tokens():
    sched, _ = make()
    a = seq_of(9)
    sched.add(a)
    run_step(sched)
    b = seq_of(9)
    sched.add(b)
    plan, _ = run_step(sched)
    assert plan == [(a.seq_id, 1), (b.seq_id, 1)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def test_finish_frees_blocks_and_removes_from_queues():
    sched, bm = make()
    a, b = seq_of(5), seq_of(5, 50)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED and a not in sched.running
    sched.finish(b)
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_same_step_admissions_share_prefix_blocks():
    sched, _ = make()
    a, b = seq_of(9), seq_of(10)
    sched.add(a)
    sched.add(b)
    plan, _ = run_step(sched)
    assert plan == [(a.seq_id, 9), (b.seq_id, 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def priority_seq(n, start, priority):
    return Sequence("r", 0, list(range(start, start + n)), SamplingParams(), priority)


def test_priority_policy_admits_by_priority_then_arrival():
    bm = BlockManager(16, 4, True)
    sched = Scheduler(bm, 2, 64, max_model_len=1000, policy="priority")
    a, b, c = priority_seq(3, 0, 1), priority_seq(3, 10, 0), priority_seq(3, 20, 1)
    for s in (a, b, c):
        sched.add(s)
    plan, _ = run_step(sched)
    assert plan == [(b.seq_id, 3), (a.seq_id, 3)]
    assert list(sched.waiting) == [c]


def test_priority_policy_preempts_the_lowest_priority_not_the_latest():
    """a (priority 5) runs first; b (priority 0) comes later. When the third block is needed, FCFS
    preempts the latest admitted (b itself); the priority policy preempts a."""
    for policy, expect_preempted in (("fcfs", "b"), ("priority", "a")):
        bm = BlockManager(3, 4, True)
        sched = Scheduler(bm, 8, 64, max_model_len=1000, policy=policy)
        a, b = priority_seq(4, 0, 5), priority_seq(4, 100, 0)
        sched.add(a)
        assert run_step(sched) == ([(a.seq_id, 4)], [a.seq_id])
        sched.add(b)
        run_step(sched)                       # a decodes into its 2nd block, b takes the 3rd
        assert bm.num_free_blocks == 0
        plan, _ = run_step(sched)             # b's 5th token needs a 4th block
        preempted = {"a": a, "b": b}[expect_preempted]
        assert preempted.status == SequenceStatus.WAITING and list(sched.waiting) == [preempted]
        assert [sid for sid, _ in plan] == [s.seq_id for s in (a, b) if s is not preempted]
