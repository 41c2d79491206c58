"""BlockManager unit tests: exact block ids, ref counts and free-queue order (block_size 4)."""
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def seq_of(tokens):
    return Sequence("r", 0, tokens, SamplingParams())


def compute_all(bm, seq, num_tokens=None):
    """Pretend the model ran over the sequence's tokens."""
    seq.num_computed_tokens = seq.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(seq, seq.num_computed_tokens)


def test_fresh_allocation_takes_blocks_in_order():
    bm = BlockManager(num_blocks=11, block_size=4)
    seq = seq_of(list(range(10)))
    assert bm.get_computed_blocks(seq) == []
    assert bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 8
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 8, 9, 10]


def test_full_blocks_are_cached_and_shared():
    bm = BlockManager(num_blocks=11, block_size=4)
    a = seq_of(list(range(10)))
    bm.allocate_slots(a, 10)
    compute_all(bm, a)
    assert [bm.blocks[b].block_hash is not None for b in a.block_table] == [True, True, False]
    b = seq_of(list(range(8)) + [100, 101, 102])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, 3, hits)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_last_prompt_token_is_always_recomputed():
    bm = BlockManager(num_blocks=11, block_size=4)
    a = seq_of(list(range(8)))
    bm.allocate_slots(a, 8)
    compute_all(bm, a)
    # Both blocks are cached, but an 8-token prompt may only hit the first.
    assert bm.get_computed_blocks(seq_of(list(range(8)))) == [0]
    assert bm.get_computed_blocks(seq_of(list(range(9)))) == [0, 1]


def test_free_queue_order_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(list(range(10)))            # blocks 0, 1 full (cached), 2 partial
    bm.allocate_slots(a, 10)
    compute_all(bm, a)
    b = seq_of(list(range(50, 58)) + [1])  # blocks 3, 4 full (cached), 5 partial
    bm.allocate_slots(b, 9)
    compute_all(bm, b)
    assert bm.num_free_blocks == 0
    bm.free(a)
    bm.free(b)
    # Never-hashed blocks first (reused first); cached blocks after, tail before head, in free order.
    assert list(bm.free_queue) == [5, 2, 1, 0, 4, 3]
    c = seq_of(list(range(100, 112)))      # needs 3 blocks: takes 5, 2, then evicts 1
    bm.allocate_slots(c, 12)
    assert c.block_table == [5, 2, 1]
    assert bm.get_computed_blocks(seq_of(list(range(10)))) == [0]   # block 1 evicted, 0 still cached
    assert bm.get_computed_blocks(seq_of(list(range(50, 58)) + [1])) == [3, 4]


def test_hit_on_free_block_leaves_queue_and_counts_against_capacity():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(list(range(9)))
    bm.allocate_slots(a, 9)
    compute_all(bm, a)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    b = seq_of(list(range(8)) + [7, 7, 7, 7, 7, 7, 7, 7, 7])   # 17 tokens: 2 hits + 3 new blocks
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert not bm.allocate_slots(b, 9, hits)   # 2 hits + 3 new > 4 blocks
    assert b.block_table == [] and bm.num_free_blocks == 4 and list(bm.free_queue) == [2, 3, 1, 0]
    b = seq_of(list(range(8)) + [7, 7, 7])
    hits = bm.get_computed_blocks(b)
    assert bm.allocate_slots(b, 3, hits)
    assert b.block_table == [0, 1, 2]
    assert list(bm.free_queue) == [3]


def test_hash_collision_is_caught_by_token_comparison():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(9)))
    bm.allocate_slots(a, 9)
    compute_all(bm, a)
    bm.blocks[1].token_ids = [9, 9, 9, 9]      # as if another prefix had the same hash
    assert bm.get_computed_blocks(seq_of(list(range(9)))) == [0]


def test_chained_hash_depends_on_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate_slots(a, 9)
    compute_all(bm, a)
    # Same second block, different first block: no hit at all.
    assert bm.get_computed_blocks(seq_of([9, 2, 3, 4, 5, 6, 7, 8, 0])) == []


def test_decode_growth_caches_blocks_as_they_fill():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of([1, 2, 3])
    bm.allocate_slots(a, 3)
    compute_all(bm, a)
    a.append_token(4)
    assert bm.allocate_slots(a, 1) and a.block_table == [0]
    compute_all(bm, a)
    assert bm.blocks[0].block_hash is not None
    a.append_token(5)
    assert bm.allocate_slots(a, 1) and a.block_table == [0, 1]


def test_duplicate_block_is_not_registered_and_is_reused_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq_of(list(range(5))), seq_of(list(range(5)))
    bm.allocate_slots(a, 5)
    bm.allocate_slots(b, 5)            # scheduled in the same step, before either was cached
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.cached_block_ids == {bm.blocks[0].block_hash: 0}
    bm.free(b)
    assert list(bm.free_queue)[:2] == [2, 3]   # b's blocks: both uncached, at the front


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq_of(list(range(9)))
    bm.allocate_slots(a, 9)
    compute_all(bm, a)
    assert bm.cached_block_ids == {}
    assert bm.get_computed_blocks(seq_of(list(range(9)))) == []


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq_of(list(range(9))), seq_of(list(range(20, 29)))
    for s in (a, b):
        bm.allocate_slots(s, 9)
        compute_all(bm, s)
    bm.free(a)
    assert list(bm.free_queue) == [2, 1, 0]
    bm.reset_prefix_cache()
    assert list(bm.free_queue) == [1, 0, 2]   # 0 and 1 now never-hashed, moved to the front
    assert set(bm.cached_block_ids.values()) == {3, 4}
    assert bm.get_computed_blocks(seq_of(list(range(9)))) == []
    assert bm.get_computed_blocks(seq_of(list(range(20, 29)))) == [3, 4]


def test_cache_salt_separates_equal_prefixes():
    bm = BlockManager(num_blocks=11, block_size=4)
    salted = Sequence("r", 0, list(range(10)), SamplingParams(), cache_salt="a")
    bm.allocate_slots(salted, 10)
    compute_all(bm, salted)
    assert salted.block_table == [0, 1, 2]
    assert bm.get_computed_blocks(seq_of(list(range(10)))) == []                    # no salt: no hit
    assert bm.get_computed_blocks(Sequence("r", 0, list(range(10)), SamplingParams(), cache_salt="b")) == []
    same = Sequence("r", 0, list(range(10)), SamplingParams(), cache_salt="a")
    assert bm.get_computed_blocks(same) == [0, 1]                                   # both full blocks
