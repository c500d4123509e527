"""Fleet sizing: the fewest replicas that keep an SLO at a target rate, per router.

For each router, :func:`size_fleet` runs the scenario as a fleet of n replicas at the target
rate (open-loop arrivals for ``duration_s`` seconds, ``replicates`` runs with seeds seed,
seed + 1, ...; common random numbers across n and routers) and judges each run by the SLO
as :mod:`simcap.studies.capacity` does (:func:`simcap.studies.capacity.point_from_result`; a run whose TTFT
or E2E target can no longer hold stops once its arrival window has closed): n passes when
every replicate passes. n is doubled from 1 until it passes (at most ``max_replicas``), then
bisected down to the fewest passing count. All routers' runs of one round go to the same
pool: ``capacity.Runner``'s processes (``backend="local"``) or Ray tasks (``"ray"``, as
``simcap sweep --backend ray``).

With ``curve_counts``, it also finds each router's safe rate (:func:`simcap.studies.capacity.
find_capacity`) at each of those replica counts, and where routing stops mattering: the
smallest count from which every larger count's safe rates, over the routers, differ by at
most ``ROUTING_TOL`` of the largest. A price per replica-hour gives each answer's cost per
hour and per million requests at the target rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from simcap._version import __version__
from simcap.studies.capacity import (
    DEFAULT_REPLICATES, CapacityPoint, Runner, _run_one, find_capacity, parse_slo,
)
from simcap.config.scenario import MAX_NUM_SEQS, ROUTERS, DeploymentConfig, Scenario
from simcap.errors import ScenarioError

ROUTING_TOL = 0.05  # safe rates within 5 % of each other: routing no longer matters
DEFAULT_DURATION_S = 120.0
DEFAULT_MAX_REPLICAS = 64


def parse_routers(text: str | None, scenario: Scenario) -> list[str]:
    """``"roundrobin,least_request"`` -> the list; None: the scenario's router (or
    roundrobin). An unknown name is a ScenarioError listing the known ones."""
    if text is None:
        return [scenario.deployment.router if scenario.deployment else "roundrobin"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ScenarioError(f"--router: give router names, comma-separated; known: {', '.join(ROUTERS)}")
    for name in names:
        if name not in ROUTERS:
            raise ScenarioError(f"--router: unknown router {name!r}; known: {', '.join(ROUTERS)}")
    return list(dict.fromkeys(names))


def with_fleet(scenario: Scenario, replicas: int, router: str | None = None) -> Scenario:
    """``scenario`` as a fleet of ``replicas`` replicas (its deployment's other keys kept)
    behind ``router`` (default: its own, or roundrobin)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_NUM_SEQS:
        raise ScenarioError(f"--replicas: must be a whole number in [1, {MAX_NUM_SEQS}] (got {replicas!r})")
    dep = scenario.deployment
    if dep is not None and dep.disaggregated is not None:
        raise ScenarioError(
            "deployment.disaggregated: sizing varies the replica count of a fleet of one "
            "configuration (leave disaggregated out)"
        )
    if dep is not None and dep.groups is not None:
        raise ScenarioError(
            "deployment.groups: a fleet of replica groups has its own counts; sizing varies the "
            "replica count of a fleet of one configuration (leave groups out)"
        )
    data = dep.model_dump() if dep is not None else {}
    data["replicas"] = replicas
    if router is not None:
        data["router"] = router
        if router != "prefix_cache":
            data["weights"] = None
    return scenario.model_copy(update={"deployment": DeploymentConfig(**data)})


def _run_indexed(task: tuple) -> tuple[int, CapacityPoint]:
    index, inner = task
    return index, _run_one(inner)


def run_tasks(tasks: list[tuple], runner: Runner, backend: str) -> list[CapacityPoint]:
    """Capacity tasks, results in task order: in ``runner``'s processes, or as Ray tasks."""
    if backend == "local":
        return runner.map(tasks)
    from simcap.studies.sweep import run_ray

    out: list[CapacityPoint | None] = [None] * len(tasks)
    indexed = [(i, (*t, runner.early_stop)) for i, t in enumerate(tasks)]
    for i, point in run_ray(indexed, _run_indexed):
        out[i] = point
    return out  # type: ignore[return-value]


@dataclass
class RouterSizing:
    router: str
    replicas: int | None  # the fewest passing; None: none up to max_replicas
    tested: dict[int, bool]  # replica count -> all replicates passed
    points: dict[int, list[CapacityPoint]]
    cost_per_hour: float | None = None
    cost_per_million_requests: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "replicas": self.replicas,
            "tested": {str(n): ok for n, ok in sorted(self.tested.items())},
            "cost_per_hour": self.cost_per_hour,
            "cost_per_million_requests": self.cost_per_million_requests,
            "runs": {str(n): [p.to_dict() for p in pts] for n, pts in sorted(self.points.items())},
        }


@dataclass
class FleetSizing:
    target_rate: float
    slo: dict[str, float]
    duration_s: float
    replicates: int
    max_replicas: int
    price_per_replica_hour: float | None
    routers: list[RouterSizing]
    curve: dict[str, dict[int, float | None]] | None = None  # router -> count -> safe rate
    routing_stops_mattering_at: int | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_rate": self.target_rate,
            "slo": self.slo,
            "duration_s": self.duration_s,
            "replicates": self.replicates,
            "max_replicas": self.max_replicas,
            "price_per_replica_hour": self.price_per_replica_hour,
            "routers": [r.to_dict() for r in self.routers],
            "safe_rate_by_replicas": None if self.curve is None else {
                router: {str(n): v for n, v in sorted(by_n.items())}
                for router, by_n in self.curve.items()
            },
            "routing_tolerance": ROUTING_TOL,
            "routing_stops_mattering_at": self.routing_stops_mattering_at,
            "provenance": self.provenance,
        }


def routing_stops_mattering(curve: Mapping[str, Mapping[int, float | None]]) -> int | None:
    """The smallest replica count from which, at it and every larger count, the routers'
    safe rates differ by at most ROUTING_TOL of the largest; None with one router, or if
    they differ at the largest count."""
    if len(curve) < 2:
        return None
    counts = sorted(set.intersection(*(set(c) for c in curve.values())))
    since = None
    for n in counts:
        rates = [by_n[n] or 0.0 for by_n in curve.values()]
        top = max(rates)
        close = top > 0 and (top - min(rates)) <= ROUTING_TOL * top
        if close and since is None:
            since = n
        elif not close:
            since = None
    return since


def size_fleet(
    scenario: Scenario,
    target_rate: float,
    slo: Mapping[str, float] | Sequence[str] | None = None,
    routers: Sequence[str] | None = None,
    *,
    duration_s: float = DEFAULT_DURATION_S,
    replicates: int = DEFAULT_REPLICATES,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    price_per_replica_hour: float | None = None,
    curve_counts: Sequence[int] | None = None,
    workers: int = 1,
    backend: str = "local",
    progress: Callable[[str], None] | None = None,
) -> FleetSizing:
    """The fewest replicas per router for ``target_rate`` under ``slo`` (module doc)."""
    targets = parse_slo(slo) if slo else dict(scenario.slo)
    if not targets:
        raise ScenarioError(
            "slo: fleet sizing needs an SLO: give --slo ttft_p95=2.0 or an slo section in the scenario"
        )
    if not target_rate > 0 or target_rate == float("inf"):
        raise ScenarioError(f"--target-rate: must be > 0 requests/s (got {target_rate})")
    if price_per_replica_hour is not None and not price_per_replica_hour >= 0:
        raise ScenarioError(f"--price-per-replica-hour: must be >= 0 (got {price_per_replica_hour})")
    if not 1 <= max_replicas <= MAX_NUM_SEQS:
        raise ScenarioError(f"--max-replicas: must be in [1, {MAX_NUM_SEQS}] (got {max_replicas})")
    if backend not in ("local", "ray"):
        raise ScenarioError(f"--backend {backend}: unknown backend; allowed: local, ray")
    names = list(routers) if routers else parse_routers(None, scenario)
    for name in names:
        if name not in ROUTERS:
            raise ScenarioError(f"--router: unknown router {name!r}; known: {', '.join(ROUTERS)}")
    with_fleet(scenario, 1)  # (refuses replica groups up front)
    sizings = {name: RouterSizing(name, None, {}, {}) for name in names}
    bounds = {name: [0, None] for name in names}  # highest failing, lowest passing count

    def next_count(name: str) -> int | None:
        lo, hi = bounds[name]
        if hi is None:
            n = 1 if lo == 0 else min(2 * lo, max_replicas)
            return None if n in sizings[name].tested else n
        return None if hi - lo <= 1 else (lo + hi) // 2

    with Runner(workers, early_stop=True) as runner:
        while True:
            round_ = [(name, n) for name in names if (n := next_count(name)) is not None]
            if not round_:
                break
            tasks = [
                (with_fleet(scenario, n, name), target_rate, r, duration_s, targets, None, "search")
                for name, n in round_ for r in range(replicates)
            ]
            if progress is not None:
                progress(", ".join(f"{name} x{n}" for name, n in round_))
            points = run_tasks(tasks, runner, backend)
            for j, (name, n) in enumerate(round_):
                pts = points[j * replicates:(j + 1) * replicates]
                ok = all(p.passed for p in pts)
                sizings[name].tested[n] = ok
                sizings[name].points[n] = pts
                if ok:
                    bounds[name][1] = n
                else:
                    bounds[name][0] = n
        for name in names:
            sizing = sizings[name]
            sizing.replicas = bounds[name][1]
            if price_per_replica_hour is not None and sizing.replicas is not None:
                sizing.cost_per_hour = price_per_replica_hour * sizing.replicas
                sizing.cost_per_million_requests = sizing.cost_per_hour / (target_rate * 3600.0) * 1e6
    prov = {
        "simcap_version": __version__,
        "vllm_version_modelled": scenario.engine.vllm_version,
        "scenario_name": scenario.name,
        "scenario_sha256": scenario.digest(),
        "seed": scenario.seed,
        "backend": backend,
    }
    result = FleetSizing(
        float(target_rate), targets, float(duration_s), replicates, max_replicas,
        price_per_replica_hour, [sizings[n] for n in names], provenance=prov,
    )
    if curve_counts:
        add_safe_rate_curve(result, scenario, curve_counts, workers=workers, progress=progress)
    return result


def curve_counts_for(result: FleetSizing) -> list[int]:
    """1, 2, 4, ... up to the largest fleet any router needed (or max_replicas)."""
    found = [r.replicas for r in result.routers if r.replicas is not None]
    top = max(found) if found else result.max_replicas
    counts = [1]
    while counts[-1] < top:
        counts.append(min(2 * counts[-1], top))
    return counts


def add_safe_rate_curve(
    result: FleetSizing, scenario: Scenario, counts: Sequence[int], *, workers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Each router's safe rate (capacity's search, same SLO, duration and replicates) at each
    replica count of ``counts``, and where routing stops mattering."""
    curve: dict[str, dict[int, float | None]] = {}
    for sizing in result.routers:
        name = sizing.router
        curve[name] = {}
        for n in counts:
            if progress is not None:
                progress(f"safe rate: {name} x{n}")
            res = find_capacity(
                with_fleet(scenario, n, name), result.slo, auto=True, duration_s=result.duration_s,
                replicates=result.replicates, workers=workers, interval=False,
                probe_saturation=False,
            )
            curve[name][n] = res.safe_rate
    result.curve = curve
    result.routing_stops_mattering_at = routing_stops_mattering(curve)


def render_sizing(result: FleetSizing, console: Any) -> None:
    from rich.table import Table

    table = Table(
        title=f"fleet sizing at {result.target_rate:g} req/s, SLO "
              + ", ".join(f"{k} <= {v:g} s" for k, v in result.slo.items()),
        title_justify="left",
    )
    for col in ("router", "replicas", "tested (n: pass)", "cost / h", "cost / 1M req"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in result.routers:
        tested = " ".join(f"{n}:{'y' if ok else 'n'}" for n, ok in sorted(r.tested.items()))
        table.add_row(
            r.router,
            str(r.replicas) if r.replicas is not None else f"> {result.max_replicas}",
            tested,
            "-" if r.cost_per_hour is None else f"{r.cost_per_hour:,.2f}",
            "-" if r.cost_per_million_requests is None else f"{r.cost_per_million_requests:,.2f}",
        )
    console.print(table)
    if result.curve is not None:
        curve = Table(title="safe rate (req/s) by replica count", title_justify="left")
        counts = sorted({n for by_n in result.curve.values() for n in by_n})
        curve.add_column("router")
        for n in counts:
            curve.add_column(str(n), justify="right")
        for router, by_n in result.curve.items():
            curve.add_row(router, *("-" if by_n.get(n) is None else f"{by_n[n]:.3g}" for n in counts))
        console.print(curve)
        at = result.routing_stops_mattering_at
        console.print(
            "routing stops mattering " + (f"from {at} replicas (safe rates within "
            f"{ROUTING_TOL:.0%})" if at is not None else "nowhere in the counts tried"
            if len(result.curve) > 1 else "(one router: nothing to compare)")
        )
    console.print(
        f"{result.replicates} run(s) of {result.duration_s:g} s of arrivals per count; simcap "
        f"{result.provenance.get('simcap_version')}, scenario sha256 "
        f"{str(result.provenance.get('scenario_sha256'))[:12]}",
        style="dim",
    )


# --------------------------------------------------------------------------- disaggregated


def with_pools(scenario: Scenario, prefill: int, decode: int) -> Scenario:
    """``scenario``'s disaggregated deployment with ``prefill`` and ``decode`` replicas."""
    dep = scenario.deployment
    if dep is None or dep.disaggregated is None:
        raise ScenarioError(
            "deployment.disaggregated: sizing prefill and decode pools needs a disaggregated "
            "deployment in the scenario (its pools' sections and kv_transfer)"
        )
    pools = dep.disaggregated.model_copy(update={
        "prefill": dep.disaggregated.prefill.model_copy(update={"replicas": prefill}),
        "decode": dep.disaggregated.decode.model_copy(update={"replicas": decode}),
    })
    return scenario.model_copy(update={"deployment": dep.model_copy(update={"disaggregated": pools})})


@dataclass
class PoolSizing:
    target_rate: float
    slo: dict[str, float]
    duration_s: float
    replicates: int
    max_replicas: int
    tested: dict[tuple[int, int], bool]  # (prefill, decode) -> every replicate passed
    ttft_p95: dict[tuple[int, int], float | None]  # median over replicates
    best: tuple[int, int] | None
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_rate": self.target_rate,
            "slo": self.slo,
            "duration_s": self.duration_s,
            "replicates": self.replicates,
            "max_replicas": self.max_replicas,
            "best": None if self.best is None else {
                "prefill": self.best[0], "decode": self.best[1], "replicas": sum(self.best)},
            "tested": [
                {"prefill": p, "decode": d, "passed": ok, "ttft_p95_s": self.ttft_p95[(p, d)]}
                for (p, d), ok in sorted(self.tested.items(), key=lambda kv: (sum(kv[0]), kv[0]))
            ],
            "provenance": self.provenance,
        }


def size_pools(
    scenario: Scenario,
    target_rate: float,
    slo: Mapping[str, float] | Sequence[str] | None = None,
    *,
    duration_s: float = DEFAULT_DURATION_S,
    replicates: int = DEFAULT_REPLICATES,
    max_replicas: int = 16,
    workers: int = 1,
    backend: str = "local",
) -> PoolSizing:
    """The best prefill:decode split of the fewest replicas that keeps ``slo`` at
    ``target_rate``: for n = 2, 3, ... (at most ``max_replicas``) every split p + d = n is run
    (as :func:`size_fleet` runs a count); the first n with a passing split is the answer, and
    among its passing splits the one with the lowest TTFT p95 (median over replicates)."""
    targets = parse_slo(slo) if slo else dict(scenario.slo)
    if not targets:
        raise ScenarioError(
            "slo: fleet sizing needs an SLO: give --slo ttft_p95=2.0 or an slo section in the scenario"
        )
    if not target_rate > 0 or target_rate == float("inf"):
        raise ScenarioError(f"--target-rate: must be > 0 requests/s (got {target_rate})")
    if not 2 <= max_replicas <= MAX_NUM_SEQS:
        raise ScenarioError(f"--max-replicas: must be in [2, {MAX_NUM_SEQS}] with pools (got {max_replicas})")
    if backend not in ("local", "ray"):
        raise ScenarioError(f"--backend {backend}: unknown backend; allowed: local, ray")
    with_pools(scenario, 1, 1)  # (refuses a scenario without pools up front)
    tested: dict[tuple[int, int], bool] = {}
    ttft: dict[tuple[int, int], float | None] = {}
    best = None
    with Runner(workers, early_stop=True) as runner:
        for n in range(2, max_replicas + 1):
            splits = [(p, n - p) for p in range(1, n)]
            tasks = [
                (with_pools(scenario, p, d), target_rate, r, duration_s, targets, None, "search")
                for p, d in splits for r in range(replicates)
            ]
            points = run_tasks(tasks, runner, backend)
            for j, split in enumerate(splits):
                pts = points[j * replicates:(j + 1) * replicates]
                tested[split] = all(p.passed for p in pts)
                values = sorted(v for p in pts if (v := p.values.get("ttft_p95")) is not None)
                ttft[split] = values[len(values) // 2] if len(values) == len(pts) else None
            passing = [s for s in splits if tested[s]]
            if passing:
                best = min(passing, key=lambda s: (ttft[s] if ttft[s] is not None else float("inf"), s))
                break
    prov = {
        "simcap_version": __version__,
        "scenario_name": scenario.name,
        "scenario_sha256": scenario.digest(),
        "seed": scenario.seed,
        "backend": backend,
    }
    return PoolSizing(float(target_rate), targets, float(duration_s), replicates, max_replicas,
                      tested, ttft, best, prov)


def render_pool_sizing(result: PoolSizing, console: Any) -> None:
    from rich.table import Table

    table = Table(
        title=f"prefill:decode sizing at {result.target_rate:g} req/s, SLO "
              + ", ".join(f"{k} <= {v:g} s" for k, v in result.slo.items()),
        title_justify="left",
    )
    for col in ("replicas", "prefill", "decode", "TTFT p95 (s)", "pass"):
        table.add_column(col, justify="right")
    for (p, d), ok in sorted(result.tested.items(), key=lambda kv: (sum(kv[0]), kv[0])):
        value = result.ttft_p95[(p, d)]
        table.add_row(str(p + d), str(p), str(d), "-" if value is None else f"{value:.3f}",
                      "yes" if ok else "NO")
    console.print(table)
    if result.best is None:
        console.print(f"no split of up to {result.max_replicas} replicas keeps the SLO")
    else:
        p, d = result.best
        console.print(f"best: {p} prefill + {d} decode replicas ({p}:{d}), {p + d} in all")
