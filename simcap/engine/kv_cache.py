"""The paged KV pool with prefix caching: vLLM's ``BlockPool`` and ``KVCacheManager``.

Blocks ``1 .. num_blocks-1`` are usable; block 0 is vLLM's reserved null block, so the pool
holds ``(num_blocks - 1) * block_size`` tokens. Free blocks wait in an LRU queue: allocation
takes from the head (evicting the block's cached hash), freeing appends a request's cached
blocks to the tail in reverse order, so a request's tail blocks are evicted first. A block whose hash
is cached and whose ref count is 0 is both free and reusable by a prefix hit ("touch").

Invariant (checked by the tests): free blocks + blocks with ref_cnt > 0 == num_blocks - 1.
"""

from __future__ import annotations

from collections import OrderedDict

from simcap.engine.request import Request


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
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached_block_hash_to_block: dict[int, int] = {}
        self.req_to_blocks: dict[int, list[int]] = {}
        self._num_committed: dict[int, int] = {}  # request id -> blocks committed to the cache
        # Prefix-cache counters (tokens), as vllm:prefix_cache_queries / _hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: cached-but-unreferenced blocks count as free."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def num_blocks_held(self, request: Request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def get_computed_blocks(self, request: Request, drop_last_block: bool = False) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that opens the request, and its length in tokens.

        The hit is capped at ``num_tokens - 1``: the last token is always recomputed so that
        the step produces logits. With EAGLE vLLM drops the last hit block.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.hash_full_blocks(bs)
        cached = self.cached_block_hash_to_block
        blocks: list[int] = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
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
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        need_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if need_tokens > self.max_model_len:
            need_tokens = self.max_model_len
        if not new_computed_blocks and need_tokens <= num_held * bs:
            # Common decode step: the held blocks already have room.
            if self.enable_caching:
                num_tokens = request.num_prompt_tokens + request.num_output_tokens
                end = num_computed + num_new_tokens
                self._cache_full_blocks(request, end if end < num_tokens else num_tokens)
            return True
        num_new_blocks = -(-need_tokens // bs) - num_held - len(new_computed_blocks)
        ref_cnt = self.ref_cnt
        num_evictable_hits = 0
        for block in new_computed_blocks:
            if ref_cnt[block] == 0:
                num_evictable_hits += 1
        if num_new_blocks + num_evictable_hits > len(self.free_queue):
            return False
        if held is None:
            held = self.req_to_blocks[rid] = []
        free_queue = self.free_queue
        for block in new_computed_blocks:  # touch: a hit on a free block takes it off the queue
            if ref_cnt[block] == 0:
                del free_queue[block]
            ref_cnt[block] += 1
            held.append(block)
        if num_new_blocks > 0:
            block_hash = self.block_hash
            cached = self.cached_block_hash_to_block
            for _ in range(num_new_blocks):
                block, _ = free_queue.popitem(last=False)
                h = block_hash[block]
                if h is not None:  # evict the LRU cached block
                    if cached.get(h) == block:
                        del cached[h]
                    block_hash[block] = None
                ref_cnt[block] = 1
                held.append(block)
        if self.enable_caching:
            if new_computed_blocks and rid not in self._num_committed:
                self._num_committed[rid] = len(new_computed_blocks)
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def append_block(self, request: Request) -> None:
        """Give a running request one more block (the caller checked one is free).

        The fast path's form of the allocation a decode step makes every ``block_size``
        tokens: the same LRU pop and eviction as :meth:`allocate_slots`.
        """
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached_block_hash_to_block.get(h) == block:
                del self.cached_block_hash_to_block[h]
            self.block_hash[block] = None
        self.ref_cnt[block] = 1
        self.req_to_blocks[request.request_id].append(block)

    def commit_full_blocks(self, request: Request) -> None:
        """Commit every full block of the request's computed tokens to the prefix cache."""
        if self.enable_caching:
            num_tokens = request.num_prompt_tokens + request.num_output_tokens
            computed = request.num_computed_tokens
            self._cache_full_blocks(request, computed if computed < num_tokens else num_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Commit the request's newly full blocks (never drafts) to the prefix cache."""
        bs = self.block_size
        num_full = num_tokens // bs
        rid = request.request_id
        done = self._num_committed.get(rid, 0)
        if num_full <= done:
            return
        hashes = request.hash_full_blocks(bs)
        blocks = self.req_to_blocks[rid]
        cached = self.cached_block_hash_to_block
        block_hash = self.block_hash
        for i in range(done, num_full):
            h = hashes[i]
            block = blocks[i]
            block_hash[block] = h
            if h not in cached:
                cached[h] = block
        self._num_committed[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, to the LRU free queue.

        Cached (hashed) blocks join the tail, to be evicted last; blocks without a hash hold
        nothing reusable and, since vLLM 0.24, go to the head to be reused first.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self._num_committed.pop(rid, None)
        if not blocks:
            return
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        block_hash = self.block_hash
        head_first = self.free_unhashed_first
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                free_queue[block] = None
                if head_first and block_hash[block] is None:
                    free_queue.move_to_end(block, last=False)

    def check_invariants(self) -> None:
        """free + referenced == usable blocks; every referenced block is off the free queue."""
        referenced = sum(1 for c in self.ref_cnt[1:] if c > 0)
        assert referenced + len(self.free_queue) == self.num_blocks - 1, "block leak"
        for block in self.free_queue:
            assert self.ref_cnt[block] == 0, "referenced block on the free queue"
        held = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                held[block] = held.get(block, 0) + 1
        for block, count in held.items():
            assert self.ref_cnt[block] == count, "ref count differs from holders"
