"""The paged KV pool with prefix caching: vLLM's ``BlockPool`` and ``KVCacheManager``.

Blocks ``1 .. num_blocks-1`` are usable; block 0 is vLLM's reserved null block, so the pool
holds ``(num_blocks - 1) * block_size`` tokens. Free blocks wait in an LRU queue: allocation
takes from the head (evicting the block's cached hash), freeing appends a request's cached
blocks to the tail in reverse order, so a request's tail blocks are evicted first. A block whose hash
is cached and whose ref count is 0 is both free and reusable by a prefix hit ("touch").

Three parts, one job each: :class:`FreeBlockQueue` (the LRU order of free blocks),
:class:`PrefixCache` (block hash -> block, and each block's hash) and :class:`KVCacheManager`
(ref counts, the blocks each request holds, and the allocation rules built on the other two).
They are laid out for bulk work: a request gets, commits and frees dozens of blocks at once.

Only a block in the prefix cache (one with a hash) can be shared: a prefix hit is the only
way a second request takes a block. So ``ref_cnt`` is kept for those blocks alone; a block
without a hash has one holder or none, and its ``ref_cnt`` entry stays 0
(:meth:`KVCacheManager.ref_counts` gives every block's count).

Invariant (checked by the tests): free blocks + held blocks == num_blocks - 1.
"""

from __future__ import annotations

from simcap.engine.request import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_LENGTH_CAPPED  # (Request.is_finished: status >= this)


class FreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: free blocks in the order allocation reuses them.

    vLLM keeps a doubly linked list of blocks, so that a block can leave from anywhere when a
    prefix hit touches it. Here the queue is two Python lists, so that bulk pops and pushes
    are slices and ``extend`` calls:

    - ``_front``, a stack of blocks pushed at the head (its last item is the queue's head);
    - ``_main[_head:]``, the rest of the queue in order; pushes at the tail append to it.

    Only blocks pushed at the tail are ever removed from the middle (:meth:`remove`): the
    pool pushes at the head only blocks without cached content, and a prefix hit touches only
    cached ones (``KVCacheManager.check_invariants`` checks that no block in ``_front`` has a
    hash). Removal is lazy: the block's entry stays and ``_stale[block]`` counts it. Entries only
    join ``_main`` at the tail, and a removed block is off the queue until it is pushed
    again, so a block's stale entries always come before its live one: a pop that meets a
    block with a stale count skips that entry and lowers the count. Consumed entries are
    dropped once they outnumber the rest, and stale ones once they outnumber the free blocks
    (hits that touch many blocks while allocation takes few), so memory stays bounded.
    """

    def __init__(self, blocks: range) -> None:
        size = blocks.stop
        self._front: list[int] = []
        self._main: list[int] = list(blocks)
        self._head = 0
        self._stale = [0] * size
        self._num_stale = 0
        self.num_free = len(self._main)
        self.compact_at = 4096  # slack before consumed or stale entries are dropped

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> int:
        """Take the head block."""
        self.num_free -= 1
        front = self._front
        if front:
            return front.pop()
        main = self._main
        head = self._head
        block = main[head]
        head += 1
        if self._num_stale:
            stale = self._stale
            while stale[block]:
                stale[block] -= 1
                self._num_stale -= 1
                block = main[head]
                head += 1
        self._head = head
        if head > self.compact_at and head * 2 > len(main):
            del main[:head]
            self._head = 0
        return block

    def popleft_many(self, n: int) -> list[int]:
        """Take the ``n`` head blocks, in queue order (the caller checked ``n <= len``)."""
        self.num_free -= n
        front = self._front
        out: list[int] = []
        if front:
            k = len(front) if len(front) < n else n
            out = front[-k:]
            del front[-k:]
            out.reverse()
            n -= k
            if not n:
                return out
        main = self._main
        head = self._head
        if not self._num_stale:
            if out:
                out += main[head : head + n]
            else:
                out = main[head : head + n]
            head += n
        else:
            stale = self._stale
            while n:
                block = main[head]
                head += 1
                if stale[block]:
                    stale[block] -= 1
                    self._num_stale -= 1
                else:
                    out.append(block)
                    n -= 1
        if head > self.compact_at and head * 2 > len(main):
            del main[:head]
            head = 0
        self._head = head
        return out

    def extend(self, blocks: list[int]) -> None:
        """Push ``blocks`` at the tail, in order."""
        self._main += blocks
        self.num_free += len(blocks)

    def extend_head(self, blocks: list[int]) -> None:
        """Push each of ``blocks`` at the head in turn: the last one pushed is the new head.
        :meth:`remove` never takes them off (see the class's doc)."""
        self._front += blocks
        self.num_free += len(blocks)

    def remove(self, block: int) -> None:
        """Take a free block off the queue wherever it is (a prefix hit touches it); a block
        pushed at the tail."""
        self.num_free -= 1
        self._stale[block] += 1
        self._num_stale += 1
        if self._num_stale > self.num_free + self.compact_at:
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Rewrite ``_main`` without its consumed and stale entries."""
        stale = self._stale
        live = []
        for block in self._main[self._head :]:
            if stale[block]:
                stale[block] -= 1
            else:
                live.append(block)
        self._main = live
        self._head = 0
        self._num_stale = 0

    def __iter__(self):
        return iter(self.blocks())

    def blocks(self) -> list[int]:
        """The free blocks in queue order, head first."""
        out = self._front[::-1]
        if not self._num_stale:
            return out + self._main[self._head :]
        pending = {}  # block -> stale entries not yet skipped
        stale = self._stale
        for block in self._main[self._head :]:
            skip = pending.get(block, stale[block])
            if skip:
                pending[block] = skip - 1
            else:
                out.append(block)
        return out


class PrefixCache:
    """vLLM's ``BlockPool.cached_block_hash_to_block``: which block holds a prefix's KV.

    ``block_hash[b]`` is the hash of block ``b``'s content while ``b`` holds a committed full
    block (None otherwise). vLLM does not de-duplicate: two requests that compute the same
    block each register their own copy, and the cache keeps every holder of a hash, in the
    order they were registered; a hit takes the oldest still there. Here ``_map`` maps a
    hash to that oldest holder and ``_more`` keeps the later ones (rare: blocks computed
    side by side before either was cached), so evicting the holder hands the entry to the
    next copy, as vLLM's ``BlockHashToBlockMap`` does.
    """

    def __init__(self, num_blocks: int) -> None:
        self.block_hash: list[int | None] = [None] * num_blocks
        self._map: dict[int, int] = {}
        self._more: dict[int, list[int]] = {}  # later holders of a mapped hash, oldest first
        self.num_hashed = 0  # blocks whose block_hash is not None

    def __len__(self) -> int:
        """How many hashes the cache can hit."""
        return len(self._map)

    def longest_prefix(self, hashes: list[int], max_blocks: int) -> list[int]:
        """Blocks holding ``hashes[0]``, ``hashes[1]``, ... up to the first miss."""
        cached = self._map
        if max_blocks <= 0 or hashes[0] not in cached:
            return []
        blocks = list(map(cached.get, hashes[:max_blocks]))
        if None in blocks:
            del blocks[blocks.index(None) :]
        return blocks

    def register(self, blocks: list[int], hashes: list[int]) -> None:
        """Record that ``blocks[i]`` holds ``hashes[i]``; an existing holder keeps the entry.

        The blocks hold no hash yet (a block is registered once, after its allocation)."""
        self.num_hashed += len(blocks)
        block_hash = self.block_hash
        setdefault = self._map.setdefault
        for block, h in zip(blocks, hashes):
            block_hash[block] = h
            if setdefault(h, block) != block:
                self._more.setdefault(h, []).append(block)

    def register_one(self, block: int, h: int) -> None:
        """:meth:`register` for one block (a decode step fills one block at a time)."""
        self.num_hashed += 1
        self.block_hash[block] = h
        if self._map.setdefault(h, block) != block:
            self._more.setdefault(h, []).append(block)

    def evict(self, blocks: list[int]) -> None:
        """Forget the content of blocks taken for reuse."""
        if not self.num_hashed:
            return
        block_hash = self.block_hash
        pop = self._map.pop
        for block in blocks:
            h = block_hash[block]
            if h is not None:
                self.num_hashed -= 1
                block_hash[block] = None
                holder = pop(h, block)
                if holder != block:  # an older copy keeps the entry; this one was a later copy
                    self._map[h] = holder
                    more = self._more[h]
                    more.remove(block)
                    if not more:
                        del self._more[h]
                elif h in self._more:  # the next copy takes the entry
                    more = self._more[h]
                    self._map[h] = more.pop(0)
                    if not more:
                        del self._more[h]

    def check(self) -> None:
        """Every entry points to a block that holds its hash; the hashed blocks are counted."""
        block_hash = self.block_hash
        assert self.num_hashed == len(block_hash) - block_hash.count(None), "hashed count"
        for h, block in self._map.items():
            assert block_hash[block] == h, "cache entry for a block that does not hold it"
        for h, more in self._more.items():
            assert more and h in self._map, "later copies of a hash without its entry"
            assert all(block_hash[b] == h for b in more), "later copy that does not hold it"
        num_copies = len(self._map) + sum(map(len, self._more.values()))
        assert num_copies == self.num_hashed, "hashed blocks missing from the cache"


class KVCacheManager:
    """Allocate, share and free KV blocks for requests; a narrow interface over the pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        free_unhashed_first: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.free_unhashed_first = free_unhashed_first
        self.ref_cnt = [0] * num_blocks  # holders of each block with a hash (see above)
        self._num_shared = 0  # references beyond a block's first: sum of max(ref_cnt - 1, 0)
        self.free_queue = FreeBlockQueue(range(1, num_blocks))
        self.prefix_cache = PrefixCache(num_blocks)
        self.req_to_blocks: dict[int, list[int]] = {}
        self._num_committed: dict[int, int] = {}  # request id -> blocks committed to the cache
        # Requests freed unfinished (preempted) and not finished since: they may hit their
        # own private blocks, so those are registered in the prefix cache (see _num_registrable).
        self._preempted: set[int] = set()
        # Prefix-cache counters (tokens), as vllm:prefix_cache_queries / _hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: cached-but-unreferenced blocks count as free."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def num_blocks_held(self, request: Request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def free_block_ids(self) -> list[int]:
        """The free blocks in LRU order: the next allocation takes the first."""
        return self.free_queue.blocks()

    def get_computed_blocks(self, request: Request, drop_last_block: bool = False) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that opens the request, and its length in tokens.

        The hit is capped at ``num_tokens - 1``: the last token is always recomputed so that
        the step produces logits. With EAGLE vLLM drops the last hit block.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_prompt_tokens + request.num_output_tokens - 1) // bs
        if request.request_id not in self._preempted:  # (_num_registrable, inline)
            limit = request.num_public_tokens // bs
            if limit < max_blocks:  # private blocks of a request never preempted: nobody holds them
                max_blocks = limit
        if max_blocks <= 0:
            return [], 0
        hashes = request.hash_full_blocks(bs, max_blocks)
        blocks = self.prefix_cache.longest_prefix(hashes, max_blocks)
        if drop_last_block and blocks:
            blocks.pop()
        return blocks, len(blocks) * bs

    def record_prefix_cache_stats(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    # ------------------------------------------------------------------ changes

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[int] | tuple[int, ...] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens (plus lookahead slots).

        Returns False, changing nothing, when the free blocks cannot cover the need; the
        scheduler then preempts (running requests) or stops admitting (waiting ones).
        """
        bs = self.block_size
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        num_held = len(held) if held is not None else 0
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need_tokens = end + num_lookahead_tokens
        if need_tokens > self.max_model_len:
            need_tokens = self.max_model_len
        if not new_computed_blocks and need_tokens <= num_held * bs:
            # Common decode step: the held blocks already have room.
            if self.enable_caching:
                num_tokens = request.num_prompt_tokens + request.num_output_tokens - request.num_unapplied_tokens
                if end > num_tokens:
                    end = num_tokens
                if end // bs > self._num_committed.get(rid, 0):
                    self._cache_full_blocks(request, end)
            return True
        num_new_blocks = -(-need_tokens // bs) - num_held - len(new_computed_blocks)
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        if new_computed_blocks:
            # Hits on free cached blocks take them off the free queue ("touch").
            touched = [block for block in new_computed_blocks if not ref_cnt[block]]
            if num_new_blocks + len(touched) > free_queue.num_free:
                return False
            for block in touched:
                free_queue.remove(block)
            self._num_shared += len(new_computed_blocks) - len(touched)
            for block in new_computed_blocks:
                ref_cnt[block] += 1
        elif num_new_blocks > free_queue.num_free:
            return False
        if num_new_blocks > 0:
            if num_new_blocks == 1:
                new = [free_queue.popleft()]
            else:
                new = free_queue.popleft_many(num_new_blocks)
            if self.prefix_cache.num_hashed:
                self.prefix_cache.evict(new)  # the LRU blocks lose their cached content
            if held is None:  # its first blocks
                self.req_to_blocks[rid] = [*new_computed_blocks, *new] if new_computed_blocks else new
            else:
                held += new_computed_blocks
                held += new
        elif held is None:
            self.req_to_blocks[rid] = list(new_computed_blocks)
        else:
            held += new_computed_blocks
        if self.enable_caching:
            if new_computed_blocks and rid not in self._num_committed:
                self._num_committed[rid] = len(new_computed_blocks)
            num_tokens = request.num_prompt_tokens + request.num_output_tokens - request.num_unapplied_tokens
            self._cache_full_blocks(request, end if end < num_tokens else num_tokens)
        return True

    def append_block(self, request: Request) -> None:
        """Give a running request one more block (the caller checked one is free).

        The allocation a decode step makes every ``block_size`` tokens: the same LRU pop and
        eviction as :meth:`allocate_slots`.
        """
        self.append_blocks([request])

    def append_blocks(self, requests: list[Request]) -> None:
        """:meth:`append_block` for each of ``requests`` in turn (the caller checked enough
        blocks are free); a request may appear more than once. The fast path's form: one
        call for all the blocks a stretch of decode steps takes, in the order it takes them."""
        new = self.free_queue.popleft_many(len(requests))
        prefix_cache = self.prefix_cache
        if prefix_cache.num_hashed:  # (else none of them holds content to forget)
            prefix_cache.evict(new)
        req_to_blocks = self.req_to_blocks
        for block, request in zip(new, requests):
            req_to_blocks[request.request_id].append(block)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Commit the request's full blocks of its first ``num_tokens`` tokens to the prefix
        cache: what :meth:`allocate_slots` does for a step that computes up to there, for a
        fast path that takes the step's blocks otherwise (vLLM's ``cache_blocks``)."""
        if self.enable_caching:
            self._cache_full_blocks(request, num_tokens)

    def commit_full_blocks(self, request: Request) -> None:
        """Commit every full block of the request's computed tokens to the prefix cache
        (those of drafts accepted in its last step wait for its next allocation)."""
        if self.enable_caching:
            computed = self._committable(request)
            if computed // self.block_size > self._num_committed.get(request.request_id, 0):
                self._cache_full_blocks(request, computed)

    def _committable(self, request: Request) -> int:
        """How many of the request's leading tokens have their KV committed once it next
        allocates or is released: its computed tokens but the drafts accepted in its last
        step (cached at its next allocation), and under async scheduling but the tokens not
        yet applied (cached a step later; the step before's accepted drafts were cached when
        its output was applied); at most its applied tokens."""
        num_tokens = request.num_prompt_tokens + request.num_output_tokens - request.num_unapplied_tokens
        unapplied = request.num_unapplied_tokens
        computed = request.num_computed_tokens - (unapplied if unapplied else request.num_accepted_uncommitted)
        return computed if computed < num_tokens else num_tokens

    def _num_registrable(self, request: Request) -> int:
        """How many of the request's leading blocks go into the prefix cache when they fill.

        A block whose content includes a private segment (see ``request.py``) can only ever
        be hit by its own request, after a preemption. So the blocks of a request never
        preempted are registered only as far as its public prefix goes; the rest are
        registered when it is first preempted (:meth:`free`), none of their hashes being in
        the cache before, which leaves the cache as registering them one by one would have.
        A finished request's private blocks are never registered: no request can hit them.
        What shows is the same: every block a request could hit, and the order of the free
        queue (a block counts as cached when it is full, registered or not).

        The rule is written inline where blocks fill (hot paths); this is its statement.
        """
        if request.request_id in self._preempted:
            return request.num_tokens // self.block_size  # all of its full blocks
        return request.num_public_tokens // self.block_size

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Commit the request's newly full blocks (never drafts) to the prefix cache."""
        num_full = num_tokens // self.block_size
        rid = request.request_id
        done = self._num_committed.get(rid, 0)
        if num_full <= done:
            return
        self._num_committed[rid] = num_full
        if rid not in self._preempted:  # (_num_registrable, inline: this runs at every fill)
            limit = request.num_public_tokens // self.block_size
            if limit < num_full:
                num_full = limit
        if num_full > done:
            self._register(request, done, num_full)

    def _register(self, request: Request, start: int, stop: int, blocks: list[int] | None = None) -> None:
        """Register the request's blocks ``start .. stop-1`` in the prefix cache (``blocks``:
        those it holds, when not in ``req_to_blocks``)."""
        if stop <= start:
            return
        hashes = request.hash_full_blocks(self.block_size, stop)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id]
        ref_cnt = self.ref_cnt
        if stop == start + 1:
            self.prefix_cache.register_one(blocks[start], hashes[start])
            ref_cnt[blocks[start]] = 1
        else:
            self.prefix_cache.register(blocks[start:stop], hashes[start:stop])
            for block in blocks[start:stop]:
                ref_cnt[block] = 1

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, to the LRU free queue.

        Cached (full, committed) blocks join the tail, to be evicted last; blocks without a
        hash hold nothing reusable and, since vLLM 0.24, go to the head to be reused first.
        A request freed before it finished (preempted) first registers its private blocks,
        which it may hit when it is scheduled again.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        num_committed = self._num_committed.pop(rid, 0) if self._num_committed else 0
        finished = request.status >= _FINISHED  # (request.is_finished, inline)
        preempted = self._preempted
        was_preempted = rid in preempted
        if finished:
            if was_preempted:
                preempted.discard(rid)
        else:
            preempted.add(rid)
        if not blocks:
            return
        num_cached = 0  # blocks 0 .. num_cached-1 hold committed content; the rest none
        num_tracked = 0  # blocks 0 .. num_tracked-1 are in the prefix cache (with ref counts)
        if self.enable_caching:
            bs = self.block_size
            # Commit what the fast path left to commit (commit_full_blocks).
            num_cached = self._committable(request) // bs
            if num_cached < num_committed:
                num_cached = num_committed
            # In the prefix cache: the committed blocks as far as _num_registrable goes (all of
            # them when it was preempted before), and all of them when it is preempted now (it
            # may hit them when rescheduled). Register those not registered yet, in order.
            if was_preempted:
                num_registered = num_committed
                num_tracked = num_cached
            else:
                limit = request.num_public_tokens // bs
                num_registered = num_committed if num_committed < limit else limit
                num_tracked = num_cached if not finished or num_cached < limit else limit
            if num_tracked > num_registered:
                self._register(request, num_registered, num_tracked, blocks)
        # Tail first. Blocks outside the prefix cache had this request as their only holder.
        ref_cnt = self.ref_cnt
        if not self._num_shared:  # nor do the others
            if num_tracked:
                for block in blocks[:num_tracked]:
                    ref_cnt[block] = 0
            cached = blocks[:num_cached]
            cached.reverse()
        else:
            cached = blocks[num_tracked:num_cached]
            cached.reverse()
            for i in range(num_tracked - 1, -1, -1):
                block = blocks[i]
                count = ref_cnt[block] - 1
                ref_cnt[block] = count
                if count:
                    self._num_shared -= 1
                else:
                    cached.append(block)
        if self.free_unhashed_first:
            # vLLM prepends them as a run in the order freed (tail first): the request's last
            # block becomes the head. Pushed one by one, the first block goes in first.
            if num_cached < len(blocks):
                self.free_queue.extend_head(blocks[num_cached:])
            self.free_queue.extend(cached)
        else:
            uncached = blocks[num_cached:]
            uncached.reverse()
            self.free_queue.extend(uncached + cached)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: forget every cached block, so that no
        later request hits; refused (False) while any block is held."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        self.prefix_cache.evict(list(range(self.num_blocks)))
        return True

    def ref_counts(self) -> list[int]:
        """Every block's number of holders (``ref_cnt`` as vLLM keeps it, for all blocks)."""
        counts = [0] * self.num_blocks
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                counts[block] += 1
        return counts

    def check_invariants(self) -> None:
        """free + held == usable blocks; no held block is on the free queue, no cached one
        among the blocks pushed at its head; a block with a hash has ref_cnt == its holders,
        one without has a single holder and ref_cnt 0; cache entries point to blocks holding
        their hash."""
        free = self.free_queue.blocks()
        assert len(free) == self.free_queue.num_free, "free count differs from the queue"
        assert len(set(free)) == len(free), "block twice on the free queue"
        counts = self.ref_counts()
        held = sum(1 for c in counts[1:] if c > 0)
        assert held + len(free) == self.num_blocks - 1, "block leak"
        block_hash = self.prefix_cache.block_hash
        for block in free:
            assert counts[block] == 0 and self.ref_cnt[block] == 0, "held block on the free queue"
        # A prefix hit may take a cached block off the queue: only the tail part supports it.
        assert all(block_hash[b] is None for b in self.free_queue._front), "cached block at the head"
        for block, count in enumerate(counts):
            if block_hash[block] is not None:
                assert self.ref_cnt[block] == count, "ref count differs from holders"
            else:
                assert count <= 1 and self.ref_cnt[block] == 0, "shared block without a hash"
        self.prefix_cache.check()
