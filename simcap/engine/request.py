"""A request inside the engine model, with vLLM's field names.

Token *content* matters only for prefix caching, so a request carries no token ids: its
prompt is a sequence of segments ``(key, length)``. Two requests whose prompts open with the
same segments hold the same tokens there (a shared system prompt, an earlier turn of the same
conversation). Output tokens form one more segment keyed by ``output_key``, so that a later
turn can quote them and a preempted request can hit its own freed blocks.
"""

from __future__ import annotations

import enum


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_LENGTH_CAPPED = 3  # max_tokens or max_model_len reached


class Request:
    """Engine-side state of one request (``vllm/v1/request.py``)."""

    __slots__ = (
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
        "num_preemptions",
        "num_cached_tokens",
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
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        # Unique content by default: a key no other request uses.
        self.segments = segments if segments is not None else ((-2 * request_id - 1, num_prompt_tokens),)
        if sum(length for _, length in self.segments) != num_prompt_tokens:
            raise ValueError("segments must add up to num_prompt_tokens")
        self.output_key = output_key if output_key is not None else -2 * request_id - 2
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_spec_tokens = 0  # len(spec_token_ids): drafts awaiting verification
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.block_hashes: list[int] = []
        self._hash_cursor = (0, 0, 0)  # (segment index, offset in it, parent hash)
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

    def hash_full_blocks(self, block_size: int) -> list[int]:
        """Extend ``block_hashes`` over every full block of ``num_tokens``; return the list.

        Block ``i``'s hash chains its parent's hash with the (key, start, end) pieces of the
        segments it covers, as vLLM chains ``hash(parent, block_tokens)``; a block inside one
        segment hashes as ``(parent, key, start)``.
        """
        hashes = self.block_hashes
        num_full = self.num_tokens // block_size
        if len(hashes) >= num_full:
            return hashes
        seg_index, offset, parent = self._hash_cursor
        segments = self.segments
        num_segments = len(segments)
        while len(hashes) < num_full:
            # Fast case: the block lies inside one segment.
            if seg_index < num_segments:
                key, length = segments[seg_index]
            else:
                key, length = self.output_key, self.num_output_tokens
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
                    key, length = self.output_key, self.num_output_tokens
                take = min(need, length - offset)
                pieces.append((key, offset, offset + take))
                offset += take
                need -= take
                if offset == length and seg_index < num_segments:
                    seg_index += 1
                    offset = 0
            parent = hash((parent, tuple(pieces)))
            hashes.append(parent)
        self._hash_cursor = (seg_index, offset, parent)
        return hashes
