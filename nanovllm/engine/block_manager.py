"""BlockManager: paged KV-cache blocks with reference counts and hash-based prefix caching.

No torch here: a block is an id into the KV-cache tensors the model runner owns.

A full block of `block_size` tokens is identified by a chained hash,
`hash(block i) = xxh64(hash(block i-1) || token ids of block i)`, so equal hashes mean equal
prefixes. A hit is confirmed by comparing the block's token ids too. A request with a cache_salt
starts the chain from the salt's hash, so its blocks match only requests with the same salt.
Where a prompt was given as vectors (prompt_embeds), its ids are placeholders: the block's
vectors go into its hash too.

Every block with ref_count 0 sits in one free queue, ordered by reuse preference:

    front | never-hashed blocks | cached blocks, least recently used first | back

Allocation pops from the front, so cached blocks are evicted LRU-first and only when no
empty block is left; a cache hit takes its block out of the queue wherever it stands.
"""
from collections import OrderedDict

import numpy as np
import xxhash


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: list[int] = []   # set only for full, hashed blocks


def salt_hash(cache_salt: str | None, lora_int_id: int = 0) -> int | None:
    """The first block's parent hash: None, or that of the salt and the LoRA adapter's id, so that salted
    blocks match only their salt, and an adapter's blocks (its own K/V) only that adapter's."""
    if cache_salt is None and not lora_int_id:
        return None
    return xxhash.xxh64(f"{lora_int_id}:{cache_salt!r}".encode()).intdigest()


def hash_block(parent_hash: int | None, token_ids: list[int], extra: bytes = b"") -> int:
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}   # block hash -> block id

    def reset_prefix_cache(self):
        """Forget every cached block (after a step that may not have written its K/V)."""
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                block.block_hash, block.token_ids = None, []
                self.free_queue.move_to_end(block.block_id, last=False)   # never-hashed blocks go first
        self.cached_block_ids = {h: b for h, b in self.cached_block_ids.items() if self.blocks[b].ref_count > 0}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hash_full_blocks(self, seq):
        """Extend seq.block_hashes to every full block of seq's known (not pending) tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_resolved_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else salt_hash(seq.cache_salt, seq.lora_int_id)
            embeds = b"" if seq.prompt_embeds is None else seq.prompt_embeds.key(i * bs, (i + 1) * bs)
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], embeds))

    def get_computed_blocks(self, seq) -> list[int]:
        """Ids of cached blocks matching seq's leading full blocks (seq holds no blocks yet).

        The last prompt token is always recomputed, so the step that finishes the prompt has
        logits to sample from: a prompt of exactly k full blocks can hit at most k - 1.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(seq)
        bs = self.block_size
        hits = []
        for i in range(min((seq.num_tokens - 1) // bs, len(seq.block_hashes))):
            block_id = self.cached_block_ids.get(seq.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != seq.token_ids[i * bs:(i + 1) * bs]:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Grow seq's block table to hold its computed tokens, `computed_blocks` and
        `num_new_tokens` more. Returns False, changing nothing, when too few blocks are free.

            | computed (in seq.block_table) | computed_blocks (cache hits) | new |
        """
        num_tokens = (seq.num_computed_tokens + len(computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new_blocks = (self.num_blocks_for(num_tokens) - len(seq.block_table)
                          - len(computed_blocks))
        if num_new_blocks <= 0 and not computed_blocks:
            return True   # (most decode steps: the token fits the last block)
        # A hit on a block nobody holds takes it out of the free queue, too.
        num_reused_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_reused_free > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:   # evict from the prefix cache
            if self.cached_block_ids.get(block.block_hash) == block_id:
                del self.cached_block_ids[block.block_hash]
            block.block_hash, block.token_ids = None, []
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq, num_tokens: int):
        """Register the blocks that seq's first `num_tokens` tokens fill (new ones only).

        Called when those tokens are scheduled, before they are computed: in a step, every layer
        writes all new K/V before any attention reads them, so a later sequence of the same
        batch can already share the blocks."""
        num_full = min(num_tokens, seq.num_resolved_tokens) // self.block_size
        if (not self.enable_prefix_caching or num_full == 0
                or self.blocks[seq.block_table[num_full - 1]].block_hash is not None):
            return   # no full block, or the last is registered and so is every one before it
        self._hash_full_blocks(seq)
        bs = self.block_size
        for i in reversed(range(num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                break   # this one and all before it were registered earlier
            block.block_hash = seq.block_hashes[i]
            block.token_ids = seq.token_ids[i * bs:(i + 1) * bs]
            # A duplicate of an already cached block keeps its hash but stays unregistered.
            self.cached_block_ids.setdefault(block.block_hash, block.block_id)

    def free(self, seq):
        """Release seq's blocks, tail first, so a prefix's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if self.cached_block_ids.get(block.block_hash) != block_id:
                    block.block_hash, block.token_ids = None, []
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
