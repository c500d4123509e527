"""Reference model for the KV pool tests: the pre-optimisation KVCacheManager, kept as is.

This is the straightforward implementation that ``simcap/engine/kv_cache.py`` and
``Request.hash_full_blocks`` replaced (OrderedDict free queue, delete-on-evict cache map,
per-block chained tuple hashes). It is not used by the simulator: ``tests/test_kv_oracle.py``
drives it and the real pool with the same operations and requires identical observable
behaviour, and ``benchmarks/bench_kv.py`` times it as the "old" side.

The per-request hash state (``block_hashes`` and the cursor) lived on the Request; here it
lives in the oracle, keyed by request id, so that the oracle depends only on a request's
content fields (segments, output_key, token counts).
"""

from __future__ import annotations

from collections import OrderedDict


class OracleHasher:
    """The old ``Request.hash_full_blocks``: chained Python tuple hashes, one per block."""

    def __init__(self) -> None:
        self._state: dict[int, tuple[list[int], tuple[int, int, int]]] = {}

    def hash_full_blocks(self, request, block_size: int) -> list[int]:
        state = self._state.get(request.request_id)
        if state is None:
            state = self._state[request.request_id] = ([], (0, 0, 0))
        hashes = state[0]
        num_full = (request.num_prompt_tokens + request.num_output_tokens) // block_size
        if len(hashes) >= num_full:
            return hashes
        seg_index, offset, parent = state[1]
        segments = request.segments
        num_segments = len(segments)
        while len(hashes) < num_full:
            # Fast case: the block lies inside one segment.
            if seg_index < num_segments:
                key, length = segments[seg_index]
            else:
                key, length = request.output_key, request.num_output_tokens
            if length - offset >= block_size:
                parent = hash((parent, key, offset))
                hashes.append(parent)
                offset += block_size
                if offset == length and seg_index < num_segments:
                    seg_index += 1
                    offset = 0
                continue
            pieces = []
            need = block_size
            while need:
                if seg_index < num_segments:
                    key, length = segments[seg_index]
                else:  # the output segment grows with the request
                    key, length = request.output_key, request.num_output_tokens
                take = min(need, length - offset)
                pieces.append((key, offset, offset + take))
                offset += take
                need -= take
                if offset == length and seg_index < num_segments:
                    seg_index += 1
                    offset = 0
            parent = hash((parent, tuple(pieces)))
            hashes.append(parent)
        self._state[request.request_id] = (hashes, (seg_index, offset, parent))
        return hashes


class OracleKVCacheManager:
    """The old KVCacheManager (vLLM's BlockPool + KVCacheManager with prefix caching)."""

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
        # hash -> every block holding it, oldest first (vLLM keeps duplicates; hits take the
        # oldest).
        self.cached_block_hash_to_block: dict[int, list[int]] = {}
        self.req_to_blocks: dict[int, list[int]] = {}
        self._num_committed: dict[int, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.hasher = OracleHasher()

    def free_block_ids(self) -> list[int]:
        return list(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def num_blocks_held(self, request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def get_computed_blocks(self, request, drop_last_block: bool = False) -> tuple[list[int], int]:
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self.hasher.hash_full_blocks(request, bs)
        cached = self.cached_block_hash_to_block
        blocks: list[int] = []
        for i in range(max_blocks):
            holders = cached.get(hashes[i])
            if holders is None:
                break
            blocks.append(holders[0])
        if drop_last_block and blocks:
            blocks.pop()
        return blocks, len(blocks) * bs

    def record_prefix_cache_stats(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks=(),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        bs = self.block_size
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        num_held = len(held) if held is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        need_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if need_tokens > self.max_model_len:
            need_tokens = self.max_model_len
        if not new_computed_blocks and need_tokens <= num_held * bs:
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
        for block in new_computed_blocks:
            if ref_cnt[block] == 0:
                del free_queue[block]
            ref_cnt[block] += 1
            held.append(block)
        if num_new_blocks > 0:
            block_hash = self.block_hash
            for _ in range(num_new_blocks):
                block, _ = free_queue.popitem(last=False)
                h = block_hash[block]
                if h is not None:
                    self._uncache(h, block)
                    block_hash[block] = None
                ref_cnt[block] = 1
                held.append(block)
        if self.enable_caching:
            if new_computed_blocks and rid not in self._num_committed:
                self._num_committed[rid] = len(new_computed_blocks)
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def append_block(self, request) -> None:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            self._uncache(h, block)
            self.block_hash[block] = None
        self.ref_cnt[block] = 1
        self.req_to_blocks[request.request_id].append(block)

    def commit_full_blocks(self, request) -> None:
        if self.enable_caching:
            num_tokens = request.num_prompt_tokens + request.num_output_tokens
            computed = request.num_computed_tokens
            self._cache_full_blocks(request, computed if computed < num_tokens else num_tokens)

    def _uncache(self, h: int, block: int) -> None:
        holders = self.cached_block_hash_to_block[h]
        holders.remove(block)
        if not holders:
            del self.cached_block_hash_to_block[h]

    def _cache_full_blocks(self, request, num_tokens: int) -> None:
        bs = self.block_size
        num_full = num_tokens // bs
        rid = request.request_id
        done = self._num_committed.get(rid, 0)
        if num_full <= done:
            return
        hashes = self.hasher.hash_full_blocks(request, bs)
        blocks = self.req_to_blocks[rid]
        cached = self.cached_block_hash_to_block
        block_hash = self.block_hash
        for i in range(done, num_full):
            h = hashes[i]
            block = blocks[i]
            block_hash[block] = h
            cached.setdefault(h, []).append(block)
        self._num_committed[rid] = num_full

    def free(self, request) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self._num_committed.pop(rid, None)
        if not blocks:
            return
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        block_hash = self.block_hash
        head_first = self.free_unhashed_first
        to_head = []  # vLLM prepends these as one run, in the order freed (tail block first)
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                free_queue[block] = None
                if head_first and block_hash[block] is None:
                    to_head.append(block)
        for block in reversed(to_head):
            free_queue.move_to_end(block, last=False)

    def check_invariants(self) -> None:
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
