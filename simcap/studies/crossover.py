"""Where speculative decoding stops paying: the same load, with and without drafts.

EAGLE-style speculation emits ``acceptance_length`` tokens per request per step for the price
of verifying ``k`` more tokens and running ``k`` draft passes. At low concurrency a step is
dominated by its fixed cost, so more tokens per step is nearly free and latency falls; at high
concurrency the per-token terms dominate, the verify and draft work is no longer hidden, and
throughput falls below plain decoding. :func:`find_crossover` runs one scenario twice at each
load point -- as given (its ``speculative`` section) and with ``speculative`` removed -- with
the same workload and seed, and finds where the throughput gain crosses zero.

Load points:

- closed loop (``concurrencies``): ``workload.arrival = {process: closed, concurrency: c}``
  (the scenario's ``think_time_s`` is kept when it is already closed loop);
- open loop (``rates``): ``workload.arrival.rate = r``, Poisson unless the scenario's arrival
  is gamma (then its burstiness is kept).

Sizing: a closed-loop point runs ``max(num_requests, REQUESTS_PER_CLIENT x c)`` requests
(8 per client), so every client completes several requests and the high-concurrency points
spend most of their time in steady state rather than in the first wave and the drain. A
scenario stopped by ``duration_s`` keeps its duration (clients then send as many as fit), and
open-loop points keep the scenario's own stop rule. Throughput is the ``vllm bench`` figure
(output tokens over first arrival to last finish), ramp and drain included, as the field
measures it.

Gains are in percent, positive when speculation is better: throughput ``spec / base - 1``;
latency (E2E mean or p95, TPOT) ``1 - spec / base``. The crossover is interpolated linearly in
``log2(load)`` between the last point where the throughput gain is positive and the next
point where it is not; "none in range" when no such pair exists.

Usage::

    from simcap.studies.crossover import find_crossover
    r = find_crossover(load_scenario("s.yaml"), concurrencies=[1, 2, 4, 8], per_stream_tps=60)
    r.crossover["value"], r.to_dict()          # the JSON `simcap crossover --json` prints

    simcap crossover s.yaml --concurrency 1,2,4,8,16,32,64,128 --per-stream-tps 60 --plot xo.png

The figure is :func:`simcap.studies.plots.plot_crossover` (re-exported here). ``workers > 1`` runs
the arms in worker processes (the capacity search's :class:`simcap.studies.capacity.Runner`); the
result is the same as the serial run's, number for number.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from simcap.errors import ScenarioError
from simcap.studies.capacity import Runner, check_workers
from simcap.studies.plots import plot_crossover  # noqa: F401  (the figure lives with the other plots)
from simcap.config.scenario import Scenario, parse_scenario
from simcap.fleet.run import simulate
from simcap.metrics.summary import Summary
from simcap.simulation.simulator import Result, provenance

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128)
# Closed loop: at least this many requests per client at each point (see the module docstring).
REQUESTS_PER_CLIENT = 8
BUNDLES_PER_WORKER = 6  # arms go to worker processes in this many bundles per worker


# --------------------------------------------------------------------------- inputs


def parse_load_list(text: str, option: str, *, integer: bool) -> list[float]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: positive, distinct numbers; errors name ``option``."""
    items = [part.strip() for part in str(text).split(",")]
    if not any(items):
        raise ScenarioError(f"{option}: expected a comma-separated list, e.g. 1,2,4,8 (got {text!r})")
    values: list[Any] = []
    for item in items:
        try:
            value = int(item) if integer else float(item)
        except ValueError:
            kind = "positive integers" if integer else "positive numbers"
            raise ScenarioError(
                f"{option}: expected comma-separated {kind}, e.g. 1,2,4,8 (got {item!r} in {text!r})"
            ) from None
        values.append(value)
    return check_loads(values, option, integer=integer)


def check_loads(values: Iterable[Any], option: str, *, integer: bool) -> list[Any]:
    """Validate load points: non-empty, positive, finite, distinct; returned sorted."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ScenarioError(f"{option}: expected numbers (got {value!r})")
        if integer and float(value) != int(value):
            raise ScenarioError(f"{option}: concurrency must be a whole number of clients (got {value!r})")
        if not math.isfinite(float(value)) or value <= 0:
            raise ScenarioError(f"{option}: every load point must be > 0 (got {value!r})")
        out.append(int(value) if integer else float(value))
    if not out:
        raise ScenarioError(f"{option}: give at least one load point")
    if len(set(out)) != len(out):
        dup = sorted({v for v in out if out.count(v) > 1})[0]
        raise ScenarioError(f"{option}: load point {dup} is given twice")
    return sorted(out)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ArmPoint:
    """One arm (with or without speculation) at one load point."""

    output_tokens_per_s: float
    requests_per_s: float
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_mean_s: float | None
    tpot_mean_s: float | None
    per_stream_tps_mean: float | None  # mean over requests of output tokens / E2E
    completed: int
    duration_s: float
    preemptions: int
    mean_acceptance_length: float | None  # simulated, or the server's counters; None without speculation
    scenario_sha256: str

    @classmethod
    def of(cls, result: Result) -> "ArmPoint":
        m = result.metrics
        return cls.from_summary(
            result.summary, m.finish_times - m.arrival_times, m.num_output_tokens,
            (result.summary.spec_decode or {}).get("mean_acceptance_length"),
            result.provenance["scenario_sha256"],
        )

    @classmethod
    def from_summary(
        cls, s: Summary, e2e: np.ndarray, num_output_tokens: np.ndarray,
        mean_acceptance_length: float | None, scenario_sha256: str,
    ) -> "ArmPoint":
        """One arm from its summary and per-request E2E and output tokens (simulated or
        measured: one path)."""
        e2e = np.asarray(e2e, dtype=float)
        ok = np.isfinite(e2e) & (e2e > 0)
        rates = np.asarray(num_output_tokens, dtype=float)[ok] / e2e[ok]
        return cls(
            output_tokens_per_s=s.throughput["output_tokens_per_s"],
            requests_per_s=s.throughput["requests_per_s"],
            latency_mean_s=s.e2e_s.mean,
            latency_p50_s=s.e2e_s.p50,
            latency_p95_s=s.e2e_s.p95,
            ttft_mean_s=s.ttft_s.mean,
            tpot_mean_s=s.tpot_s.mean,
            per_stream_tps_mean=float(np.mean(rates)) if rates.size else None,
            completed=s.completed,
            duration_s=s.duration_s,
            preemptions=s.preemptions,
            mean_acceptance_length=mean_acceptance_length,
            scenario_sha256=scenario_sha256,
        )


def _gain_up(spec: float | None, base: float | None) -> float | None:
    """Percent by which ``spec`` exceeds ``base`` (higher is better)."""
    if spec is None or base is None or base == 0:
        return None
    return (spec / base - 1.0) * 100.0


def _gain_down(spec: float | None, base: float | None) -> float | None:
    """Percent by which ``spec`` is below ``base`` (lower is better)."""
    if spec is None or base is None or base == 0:
        return None
    return (1.0 - spec / base) * 100.0


@dataclass(frozen=True)
class CrossoverPoint:
    load: float  # concurrency (closed loop) or requests/s (open loop)
    num_requests: int | None
    spec: ArmPoint
    baseline: ArmPoint

    @property
    def gain_pct(self) -> dict[str, float | None]:
        s, b = self.spec, self.baseline
        return {
            "throughput": _gain_up(s.output_tokens_per_s, b.output_tokens_per_s),
            "latency_mean": _gain_down(s.latency_mean_s, b.latency_mean_s),
            "latency_p95": _gain_down(s.latency_p95_s, b.latency_p95_s),
            "tpot_mean": _gain_down(s.tpot_mean_s, b.tpot_mean_s),
            "per_stream_tps": _gain_up(s.per_stream_tps_mean, b.per_stream_tps_mean),
        }


@dataclass(frozen=True)
class CrossoverResult:
    """Both arms at every load point, the crossover and the per-stream target answer."""

    axis: str  # "concurrency" or "rate"
    points: list[CrossoverPoint]
    crossover: dict[str, Any]
    latency_crossover: dict[str, Any]
    per_stream_target: dict[str, Any] | None
    provenance: dict[str, Any]
    wall_s: float = 0.0

    @property
    def loads(self) -> list[float]:
        return [p.load for p in self.points]

    def to_dict(self) -> dict[str, Any]:
        points = []
        for p in self.points:
            load = int(p.load) if self.axis == "concurrency" else p.load
            points.append({
                self.axis: load,
                "num_requests": p.num_requests,
                "spec": asdict(p.spec),
                "baseline": asdict(p.baseline),
                "gain_pct": p.gain_pct,
            })
        return {
            "axis": self.axis,
            "points": points,
            "crossover": self.crossover,
            "latency_crossover": self.latency_crossover,
            "per_stream_target": self.per_stream_target,
            "provenance": self.provenance,
        }


# --------------------------------------------------------------------------- analysis


def _interp_log2(x0: float, y0: float, x1: float, y1: float, level: float = 0.0) -> float:
    """The x in [x0, x1] where the line through (log2 x, y) reaches ``level``."""
    if y0 == y1:
        return x1
    t0, t1 = math.log2(x0), math.log2(x1)
    frac = (y0 - level) / (y0 - y1)
    return float(2.0 ** (t0 + frac * (t1 - t0)))


def locate_crossover(
    loads: Sequence[float], gains: Sequence[float | None], *, axis: str = "concurrency",
    metric: str = "throughput",
) -> dict[str, Any]:
    """Where a gain (percent, positive: speculation better) first turns from > 0 to <= 0.

    Linear interpolation in ``log2(load)``. Every sign change is listed in ``crossings``;
    the answer (``value``) is the first one from winning to losing.
    """
    pts = [(x, g) for x, g in zip(loads, gains) if g is not None]
    crossings = []
    for (x0, g0), (x1, g1) in zip(pts, pts[1:]):
        if (g0 > 0) != (g1 > 0):
            crossings.append({
                "value": _interp_log2(x0, g0, x1, g1),
                "between": [x0, x1],
                "direction": "spec stops paying" if g0 > 0 else "spec starts paying",
            })
    first = next((c for c in crossings if c["direction"] == "spec stops paying"), None)
    out: dict[str, Any] = {"metric": metric, "axis": axis}
    if first is not None:
        out.update(status="found", value=first["value"], between=first["between"])
        lo, hi = first["between"]
        out["detail"] = (
            f"{metric} gain crosses zero between {axis} {_fmt(lo)} and {_fmt(hi)}, "
            f"at about {first['value']:.3g} (linear in log2 {axis})"
        )
    else:
        out.update(status="none in range", value=None, between=None)
        if not pts:
            out["detail"] = "no load point gave a gain"
        elif all(g > 0 for _, g in pts):
            out["detail"] = (
                f"speculation wins at every {axis} tested ({_fmt(pts[0][0])}-{_fmt(pts[-1][0])}); "
                "the crossover, if any, lies above the range"
            )
        elif all(g <= 0 for _, g in pts):
            out["detail"] = (
                f"speculation loses at every {axis} tested ({_fmt(pts[0][0])}-{_fmt(pts[-1][0])}); "
                "the crossover, if any, lies below the range"
            )
        else:
            out["detail"] = "speculation only starts paying within the range (see crossings)"
    out["crossings"] = crossings
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def per_stream_answer(
    loads: Sequence[float], values: Sequence[float | None], target: float
) -> dict[str, Any]:
    """Highest tested load whose mean per-stream tokens/s is >= ``target``, and where the
    curve crosses the target just above it (log2-linear), when it does within the range."""
    ok = [i for i, v in enumerate(values) if v is not None and v >= target]
    if not ok:
        return {"max_load": None, "interpolated": None,
                "detail": f"below {target:g} tok/s per stream at every load point"}
    i = ok[-1]
    out: dict[str, Any] = {"max_load": loads[i], "interpolated": None}
    if i + 1 < len(loads) and values[i + 1] is not None:
        out["interpolated"] = _interp_log2(loads[i], values[i], loads[i + 1], values[i + 1], target)
        out["detail"] = f"meets {target:g} tok/s per stream up to {_fmt(loads[i])}"
    elif i + 1 == len(loads):
        out["detail"] = f"meets {target:g} tok/s per stream at every point up to {_fmt(loads[i])}"
    if len(ok) != i + 1:
        out["detail"] = out.get("detail", "") + " (not at every lower point)"
    return out


# --------------------------------------------------------------------------- running


def check_baseline(scenario: Scenario, baseline: Scenario) -> None:
    """A separate baseline arm must run the same workload: only its step time, KV pool and
    release may differ (a profile calibrated on the server without speculation)."""
    for section in ("workload", "slo"):
        mine = getattr(scenario, section)
        theirs = getattr(baseline, section)
        if (mine and mine.model_dump(mode="json")) != (theirs and theirs.model_dump(mode="json")):
            raise ScenarioError(
                f"baseline: its {section} section differs from the scenario's; the baseline arm "
                "must run the same workload (give it through its own profile, not another scenario)"
            )
    if scenario.seed != baseline.seed:
        raise ScenarioError(f"baseline: seed {baseline.seed} differs from the scenario's {scenario.seed}")


def arm_scenarios(
    scenario: Scenario, *, concurrency: int | None = None, rate: float | None = None,
    requests_per_client: int = REQUESTS_PER_CLIENT, baseline: Scenario | None = None,
) -> tuple[Scenario, Scenario, int | None]:
    """The (speculative, baseline) scenarios at one load point, and its request count.
    ``baseline``: the baseline arm's own scenario (default: ``scenario`` without its
    speculative section), at the same load point."""
    if scenario.speculative is None:
        raise ScenarioError(
            "speculative: the scenario has no speculative section; crossover compares a "
            "scenario with speculation against the same one without it"
        )
    if scenario.workload.sessions is not None:
        raise ScenarioError(
            "workload.sessions: crossover sizes its load points in requests and does not run "
            "session workloads yet; compare the two arms with simulate or sweep"
        )
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency or rate")
    data = scenario.model_dump(mode="json")
    wl = data["workload"]
    old = wl["arrival"] or {}  # (none: a trace at its own times; the load point replaces them)
    if concurrency is not None:
        arrival: dict[str, Any] = {"process": "closed", "concurrency": int(concurrency)}
        if old.get("process") == "closed" and old.get("think_time_s"):
            arrival["think_time_s"] = old["think_time_s"]
        if wl.get("num_requests") is not None:
            wl["num_requests"] = max(int(wl["num_requests"]), requests_per_client * int(concurrency))
    else:
        arrival = {"process": "poisson", "rate": float(rate)}
        if old.get("process") == "gamma":
            arrival = {"process": "gamma", "rate": float(rate), "burstiness": old["burstiness"]}
    wl["arrival"] = arrival
    spec = _rebuild(data, scenario)
    if baseline is None:
        data = dict(data)
    else:
        data = baseline.model_dump(mode="json")
        data["workload"] = wl
    data.pop("speculative")
    base = _rebuild(data, scenario if baseline is None else baseline)
    return spec, base, wl.get("num_requests")


def _run_arms(scenarios: list[Scenario]) -> list[ArmPoint]:
    return [ArmPoint.of(simulate(s)) for s in scenarios]


def _rebuild(data: dict[str, Any], like: Scenario) -> Scenario:
    # The dump is already merged with its profile and has its files read in; keep the link
    # to the profile file for results that report its intervals.
    scenario = parse_scenario(data)
    scenario._profile_file = like.profile_file
    return scenario


def find_crossover(
    scenario: Scenario,
    concurrencies: Sequence[int] | None = None,
    rates: Sequence[float] | None = None,
    per_stream_tps: float | None = None,
    *,
    requests_per_client: int = REQUESTS_PER_CLIENT,
    workers: int = 1,
    runner: Runner | None = None,
    baseline: Scenario | None = None,
) -> CrossoverResult:
    """Run ``scenario`` with and without its ``speculative`` section at each load point.
    ``baseline``: the baseline arm's own scenario, for a step time and KV pool of its own (a
    profile calibrated on the server without speculation; ``--baseline-profile``); it must run
    the same workload, and its speculative section is dropped.

    Closed loop at ``concurrencies`` (default 1, 2, 4, ..., 128) or open loop at ``rates``
    (requests/s), never both. ``per_stream_tps``: also report the highest load at which each
    arm keeps that mean per-stream output rate (tokens/s per request). ``workers``: processes
    running the arms (or ``runner``: a :class:`simcap.studies.capacity.Runner` to share between
    calls, left open). Raises :class:`ScenarioError` for bad input.
    """
    return find_crossovers(
        [scenario], concurrencies, rates, per_stream_tps, requests_per_client=requests_per_client,
        workers=workers, runner=runner, baselines=None if baseline is None else [baseline],
    )[0]


def find_crossovers(
    scenarios: Sequence[Scenario],
    concurrencies: Sequence[int] | None = None,
    rates: Sequence[float] | None = None,
    per_stream_tps: float | None = None,
    *,
    requests_per_client: int = REQUESTS_PER_CLIENT,
    workers: int = 1,
    runner: Runner | None = None,
    baselines: Sequence[Scenario | None] | None = None,
) -> list[CrossoverResult]:
    """:func:`find_crossover` for several scenarios at the same load points, every arm of
    every scenario in one batch: a few bundles of arms of similar estimated cost per worker
    process, costliest first, so that the processes finish together and wait little on the
    parent. Each result is the one :func:`find_crossover` gives for its scenario (and its
    entry of ``baselines``, where given)."""
    check_workers(workers)
    baselines = list(baselines) if baselines is not None else [None] * len(scenarios)
    if len(baselines) != len(scenarios):
        raise ValueError("baselines: one entry (or None) per scenario")
    for scenario, baseline in zip(scenarios, baselines):
        if scenario.speculative is None:
            arm_scenarios(scenario, concurrency=1)  # raises the one-line error
        if baseline is not None:
            check_baseline(scenario, baseline)
    if concurrencies is not None and rates is not None:
        raise ScenarioError("--rate: give either concurrencies (closed loop) or rates (open loop), not both")
    if per_stream_tps is not None and (
        isinstance(per_stream_tps, bool) or not math.isfinite(float(per_stream_tps))
        or per_stream_tps <= 0
    ):
        raise ScenarioError(f"--per-stream-tps: must be a positive number of tokens/s (got {per_stream_tps!r})")
    if requests_per_client < 1:
        raise ScenarioError(f"requests_per_client: must be >= 1 (got {requests_per_client})")
    if rates is not None:
        axis, loads = "rate", check_loads(rates, "--rate", integer=False)
    else:
        axis = "concurrency"
        loads = check_loads(
            DEFAULT_CONCURRENCIES if concurrencies is None else concurrencies,
            "--concurrency", integer=True,
        )
    started = time.perf_counter()
    arms = []  # per scenario, per load: (spec scenario, baseline scenario, num_requests)
    for scenario, baseline in zip(scenarios, baselines):
        mine = []
        for load in loads:
            kw = {"concurrency": load} if axis == "concurrency" else {"rate": load}
            mine.append(arm_scenarios(scenario, requests_per_client=requests_per_client, baseline=baseline, **kw))
        arms.append(mine)
    tasks = [sc for mine in arms for spec_sc, base_sc, _ in mine for sc in (spec_sc, base_sc)]
    own = runner is None
    pool = Runner(workers) if own else runner
    bundles = _bundles([_cost(t) for t in tasks], BUNDLES_PER_WORKER * pool.workers)
    try:
        ran = pool.map([[tasks[i] for i in b] for b in bundles], _run_arms)
    finally:
        if own:
            pool.close()
    done: list[ArmPoint | None] = [None] * len(tasks)
    for bundle, arms_done in zip(bundles, ran):
        for i, arm in zip(bundle, arms_done):
            done[i] = arm
    wall = time.perf_counter() - started
    results = []
    for j, (scenario, mine) in enumerate(zip(scenarios, arms)):
        first = 2 * len(loads) * j
        points = [
            CrossoverPoint(load=load, num_requests=n, spec=done[first + 2 * i],
                           baseline=done[first + 2 * i + 1])
            for i, (load, (_, _, n)) in enumerate(zip(loads, mine))
        ]
        results.append(analyse(scenario, axis, loads, points, per_stream_tps,
                                requests_per_client, wall, baselines[j]))
    return results


def _cost(scenario: Scenario) -> float:
    """A rough relative cost of simulating one arm: its requests, more when it speculates
    (a verify step costs several decode steps to simulate)."""
    wl = scenario.workload
    n = wl.num_requests if wl.trace is None else len(wl.trace.requests)
    if n is None:
        rate = getattr(wl.arrival, "rate", None)
        n = rate * wl.duration_s if rate else wl.duration_s
    spec = scenario.speculative
    return float(n) * (1 + 2 * (spec.num_speculative_tokens if spec else 0))


def _bundles(costs: list[float], count: int) -> list[list[int]]:
    """Task indices in at most ``count`` bundles of similar cost (costliest task first into
    the cheapest bundle), costliest bundle first: few hand-offs to the worker processes, which
    finish at about the same time."""
    loads = [(0.0, b) for b in range(min(count, len(costs)))]
    members: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, b = heapq.heappop(loads)
        members[b].append(i)
        heapq.heappush(loads, (load + costs[i], b))
    total = {b: load for load, b in loads}
    return [members[b] for b in sorted(total, key=lambda b: -total[b]) if members[b]]


def analyse(
    scenario: Scenario, axis: str, loads: list, points: list[CrossoverPoint],
    per_stream_tps: float | None, requests_per_client: int, wall: float,
    baseline: Scenario | None = None,
) -> CrossoverResult:
    """The crossovers and the per-stream answer of both arms at every load point (simulated
    here, or measured live by :mod:`simcap.live.crossover_arms`)."""
    gains = [p.gain_pct for p in points]
    crossover = locate_crossover(loads, [g["throughput"] for g in gains], axis=axis)
    latency_crossover = locate_crossover(
        loads, [g["latency_mean"] for g in gains], axis=axis, metric="latency_mean"
    )
    target = None
    if per_stream_tps is not None:
        target = {
            "target_tps": float(per_stream_tps),
            "axis": axis,
            "spec": per_stream_answer(loads, [p.spec.per_stream_tps_mean for p in points], per_stream_tps),
            "baseline": per_stream_answer(
                loads, [p.baseline.per_stream_tps_mean for p in points], per_stream_tps
            ),
        }
    prov = provenance(scenario)
    prov.update({
        "speculative": scenario.speculative.model_dump(mode="json"),
        "baseline": "the same scenario with the speculative section removed" if baseline is None else {
            "scenario": "its own step time and KV pool, the same workload, no speculative section",
            "profile": provenance(baseline).get("profile"),
            "step_time": baseline.step_time.model_dump(mode="json"),
            "num_gpu_blocks": baseline.engine.num_gpu_blocks,
        },
        "same_workload_and_seed": True,
        "sizing": (
            f"closed loop: max(num_requests, {requests_per_client} x concurrency) requests per "
            "point (duration_s kept when the scenario stops by duration)"
            if axis == "concurrency" else "open loop: the scenario's own stop rule at each rate"
        ),
        "throughput_definition": "output tokens / (last finish - first arrival), ramp and drain included",
        "crossover_interpolation": "linear in log2(load) between the bracketing points",
    })
    return CrossoverResult(axis, points, crossover, latency_crossover, target, prov, wall)


# --------------------------------------------------------------------------- rendering


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _num(x: float | None, fmt: str = ",.1f") -> str:
    return "-" if x is None else format(x, fmt)


def render_crossover(result: CrossoverResult, console) -> None:
    """Print the two arms side by side, the crossover and the per-stream answer."""
    from rich.table import Table

    axis = result.axis
    table = Table(
        title="speculation (spec) vs none (base); gains in % (positive: spec better)",
        title_justify="left",
    )
    table.add_column("clients" if axis == "concurrency" else "req/s", justify="right",
                     no_wrap=True)
    for col in (
        "output tok/s\nspec / base", "tput\ngain %", "E2E mean s\nspec / base",
        "E2E p95 s\nspec / base", "E2E\ngain %", "TPOT ms\nspec / base",
        "tok/s/stream\nspec / base", "accept\nlength",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for p in result.points:
        g = p.gain_pct
        s, b = p.spec, p.baseline
        table.add_row(
            _fmt(p.load),
            f"{_num(s.output_tokens_per_s)} / {_num(b.output_tokens_per_s)}",
            _pct(g["throughput"]),
            f"{_s(s.latency_mean_s)} / {_s(b.latency_mean_s)}",
            f"{_s(s.latency_p95_s)} / {_s(b.latency_p95_s)}",
            _pct(g["latency_mean"]),
            f"{_ms(s.tpot_mean_s)} / {_ms(b.tpot_mean_s)}",
            f"{_num(s.per_stream_tps_mean)} / {_num(b.per_stream_tps_mean)}",
            _num(s.mean_acceptance_length, ".2f"),
        )
    console.print(table)
    c = result.crossover
    if c["status"] == "found":
        lo, hi = c["between"]
        console.print(
            f"throughput crossover: {axis} ~{c['value']:.3g} (gain changes sign between "
            f"{_fmt(lo)} and {_fmt(hi)}; interpolated linearly in log2 {axis})"
        )
    else:
        console.print(f"throughput crossover: none in range ({c['detail']})")
    lc = result.latency_crossover
    if lc["status"] == "found":
        console.print(f"mean-latency crossover: {axis} ~{lc['value']:.3g}")
    else:
        console.print(f"mean-latency crossover: none in range ({lc['detail']})")
    t = result.per_stream_target
    if t:
        for arm in ("spec", "baseline"):
            a = t[arm]
            where = "none" if a["max_load"] is None else _fmt(a["max_load"])
            extra = f" (target crossed at ~{a['interpolated']:.3g})" if a.get("interpolated") else ""
            console.print(
                f"{arm}: highest {axis} keeping {t['target_tps']:g} tok/s per stream: {where}{extra}"
            )
    prov = result.provenance
    console.print(
        f"simcap {prov.get('simcap_version')} modelling vLLM {prov.get('vllm_version_modelled')} V1; "
        f"scenario {prov.get('scenario_name') or '(unnamed)'} sha256 "
        f"{str(prov.get('scenario_sha256'))[:12]}, seed {prov.get('seed')}, step time from "
        f"{prov.get('step_time_source')}; {prov.get('sizing')}",
        style="dim",
    )
