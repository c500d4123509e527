"""A request inside the engine model, with vLLM's field names.

Token *content* matters only for prefix caching, so a request carries no token ids: its
prompt is a sequence of segments ``(key, length)``. Two requests whose prompts open with the
same segments hold the same tokens there (a shared system prompt, an earlier turn of the same
conversation). Output tokens form one more segment keyed by ``output_key``, so that a later
turn can quote them and a preempted request can hit its own freed blocks. Nothing quotes a
request's output while it still runs (a client has not seen all of it yet): the fast path
relies on that to commit a running request's output blocks when it releases them.

Keys below zero are *private*: content that no other request's prompt holds (a request's own
prompt tail, its output unless a later turn quotes it under a key >= 0). A block whose
content reaches into a private segment can only be hit by its own request after a
preemption, and the KV pool keeps it out of the prefix cache until then
(``KVCacheManager._num_registrable``).
"""

from __future__ import annotations

import enum


ALL_PUBLIC = 1 << 62  # num_public_tokens of a request with no private segment


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_LENGTH_CAPPED = 3  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 4  # its client went away (simcap serve)


_WAITING = RequestStatus.WAITING  # (read through the class at every request, it costs more)


class Request:
    """Engine-side state of one request (``vllm/v1/request.py``)."""

    __slots__ = (
        "num_external_tokens",
        "request_id",
        "arrival_time",
        "num_prompt_tokens",
        "max_tokens",
        "segments",
        "output_key",
        "status",
        "num_computed_tokens",
        "num_output_tokens",
        "num_spec_tokens",
        "match_probability",
        "is_prefill_chunk",
        "num_accepted_uncommitted",
        "num_unapplied_tokens",
        "num_rejected_pending",
        "num_preemptions",
        "num_cached_tokens",
        "num_public_tokens",
        "block_hashes",
        "_hash_cursor",
        "scheduled_ts",
        "first_token_ts",
        "last_token_ts",
    )

    def __init__(
        self,
        request_id: int,
        arrival_time: float,
        num_prompt_tokens: int,
        max_tokens: int,
        segments: tuple[tuple[int, int], ...] | None = None,
        output_key: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        # Prompt tokens whose KV another engine computed (disaggregated prefill): admission
        # counts them computed, as vLLM's KV connector does, all but the last prompt token.
        self.num_external_tokens = 0
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        # Unique content by default: a key no other request uses.
        if segments is None:
            segments = ((-2 * request_id - 1, num_prompt_tokens),)
        self.segments = segments
        self.output_key = output_key if output_key is not None else -2 * request_id - 2
        # Tokens before the first private segment (the output's, if the prompt has none).
        public = total = 0
        private = False
        for key, length in segments:
            total += length
            if key < 0:
                private = True
            elif not private:
                public += length
        if total != num_prompt_tokens:
            raise ValueError("segments must add up to num_prompt_tokens")
        if not private and self.output_key >= 0:
            public = ALL_PUBLIC
        self.num_public_tokens = public
        self.status = _WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_spec_tokens = 0  # len(spec_token_ids): drafts awaiting verification
        # ngram: the chance that a step's prompt lookup matches this request's content
        # (set by the proposer when first needed; -1.0 until then).
        self.match_probability = -1.0
        # Whether the last scheduled chunk left tokens to compute (a prefill still under way).
        # Kept only under speculation, where the waiting queue's draft padding reads it.
        self.is_prefill_chunk = False
        # Drafts the last step accepted: their KV is computed, but vLLM caches the blocks they
        # fill only at the request's next allocation (which a finished or preempted request
        # never makes).
        self.num_accepted_uncommitted = 0
        # Async scheduling: tokens the last step sampled that vLLM has not yet applied when the
        # next step is scheduled, so its allocation cannot cache the blocks they fill.
        self.num_unapplied_tokens = 0
        # Async scheduling with drafts: drafts the last step rejected, whose KV slots vLLM still
        # counts when the next step allocates (it rolls them back once the output is applied).
        self.num_rejected_pending = 0
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.block_hashes: list[int] = []
        # (segment index, its first token, its seed, its end or None for the growing output
        # segment) of the segment the last hashed block ends in; None until a block is hashed.
        self._hash_cursor: tuple[int, int, int, int | None] | None = None
        # Timestamps as vLLM's RequestStateStats keeps them (first scheduling, first and
        # latest output token), in simulated seconds.
        self.scheduled_ts: float | None = None
        self.first_token_ts: float | None = None
        self.last_token_ts: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens + self.num_spec_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_LENGTH_CAPPED

    def hash_full_blocks(self, block_size: int, max_blocks: int | None = None) -> list[int]:
        """Extend ``block_hashes`` over every full block of ``num_tokens`` (at least the first
        ``max_blocks`` of them, when given); return the list.

        vLLM chains ``hash(parent_hash, block_token_ids)``, so block ``i``'s hash identifies
        all tokens up to the block's end. Here token content is a list of segments, and the
        same identity is computed without chaining blocks: the prefix that ends ``o`` tokens
        into segment ``j`` (``0 < o <= length_j``) hashes to ``seed_j + o``, where the random
        ``seed_j`` mixes the identity of the whole segments before ``j`` with ``key_j`` (see
        :func:`segment_seed`). Two requests therefore agree on block ``i``'s hash iff their
        segment lists agree up to token ``(i + 1) * block_size``, barring a collision (two
        different seeds closer than the offsets: odds about ``length / 2**60``), and the
        hashes of all blocks that end in one segment are one ``range``. The hashes are kept on
        the request and extended as output tokens grow the last segment.
        """
        hashes = self.block_hashes
        num_full = (self.num_prompt_tokens + self.num_output_tokens) // block_size
        if max_blocks is not None and max_blocks < num_full:
            num_full = max_blocks
        n = len(hashes)
        if n >= num_full:
            return hashes
        cursor = self._hash_cursor
        if cursor is not None:
            _, seg_start, seed, seg_end = cursor
            if seg_end is None or num_full * block_size <= seg_end:  # all in the cursor's segment
                base = seed - seg_start
                if num_full == n + 1:
                    hashes.append(base + num_full * block_size)
                else:
                    hashes.extend(range(base + (n + 1) * block_size, base + num_full * block_size + 1, block_size))
                return hashes
        self._hash_segments(block_size, n, num_full)
        return hashes

    def _hash_segments(self, block_size: int, n: int, num_full: int) -> None:
        """Hash blocks ``n .. num_full-1``, walking the segments their ends lie in."""
        hashes = self.block_hashes
        segments = self.segments
        num_segments = len(segments)
        if self._hash_cursor is None:  # segment 0 starts at token 0
            key = segments[0][0] if num_segments else self.output_key
            seg_index, seg_start, seed = 0, 0, segment_seed(_EMPTY_PREFIX, key)
        else:
            seg_index, seg_start, seed, _ = self._hash_cursor
        target = num_full * block_size
        while True:
            if seg_index < num_segments:
                length = segments[seg_index][1]
            else:  # the output segment grows with the request
                length = self.num_output_tokens
            seg_end = seg_start + length
            last = (seg_end if seg_end < target else target) // block_size
            if last > n:  # blocks n .. last-1 end in this segment
                first = seed + (n + 1) * block_size - seg_start
                hashes.extend(range(first, first + (last - n) * block_size, block_size))
                n = last
            if n >= num_full:
                break
            # The next block ends beyond this segment: chain its whole identity into the next.
            seg_index += 1
            key = segments[seg_index][0] if seg_index < num_segments else self.output_key
            seed = segment_seed(prefix_identity(seed, length), key)
            seg_start = seg_end
        # The segment the last block ends in, and where that segment ends (None: the output).
        self._hash_cursor = (seg_index, seg_start, seed, seg_end if seg_index < num_segments else None)


# Prefix identities from Python's tuple hash (C speed, the same in every run: ints and tuples
# of ints are not salted). Python hashes an int modulo 2**61 - 1 and maps -1 to -2, so keys
# are shifted by 2**60 first: keys below 2**59 in magnitude stay distinct.
_SEED_MASK = (1 << 60) - 1
_KEY_SHIFT = 1 << 60
_PREFIX_SALT = 0x2545F4914F6CDD1D
_EMPTY_PREFIX = 0x6A09E667F3BCC908


def segment_seed(prefix: int, key: int) -> int:
    """Seed of a segment keyed ``key`` that follows the prefix whose identity is ``prefix``.

    60 bits, so that seed + offset stays a machine-sized int: ``range`` over such ints is
    fast, and they hash to themselves in dicts.
    """
    return hash((prefix, key + _KEY_SHIFT)) & _SEED_MASK


def prefix_identity(seed: int, length: int) -> int:
    """Identity of the prefix that ends with the whole segment (``seed``, ``length``).

    Defined for ``length == 0`` too, and different from the segment's own prefix identity,
    so that an empty segment still changes what follows it (as in the per-block chained
    hashes this scheme replaced, where an empty segment was a piece of the next block).
    """
    return hash((seed, length, _PREFIX_SALT))
