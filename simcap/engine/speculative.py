"""Speculative decoding: who gets drafts after a step, and how many of them verify.

vLLM V1 appends drafts to ``spec_token_ids``; the next step verifies them in the same target
forward pass as everyone's prefill and decode, accepts the longest matching prefix and emits
``accepted + 1`` tokens (the bonus or corrected token). The scheduler charges the drafts to
the token budget and rolls rejected ones back; this module decides the rest:

- :class:`AcceptanceModel` -- per-position acceptance. vLLM reports per-position rates
  ``r_i = P(accepted >= i)`` (``spec_decode_num_accepted_tokens_per_pos / num_drafts``) and the
  mean acceptance length ``1 + sum(r_i)``. A draft run stops at its first rejection, so the
  rates never increase with position; the conditional probability of position ``i`` given
  ``i-1`` is ``r_i / r_{i-1}``. One uniform draw ``u`` per verified request gives
  ``accepted = #{i : u < r_i}``, which has exactly these rates.
- :class:`Proposer` -- after each step, which requests carry ``k`` drafts into the next:
  EAGLE/EAGLE3 draft for every request that sampled (k sequential draft passes); ngram only
  where the prompt-lookup finds a match: ``proposal_rate`` of request-steps, the same chance
  for every request or (``proposal_concentration``) a chance of each request's own, as its
  content repeats or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np

from simcap.engine.request import Request


class SpeculativeSettings(Protocol):
    """What speculative decoding reads of ``--speculative-config`` (a scenario's
    ``speculative`` section, :class:`simcap.config.scenario.SpeculativeConfig`, is one)."""

    method: str
    num_speculative_tokens: int
    per_position_rates: tuple[float, ...]
    proposal_rate: float
    proposal_concentration: float | None
    proposal_onset_tokens: int


def rates_for_length(acceptance_length: float, k: int) -> tuple[float, ...]:
    """Per-position rates with one constant conditional acceptance ``p`` and mean length L.

    Solves ``1 + p + p^2 + ... + p^k = L`` for ``p`` (bisection; the left side rises with p).
    """
    target = acceptance_length - 1.0
    if target <= 0.0:
        return (0.0,) * k
    if target >= k:
        return (1.0,) * k
    lo, hi = 0.0, 1.0
    for _ in range(100):
        p = (lo + hi) / 2
        if sum(p**i for i in range(1, k + 1)) < target:
            lo = p
        else:
            hi = p
    p = (lo + hi) / 2
    return tuple(p**i for i in range(1, k + 1))


class UniformStream:
    """Uniforms from a generator of its own, drawn ahead in blocks and used in order.

    Each :meth:`take` sees the values that drawing its own would have given (numpy's
    ``Generator.random`` fills an array with successive draws), so callers may take one
    request's, one step's or a whole stretch's worth at a time and get the same numbers.
    The buffer is an array (:attr:`array`, for many at once) and, made from it when first
    read, a list of the same values (:attr:`buffer`, for a few at a time).
    """

    def __init__(self, rng: np.random.Generator, block: int = 4096) -> None:
        self.rng = rng
        self.block = block  # uniforms drawn at once
        self.array = np.zeros(0)  # the buffer's values, as float64
        self._list: list[float] | None = []  # the same as a list, once read
        self.next = 0  # the next unused uniform

    @property
    def buffer(self) -> list[float]:
        """The buffer's values as a list (made from :attr:`array` when first read)."""
        if self._list is None:
            self._list = self.array.tolist()
        return self._list

    def take(self, n: int) -> tuple[list[float], int]:
        """Use up the next ``n`` uniforms: they are ``buffer[start : start + n]`` of the
        returned ``(buffer, start)`` (a list the caller only reads)."""
        buffer, start = self.reserve(n)
        self.next = start + n
        return buffer, start

    def reserve(self, n: int) -> tuple[list[float], int]:
        """``(buffer, start)`` with at least ``n`` unused uniforms from ``buffer[start]`` on,
        none used up (:meth:`advance` does that): a caller reads as many as it needs."""
        start = self.reserve_array(n)
        return self.buffer, start

    def reserve_array(self, n: int) -> int:
        """:meth:`reserve`, the uniforms read from :attr:`array`: the index of the first."""
        start = self.next
        if start + n > len(self.array):
            self.array = np.concatenate((self.array[start:], self.rng.random(max(self.block, n))))
            self._list = None
            self.next = start = 0
        return start

    def advance(self, n: int) -> None:
        """Use up the next ``n`` uniforms (reserved before)."""
        self.next += n


class AcceptanceModel:
    """Samples accepted draft counts from per-position acceptance rates (seeded).

    One uniform per verifying request, from the model's own :class:`UniformStream`.
    """

    def __init__(self, rates: Sequence[float], rng: np.random.Generator) -> None:
        self.rates = np.asarray(rates, dtype=float)
        self.uniforms = UniformStream(rng)
        self.rate_list: list[float] = self.rates.tolist()
        r = self.rate_list
        # The rates never rise with position (as vLLM's per-position rates), so the accepted
        # count for a uniform u is the number of rates above it (see sample).
        self.non_increasing = all(b <= a for a, b in zip(r, r[1:]))
        # Then accepted = bisect_left(neg_rates, -u); and for many uniforms at once (the fast
        # path's reserve_tokens) k - accepted = searchsorted(rates_ascending, u, side="right").
        self.neg_rates = [-x for x in r]
        self.rates_ascending = self.rates[::-1].copy()
        self.mean_tokens = 1.0 + sum(r)  # mean accepted + 1 with every draft verified
        self.tokens: list[int] = []  # reserve_tokens' table, for the stream's array tokens_of
        self.tokens_of: np.ndarray | None = None

    @classmethod
    def from_config(cls, config: SpeculativeSettings, rng: np.random.Generator) -> "AcceptanceModel":
        return cls(config.per_position_rates, rng)

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + sum(r_i)``: vLLM's mean acceptance length for full-length drafts."""
        return 1.0 + float(self.rates.sum())

    def reserve_tokens(self, n: int) -> tuple[list[int], int]:
        """:meth:`UniformStream.reserve` on the model's stream, each uniform ``u`` read as the
        tokens a request emits when it verifies all k drafts: ``1 + accepted``, with accepted
        the number of rates above ``u`` (``min(tokens - 1, d)`` accepted of ``d`` drafts).
        Rates that never rise only (:attr:`non_increasing`). The table is made once for each
        buffer the stream draws (numpy's comparisons of the same floats: the counts
        :meth:`sample` takes, one uniform at a time)."""
        uniforms = self.uniforms
        start = uniforms.reserve_array(n)
        if uniforms.array is not self.tokens_of:
            self.tokens_of = uniforms.array
            rejected = self.rates_ascending.searchsorted(uniforms.array, side="right")
            self.tokens = (len(self.rate_list) + 1 - rejected).tolist()
        return self.tokens, start

    def sample(self, num_drafts: Sequence[int]) -> list[int]:
        """Accepted count for each request that verifies ``num_drafts[i]`` drafts (may be 0)."""
        n = len(num_drafts)
        if n == 0:
            return []
        uniforms, start = self.uniforms.take(n)
        rates = self.rate_list
        accepted = []
        for ui, d in zip(uniforms[start : start + n], num_drafts):
            a = 0
            while a < d and ui < rates[a]:
                a += 1
            accepted.append(a)
        return accepted


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters (``vllm:spec_decode_*``), for simulated and live runs."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: Sequence[int], accepted: Sequence[int]) -> None:
        per_pos = self.accepted_per_pos
        drafts = draft_tokens = accepted_tokens = 0
        for d, a in zip(num_drafts, accepted):
            if d <= 0:
                continue
            drafts += 1
            draft_tokens += d
            accepted_tokens += a
            while len(per_pos) < a:
                per_pos.append(0)
            for i in range(a):
                per_pos[i] += 1
        self.num_drafts += drafts
        self.num_draft_tokens += draft_tokens
        self.num_accepted_tokens += accepted_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """``1 + accepted / drafts`` (bonus token included), as vLLM reports it."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def to_dict(self) -> dict:
        drafts = self.num_drafts
        return {
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
            ),
            "per_position_rate": [c / drafts for c in self.accepted_per_pos] if drafts else [],
        }


def splitmix64(x: int) -> int:
    """A 64-bit mix of ``x`` (SplitMix64's finaliser): neighbouring inputs, unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = (1 << 64) - 1


def step_moments(mean: float, concentration: float, accepted_per_draft: float) -> tuple[float, float]:
    """Mean and variance of the match probability over request-steps when it is Beta(mean,
    concentration) over requests: a request matching with chance ``p`` emits ``1 + p * a``
    tokens a step (``a`` accepted per draft), so it takes steps in proportion to
    ``w = 1 / (1 + p * a)``. The mean is the fraction of request-steps with drafts. Closed
    form: ``E[w] = 2F1(1, alpha; alpha + beta; -a)`` (Gauss's hypergeometric function), and
    ``p w = (1 - w) / a``, ``p^2 w = (p - p w) / a``."""
    from scipy.special import hyp2f1

    alpha, beta = mean * concentration, (1.0 - mean) * concentration
    a = accepted_per_draft
    if a <= 0.0:  # every request takes as many steps
        return mean, mean * (1.0 - mean) / (concentration + 1.0)
    ew = float(hyp2f1(1.0, alpha, alpha + beta, -a))
    epw = (1.0 - ew) / a
    ep2w = (mean - epw) / a
    m = epw / ew
    return m, max(ep2w / ew - m * m, 0.0)


def step_rate_for_request_mean(mean: float, concentration: float, accepted_per_draft: float) -> float:
    """The fraction of request-steps with drafts (:func:`step_moments`)."""
    return step_moments(mean, concentration, accepted_per_draft)[0]


@lru_cache(maxsize=256)
def request_mean_for_step_rate(rate: float, concentration: float, accepted_per_draft: float) -> float:
    """The Beta's mean over requests whose fraction of request-steps with drafts is ``rate``
    (bisection: the step rate rises with the mean; cached, as every simulation of a search
    asks again)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if step_rate_for_request_mean(mid, concentration, accepted_per_draft) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class Proposer:
    """Gives requests their next drafts after a step (EAGLE: all who sampled; ngram: matches).

    ngram's prompt lookup finds a match where the request's own prompt and output repeat the
    last few tokens, so whether it drafts depends on the request's content. Each request has a
    match probability: ``proposal_rate`` for all (no ``proposal_concentration``), or its own,
    drawn from Beta(``m * c``, ``(1 - m) * c``) with ``c`` the concentration and the mean ``m``
    that gives ``proposal_rate`` of request-steps (:func:`request_mean_for_step_rate`): the
    inverse CDF of a uniform hashed from the scenario's seed and the request id, so a request
    keeps its content whatever else runs (another load, the other arm of a crossover, another
    replica) and whichever path (stepping, fast path) first asks. ``proposal_onset_tokens``:
    no match before the request has that many output tokens (a lookup in content that repeats
    only once the output does); the uniform is drawn all the same.
    """

    def __init__(self, config: SpeculativeSettings, rng: np.random.Generator, content_seed: int = 0) -> None:
        self.k = config.num_speculative_tokens
        self.method = config.method
        self.proposal_rate = config.proposal_rate
        self.concentration = config.proposal_concentration
        # ngram: no match before a request has this many output tokens.
        self.onset = config.proposal_onset_tokens
        # Each request's match probability varies (Beta) only with a concentration and a rate
        # below 1 (at rate 1 every request matches in every step).
        self.per_request = self.concentration is not None and self.proposal_rate < 1.0
        self.content_key = splitmix64(int(content_seed) & _MASK64)
        # proposal_rate is a rate of request-steps (what vLLM's counters measure); requests
        # that match often emit more tokens a step and so take fewer steps, so the Beta's mean
        # over requests sits above it.
        self.beta_mean = (
            request_mean_for_step_rate(self.proposal_rate, self.concentration,
                                       sum(config.per_position_rates))
            if self.per_request else self.proposal_rate
        )
        # ngram: one uniform per request that sampled, whether it finished or not.
        self.uniforms = UniformStream(rng)

    def match_probability(self, req: Request) -> float:
        """The chance that a step's prompt lookup matches ``req`` (its own, drawn once)."""
        p = req.match_probability
        if p < 0.0:
            p = req.match_probability = self.content_match_probability(req.request_id)
        return p

    def content_match_probability(self, request_id: int) -> float:
        """Request ``request_id``'s match probability: ``proposal_rate``, or its Beta draw."""
        if not self.per_request:
            return self.proposal_rate
        from scipy.special import betaincinv

        h = splitmix64(self.content_key ^ (int(request_id) & _MASK64))
        u = ((h >> 11) + 0.5) / 9007199254740992.0  # in (0, 1), 53 bits
        m, c = self.beta_mean, self.concentration
        return float(betaincinv(m * c, (1.0 - m) * c, u))

    def propose(self, sampled: Sequence[Request]) -> None:
        """Set ``num_spec_tokens`` for requests that sampled this step and still run."""
        # vLLM drafts k tokens even near max_tokens; tokens past the stop are trimmed.
        k, onset = self.k, self.onset
        if self.proposal_rate >= 1.0:
            for req in sampled:
                if not req.is_finished and req.num_output_tokens >= onset:
                    req.num_spec_tokens = k
            return
        n = len(sampled)
        draws, start = self.uniforms.take(n)
        if self.per_request:
            match = self.match_probability
            for req, u in zip(sampled, draws[start : start + n]):
                if not req.is_finished and u < match(req) and req.num_output_tokens >= onset:
                    req.num_spec_tokens = k
            return
        for req, u in zip(sampled, draws[start : start + n]):
            if not req.is_finished and u < self.proposal_rate and req.num_output_tokens >= onset:
                req.num_spec_tokens = k
