"""Early stop: end a run as soon as its SLO is certain to fail, whatever happens next.

A capacity search spends most of an overloaded run draining a backlog whose verdict is long
settled. :class:`SloStop` is checked by the engine between steps (``simulate(..., stop=...)``)
and ends the run when one SLO target on TTFT or E2E can no longer hold.

The rule, at simulated time ``t`` of an open-loop run of ``N`` requests (all of them known in
advance), for a target ``METRIC_STAT <= tau`` with METRIC ``ttft`` or ``e2e``:

- every request that has arrived has a known lower bound ``L_i`` of its value: its value
  itself once it is known (the first token came; the request finished), otherwise ``t - a_i``
  (its first token or last token comes at the end of a later step, so at ``t`` or after);
  requests still to arrive have none;
- ``pXX`` (numpy's linear interpolation, as :mod:`simcap.metrics.summary` computes it): with the
  virtual index ``h = (N - 1) * XX / 100``, the percentile lies between the sorted samples
  ``x[floor h]`` and ``x[floor h + 1]`` and is never below ``x[floor h]`` (both of numpy's
  interpolation forms round monotonically). So once ``c >= N - floor(h)`` requests have
  ``L_i > tau``, ``x[floor h] > tau`` and the percentile fails;
- ``mean``: the mean is at least ``sum(L_i) / N``; the run fails once that exceeds ``tau``
  by more than summation rounding (a relative ``1e-9``).

Each step is conservative: a bound only understates a value, so the rule never stops a run
that would have passed (``tests/test_early_stop.py`` compares stopped and full runs on random
scenarios). TPOT and ITL targets never stop a run: a request's later tokens can still pull
them down. Closed-loop runs are never stopped (their request count is not known ahead).

``not_before`` delays the first check (a capacity run waits until its arrival window has
closed, so that every measurement of the window is exact), then the rule is checked every
``period`` simulated seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from simcap.metrics.summary import PERCENTILES

STOPPABLE = ("ttft", "e2e")  # metrics whose value a run's future cannot lower
MEAN_MARGIN = 1e-9  # relative: more than the rounding of a mean over any run's requests
DEFAULT_PERIOD_S = 1.0


def stoppable_keys(slo: Mapping[str, float]) -> list[str]:
    """The SLO keys the rule can settle early (TTFT and E2E targets)."""
    return [k for k in slo if k.partition("_")[0] in STOPPABLE]


def certain_failure(
    key: str, target: float, num_requests: int, lower_bounds: np.ndarray
) -> str | None:
    """Why ``key <= target`` must fail over ``num_requests`` requests, given ``lower_bounds``
    of the values of those that have arrived (None when it may still hold)."""
    metric, _, stat = key.partition("_")
    n = int(num_requests)
    if n <= 0 or lower_bounds.size == 0:
        return None
    over = int(np.count_nonzero(lower_bounds > target))
    if stat == "mean":
        bound = float(lower_bounds.sum()) / n
        if bound > target * (1.0 + MEAN_MARGIN):
            return (f"{key} cannot hold: the {n} requests' mean {metric.upper()} is already "
                    f">= {bound:.6g} s > {target:g} s")
        return None
    q = np.true_divide(PERCENTILES[stat], 100)  # as simcap.metrics.summary computes the index
    need = n - int(math.floor((n - 1) * q))
    if over >= need:
        return (f"{key} cannot hold: {over} of {n} requests already have {metric.upper()} > "
                f"{target:g} s ({need} are enough to fail it)")
    return None


@dataclass
class StopRecord:
    """Where and why a run stopped, and the arrival times of the requests it left unfinished."""

    at_s: float
    key: str
    reason: str
    failed: list[str]  # every SLO key settled as failing at the stop
    unfinished_arrivals: np.ndarray = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "key": self.key, "reason": self.reason,
                "failed": list(self.failed), "unfinished": int(self.unfinished_arrivals.size)}


class SloStop:
    """The engine's stop check for one run (see the module doc). Use one per run."""

    def __init__(
        self, slo: Mapping[str, float], *, not_before: float = 0.0,
        period: float = DEFAULT_PERIOD_S,
    ) -> None:
        if not (period > 0 and math.isfinite(period)):
            raise ValueError(f"period must be > 0 seconds (got {period})")
        self.targets = {k: float(slo[k]) for k in stoppable_keys(slo)}
        self.period = float(period)
        self.next_check = float(not_before) if self.targets else math.inf
        self.record: StopRecord | None = None

    def __call__(self, world: Any, now: float) -> bool:
        """True (and ``self.record`` set) when the run can stop at ``now``."""
        self.next_check = now + self.period
        scheduler = world.scheduler
        # (async scheduling: a request the last step finished is in the metrics, and RUNNING
        # until the next schedule)
        pending = list(scheduler.waiting) + [r for r in scheduler.running if not r.is_finished]
        if not pending and len(world.metrics) >= world.num_arrivals:
            return False  # every request is done: nothing left to skip
        arrival = np.fromiter((r.arrival_time for r in pending), float, len(pending))
        first = np.fromiter(
            (now if r.first_token_ts is None else r.first_token_ts for r in pending),
            float, len(pending),
        )
        ttft_done, e2e_done = world.metrics.completed_latencies()
        bounds = {
            "ttft": np.concatenate([ttft_done, first - arrival]),
            "e2e": np.concatenate([e2e_done, now - arrival]),
        }
        failed = []
        for key, target in self.targets.items():
            why = certain_failure(key, target, world.num_arrivals, bounds[key.partition("_")[0]])
            if why is not None:
                failed.append((key, why))
        if not failed:
            return False
        key, why = failed[0]
        self.record = StopRecord(now, key, why, [k for k, _ in failed], np.sort(arrival))
        return True


def describe(slo: Mapping[str, float]) -> str:
    """The rule in one line, for a result's ``rules``."""
    keys = stoppable_keys(slo)
    return (
        "after the arrival window, checked every second, a run stops once a TTFT or E2E "
        "target cannot hold whatever happens next: pXX fails once N - floor((N-1) XX/100) of "
        "the run's N requests are known to exceed it (a request waiting since a has TTFT and "
        "E2E >= t - a), a mean once its lower bound does; the run counts as failed; keys "
        f"that can stop a run here: {', '.join(keys) if keys else 'none'}"
    )
