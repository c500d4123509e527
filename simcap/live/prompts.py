"""Prompts of exact token lengths, built from a request's content segments.

A :class:`~simcap.workloads.requests.RequestSpec` describes its prompt as ``(content key, tokens)``
segments: requests sharing a key share those tokens, which is what prefix caching sees. Live
mode turns each key into a deterministic, seeded sequence of token ids drawn from a pool of
ordinary (non-special) ids of the served model, and sends the prompt to the completions
endpoint as a list of token ids, so the server sees exactly ``num_prompt_tokens`` tokens and
shared prefixes are shared token for token, as in the simulator.

The pool is discovered from the server: ``POST /tokenize`` of a fixed probe text without
special tokens returns ids that are valid for that model and never special. Key ``k``'s
sequence is the first ``n`` ids of an infinite stream seeded by ``(seed, k)``, drawn in fixed
chunks, so a key's tokens do not depend on which requests were built before, or how long.

``period``: every segment is its stream's first ``period`` ids repeated. Such a prompt
repeats itself, so vLLM's ngram proposer (prompt lookup) finds matches in it and its drafts
are accepted where the model continues the pattern, as in code edits and quoted text; random
ids (no period) give a random-weight model little to match.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from simcap.workloads.requests import RequestSpec

_CHUNK = 256

# Varied text: words, digits and punctuation give a pool of a few hundred ordinary ids on
# most tokenizers (all ids a tiny byte-level BPE has for these characters).
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "Sphinx of black quartz, judge my vow? How vexingly quick daft zebras jump; "
    "a capacity simulator predicts latency and throughput of a serving engine: each step "
    "schedules decodes first, then prefill chunks (chunked prefill) within its token budget. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1000 2048 3.14 -7 +8 = 15% #tag @user "
    "[brackets] {braces} <angle> 'quotes' \"double\" a_b c-d e/f g|h ~ ` ^ & * $ \\ "
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    "Requests share a system prompt, so prefix caching saves most of the prompt work."
)


class PromptBuilder:
    """Token ids for request prompts: same key and seed -> same ids, in any run."""

    def __init__(self, token_pool: Iterable[int], seed: int = 0, period: int | None = None) -> None:
        pool = sorted({int(t) for t in token_pool})
        if len(pool) < 2:
            raise ValueError(f"token pool needs at least 2 distinct ids, got {len(pool)}")
        if pool[0] < 0:
            raise ValueError(f"token ids must be >= 0, got {pool[0]}")
        self.pool = np.asarray(pool, dtype=np.int64)
        self.seed = int(seed)
        if period is not None and int(period) < 1:
            raise ValueError(f"prompt period must be >= 1 tokens, got {period}")
        self.period = None if period is None else int(period)
        self._streams: dict[int, tuple[np.random.Generator, np.ndarray]] = {}

    @classmethod
    def for_vocab(
        cls, vocab_size: int, special_ids: Iterable[int] = (), seed: int = 0
    ) -> "PromptBuilder":
        """A pool of every id below ``vocab_size`` except ``special_ids``."""
        special = {int(s) for s in special_ids}
        return cls((i for i in range(vocab_size) if i not in special), seed)

    def _rng(self, key: int) -> np.random.Generator:
        # SeedSequence entropy must be non-negative: fold the key's sign into a flag word.
        key = int(key)
        words = [self.seed, abs(key) & 0xFFFFFFFF, abs(key) >> 32, 1 if key < 0 else 0]
        return np.random.default_rng(np.random.SeedSequence(words))

    def segment_ids(self, key: int, num_tokens: int) -> list[int]:
        """The first ``num_tokens`` ids of key ``key``'s stream (its first ``period`` ids
        repeated, with a period)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self.period is not None and num_tokens > self.period:
            head = self.segment_ids(key, self.period)
            return (head * -(-num_tokens // self.period))[:num_tokens]
        stream = self._streams.get(key)
        if stream is None:
            stream = (self._rng(key), np.empty(0, dtype=np.int64))
        rng, drawn = stream
        while len(drawn) < num_tokens:
            drawn = np.concatenate([drawn, self.pool[rng.integers(0, len(self.pool), _CHUNK)]])
        self._streams[key] = (rng, drawn)
        return drawn[:num_tokens].tolist()

    def segments_ids(self, segments: Sequence[tuple[int, int]]) -> list[int]:
        ids: list[int] = []
        for key, n in segments:
            ids.extend(self.segment_ids(key, n))
        return ids

    def prompt_ids(self, spec: RequestSpec) -> list[int]:
        """The prompt of ``spec`` as exactly ``spec.num_prompt_tokens`` token ids."""
        ids = self.segments_ids(spec.segments)
        if len(ids) != spec.num_prompt_tokens:
            raise ValueError(
                f"request {spec.request_id}: segments give {len(ids)} tokens, "
                f"spec says {spec.num_prompt_tokens}"
            )
        return ids
