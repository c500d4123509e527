"""The KV pool and block hashing against the reference model in ``tests/kv_oracle.py``.

Random operation sequences (admissions with prefix hits, EAGLE's dropped last hit, chunked
prefill, decode with drafts and lookahead, the fast path's append_block, cache_blocks and
commit_full_blocks, finishing, preemption and readmission) drive the pool and the reference
model side by side on tiny pools, where eviction and allocation failure are common. After
every operation both must agree on return values, every request's blocks, the free queue's
order, ref counts, usage and the prefix-cache counters. Hash values may differ; which blocks
hash alike may not.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simcap.engine.kv_cache import KVCacheManager
from simcap.engine.request import Request, RequestStatus
from tests.kv_oracle import OracleHasher, OracleKVCacheManager

KEYS = [1, 2, 3, 100, 101]  # 100 and 101 are also output keys: a prompt can quote an output


@st.composite
def segment_lists(draw, block_size: int, min_tokens: int = 1):
    shared = draw(st.sampled_from([(), ((1, block_size),), ((1, block_size + 3),), ((2, 2 * block_size),)]))
    rest = draw(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 3 * block_size)), max_size=4))
    segments = tuple(shared) + tuple(rest)
    if sum(n for _, n in segments) < min_tokens:
        segments += ((draw(st.sampled_from(KEYS)), min_tokens),)
    return segments


def compare(pool: KVCacheManager, oracle: OracleKVCacheManager, waiting=()) -> None:
    """Everything observable agrees; ``waiting``: requests that may be admitted next, whose
    prefix hits must agree. (The pool keeps blocks only their own running or finished request
    could hit out of its prefix cache, so the caches' sizes may differ.)"""
    for req in waiting:
        assert pool.get_computed_blocks(req) == oracle.get_computed_blocks(req)
    assert pool.free_block_ids() == list(oracle.free_queue)
    assert pool.num_free_blocks == oracle.num_free_blocks
    assert pool.usage == oracle.usage
    assert pool.req_to_blocks == oracle.req_to_blocks
    assert pool.ref_counts() == oracle.ref_cnt
    assert pool.prefix_cache_queries == oracle.prefix_cache_queries
    assert pool.prefix_cache_hits == oracle.prefix_cache_hits
    pool.check_invariants()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_pool_matches_reference_model(data):
    draw = data.draw
    bs = draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    num_blocks = draw(st.integers(2, 24), label="num_blocks")
    max_model_len = draw(st.sampled_from([24, 64, 1000]), label="max_model_len")
    kw = dict(
        enable_caching=draw(st.booleans(), label="enable_caching"),
        free_unhashed_first=draw(st.booleans(), label="free_unhashed_first"),
    )
    pool = KVCacheManager(num_blocks, bs, max_model_len, **kw)
    oracle = OracleKVCacheManager(num_blocks, bs, max_model_len, **kw)
    if draw(st.booleans(), label="compact early"):  # exercise the free queue's compaction
        pool.free_queue.compact_at = draw(st.integers(0, 8))
    requests = []
    for i in range(draw(st.integers(1, 6), label="num_requests")):
        if requests and draw(st.booleans(), label="near copy"):
            segments = draw(near_copies(requests[-1].segments), label="segments")
        else:
            segments = draw(segment_lists(bs), label="segments")
        prompt = sum(n for _, n in segments)
        output_key = draw(st.sampled_from([None, None, 100, 101]), label="output_key")
        # Ids from 1: request 0's default keys -1 and -2 have equal Python hashes, which the
        # reference model's tuple hashes inherit.
        requests.append(Request(i + 1, 0.0, prompt, 1000, segments, output_key))
    running: set[int] = set()
    for _ in range(draw(st.integers(1, 60), label="num_ops")):
        op = draw(st.sampled_from(["admit", "admit", "step", "step", "stretch", "finish", "preempt"]), label="op")
        waiting = sorted(set(range(len(requests))) - running)
        pick = sorted(running) if op in ("step", "stretch") or not waiting else waiting
        if op in ("finish", "preempt"):
            pick = list(range(len(requests)))
        if not pick:
            continue
        i = draw(st.sampled_from(pick), label="request")
        req = requests[i]
        if op == "admit" and i not in running:
            if req.num_tokens >= max_model_len:
                continue
            drop = draw(st.booleans(), label="drop_last_block")
            got = pool.get_computed_blocks(req, drop_last_block=drop)
            assert got == oracle.get_computed_blocks(req, drop_last_block=drop)
            hits, num_hit = got
            if kw["enable_caching"]:
                pool.record_prefix_cache_stats(req.num_tokens, num_hit)
                oracle.record_prefix_cache_stats(req.num_tokens, num_hit)
            chunk = draw(st.integers(1, 3 * bs + 2), label="chunk")
            n = min(req.num_tokens - num_hit, chunk)
            lookahead = draw(st.sampled_from([0, 0, 1, 3]), label="lookahead")
            ok = pool.allocate_slots(req, n, num_hit, list(hits), lookahead)
            assert ok == oracle.allocate_slots(req, n, num_hit, list(hits), lookahead)
            if ok:
                running.add(i)
                req.num_computed_tokens = num_hit + n
                if req.num_computed_tokens == req.num_tokens:
                    req.num_output_tokens += 1  # the prefill's last chunk samples a token
        elif op == "step" and i in running:
            computed = req.num_computed_tokens
            if computed < req.num_tokens:  # prefill chunk
                n = min(req.num_tokens - computed, draw(st.integers(1, 3 * bs + 2), label="chunk"))
                num_spec = 0
            else:
                num_spec = draw(st.integers(0, 3), label="drafts")
                n = 1 + num_spec
            if computed + n > max_model_len - 1:
                continue
            lookahead = draw(st.sampled_from([0, 0, 1, 3]), label="lookahead")
            ok = pool.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            assert ok == oracle.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            if ok:
                if num_spec:
                    accepted = draw(st.integers(0, num_spec), label="accepted")
                    req.num_computed_tokens += 1 + accepted
                    req.num_output_tokens += 1 + accepted
                else:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens >= req.num_tokens:
                        req.num_output_tokens += 1
        elif op == "stretch" and i in running and req.num_computed_tokens == req.num_tokens - 1:
            # The fast path: new blocks as decode tokens need them, then one commit; the
            # prompt's last token (a chunk stopped one short) commits its block at once.
            for _ in range(draw(st.integers(1, 3 * bs), label="decode tokens")):
                if req.num_tokens + 1 > max_model_len - 1:
                    break
                if req.num_computed_tokens + 1 > pool.num_blocks_held(req) * bs:
                    if pool.num_free_blocks == 0:
                        break
                    pool.append_block(req)
                    oracle.append_block(req)
                if not req.num_output_tokens:
                    pool.cache_blocks(req, req.num_computed_tokens + 1)
                    assert oracle.allocate_slots(req, 1)  # (the held blocks have room)
                req.num_computed_tokens += 1
                req.num_output_tokens += 1
            pool.commit_full_blocks(req)
            oracle.commit_full_blocks(req)
        elif op in ("finish", "preempt"):
            if op == "finish":
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            pool.free(req)
            oracle.free(req)
            running.discard(i)
            req.num_computed_tokens = 0
            if op == "finish":  # a finished request does not come back: start it afresh
                # (with the same content, but output of its own: a private key is one
                # request's alone)
                output_key = req.output_key if req.output_key >= 0 else None
                requests[i] = Request(req.request_id + 100, 0.0, req.num_prompt_tokens, 1000,
                                      req.segments, output_key)
        compare(pool, oracle, [r for j, r in enumerate(requests) if j not in running])


# ---------------------------------------------------------------------------- hashing


def hashes(segments, block_size, num_output=0, output_key=None, request_id=1):
    req = Request(request_id, 0.0, sum(n for _, n in segments), 1000, tuple(segments), output_key)
    req.num_output_tokens = num_output
    return req.hash_full_blocks(block_size)


def test_block_hashes_identify_the_whole_content_prefix():
    a, b = 7, 8
    # Same tokens split differently are different content: (A 0..7, A 0..7) != A 0..15.
    assert hashes([(a, 16)], 16) != hashes([(a, 8), (a, 8)], 16)
    # A block straddling segments hashes alike across requests.
    assert hashes([(a, 10), (b, 6)], 16, request_id=1) == hashes([(a, 10), (b, 6)], 16, request_id=2)
    assert hashes([(a, 10), (b, 6)], 16) != hashes([(a, 10), (a, 6)], 16)
    # Blocks agree exactly as far as the content does.
    x = hashes([(a, 20), (b, 30)], 8)
    y = hashes([(a, 20), (b, 12), (a, 18)], 8)
    assert x[:4] == y[:4] and x[4] != y[4]
    # An empty segment changes what follows it, as in the chained per-block scheme.
    assert hashes([(a, 8), (b, 0), (a, 8)], 8)[1] != hashes([(a, 8), (a, 8)], 8)[1]
    assert hashes([(a, 8), (a, 8), (b, 0)], 8) == hashes([(a, 8), (a, 8)], 8)
    # Outputs are one more segment: a later turn quoting them shares those blocks.
    assert hashes([(a, 10)], 4, num_output=14, output_key=50) == hashes([(a, 10), (50, 14)], 4)


def test_hashes_extend_incrementally_as_outputs_grow():
    segments = ((3, 5), (4, 40), (5, 1))
    whole = hashes(segments, 4, num_output=57, output_key=9)
    req = Request(1, 0.0, 46, 1000, segments, 9)
    for n in (0, 1, 2, 3, 9, 10, 30, 31, 57):
        req.num_output_tokens = n
        assert req.hash_full_blocks(4) == whole[: (46 + n) // 4]


def truncated(segments, end):
    """The segment list cut at token ``end``: the content identity a block ending there has."""
    out, start = [], 0
    for key, n in segments:
        if start >= end:
            break
        out.append((key, min(n, end - start)))
        start += n
    return out


@st.composite
def near_copies(draw, segments):
    """The same content or a small edit of it: an empty segment, a split, a length or key."""
    segs = list(segments)
    k = draw(st.integers(0, len(segs)))
    edit = draw(st.sampled_from(["same", "empty", "split", "length", "key"]))
    if edit == "empty":
        segs.insert(k, (draw(st.sampled_from(KEYS)), 0))
    elif k < len(segs):
        key, n = segs[k]
        if edit == "split":
            cut = draw(st.integers(0, n))
            segs[k : k + 1] = [(key, cut), (key, n - cut)]
        elif edit == "length":
            segs[k] = (key, max(0, n + draw(st.sampled_from([-1, 1]))))
        elif edit == "key":
            segs[k] = (draw(st.sampled_from(KEYS)), n)
    if sum(n for _, n in segs) == 0:
        segs.append((1, 1))
    return tuple(segs)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_hash_equality_matches_content_and_the_reference_model(data):
    bs = data.draw(st.sampled_from([1, 3, 4, 16]))
    first = data.draw(segment_lists(bs))
    segs = [first, data.draw(st.one_of(segment_lists(bs), near_copies(first)))]
    outs = [data.draw(st.integers(0, 3 * bs)) for _ in range(2)]
    out_keys = [data.draw(st.sampled_from([100, 101])) for _ in range(2)]
    reqs = [Request(i + 1, 0.0, sum(n for _, n in s), 1000, s, k) for i, (s, k) in enumerate(zip(segs, out_keys))]
    oracle = OracleHasher()
    new, old = [], []
    for req, n in zip(reqs, outs):
        req.num_output_tokens = n
        new.append(req.hash_full_blocks(bs))
        old.append(oracle.hash_full_blocks(req, bs))
    full = [list(s) + [(k, n)] for s, k, n in zip(segs, out_keys, outs)]
    for i in range(min(len(new[0]), len(new[1]))):
        same_content = truncated(full[0], (i + 1) * bs) == truncated(full[1], (i + 1) * bs)
        assert (new[0][i] == new[1][i]) == same_content
        assert (old[0][i] == old[1][i]) == same_content
    assert len(set(new[0])) == len(new[0])  # no two prefixes of one request collide


@pytest.mark.parametrize("compact_at", [0, 3, 4096])
def test_many_touches_few_pops_keep_the_queue_small(compact_at):
    """Hits that touch a long shared prefix while allocating one block: stale entries pile up."""
    pool = KVCacheManager(40, 4, 1000)
    oracle = OracleKVCacheManager(40, 4, 1000)
    pool.free_queue.compact_at = compact_at
    for i in range(300):
        req = Request(i + 1, 0.0, 41, 10, ((1, 40), (1000 + i, 1)))
        got = pool.get_computed_blocks(req)
        assert got == oracle.get_computed_blocks(req)
        hits, num_hit = got
        assert pool.allocate_slots(req, 41 - num_hit, num_hit, list(hits))
        assert oracle.allocate_slots(req, 41 - num_hit, num_hit, list(hits))
        pool.free(req)
        oracle.free(req)
        compare(pool, oracle)
    queue = pool.free_queue
    assert len(queue._main) - queue._head <= 2 * 40 + compact_at


@pytest.mark.parametrize("planted", ["tail_head_swapped"])
def test_the_comparison_catches_a_planted_bug(planted, monkeypatch):
    """A pool whose free() sends hashed blocks to the head must fail the comparison."""
    import types

    def bad_extend(self, blocks):  # hashed blocks to the head instead of the tail
        self._front += blocks
        self.num_free += len(blocks)

    pool = KVCacheManager(9, 4, 1000)
    oracle = OracleKVCacheManager(9, 4, 1000)
    # (on the pool's queue: a compiled class's methods cannot be replaced)
    monkeypatch.setattr(pool.free_queue, "extend", types.MethodType(bad_extend, pool.free_queue))
    reqs = [Request(i + 1, 0.0, 8, 10) for i in range(2)]
    for req in reqs:
        assert pool.allocate_slots(req, 8) and oracle.allocate_slots(req, 8)
    pool.free(reqs[0])
    oracle.free(reqs[0])
    with pytest.raises(AssertionError):
        compare(pool, oracle)
