"""Capacity: the highest arrival rate one replica takes while its SLO holds.

A scenario with a ``deployment`` is searched as a whole fleet (``simcap capacity --replicas
N``; :mod:`simcap.fleet.replicas`): the rate is the fleet's.

The field's method, run in seconds instead of hours: open-loop arrivals (Poisson, or the
scenario's own gamma process) at a series of rates, each held for ``duration_s`` and run in
``replicates`` replicates (replicate ``r`` uses seed ``scenario.seed + r``), every request
completed, the SLO metrics (e.g. TTFT p95) computed per run exactly as ``simcap simulate``
computes them. The x axis is the MEASURED arrival rate of each run (arrivals / duration), as
in the field, where the load generator fell short of the requested rate.

Rules (also carried in every result's ``rules``):

- **pass**: a run passes when every SLO target holds (value <= target). A percentile whose
  run had too few samples for the claim (MLPerf early stopping, see :mod:`simcap.metrics.summary`)
  still passes or fails on its value, and is flagged ``samples_adequate: false``.
- **safe rate** (the "prefix rule"): walk the tested rates upward; the safe rate is the last
  rate before the first rate at which any replicate fails. So every replicate at the safe
  rate passed AND every lower tested rate passed in every replicate; a pass above a failure
  (noise) is not trusted. ``safe_rate`` is the lowest measured arrival rate among that
  rate's replicates (the rate demonstrably taken in every replicate); ``safe_offered_rate``
  is the requested one.
- **saturated** (one run): in the second half of the arrival window ``[T/2, T)``, requests
  completed fall below 0.95 x requests arrived, i.e. completed throughput has stopped
  following the arrival rate and the backlog grows. The second half skips the fill-up at
  the start; the window ends with the arrivals, so the drain afterwards is not counted.
  A stable queue's fluctuations are a few percent of the window's arrivals at most; a
  diverging one loses ``1 - mu/lambda`` of them. In a short window (few arrivals) a few
  percent is one or two requests, within a stable queue's own noise: the shortfall must also
  exceed ``SATURATION_Z`` x ``sqrt(2 n)`` requests, ``n`` the window's time-average number of
  requests in the system (a stable queue's backlog changes by about ``sqrt(2 n)`` over the
  window; a diverging one's grows with the window).
- **saturation rate**: the server's maximum throughput ``mu``, the rate at which the queue
  starts to diverge. Past it the engine runs full batches back to back, so the completion
  rate inside a saturated run's window IS ``mu``: the estimate is the median of that rate
  over the saturated runs. When no tested rate saturates, rates above the highest tested
  one are probed (role ``probe``, one replicate each, never used for the safe rate).
- **early stop** (on by default, ``early_stop=False`` / ``--no-early-stop`` to run every
  request; ``early_stop="interval"``: only in the bootstrap interval's searches, whose runs
  give nothing but a verdict and a completion rate): once the arrival window has closed, a run stops as soon as a TTFT or E2E target
  is certain to fail whatever happens next (:mod:`simcap.simulation.early_stop`: e.g. a p95 fails once
  more than 5% of ALL the run's requests are known to exceed it, a request waiting since
  ``a`` having TTFT >= t - a). It counts as failed, as it would have; the window's
  measurements (measured rate, saturation, completion rate) are complete by then, so the
  search takes the same path as without the stop. What it skips is the drain of the backlog.
  A stopped run's SLO values are not known (None), nor its verdicts on the SLO keys that
  did not stop it (TPOT, ITL): a by-SLO safe rate that reaches such a run is a lower bound.
- **common random numbers**: replicate ``r`` uses seed ``scenario.seed + r`` at every rate,
  and the workload draws unit-rate gaps scaled by ``1 / rate`` and lengths from streams of
  their own, so two rates' runs of a replicate have the same requests, arriving at times in
  the ratio of the rates (:mod:`simcap.workloads.requests`).

The search (:func:`run_search`) and the rules (:func:`capacity_result`) take the runs from
an evaluator (:data:`Evaluate`): :func:`find_capacity` simulates them, ``simcap live capacity``
(:mod:`simcap.live.rate_search`) sends them to a real server; a run becomes a point through
:func:`point_from_measurements` either way.

``find_capacity(..., auto=True)`` brackets the safe rate by doubling or halving from a start
rate (jumping to 0.9 x the completion rate of a saturated run), then bisects until the
bracket is within ``rel_tol`` or ``max_points`` rates were tried. With a profile that carries
``bootstrap`` coefficient sets, the same search is rerun per coefficient set (coarser
tolerance, started from that set's own saturation rate) and ``safe_rate_interval`` is the
central range of those safe rates at the profile's CI level (default 90%: 5th-95th percentile).
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

import numpy as np

from simcap._version import __version__
from simcap.errors import ScenarioError
from simcap.metrics.summary import ADEQUACY, SLO_METRICS, SLO_STATS, early_stopping_min_queries
from simcap.simulation.early_stop import SloStop, describe as describe_early_stop
from simcap.config.scenario import (
    MAX_REQUESTS, MAX_SIMULATED_S, ClosedArrival, GammaArrival, PoissonArrival, Scenario,
    StepTimeConfig, expected_requests,
)
from simcap.fleet.run import simulate
from simcap.simulation.simulator import Result, provenance

DEFAULT_DURATION_S = 300.0
DEFAULT_REPLICATES = 2
MAX_RATES = 1000  # rates one grid tests (each a whole simulation per replicate)
MAX_REPLICATES = 1000
SATURATION_RATIO = 0.95
SATURATION_Z = 2.5  # the shortfall must also exceed this many sd of a stable queue's
REPORTED = ("ttft_p95", "tpot_p95")  # always reported per point, SLO or not

RULES = {
    "pass": "every SLO target holds in the run (value <= target); percentiles with too few "
    "samples (MLPerf early stopping, 99% confidence) are flagged, not failed",
    "safe_rate": "prefix rule: the highest tested rate below the first rate at which any "
    "replicate fails (so it and every lower tested rate passed in every replicate); reported "
    "as the lowest measured arrival rate among its replicates",
    "saturated": f"completed < {SATURATION_RATIO} x arrived in the second half of the arrival "
    f"window [T/2, T), by more than {SATURATION_Z:g} x sqrt(2 n) requests (n: the window's mean "
    "number of requests in the system; a stable queue's backlog moves by about sqrt(2 n))",
    "saturation_rate": "median completion rate (requests/s) inside that window over the "
    "saturated runs: the server's maximum throughput, where the queue starts to diverge",
}


# --------------------------------------------------------------------------- SLO input


def parse_slo(items: Iterable[str] | Mapping[str, float] | None) -> dict[str, float]:
    """``["ttft_p95=2.0", "tpot_p95=50ms"]`` (or a mapping) -> ``{"ttft_p95": 2.0, ...}`` seconds.

    Values are seconds, or milliseconds with an ``ms`` suffix. Raises :class:`ScenarioError`
    naming the offending key.
    """
    if items is None:
        return {}
    pairs: list[tuple[str, Any, str]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), v, f"{k}={v}") for k, v in items.items()]
    else:
        for item in items:
            key, sep, raw = str(item).partition("=")
            key = key.strip()
            if not sep or not key or not raw.strip():
                raise ScenarioError(
                    f"--slo {item!r}: expected METRIC_STAT=SECONDS, e.g. ttft_p95=2.0 or tpot_p95=50ms"
                )
            pairs.append((key, raw.strip(), item))
    allowed = [f"{m}_{s}" for m in SLO_METRICS for s in SLO_STATS]
    out: dict[str, float] = {}
    for key, raw, item in pairs:
        if key not in allowed:
            raise ScenarioError(
                f"slo.{key}: unknown SLO in --slo {item!r}; allowed: METRIC_STAT with METRIC in "
                f"{', '.join(SLO_METRICS)} and STAT in {', '.join(SLO_STATS)}"
            )
        scale = 1.0
        text = str(raw).strip().lower()
        if text.endswith("ms"):
            text, scale = text[:-2], 1e-3
        elif text.endswith("s"):
            text = text[:-1]
        try:
            value = float(text) * scale
        except ValueError:
            raise ScenarioError(
                f"slo.{key}: target must be a number of seconds (or NNms), got {raw!r}"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise ScenarioError(f"slo.{key}: target must be > 0 seconds (got {raw!r})")
        out[key] = value
    return out


def parse_rates(text: str) -> list[float]:
    """``"1,2,3.5"`` or ``"START:STOP:N"`` (N evenly spaced, both ends included) -> rates."""
    text = text.strip()
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise ValueError
            start, stop, n = float(parts[0]), float(parts[1]), int(parts[2])
            if n < 1 or stop < start:
                raise ValueError
            if n > MAX_RATES:
                raise ScenarioError(f"--rates {text!r}: at most {MAX_RATES} rates (got {n})")
            rates = [float(r) for r in np.linspace(start, stop, n)]
        else:
            rates = [float(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise ScenarioError(
            f"--rates {text!r}: expected rates in requests/s as R1,R2,... or START:STOP:N"
        ) from None
    if len(rates) > MAX_RATES:
        raise ScenarioError(f"--rates {text!r}: at most {MAX_RATES} rates (got {len(rates)})")
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise ScenarioError(f"--rates {text!r}: every rate must be > 0 requests/s")
    return sorted(set(rates))


# --------------------------------------------------------------------------- one run


def at_rate(
    scenario: Scenario,
    rate: float,
    *,
    duration_s: float,
    seed: int,
    slo: Mapping[str, float] | None = None,
    step_time: Mapping[str, float] | None = None,
) -> Scenario:
    """The scenario with open-loop arrivals at ``rate`` for ``duration_s``, a seed and an SLO.

    Gamma arrivals keep their burstiness; closed-loop workloads become Poisson (the capacity
    method is open loop). ``step_time``: coefficient values to substitute (bootstrap sets).
    """
    wl = scenario.workload
    arrival = wl.arrival
    if isinstance(arrival, GammaArrival):
        new_arrival: PoissonArrival | GammaArrival = arrival.model_copy(update={"rate": float(rate)})
    else:
        new_arrival = PoissonArrival(process="poisson", rate=float(rate))
    workload = wl.model_copy(
        update={"arrival": new_arrival, "duration_s": float(duration_s), "num_requests": None}
    )
    update: dict[str, Any] = {"workload": workload, "seed": int(seed)}
    if slo is not None:
        update["slo"] = dict(slo)
    if step_time:
        from simcap.calibrate.fit_bench import apply_coefficients

        values = apply_coefficients(scenario.step_time.model_dump(),
                                    {k: float(v) for k, v in step_time.items()})
        update["step_time"] = StepTimeConfig(**values)
    return scenario.model_copy(update=update)


@dataclass(frozen=True)
class CapacityPoint:
    """One run: a requested rate, one replicate, what it measured and whether it passed."""

    rate: float
    replicate: int
    seed: int
    measured_rate: float
    values: dict[str, float | None]  # SLO keys (and REPORTED) -> seconds; None: not known
    slo_pass: dict[str, bool | None]  # None: not known (the run stopped on another key)
    samples_adequate: dict[str, bool]
    passed: bool
    completed: int
    arrived_in_window: int
    completed_in_window: int
    completion_rate: float  # completed per second inside [T/2, T)
    saturated: bool
    role: str = "search"  # "grid", "search", "probe" or "bootstrap"
    stopped: dict[str, Any] | None = None  # early stop: at_s, key, reason, failed, unfinished
    live: dict[str, Any] | None = None  # a live run's facts (simcap.live.rate_search)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "measured_rate": self.measured_rate,
            "replicate": self.replicate,
            "seed": self.seed,
            **self.values,
            "pass": self.passed,
            "slo_pass": dict(self.slo_pass),
            "samples_adequate": dict(self.samples_adequate),
            "completed": self.completed,
            "completion_rate": self.completion_rate,
            "saturated": self.saturated,
            "role": self.role,
            **({"stopped_early": dict(self.stopped)} if self.stopped else {}),
            **({"live": dict(self.live)} if self.live is not None else {}),
        }


def point_from_result(
    result: Result, rate: float, replicate: int, duration_s: float, role: str = "search"
) -> CapacityPoint:
    """Measure one finished simulated run (see :func:`point_from_measurements`)."""
    return point_from_measurements(
        result.summary, result.metrics.arrival_times, result.metrics.finish_times,
        rate=rate, replicate=replicate, seed=result.scenario.seed, duration_s=duration_s,
        role=role, stop=result.stopped,
    )


def point_from_measurements(
    summary: Any,
    arrival: np.ndarray,
    finish: np.ndarray,
    *,
    rate: float,
    replicate: int,
    seed: int,
    duration_s: float,
    role: str = "search",
    stop: Any = None,
    measured_rate: float | None = None,
    live: dict[str, Any] | None = None,
) -> CapacityPoint:
    """Measure one finished run, simulated or live: measured rate, SLO values and flags,
    saturation.

    ``summary``: the run's :class:`~simcap.metrics.summary.Summary` with its SLO; ``arrival`` /
    ``finish``: every request's arrival and finish time on the run's clock (``inf``: never
    finished). ``measured_rate``: default arrivals / ``duration_s``. A run stopped early
    (``stop``, after its arrival window) counts as failed; its SLO values are unknown, and so
    are its verdicts on the keys that did not stop it. ``live``: a live run's facts, kept on
    the point.
    """
    slo = summary.slo or {}
    arrival = np.asarray(arrival, dtype=float)
    finish = np.asarray(finish, dtype=float)
    if stop is not None:
        if stop.at_s < duration_s:
            raise ValueError("a capacity run may only stop after its arrival window")
        left = stop.unfinished_arrivals
        arrival = np.concatenate([arrival, left])
        finish = np.concatenate([finish, np.full(left.size, np.inf)])
    half = duration_s / 2.0
    arrived_w = int(np.count_nonzero((arrival >= half) & (arrival < duration_s)))
    done_w = int(np.count_nonzero((finish >= half) & (finish < duration_s)))
    # time-average number in the system over the window (Little's n; an unfinished one to T)
    inside = np.clip(np.minimum(finish, duration_s), half, duration_s) - np.clip(arrival, half, duration_s)
    n_bar = float(np.clip(inside, 0.0, None).sum()) / half if half > 0 else 0.0
    saturated = (arrived_w > 0 and done_w < SATURATION_RATIO * arrived_w
                 and arrived_w - done_w > SATURATION_Z * math.sqrt(2.0 * n_bar))
    values: dict[str, float | None] = {}
    adequate: dict[str, bool] = {}
    for key in list(slo) + [k for k in REPORTED if k not in slo]:
        metric, _, stat = key.partition("_")
        dist = getattr(summary, SLO_METRICS[metric])
        values[key] = None if stop is not None else dist.stat(stat)
        # the key that stopped a run (TTFT or E2E: one sample a request) has all its requests
        adequate[key] = (
            len(arrival) >= early_stopping_min_queries(ADEQUACY[stat], 1)
            if stop is not None and key in stop.failed and stat in ADEQUACY
            else dist.stat_adequate(stat)
        )
    verdicts: dict[str, bool | None] = {k: bool(v["pass"]) for k, v in slo.items()}
    if stop is not None:
        verdicts = {k: (False if k in stop.failed else None) for k in slo}
    return CapacityPoint(
        rate=float(rate),
        replicate=int(replicate),
        seed=int(seed),
        measured_rate=float(measured_rate) if measured_rate is not None else len(arrival) / duration_s,
        values=values,
        slo_pass=verdicts,
        samples_adequate=adequate,
        passed=bool(summary.slo_pass) and stop is None,
        completed=summary.completed,
        arrived_in_window=arrived_w,
        completed_in_window=done_w,
        completion_rate=done_w / half if half > 0 else 0.0,
        saturated=bool(saturated),
        role=role,
        stopped=stop.to_dict() if stop is not None else None,
        live=live,
    )


def _run_one(task: tuple) -> CapacityPoint:
    scenario, rate, replicate, duration_s, slo, step_time, role, early_stop = task
    s = at_rate(
        scenario, rate, duration_s=duration_s, seed=scenario.seed + replicate, slo=slo,
        step_time=step_time,
    )
    stop = (SloStop(s.slo, not_before=duration_s)
            if early_stop is True or (early_stop == "interval" and role == "bootstrap") else None)
    return point_from_result(simulate(s, stop=stop), rate, replicate, duration_s, role)


def check_workers(workers: int) -> int:
    """``workers`` if it is a whole number of processes >= 1; else a ScenarioError."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ScenarioError(f"--workers: must be a whole number >= 1 (got {workers!r})")
    return workers


class Runner:
    """Runs batches of tasks, in worker processes when ``workers > 1``, results in task order.

    ``map(tasks)`` runs capacity (rate, replicate) tasks; ``map(tasks, fn)`` any picklable
    module-level ``fn`` (the crossover's arms). ``early_stop`` applies to capacity tasks.
    """

    def __init__(self, workers: int = 1, early_stop: bool | str = True) -> None:
        self.workers = check_workers(workers)
        self.early_stop = early_stop
        self._pool: ProcessPoolExecutor | None = None

    def map(self, tasks: list[tuple], fn: Callable[[Any], Any] | None = None) -> list[Any]:
        if fn is None:
            fn, tasks = _run_one, [(*t, self.early_stop) for t in tasks]
        if self.workers == 1 or len(tasks) == 1:
            return [fn(t) for t in tasks]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers)
        return list(self._pool.map(fn, tasks))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- rules


def safe_rate_of(points: Sequence[CapacityPoint], key: str | None = None) -> tuple[float | None, float | None]:
    """Prefix rule over non-probe points: ``(safe offered rate, its lowest measured rate)``.

    ``key``: judge by that SLO key alone instead of the whole SLO; a run whose verdict on it
    is unknown (stopped early on another key) ends the walk like a failure.
    """
    return _prefix_walk(points, key)[:2]


def _prefix_walk(
    points: Sequence[CapacityPoint], key: str | None = None
) -> tuple[float | None, float | None, bool]:
    """:func:`safe_rate_of`, and whether the walk ended on an unknown verdict."""
    by_rate: dict[float, list[CapacityPoint]] = {}
    for p in points:
        if p.role != "probe":
            by_rate.setdefault(p.rate, []).append(p)
    safe: float | None = None
    unknown = False
    for rate in sorted(by_rate):
        runs = by_rate[rate]
        verdicts = [p.passed if key is None else p.slo_pass.get(key, False) for p in runs]
        if not all(verdicts):
            unknown = False not in verdicts
            break
        safe = rate
    if safe is None:
        return None, None, unknown
    return safe, min(p.measured_rate for p in by_rate[safe]), unknown


def saturation_rate_of(points: Sequence[CapacityPoint]) -> float | None:
    """Median completion rate over saturated runs (the server's maximum throughput)."""
    sat = [p.completion_rate for p in points if p.saturated]
    return float(np.median(sat)) if sat else None


def safe_rate_bracket(points: Sequence[CapacityPoint]) -> tuple[float | None, float | None]:
    """(safe rate, lowest measured rate among the failing runs of the first failing tested
    rate): the prefix rule's safe rate lies inside; an end is None where no tested rate
    passed or none failed."""
    by_rate: dict[float, list[CapacityPoint]] = {}
    for p in points:
        if p.role != "probe":
            by_rate.setdefault(p.rate, []).append(p)
    _, safe = safe_rate_of(points)
    for rate in sorted(by_rate):
        failing = [p.measured_rate for p in by_rate[rate] if not p.passed]
        if failing:
            return safe, min(failing)
    return safe, None


def saturation_bracket(points: Sequence[CapacityPoint]) -> tuple[float | None, float | None]:
    """Where the queue starts to diverge, in measured arrival rates, by the prefix rule: (the
    highest measured rate of a run that kept up below the first tested rate at which a run
    saturated, the lowest measured rate of a saturated run at that rate). As for the safe
    rate, a run that kept up above the first saturating rate (noise) is not trusted. An end
    is None where no run kept up below that rate, or none saturated."""
    by_rate: dict[float, list[CapacityPoint]] = {}
    for p in points:
        by_rate.setdefault(p.rate, []).append(p)
    lo: float | None = None
    for rate in sorted(by_rate):
        runs = by_rate[rate]
        sat = [p.measured_rate for p in runs if p.saturated]
        if sat:
            return lo, min(sat)
        top = max(p.measured_rate for p in runs)
        lo = top if lo is None else max(lo, top)
    return lo, None


# --------------------------------------------------------------------------- result


@dataclass
class CapacityResult:
    slo: dict[str, float]
    points: list[CapacityPoint]
    safe_rate: float | None
    safe_offered_rate: float | None
    saturation_rate: float | None
    safe_rate_by_slo: dict[str, float | None]
    duration_s: float
    replicates: int
    mode: str  # "grid" or "auto"
    safe_rate_interval: tuple[float, float] | None = None
    interval_info: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    early_stop: bool | str = True

    def lower_bounds(self) -> dict[str, bool]:
        """Per SLO key: whether its safe rate is only a lower bound (every tested rate passed,
        or the next rate's runs stopped early on another key before this one was known)."""
        tested = [p.rate for p in self.points if p.role != "probe"]
        top = max(tested) if tested else None
        out = {}
        for key in self.slo:
            safe, _, unknown = _prefix_walk(self.points, key)
            out[key] = safe == top or unknown
        return out

    def to_dict(self) -> dict[str, Any]:
        lo, hi = saturation_bracket(self.points)
        return {
            "safe_rate": self.safe_rate,
            "safe_offered_rate": self.safe_offered_rate,
            "saturation_rate": self.saturation_rate,
            "saturation_bracket": [lo, hi],
            "safe_rate_interval": (
                list(self.safe_rate_interval) if self.safe_rate_interval is not None else None
            ),
            "safe_rate_interval_info": self.interval_info,
            "safe_rate_by_slo": dict(self.safe_rate_by_slo),
            "safe_rate_by_slo_is_lower_bound": self.lower_bounds(),
            "slo": dict(self.slo),
            "mode": self.mode,
            "duration_s": self.duration_s,
            "replicates": self.replicates,
            "points": [p.to_dict() for p in self.points],
            "notes": list(self.notes),
            "rules": {**RULES, **({"early_stop": describe_early_stop(self.slo)}
                                  if self.early_stop else {})},
            "provenance": self.provenance,
        }


# --------------------------------------------------------------------------- search


def _search_steps(
    start: float, *, rel_tol: float, max_points: int, step: float = 2.0, min_rate: float = 1e-3
) -> Generator[float, list[CapacityPoint], None]:
    """The search as a coroutine: yields the next rate, is sent that rate's runs.

    Bracketing multiplies or divides the rate by ``step``; after a failing run that
    saturated, it jumps down to 0.9 x that run's completion rate (the server's throughput)
    when that is closer than one step. Then it bisects until the bracket is within
    ``rel_tol`` (relative to its top) or ``max_points`` rates were tried.
    """
    lo: float | None = None  # highest rate at which every replicate passed
    hi: float | None = None  # lowest rate at which some replicate failed
    tried = 0
    rate = start
    while (lo is None or hi is None) and tried < max_points and rate >= min_rate:
        runs = yield rate
        tried += 1
        if all(p.passed for p in runs):
            lo = rate
            rate = rate * step
        else:
            hi = rate
            sat = [p.completion_rate for p in runs if p.saturated]
            jump = 0.9 * min(sat) if sat else 0.0
            rate = jump if rate / step < jump < rate else rate / step
    while lo is not None and hi is not None and hi - lo > rel_tol * hi and tried < max_points:
        mid = (lo + hi) / 2.0
        runs = yield mid
        tried += 1
        if all(p.passed for p in runs):
            lo = mid
        else:
            hi = mid


def _search(
    evaluate: Callable[[float], list[CapacityPoint]], start: float, **kwargs: Any
) -> list[CapacityPoint]:
    """Run :func:`_search_steps` to the end with ``evaluate``; returns every run made."""
    points: list[CapacityPoint] = []
    steps = _search_steps(start, **kwargs)
    try:
        rate = next(steps)
        while True:
            runs = evaluate(rate)
            points.extend(runs)
            rate = steps.send(runs)
    except StopIteration:
        pass
    return points


def _search_many(
    runner: Runner, scenario: Scenario, starts: list[float], sets: list[dict[str, float]],
    replicates: int, duration_s: float, slo: dict[str, float], **kwargs: Any,
) -> list[list[CapacityPoint]]:
    """One search per coefficient set, in lockstep: each round runs every active search's
    next rate (all replicates) as one batch, so worker processes stay busy."""
    gens = [_search_steps(start, **kwargs) for start in starts]
    points: list[list[CapacityPoint]] = [[] for _ in gens]
    pending: dict[int, float] = {}
    for i, gen in enumerate(gens):
        try:
            pending[i] = next(gen)
        except StopIteration:
            pass
    while pending:
        order = list(pending)
        tasks = [
            (scenario, pending[i], r, duration_s, slo, sets[i], "bootstrap")
            for i in order for r in range(replicates)
        ]
        runs = runner.map(tasks)
        nxt: dict[int, float] = {}
        for k, i in enumerate(order):
            mine = runs[k * replicates : (k + 1) * replicates]
            points[i].extend(mine)
            try:
                nxt[i] = gens[i].send(mine)
            except StopIteration:
                pass
        pending = nxt
    return points


def _start_rate(scenario: Scenario) -> float:
    arrival = scenario.workload.arrival
    return float(arrival.rate) if not isinstance(arrival, ClosedArrival) else 1.0


def bootstrap_sets(scenario: Scenario, with_level: bool = False):
    """The profile's bootstrap coefficient sets, limited to keys the scenario took from it.

    A step-time key the scenario overrides keeps the scenario's value in every set. Returns
    (sets, notes), and with ``with_level`` also the profile's CI level (default 0.9).
    """
    path = scenario.profile_file
    if path is None:
        return ([], [], 0.9) if with_level else ([], [])
    from simcap.config.profiles import load_profile

    profile, digest = load_profile(path)
    if scenario.profile is not None and scenario.profile.sha256 != digest:
        notes = [f"profile {path} changed since the scenario was loaded: no bootstrap interval"]
        return ([], notes, 0.9) if with_level else ([], notes)
    ci = profile.provenance.get("ci") if isinstance(profile.provenance, dict) else None
    level = float(ci.get("level", 0.9)) if isinstance(ci, dict) else 0.9
    if not (0.0 < level < 1.0):
        level = 0.9
    if not profile.bootstrap:
        return ([], [], level) if with_level else ([], [])
    fields = set(StepTimeConfig.model_fields)
    current = scenario.step_time.model_dump()
    notes: list[str] = []
    sets: list[dict[str, float]] = []
    skipped: set[str] = set()
    for entry in profile.bootstrap:
        one: dict[str, float] = {}
        for key, value in entry.items():
            if key.startswith("efficiency."):  # the roofline form's multipliers
                name = key.split(".", 1)[1]
                theirs = (profile.step_time.get("efficiency") or {}).get(name, 1.0)
                if (current.get("efficiency") or {}).get(name) != float(theirs):
                    skipped.add(key)
                    continue
                one[key] = float(value)
                continue
            if key not in fields:
                skipped.add(key)
                continue
            from_profile = profile.step_time.get(key)
            if from_profile is not None and current.get(key) != float(from_profile):
                skipped.add(key)  # the scenario overrides it
                continue
            one[key] = float(value)
        sets.append(one)
    if skipped:
        notes.append(
            "bootstrap keys held at the scenario's values (not step-time coefficients, or "
            f"overridden by the scenario): {', '.join(sorted(skipped))}"
        )
    return (sets, notes, level) if with_level else (sets, notes)


Evaluate = Callable[[Sequence[float], int, str], list[CapacityPoint]]
"""``evaluate(rates, replicates, role)``: run every rate ``replicates`` times (replicate
``r`` = 0, 1, ...) and return the runs rate by rate; simulated (:func:`find_capacity`) or
live (:mod:`simcap.live.rate_search`)."""


def check_targets(
    scenario: Scenario, slo: Mapping[str, float] | Iterable[str] | None, duration_s: float,
    replicates: int, max_duration_s: float = MAX_SIMULATED_S,
) -> dict[str, float]:
    """The SLO targets (``slo``, else the scenario's), with duration and replicates checked."""
    if scenario.workload.sessions is not None:
        raise ScenarioError(
            "workload.sessions: capacity searches a request rate and does not run session "
            "workloads yet; sweep workload.arrival.rate (sessions per second) instead"
        )
    if scenario.workload.trace is not None:
        raise ScenarioError(
            "workload.trace: capacity searches a rate of synthetic arrivals for a time; a trace "
            "sends its own requests (scale its load with workload.trace.speedup in simulate or sweep)"
        )
    targets = parse_slo(slo) if slo else dict(scenario.slo)
    if not targets:
        raise ScenarioError(
            "slo: capacity needs an SLO: give --slo ttft_p95=2.0 or an slo section in the scenario"
        )
    if not (0 < duration_s <= max_duration_s):
        raise ScenarioError(
            f"--duration: must be > 0 and <= {max_duration_s:g} seconds (got {duration_s})"
        )
    if not 1 <= replicates <= MAX_REPLICATES:
        raise ScenarioError(f"--replicates: must be in [1, {MAX_REPLICATES}] (got {replicates})")
    return targets


def run_search(
    evaluate: Evaluate,
    *,
    rates: Sequence[float] | None,
    replicates: int,
    start: float,
    rel_tol: float = 0.02,
    max_points: int = 14,
    max_probes: int = 5,
) -> list[CapacityPoint]:
    """Every run of one capacity search, sorted by (rate, replicate).

    ``rates``: test exactly these (role ``grid``); None: bracket and bisect from ``start``
    (role ``search``, :func:`_search_steps`). Then, when no run saturated, up to
    ``max_probes`` rates at 1.5x steps above the highest (one replicate each, role ``probe``)
    until one saturates.
    """
    if rates is not None:
        points = evaluate(sorted(rates), replicates, "grid")
    else:
        points = _search(lambda r: evaluate([r], replicates, "search"), start,
                         rel_tol=rel_tol, max_points=max_points)
    if max_probes > 0 and not any(p.saturated for p in points):
        top = max(p.rate for p in points)
        for _ in range(max_probes):
            top *= 1.5
            probe = evaluate([top], 1, "probe")
            points.extend(probe)
            if probe[0].saturated:
                break
    points.sort(key=lambda p: (p.rate, p.replicate))
    return points


def _fmt_end(value: float | None) -> str:
    return "open" if value is None else f"{value:.4g}"


def capacity_result(
    points: list[CapacityPoint], targets: dict[str, float], *, duration_s: float,
    replicates: int, mode: str, early_stop: bool | str = False,
) -> CapacityResult:
    """Apply the rules (module doc) to a search's runs: safe and saturation rates, notes."""
    notes: list[str] = []
    safe_offered, safe = safe_rate_of(points)
    by_slo = {key: safe_rate_of(points, key)[1] for key in targets}
    saturation = saturation_rate_of(points)
    tested = sorted({p.rate for p in points if p.role != "probe"})
    if safe_offered is None:
        notes.append(f"no tested rate passed: the safe rate is below {tested[0]:g} req/s")
    elif safe_offered == tested[-1]:
        notes.append("every tested rate passed: the safe rate may be higher")
    if saturation is None:
        notes.append("no run saturated: the saturation rate is above every rate tried")
    else:
        lo, hi = saturation_bracket(points)
        # a run may keep up (by the rule) at up to mu / SATURATION_RATIO
        if (lo is not None and saturation < SATURATION_RATIO * lo) or (hi is not None and saturation > hi):
            notes.append(
                f"the saturation rate ({saturation:.4g} req/s, a completion rate) lies outside "
                f"the arrival rates that bracket the divergence ({_fmt_end(lo)}-{_fmt_end(hi)}): "
                "the runs are too short to tell a slow queue from a diverging one; a longer "
                "duration settles it"
            )
    stopped = [p for p in points if p.stopped]
    if stopped:
        notes.append(
            f"{len(stopped)} run(s) stopped early, once their SLO could no longer hold "
            f"(rules.early_stop; e.g. {stopped[0].stopped['reason']}); their SLO values "
            "are not known"
        )
    if not all(all(p.samples_adequate[k] for k in targets) for p in points):
        notes.append(
            "some percentiles rest on too few samples for the claim (samples_adequate false)"
        )
    return CapacityResult(
        slo=targets, points=points, safe_rate=safe, safe_offered_rate=safe_offered,
        saturation_rate=saturation, safe_rate_by_slo=by_slo, duration_s=float(duration_s),
        replicates=int(replicates), mode=mode, notes=notes, early_stop=early_stop,
    )


def find_capacity(
    scenario: Scenario,
    slo: Mapping[str, float] | Iterable[str] | None = None,
    rates: Sequence[float] | None = None,
    auto: bool = False,
    duration_s: float = DEFAULT_DURATION_S,
    replicates: int = DEFAULT_REPLICATES,
    *,
    workers: int = 1,
    start_rate: float | None = None,
    rel_tol: float = 0.02,
    max_points: int = 14,
    probe_saturation: bool = True,
    max_probes: int = 5,
    interval: bool = True,
    interval_max_sets: int = 8,
    interval_rel_tol: float = 0.04,
    early_stop: bool | str = True,
) -> CapacityResult:
    """The safe rate and saturation rate of ``scenario`` under ``slo`` (see the module doc).

    ``slo``: ``{"ttft_p95": 2.0}`` or ``["ttft_p95=2.0"]``; default the scenario's own SLO.
    ``rates``: requested rates (requests/s) to test; or ``auto=True`` to search. Neither:
    search. Every rate is run ``replicates`` times for ``duration_s`` seconds of arrivals.
    ``early_stop``: stop a run once its SLO is certain to fail (see the module doc); True,
    False, or ``"interval"`` (only the bootstrap interval's runs).
    """
    targets = check_targets(scenario, slo, duration_s, replicates)
    if interval and interval_max_sets < 1:
        raise ScenarioError(f"--interval-sets: must be >= 0 (got {interval_max_sets})")
    check_workers(workers)
    if rates is not None:
        rates = sorted({float(r) for r in rates})
        if not rates or any(r <= 0 or not math.isfinite(r) for r in rates):
            raise ScenarioError("--rates: every rate must be > 0 requests/s")
        top = at_rate(scenario, rates[-1], duration_s=duration_s, seed=scenario.seed, slo=targets)
        if expected_requests(top) > MAX_REQUESTS:
            raise ScenarioError(
                f"--rates: {rates[-1]:g} req/s for --duration {duration_s:g} s is "
                f"~{expected_requests(top):.3g} requests a run; one simulation holds at most "
                f"{MAX_REQUESTS:,} requests"
            )
    mode = "grid" if rates is not None and not auto else "auto"
    if early_stop not in (True, False, "interval"):
        raise ScenarioError(f"early_stop: must be true, false or 'interval' (got {early_stop!r})")
    runner = Runner(workers, early_stop=early_stop)
    try:
        def evaluate(rs: Sequence[float], n: int, role: str) -> list[CapacityPoint]:
            return runner.map([(scenario, r, k, duration_s, targets, None, role)
                               for r in rs for k in range(n)])

        points = run_search(
            evaluate, rates=rates if mode == "grid" else None, replicates=replicates,
            start=start_rate or (rates[0] if rates else _start_rate(scenario)),
            rel_tol=rel_tol, max_points=max_points,
            max_probes=max_probes if probe_saturation else 0,
        )
        result = capacity_result(points, targets, duration_s=duration_s, replicates=replicates,
                                 mode=mode, early_stop=early_stop)
        if interval and result.safe_offered_rate is not None:
            sets, set_notes, level = bootstrap_sets(scenario, with_level=True)
            if not sets:
                result.notes.extend(set_notes)
            if sets:
                _interval(result, runner, scenario, sets, set_notes, targets, duration_s,
                          replicates, interval_max_sets, interval_rel_tol, level)
    finally:
        runner.close()
    prov = provenance(scenario)
    prov.update(
        simcap_version=__version__,
        method="open-loop arrivals per rate, replicate r uses seed + r at every rate (common "
        "random numbers), every request completed unless the SLO is certain to fail"
        + {True: "", False: " (early stop off)",
           "interval": " (early stop in the bootstrap interval's runs only)"}[early_stop],
        arrival_process=(
            "gamma" if isinstance(scenario.workload.arrival, GammaArrival) else "poisson"
        ),
        seeds=[scenario.seed + r for r in range(replicates)],
    )
    result.provenance = prov
    return result


def _interval(
    result: CapacityResult, runner: Runner, scenario: Scenario, sets: list[dict[str, float]],
    notes: list[str], targets: dict[str, float], duration_s: float, replicates: int,
    max_sets: int, rel_tol: float, level: float,
) -> None:
    """Rerun the search per bootstrap coefficient set; fill ``safe_rate_interval``.

    Per set: one overloaded run (1.5x the main saturation rate, doubled until it
    saturates) measures that set's saturation rate mu_b; the search then starts at
    mu_b x (main safe rate / main saturation rate) with 15% steps, so a set whose capacity
    differs a lot costs little more than one that differs little. All sets advance in
    lockstep, one batch of runs per round.
    """
    if len(sets) > max_sets:
        idx = np.linspace(0, len(sets) - 1, max_sets).round().astype(int)
        sets = [sets[i] for i in sorted(set(idx.tolist()))]
    center = float(result.safe_offered_rate)
    mu = result.saturation_rate
    ratio = min(max(center / mu, 0.2), 0.98) if mu else None
    mu_b: list[float | None] = [None] * len(sets)
    probes_stopped = 0
    if mu:
        probe = 1.5 * mu
        todo = list(range(len(sets)))
        for _ in range(3):
            runs = runner.map([(scenario, probe, 0, duration_s, targets, sets[i], "bootstrap")
                               for i in todo])
            for i, run in zip(todo, runs):
                probes_stopped += run.stopped is not None
                if run.saturated:
                    mu_b[i] = run.completion_rate
            todo = [i for i in todo if mu_b[i] is None]
            if not todo:
                break
            probe *= 2.0
    starts = [ratio * m if (ratio and m) else center for m in mu_b]
    found_points = _search_many(runner, scenario, starts, sets, replicates, duration_s, targets,
                                rel_tol=rel_tol, max_points=12, step=1.15)
    safe_rates = [safe_rate_of(pts)[1] for pts in found_points]
    found = [r for r in safe_rates if r is not None]
    q = (1.0 - level) / 2.0 * 100.0
    if found:
        lo, hi = np.percentile(found, [q, 100.0 - q])
        result.safe_rate_interval = (float(lo), float(hi))
    missing = len(safe_rates) - len(found)
    if missing:
        notes = notes + [f"{missing} bootstrap set(s) passed at no rate tried; left out"]
    result.interval_info = {
        "method": "safe-rate search rerun per profile bootstrap coefficient set, "
        f"{replicates} replicate(s) each, relative tolerance {rel_tol:g}; interval = "
        f"{q:g}-{100 - q:g} percentiles ({level:g}, the profile's CI level)",
        "num_sets": len(sets),
        "safe_rates": safe_rates,
        "saturation_rates": mu_b,
        "num_runs": sum(len(p) for p in found_points) + len(sets),
        "stopped_early": probes_stopped + sum(1 for pts in found_points for p in pts if p.stopped),
        "notes": notes,
    }


# --------------------------------------------------------------------------- rendering


def render_capacity(result: CapacityResult, console: Any) -> None:
    """Print a capacity result: one row per run, then the safe and saturation rates."""
    from rich.table import Table

    table = Table(title=f"capacity: {result.duration_s:g} s of arrivals per run, "
                  f"{result.replicates} replicate(s), mode {result.mode}", title_justify="left")
    for col in ("rate", "measured", "rep"):
        table.add_column(col, justify="right")
    keys = list(result.slo) + [k for k in REPORTED if k not in result.slo]
    for key in keys:
        label = f"{key} (ms)" + (f" <= {result.slo[key] * 1e3:,.0f}" if key in result.slo else "")
        table.add_column(label, justify="right")
    for col in ("pass", "kept up", "role"):
        table.add_column(col)
    for p in result.points:
        if p.role == "bootstrap":
            continue
        short = p.live is not None and not p.live.get("rate_reached", True)
        cells = [f"{p.rate:.3f}", f"{p.measured_rate:.3f}" + ("!" if short else ""), str(p.replicate)]
        for key in keys:
            value = p.values.get(key)
            mark = "" if p.samples_adequate.get(key, True) else "*"
            cells.append("-" if value is None else f"{value * 1e3:,.1f}{mark}")
        verdict = "yes" if p.passed else "NO"
        if p.stopped:
            verdict += f" (stopped {p.stopped['at_s']:.0f} s)"
        cells += [verdict, "no" if p.saturated else "yes", p.role]
        table.add_row(*cells)
    console.print(table)
    if any(p.live is not None and not p.live.get("rate_reached", True) for p in result.points):
        console.print("! the load generator did not reach this rate: its achieved rate is shown",
                      style="dim")
    if any(not all(p.samples_adequate.values()) for p in result.points):
        console.print("* too few samples for this percentile (MLPerf early stopping, 99% "
                      "confidence, one sample over the bound)", style="dim")
    if result.safe_rate is not None:
        line = (f"safe rate {result.safe_rate:.3f} req/s measured "
                f"(requested {result.safe_offered_rate:.3f})")
        if result.safe_rate_interval is not None:
            lo, hi = result.safe_rate_interval
            n = (result.interval_info or {}).get("num_sets")
            line += f", interval {lo:.3f}-{hi:.3f} over {n} profile bootstrap sets"
    else:
        line = "safe rate: none of the tested rates passed"
    console.print(line)
    if len(result.slo) > 1:
        bound = result.lower_bounds()
        console.print("by SLO alone: " + ", ".join(
            f"{k} {'-' if v is None else ('>= ' if bound[k] else '') + f'{v:.3f}'}"
            for k, v in result.safe_rate_by_slo.items()
        ))
    sat = result.saturation_rate
    console.print(
        f"saturation rate {sat:.3f} req/s (server's maximum completion rate)" if sat is not None
        else "saturation rate: not reached"
    )
    for note in result.notes:
        console.print(f"note: {note}", style="dim")
    console.print(f"rules: safe rate = {RULES['safe_rate']}; saturated = {RULES['saturated']}",
                  style="dim")
