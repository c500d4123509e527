"""Hand cases of the KV pool: capacity, LRU eviction, prefix hits, free order, usage."""

from __future__ import annotations

from simcap.engine.kv_cache import KVCacheManager
from simcap.engine.request import RequestStatus
from tests.conftest import make_request


def kv(num_blocks=9, block_size=4, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, max_model_len=1024, **kw)


def test_block_zero_is_reserved_and_usage_counts_usable_blocks():
    pool = kv(num_blocks=9)
    assert pool.num_free_blocks == 8
    req = make_request(0, 10, 4)
    assert pool.allocate_slots(req, 10)  # ceil(10 / 4) = 3 blocks
    assert pool.num_blocks_held(req) == 3 and 0 not in pool.req_to_blocks[0]
    assert pool.usage == 3 / 8
    pool.check_invariants()


def test_allocation_fails_without_changing_anything():
    pool = kv(num_blocks=5)  # 4 usable blocks
    req = make_request(0, 20, 4)
    assert not pool.allocate_slots(req, 20)  # needs 5
    assert pool.num_free_blocks == 4 and pool.num_blocks_held(req) == 0
    assert pool.allocate_slots(req, 16)


def test_lookahead_slots_are_reserved():
    pool = kv()
    req = make_request(0, 8, 4)
    assert pool.allocate_slots(req, 8, num_lookahead_tokens=3)  # 11 slots -> 3 blocks
    assert pool.num_blocks_held(req) == 3


def test_free_returns_cached_blocks_to_the_tail_in_reverse_order():
    pool = kv(num_blocks=9)
    a = make_request(0, 8, 4)  # two full blocks, both cached
    pool.allocate_slots(a, 8)
    blocks = list(pool.req_to_blocks[0])
    pool.free(a)
    # Never-used blocks first; a's blocks last, its tail block before its head block.
    assert pool.free_block_ids()[-2:] == [blocks[1], blocks[0]]
    pool.check_invariants()


def test_unhashed_blocks_are_reused_first_since_0_24():
    for first in (True, False):
        pool = kv(num_blocks=9, free_unhashed_first=first)
        a = make_request(0, 6, 4)  # block 1 full (cached), block 2 partial (no hash)
        pool.allocate_slots(a, 6)
        partial = pool.req_to_blocks[0][1]
        pool.free(a)
        assert (pool.free_block_ids()[0] == partial) == first


def test_prefix_hit_shares_blocks_and_eviction_is_lru():
    pool = kv(num_blocks=5, block_size=4)  # 4 usable blocks
    seg = ((1, 8),)
    a = make_request(0, 8, 2, seg)
    pool.allocate_slots(a, 8)
    pool.free(a)  # both blocks cached, free
    b = make_request(1, 9, 2, (*seg, (-3, 1)))
    hits, n = pool.get_computed_blocks(b)
    assert n == 8 and hits == pool_blocks_of(pool, seg)
    assert pool.allocate_slots(b, 1, 8, hits)
    assert pool.ref_cnt[hits[0]] == 1 and hits[0] not in pool.free_block_ids()
    pool.check_invariants()


def pool_blocks_of(pool, seg):
    probe = make_request(99, 9, 1, (*seg, (-5, 1)))
    blocks, _ = pool.get_computed_blocks(probe)
    return blocks


def test_reset_prefix_cache_forgets_every_block_and_is_refused_while_one_is_held():
    """vLLM's BlockPool.reset_prefix_cache: False while a block is held; then no hit."""
    pool = kv(num_blocks=5, block_size=4)
    seg = ((1, 8),)
    a = make_request(0, 8, 2, seg)
    pool.allocate_slots(a, 8)
    assert not pool.reset_prefix_cache()
    pool.free(a)
    assert len(pool_blocks_of(pool, seg)) == 2
    free_order = pool.free_block_ids()
    assert pool.reset_prefix_cache()
    assert pool_blocks_of(pool, seg) == [] and pool.free_block_ids() == free_order
    pool.check_invariants()


def test_evicting_a_cached_block_drops_its_hash():
    pool = kv(num_blocks=3, block_size=4)  # 2 usable blocks
    a = make_request(0, 8, 1, ((1, 8),))
    pool.allocate_slots(a, 8)
    pool.free(a)
    assert len(pool.prefix_cache) == 2
    c = make_request(1, 8, 1)  # unrelated content takes both blocks
    assert pool.allocate_slots(c, 8)
    probe = make_request(2, 9, 1, ((1, 8), (-7, 1)))
    assert pool.get_computed_blocks(probe) == ([], 0)


def test_hit_on_free_cached_block_counts_against_free_blocks():
    pool = kv(num_blocks=4, block_size=4)  # 3 usable
    seg = ((1, 8),)
    a = make_request(0, 8, 1, seg)
    pool.allocate_slots(a, 8)
    pool.free(a)
    b = make_request(1, 12, 1, (*seg, (-3, 4)))
    hits, n = pool.get_computed_blocks(b)
    assert n == 8
    # needs 1 new block + 2 touched free blocks = 3 <= 3 free
    assert pool.allocate_slots(b, 4, n, hits)
    assert pool.num_free_blocks == 0


def test_private_blocks_enter_the_prefix_cache_only_when_their_request_is_preempted():
    pool = kv(num_blocks=9, block_size=4)
    shared = make_request(0, 12, 4, ((5, 8), (-1, 4)))  # 2 shared blocks, then its own
    assert pool.allocate_slots(shared, 12)
    assert len(pool.prefix_cache) == 2  # the private third block is not in the cache
    shared.num_computed_tokens = 12
    shared.num_output_tokens = 1  # the prompt's step sampled a token
    pool.free(shared)  # unfinished: a preemption, after which it may hit all three
    assert len(pool.prefix_cache) == 3
    shared.num_computed_tokens = 0
    hits, n = pool.get_computed_blocks(shared)
    assert n == 12 and len(hits) == 3
    other = make_request(1, 16, 4, ((5, 8), (-3, 8)))
    assert pool.allocate_slots(other, 16)
    other.num_computed_tokens = 16
    other.status = RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = list(pool.req_to_blocks[1])
    pool.free(other)  # finished: its own blocks never enter the cache, yet count as cached
    assert len(pool.prefix_cache) == 3
    assert pool.free_block_ids()[-4:] == blocks[::-1]  # all four full: to the tail, tail first
    pool.check_invariants()


def test_the_registration_rule_counts_blocks():
    """_num_registrable (the rule the hot paths write inline): a request never preempted
    registers its public prefix's full blocks, a preempted one all of its full blocks."""
    pool = kv(num_blocks=9, block_size=4)
    req = make_request(0, 12, 4, ((5, 6), (-1, 6)))  # 6 public tokens: 1 full block
    req.num_output_tokens = 2  # 14 tokens: 3 full blocks
    assert pool._num_registrable(req) == 1
    pool._preempted.add(req.request_id)
    assert pool._num_registrable(req) == 3


def test_a_hash_computed_twice_keeps_both_copies_and_a_hit_takes_the_oldest_left():
    # vLLM does not de-duplicate: two requests computing the same block side by side each
    # cache their copy; evicting the copy the cache pointed to leaves the other to hit.
    pool = kv(num_blocks=7, block_size=4)  # 6 usable blocks
    seg = ((7, 12),)
    a, b = make_request(0, 12, 1, seg), make_request(1, 12, 1, seg)
    pool.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    hits, n = pool.get_computed_blocks(b)
    assert n == 4 and pool.allocate_slots(b, 4, 4, hits)  # b computes block 1 first
    b.num_computed_tokens = 8
    pool.allocate_slots(a, 4)  # then a computes its own copy of block 1
    a.num_computed_tokens = 8
    copy_b, copy_a = pool.req_to_blocks[1][1], pool.req_to_blocks[0][1]
    assert pool.prefix_cache.block_hash[copy_a] == pool.prefix_cache.block_hash[copy_b]
    b.status = RequestStatus.FINISHED_LENGTH_CAPPED
    pool.free(b)
    filler = make_request(2, 16, 1)  # takes every free block: b's copy is evicted
    assert pool.allocate_slots(filler, 16) and copy_b in pool.req_to_blocks[2]
    c = make_request(3, 12, 1, seg)
    assert pool.get_computed_blocks(c) == ([pool.req_to_blocks[0][0], copy_a], 8)
    pool.check_invariants()


def test_unhashed_blocks_go_to_the_head_as_one_run_tail_block_first():
    # vLLM 0.24+ prepends a freed request's unhashed blocks in the order it frees them (tail
    # first), so its last block is reused first.
    pool = kv(num_blocks=9, enable_caching=False)
    a = make_request(0, 12, 4)
    pool.allocate_slots(a, 12)
    blocks = list(pool.req_to_blocks[0])
    pool.free(a)
    assert pool.free_block_ids()[:3] == blocks[::-1]
    pool.check_invariants()
