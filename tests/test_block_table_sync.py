"""Block tables sent to tensor-parallel workers as changes: exact messages, and the workers'
tables equal rank 0's through growth, preemption (new blocks) and finished sequences."""
from nanovllm.engine.block_table_sync import BlockTableReceiver, BlockTableSender
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def seq_with(blocks: list[int]) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams())
    seq.block_table = list(blocks)
    return seq


def test_only_new_block_ids_travel():
    sender, receiver = BlockTableSender(), BlockTableReceiver()
    a, b = seq_with([4, 7]), seq_with([9])
    first = sender.updates([a, b])
    assert first.rows == [(a.seq_id, True, [4, 7]), (b.seq_id, True, [9])] and first.forget == []
    assert receiver.apply(first).tolist() == [[4, 7], [9, 0]]

    decode = sender.updates([a, b])                       # no new blocks: nothing but the ids
    assert decode.rows == [(a.seq_id, False, []), (b.seq_id, False, [])]
    assert receiver.apply(decode).tolist() == [[4, 7], [9, 0]]

    b.block_table.append(2)                               # b grew a block
    grown = sender.updates([b, a])
    assert grown.rows == [(b.seq_id, False, [2]), (a.seq_id, False, [])]
    assert receiver.apply(grown).tolist() == [[9, 2], [4, 7]]


def test_preempted_sequence_gets_its_whole_new_table():
    sender, receiver = BlockTableSender(), BlockTableReceiver()
    a = seq_with([4, 7, 8])
    receiver.apply(sender.updates([a]))
    a.block_table = [4, 5]                                # freed, then given other blocks
    update = sender.updates([a])
    assert update.rows == [(a.seq_id, True, [4, 5])]
    assert receiver.apply(update).tolist() == [[4, 5]]


def test_finished_sequences_are_forgotten_on_both_sides():
    sender, receiver = BlockTableSender(), BlockTableReceiver()
    a, b = seq_with([1]), seq_with([2])
    receiver.apply(sender.updates([a, b]))
    a.status = SequenceStatus.FINISHED
    update = sender.updates([b])
    assert update.forget == [a.seq_id]
    receiver.apply(update)
    assert set(sender.sent) == set(receiver.tables) == {b.seq_id}
