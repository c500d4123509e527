"""Step-time noise: a random factor on each step's forward time.

Steps of the same composition do not take the same time on a real server (a CPU server's
batch-1 decode step: p5 6.5 ms, median 8.9 ms, p95 14 ms), and latency targets sit on the
tails. ``step_time.noise`` gives, per step kind, the distribution of the factor
``measured / predicted`` that multiplies the forward time the step-time model computes
(whatever form computed it); the host work between steps is not scaled.

Kinds: ``prefill`` (the step computes prompt tokens), ``spec`` (it verifies drafts and
computes no prompt tokens; falls back to ``decode`` when absent) and ``decode`` (the rest).
A kind without a distribution gets the factor 1.

Distributions (see :class:`~simcap.config.scenario.EmpiricalNoise`, :class:`~simcap.config.scenario.LognormalNoise`):

- ``empirical``: ``quantiles[i]`` at probability ``i / (n - 1)``; the factor is the inverse
  CDF at a uniform ``u``, linear between neighbouring quantiles (``numpy.interp``). Its mean
  is the trapezoid ``sum((q[i] + q[i+1]) / 2) / (n - 1)``; :func:`simcap.calibrate.noise_fit.fit_noise` scales the
  fitted quantiles so that this mean is exactly 1 (the step-time model keeps the mean, the
  noise adds the spread); quantiles given by hand are used as given.
- ``lognormal``: ``exp(sigma * z - sigma^2 / 2)`` with ``z`` the standard normal quantile of
  ``u``: mean 1 by construction.

Draws: :class:`StepNoise` has a generator of its own (the scenario's seed, stream 2: the
workload and speculation streams are untouched) and uses one uniform per step that runs a
forward pass, in step order, whatever the step's kind. Uniforms are drawn ahead in blocks
and turned into factors for every configured kind at once; :meth:`StepNoise.peek` reads the
factors of the next steps without using them and :meth:`StepNoise.advance` uses them, so the
fast path can price a stretch, cut it at the horizon or the KV pool, and take only the steps
it ran (:meth:`StepNoise.price_stretch`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import numpy as np

from simcap.engine.scheduler import SchedulerOutput


class NoiseDistribution(Protocol):
    """A factor distribution (``step_time.noise.<kind>``): ``kind`` ``empirical`` with
    ``quantiles``, or ``lognormal`` with ``sigma``."""

    kind: str
    quantiles: Any
    sigma: Any


class NoiseSettings(Protocol):
    """``step_time.noise``: a distribution per step kind (None: factor 1)."""

    decode: NoiseDistribution | None
    prefill: NoiseDistribution | None
    spec: NoiseDistribution | None

KINDS = ("decode", "prefill", "spec")
NOISE_STREAM = 2  # SeedSequence([seed, 2]); 1 is the speculation streams'


def step_kind(out: SchedulerOutput) -> str:
    """``prefill`` if the step computes prompt tokens, else ``spec`` if it verifies drafts,
    else ``decode``."""
    if out.num_prefill_tokens:
        return "prefill"
    if out.num_verify_tokens:
        return "spec"
    return "decode"


def inverse_cdf(dist: NoiseDistribution, u: np.ndarray) -> np.ndarray:
    """Factors at uniforms ``u`` (in [0, 1))."""
    u = np.asarray(u, dtype=float)
    if dist.kind == "empirical":
        q = np.asarray(dist.quantiles, dtype=float)
        return np.interp(u * (len(q) - 1), np.arange(len(q), dtype=float), q)
    from scipy.special import ndtri  # the lognormal form only: scipy is slow to import

    s = dist.sigma
    return np.exp(s * ndtri(u) - 0.5 * s * s)


def mean_factor(dist: NoiseDistribution) -> float:
    """The distribution's mean factor (lognormal: 1; empirical: the trapezoid rule, exact)."""
    if dist.kind == "lognormal":
        return 1.0
    q = np.asarray(dist.quantiles, dtype=float)
    return float(np.sum(q[1:] + q[:-1]) / (2 * (len(q) - 1)))


def period_of(model: Any, forward: float) -> float:
    """The step period for a forward time: ``StepTimeModel.step_period``'s combination with the
    host work."""
    host = model.host_overhead
    if model.async_scheduling:
        return forward if forward > host else host
    return forward + host


class StepNoise:
    """Per-step factors drawn from a generator of their own (see the module doc)."""

    BLOCK = 4096  # uniforms drawn at once

    def __init__(self, config: NoiseSettings, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        dists = {"decode": config.decode, "prefill": config.prefill, "spec": config.spec or config.decode}
        self._dists = {k: d for k, d in dists.items() if d is not None}
        self._factors: dict[str, list[float]] = {k: [] for k in self._dists}
        self._size = 0  # uniforms drawn ahead
        self._next = 0  # the next unused one

    @classmethod
    def from_config(
        cls, config: NoiseSettings | None, seed: int, replica: int = 0
    ) -> "StepNoise | None":
        """The scenario's noise (None when off or no kind has a distribution); replica r > 0
        of a fleet draws from a stream of its own."""
        if config is None or all(getattr(config, k) is None for k in KINDS):
            return None
        entropy = [seed, NOISE_STREAM] + ([replica] if replica else [])
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        return cls(config, rng)

    def _ensure(self, n: int) -> None:
        """At least ``n`` uniforms drawn ahead of the next unused one."""
        start = self._next
        if start + n <= self._size:
            return
        u = self.rng.random(max(self.BLOCK, n))
        for kind, dist in self._dists.items():
            self._factors[kind] = self._factors[kind][start:] + inverse_cdf(dist, u).tolist()
        self._size = self._size - start + len(u)
        self._next = 0

    def peek(self, n: int, kind: str = "decode", offset: int = 0) -> list[float]:
        """The factors of the next ``offset .. offset + n - 1`` steps, were they of ``kind``
        (nothing is used up)."""
        self._ensure(offset + n)
        factors = self._factors.get(kind)
        if factors is None:
            return [1.0] * n
        i = self._next + offset
        return factors[i : i + n]

    def advance(self, m: int) -> None:
        """Use up the next ``m`` steps' draws."""
        self._ensure(m)
        self._next += m

    def factor(self, kind: str) -> float:
        """The next step's factor, used up."""
        f = self.peek(1, kind)[0]
        self._next += 1
        return f

    def step_period(self, model: Any, out: SchedulerOutput) -> float:
        """``model.step_period(out)`` with the forward time scaled by the next factor (a step
        that runs no forward pass draws none)."""
        if not out.total_num_scheduled_tokens:
            return model.step_period(out)
        return period_of(model, model.forward_time(out) * self.factor(step_kind(out)))

    def price_stretch(
        self,
        model: Any,
        first: SchedulerOutput | None,
        running: Sequence[Any],
        context: int,
        now: float,
        horizon: float,
        todo: int,
    ) -> list[float]:
        """Periods of a fast-path stretch with noise, nothing used up.

        ``first``: an already scheduled first step, or None; then up to ``todo`` pure-decode
        steps of the ``running`` batch (``context`` attended tokens before the first of them
        counts its own), priced with ``model.forward_time`` on that step's counts, as the
        reference path prices them. Periods no longer grow along a stretch, so steps are
        priced in chunks (the first sized by the noiseless period, then doubling) until one
        starts at or after ``horizon`` (``now`` plus the periods, added one at a time, as
        the caller adds them: :func:`simcap.simulation.fast_forward.decode_starts`).
        """
        n = len(running)
        periods: list[float] = []
        t = now
        if first is not None:
            todo -= 1
            p = period_of(model, model.forward_time(first) * self.peek(1, step_kind(first))[0])
            periods.append(p)
            t += p
        out = SchedulerOutput(
            reqs=list(running), total_num_scheduled_tokens=n, num_decode_reqs=n, num_decode_tokens=n,
            num_context_tokens=context + n,
        )
        chunk = todo
        if horizon < math.inf and todo:
            p1 = period_of(model, model.forward_time(out))
            if p1 > 0:
                chunk = max(8, min(todo, int((horizon - t) / p1) + 2))
        k = 0  # decode steps priced
        while k < todo and t < horizon:
            c = min(chunk, todo - k)
            for x in self.peek(c, "decode", len(periods)):
                k += 1
                out.num_context_tokens = context + n * k
                p = period_of(model, model.forward_time(out) * x)
                periods.append(p)
                t += p
            chunk *= 2
        return periods
