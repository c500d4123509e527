"""``simcap live capacity``: the safe rate and the saturation rate measured on a real server,
with simcap's prediction of both beside them.

The field's method, run against the live server by the same search and the same rules as
``simcap capacity`` (:mod:`simcap.studies.capacity`: :func:`~simcap.studies.capacity.run_search`,
:func:`~simcap.studies.capacity.capacity_result`; only the evaluator differs):

- each (rate, replicate) is one open-loop run of the scenario's workload at that rate for
  ``duration_s`` seconds of arrivals (:func:`~simcap.studies.capacity.at_rate`, seed ``seed + r``:
  the same requests and send times the simulation draws), sent by
  :func:`~simcap.live.client.run_live`; the prefix cache is reset before every run
  (``POST /reset_prefix_cache``, vLLM with ``VLLM_SERVER_DEV_MODE=1``);
- the run's records become a :class:`~simcap.studies.capacity.CapacityPoint` through the one metrics
  path (:func:`simcap.metrics.summary.summarize`, :func:`~simcap.studies.capacity.point_from_measurements`):
  SLO values, pass, saturation from the sends and finishes in ``[T/2, T)``;
- the axis is the MEASURED arrival rate: requests sent / max(``duration_s``, last send). A run
  whose load generator fell behind its schedule (that rate below ``REACHED_RATIO`` x the
  draw's own rate, requests / ``duration_s``) is marked ``rate_reached: false`` and its
  achieved rate is the one on the axis;
- a run in which any request failed (HTTP error, cut stream, ``--request-timeout``) fails;
- safe rate (prefix rule: passed in every replicate, every lower rate too), saturation rate
  (median completion rate of the saturated runs), each with the bracket it was found in
  (:func:`~simcap.studies.capacity.safe_rate_bracket`, :func:`~simcap.studies.capacity.saturation_bracket`).

The prediction: :func:`~simcap.studies.capacity.find_capacity` on the same scenario (its step-time
model, or a profile's), with the server's reported cache shape, the same duration,
replicates, rates (or the same bisection to the same tolerance, with the simulator's point
budget) and rules; its error
against the measured value and whether it falls inside the measured bracket. It runs first:
the live bisection starts at the predicted safe rate (unless given a start), so a good
prediction costs two live rates to bracket.

Every run's records are written to ``out_dir/runs/`` as its requests complete, and a
finished run is appended to ``out_dir/points.jsonl``. ``resume=True`` takes every finished run
from there (its point recomputed from its records file) and reruns only the rest: a run
killed half-way has no line in ``points.jsonl`` and is rerun. ``out_dir/search.json``
holds the search's settings; a resume with other settings is refused, naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from simcap._version import __version__
from simcap.studies.capacity import (
    CapacityPoint, CapacityResult, at_rate, capacity_result, check_targets, find_capacity,
    point_from_measurements, run_search, safe_rate_bracket, saturation_bracket,
)
from simcap.errors import ScenarioError
from simcap.live.client import (
    PAUSE_DISTURBS_S, LiveError, auth_headers, check_request_timeout, redact, resolve_model, run_live,
)
from simcap.config.scenario import ClosedArrival, Scenario
from simcap.live.hostload import DEFAULT_THRESHOLD_CORES, CpuWatch
from simcap.live.prom import ServerMetrics, scrape
from simcap.live.validate import _local_port, _warmup, reset_prefix_cache, server_cache_update
from simcap.metrics.records import RequestRecord
from simcap.metrics.summary import summarize
from simcap.simulation.simulator import provenance
from simcap.workloads.requests import Workload

REACHED_RATIO = 0.95
SIM_MAX_POINTS = 14  # the prediction's search budget (find_capacity's defaults)
SIM_MAX_PROBES = 5
MAX_LIVE_DURATION_S = 3600.0
LIVE_RULES = {
    "measured_rate": "requests sent / max(duration, last send): the rate the server was offered",
    "rate_reached": f"the load generator reached a rate when its measured rate is >= "
    f"{REACHED_RATIO} x the draw's own rate (requests / duration); else the point is marked and "
    "its achieved rate is on the axis",
    "failed_requests": "a run with any failed request (HTTP error, cut stream, timeout) fails",
    "safe_rate_bracket": "[safe rate, lowest measured rate among the failing runs of the first "
    "failing tested rate]: the safe rate lies inside it",
    "saturation_bracket": "[highest measured rate of a run that kept up below the first tested "
    "rate at which a run saturated, lowest measured rate of a saturated run at that rate]: the "
    "queue starts to diverge inside it",
}


# --------------------------------------------------------------------------- one live run


def live_point(
    records: Sequence[RequestRecord],
    scenario: Scenario,
    *,
    rate: float,
    replicate: int,
    duration_s: float,
    slo: dict[str, float],
    role: str = "search",
    facts: dict[str, Any] | None = None,
) -> CapacityPoint:
    """One live run's records -> its :class:`~simcap.studies.capacity.CapacityPoint` (module doc).

    ``scenario``: the scenario the search runs (its schedule at ``rate`` and seed
    ``seed + replicate`` gives each request's planned send time). ``facts``: further live
    facts kept on the point (reset, disturbance: foreign CPU or the load generator's pauses, wall time).
    """
    if not records:
        raise LiveError(f"live run at {rate:g} req/s, replicate {replicate}: no request was sent")
    at = at_rate(scenario, rate, duration_s=duration_s, seed=scenario.seed + replicate, slo=slo)
    planned = Workload(at.workload, at.seed).arrival_times()
    recs = sorted(records, key=lambda r: r.request_id)
    sends = np.array([r.arrival_time for r in recs], dtype=float)
    finish = np.array([r.finish_time if r.succeeded else math.inf for r in recs], dtype=float)
    lag = [r.arrival_time - planned[r.request_id] for r in recs if r.request_id < len(planned)]
    own = len(recs) / duration_s
    measured = len(recs) / max(duration_s, float(sends.max()))
    failed = sum(1 for r in recs if not r.succeeded)
    live = {
        "requested_rate": float(rate),
        "scheduled_rate": own,
        "achieved_rate": measured,
        "rate_reached": bool(measured >= REACHED_RATIO * own),
        "max_send_lag_s": float(max(lag)) if lag else None,
        "requests": len(recs),
        "failed": failed,
        **(facts or {}),
    }
    point = point_from_measurements(
        summarize(recs, slo=slo), sends, finish, rate=rate, replicate=replicate, seed=at.seed,
        duration_s=duration_s, role=role, measured_rate=measured, live=live,
    )
    if failed:
        point = dataclasses.replace(point, passed=False)
    return point


# --------------------------------------------------------------------------- the store


def _run_name(rate: float, replicate: int) -> str:
    return f"rate{rate:.9g}-rep{replicate}.jsonl"


class CapacityStore:
    """A search's directory: ``search.json`` (settings), ``runs/*.jsonl`` (records, written as
    requests complete) and ``points.jsonl`` (one line per finished run)."""

    def __init__(self, out_dir: str | Path, settings: dict[str, Any], resume: bool) -> None:
        self.dir = Path(out_dir)
        self.settings = settings
        self.done: dict[tuple[float, int], dict[str, Any]] = {}
        manifest = self.dir / "search.json"
        if manifest.exists():
            if not resume:
                raise ScenarioError(
                    f"--out: {self.dir} already holds a capacity search; --resume to continue "
                    "it, or give another --out"
                )
            try:
                before = json.loads(manifest.read_text())
            except ValueError:
                raise ScenarioError(f"--resume: {manifest} is not JSON") from None
            for key, value in settings.items():
                if before.get(key) != value:
                    raise ScenarioError(
                        f"--resume: {key} differs from the search in {self.dir} "
                        f"(there {before.get(key)!r}, now {value!r})"
                    )
            points = self.dir / "points.jsonl"
            if points.exists():
                for line in points.read_text().splitlines():
                    try:
                        entry = json.loads(line)
                        self.done[(float(entry["rate"]), int(entry["replicate"]))] = entry
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by the kill: that run is rerun
        elif resume and not (self.dir / "points.jsonl").exists():
            raise ScenarioError(f"--resume: no capacity search in {self.dir} (no search.json)")
        (self.dir / "runs").mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    def records_path(self, rate: float, replicate: int) -> Path:
        return self.dir / "runs" / _run_name(rate, replicate)

    def load(self, rate: float, replicate: int) -> tuple[list[RequestRecord], dict[str, Any]] | None:
        """A finished run's records and facts, or None (never run, or killed half-way)."""
        entry = self.done.get((float(rate), int(replicate)))
        if entry is None:
            return None
        path = self.dir / entry["records"]
        try:
            lines = path.read_text().splitlines()
            recs = [RequestRecord.from_dict(json.loads(line)) for line in lines if line.strip()]
        except (OSError, ValueError):
            return None
        if len(recs) != entry.get("requests"):
            return None
        return recs, dict(entry.get("facts") or {})

    def finish(self, point: CapacityPoint, facts: dict[str, Any]) -> None:
        """Record a finished run (one flushed line)."""
        entry = {
            "rate": point.rate, "replicate": point.replicate,
            "records": f"runs/{_run_name(point.rate, point.replicate)}",
            "requests": (point.live or {}).get("requests"), "facts": facts,
            "point": point.to_dict(),
        }
        with open(self.dir / "points.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, allow_nan=False) + "\n")
            fh.flush()
        self.done[(point.rate, point.replicate)] = entry


# --------------------------------------------------------------------------- the server


async def _server_facts_async(base_url: str, model: str | None, api_key: str | None) -> dict[str, Any]:
    async with httpx.AsyncClient(headers=auth_headers(api_key), timeout=30.0) as client:
        name, max_len = await resolve_model(client, base_url, model)
        snap = await scrape(client, base_url)
        version = None
        try:
            resp = await client.get(base_url.rstrip("/") + "/version")
            if resp.status_code == 200:
                version = resp.json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    return {"model": name, "max_model_len": max_len, "metrics": snap, "vllm_version": version}


def server_facts(base_url: str, model: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """The served model, its max_model_len, one ``/metrics`` snapshot and vLLM's version."""
    try:
        return asyncio.run(_server_facts_async(base_url, model, api_key))
    except LiveError as exc:  # a server may echo the Authorization header in an error text
        raise LiveError(redact(str(exc), api_key)) from None


def engine_differences(scenario: Scenario, metrics: ServerMetrics | None,
                       max_model_len: int | None) -> dict[str, tuple[Any, Any]]:
    """``{field: (server's, scenario's)}`` for the engine flags the server reports that
    differ: block size, KV pool, prefix caching (``vllm:cache_config_info``), max_model_len
    (``/v1/models``). A scenario that sizes its pool from ``memory`` is not contradicted on
    ``num_gpu_blocks``."""
    eng = scenario.engine
    diff: dict[str, tuple[Any, Any]] = {}
    if metrics is not None:
        for key, value in server_cache_update(eng, metrics).items():
            if key == "num_gpu_blocks" and eng.num_gpu_blocks is None:
                continue
            diff[key] = (value, getattr(eng, key))
    if max_model_len is not None and max_model_len != eng.max_model_len:
        diff["max_model_len"] = (max_model_len, eng.max_model_len)
    return diff


# --------------------------------------------------------------------------- the search


@dataclasses.dataclass
class LiveCapacity:
    """A live capacity search and its prediction (``to_dict`` is the ``--json`` output)."""

    measured: CapacityResult
    predicted: CapacityResult | None
    comparison: dict[str, Any]
    server: dict[str, Any]
    live_time_s: float
    runs_made: int
    runs_resumed: int
    out_dir: str
    notes: list[str]
    provenance: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        measured = self.measured.to_dict()
        measured["safe_rate_bracket"] = list(safe_rate_bracket(self.measured.points))
        measured["rules"] = {**measured["rules"], **LIVE_RULES}
        measured.pop("provenance", None)
        return {
            "measured": measured,
            "predicted": self.predicted.to_dict() if self.predicted is not None else None,
            "comparison": self.comparison,
            "server": self.server,
            "live_time_s": self.live_time_s,
            "runs_made": self.runs_made,
            "runs_resumed": self.runs_resumed,
            "out_dir": self.out_dir,
            "notes": list(self.notes),
            "provenance": self.provenance,
        }


def _rel(pred: float | None, ref: float | None) -> float | None:
    return None if pred is None or ref is None or ref == 0 else (pred - ref) / ref


def _inside(value: float | None, bracket: tuple[float | None, float | None]) -> bool | None:
    """Whether ``value`` lies in the bracket (an open end is unbounded); None: nothing to say."""
    lo, hi = bracket
    if value is None or (lo is None and hi is None):
        return None
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def compare_capacity(measured: CapacityResult, predicted: CapacityResult | None) -> dict[str, Any]:
    """Safe rate and saturation rate: measured, its bracket, predicted, error, inside."""
    rows = {
        "safe_rate": (measured.safe_rate, safe_rate_bracket(measured.points),
                      None if predicted is None else predicted.safe_rate),
        "saturation_rate": (measured.saturation_rate, saturation_bracket(measured.points),
                            None if predicted is None else predicted.saturation_rate),
    }
    return {
        key: {
            "measured": value,
            "bracket": list(bracket),
            "predicted": pred,
            "rel_error": _rel(pred, value),
            "in_bracket": None if predicted is None else _inside(pred, bracket),
        }
        for key, (value, bracket, pred) in rows.items()
    }


def live_capacity(
    scenario: Scenario,
    base_url: str,
    out_dir: str | Path,
    *,
    slo: dict[str, float] | None = None,
    rates: Sequence[float] | None = None,
    duration_s: float = 60.0,
    replicates: int = 2,
    start_rate: float | None = None,
    rel_tol: float = 0.1,
    max_points: int = 8,
    max_probes: int = 2,
    predict_scenario: Scenario | None = None,
    model: str | None = None,
    endpoint: str = "completions",
    api_key: str | None = None,
    request_timeout_s: float | None = 600.0,
    adopt_server_config: bool = False,
    resume: bool = False,
    warmup: bool = True,
    say: Callable[[str], None] | None = None,
) -> LiveCapacity:
    """Search the live server's safe and saturation rates, and predict them (module doc).

    ``rates``: test these; None: bracket and bisect from ``start_rate`` (default the
    predicted safe rate; the prediction's own search starts at ``start_rate``, default the
    scenario's rate) to ``rel_tol`` or ``max_points`` rates. ``predict_scenario``: the scenario
    the prediction simulates (default ``scenario``). ``adopt_server_config``: where the
    server's engine flags differ from the scenario's, simulate the server's (noted) instead of
    refusing. Raises :class:`~simcap.errors.ScenarioError` / :class:`LiveError`, one line each.
    """
    targets = check_targets(scenario, slo, duration_s, replicates, MAX_LIVE_DURATION_S)
    if isinstance(scenario.workload.arrival, ClosedArrival) and start_rate is None and rates is None:
        raise ScenarioError(
            "workload.arrival: a closed-loop scenario has no rate to start the search from; "
            "give --rates or --start-rate"
        )
    if rates is not None:
        rates = sorted({float(r) for r in rates})
        if not rates or any(r <= 0 or not math.isfinite(r) for r in rates):
            raise ScenarioError("--rates: every rate must be > 0 requests/s")
    if not (rel_tol > 0 and math.isfinite(rel_tol)):
        raise ScenarioError(f"--rel-tol: must be > 0 (got {rel_tol})")
    if max_points < 1:
        raise ScenarioError(f"--max-points: must be >= 1 (got {max_points})")
    if max_probes < 0:
        raise ScenarioError(f"--max-probes: must be >= 0 (got {max_probes})")
    check_request_timeout(request_timeout_s)
    notes: list[str] = []
    facts = server_facts(base_url, model, api_key)
    model = facts["model"]
    snap: ServerMetrics | None = facts["metrics"]
    diff = engine_differences(scenario, snap, facts["max_model_len"])
    if diff and not adopt_server_config:
        raise LiveError(
            "the server's engine flags differ from the scenario's: "
            + ", ".join(f"{k} server {s} vs scenario {c}" for k, (s, c) in diff.items())
            + " (fix the scenario, or --adopt-server-config to predict with the server's)"
        )
    if snap is None:
        notes.append("server exposes no /metrics: its engine flags could not be checked")
    mode = "grid" if rates is not None else "auto"
    sim = predict_scenario or scenario
    if snap is not None:
        update = server_cache_update(sim.engine, snap)
        if sim.engine.num_gpu_blocks is None:
            update.pop("num_gpu_blocks", None)
        if update:
            notes.append("predicted with the server's cache config " + ", ".join(
                f"{k}={v} (scenario: {getattr(sim.engine, k)})" for k, v in update.items()))
            sim = sim.model_copy(update={"engine": sim.engine.model_copy(update=update)})
    if diff.get("max_model_len"):
        sim = sim.model_copy(update={"engine": sim.engine.model_copy(
            update={"max_model_len": diff["max_model_len"][0]})})
    sim_start = float(start_rate or (rates[0] if rates else sim.workload.arrival.rate))  # type: ignore[union-attr]
    predicted = find_capacity(  # a simulated rate costs seconds: the simulator's point budget
        sim, targets, rates=rates, auto=rates is None, duration_s=duration_s,
        replicates=replicates, start_rate=sim_start, rel_tol=rel_tol,
        max_points=max(max_points, SIM_MAX_POINTS), max_probes=max(max_probes, SIM_MAX_PROBES),
    )
    # The live search starts where the prediction put the safe rate: a good prediction
    # brackets it in two rates.
    start = float(start_rate or (rates[0] if rates else predicted.safe_offered_rate or sim_start))
    settings = {
        "scenario_sha256": scenario.digest(), "slo": targets, "duration_s": float(duration_s),
        "replicates": int(replicates), "mode": mode, "rates": rates, "start_rate": start,
        "rel_tol": rel_tol, "max_points": max_points, "max_probes": max_probes,
        "model": model, "endpoint": endpoint,
    }
    store = CapacityStore(out_dir, settings, resume)
    if warmup:
        _warmup(scenario, base_url, model, endpoint, api_key=api_key, request_timeout_s=request_timeout_s)
    tally = {"made": 0, "resumed": 0, "live_s": 0.0, "reset_failed": None}
    port = _local_port(base_url)

    def one(rate: float, k: int, role: str) -> CapacityPoint:
        kept = store.load(rate, k)
        if kept is not None:
            recs, run_facts = kept
            tally["resumed"] += 1
            point = live_point(recs, scenario, rate=rate, replicate=k, duration_s=duration_s,
                               slo=targets, role=role, facts=run_facts)
            if say:
                say(f"rate {rate:.4g} rep {k}: kept from {store.dir} ({_verdict(point)})")
            return point
        reset = reset_prefix_cache(base_url, api_key=api_key)
        if reset != "ok" and tally["reset_failed"] is None:
            tally["reset_failed"] = reset
        at = at_rate(scenario, rate, duration_s=duration_s, seed=scenario.seed + k, slo=targets)
        watch = CpuWatch((), DEFAULT_THRESHOLD_CORES, port).start()
        t0 = time.perf_counter()
        run = run_live(at, base_url, model, endpoint=endpoint,  # type: ignore[arg-type]
                       out_path=store.records_path(rate, k), progress=False, api_key=api_key,
                       request_timeout_s=request_timeout_s)
        wall = time.perf_counter() - t0
        cpu = watch.stop()
        tally["made"] += 1
        tally["live_s"] += wall
        run_facts = {"wall_s": round(wall, 3), "prefix_cache_reset": reset,
                     "disturbed": run.disturbed(cpu),
                     "foreign_cores": (round(float(cpu["foreign_cores"]), 3)
                                       if cpu.get("foreign_cores") is not None else None),
                     "client_pauses": run.client_pauses}
        point = live_point(run.records, scenario, rate=rate, replicate=k, duration_s=duration_s,
                           slo=targets, role=role, facts=run_facts)
        store.finish(point, run_facts)
        if say:
            say(f"rate {rate:.4g} rep {k}: {_verdict(point)}, {wall:.1f} s")
        return point

    def evaluate(rs: Sequence[float], n: int, role: str) -> list[CapacityPoint]:
        return [one(r, k, role) for r in rs for k in range(n)]

    points = run_search(evaluate, rates=rates, replicates=replicates, start=start,
                        rel_tol=rel_tol, max_points=max_points, max_probes=max_probes)
    measured = capacity_result(points, targets, duration_s=duration_s, replicates=replicates, mode=mode)
    if tally["reset_failed"]:
        notes.append(f"prefix cache not reset between runs: {tally['reset_failed']}; reruns may hit the cache")
    short = [p for p in points if p.live and not p.live["rate_reached"]]
    if short:
        notes.append(
            f"{len(short)} run(s): the load generator did not reach the rate (e.g. requested "
            f"{short[0].rate:.4g}, achieved {short[0].measured_rate:.4g} req/s); marked, their "
            "achieved rate is on the axis"
        )
    failed = [p for p in points if p.live and p.live["failed"]]
    if failed:
        notes.append(f"{len(failed)} run(s) had failed requests and count as failed")
    disturbed = [p for p in points if p.live and p.live.get("disturbed")]
    if disturbed:
        notes.append(f"{len(disturbed)} run(s) disturbed: other processes loaded the CPU, or the load "
                     f"generator paused {PAUSE_DISTURBS_S * 1e3:.0f} ms or more")

    server = {
        "base_url": base_url.rstrip("/"), "model": model, "max_model_len": facts["max_model_len"],
        "vllm_version": facts["vllm_version"],
        "cache_config": dict(snap.cache_config) if snap is not None else None,
        "engine_differences": {k: {"server": s, "scenario": c} for k, (s, c) in diff.items()},
    }
    prov = provenance(scenario)
    prov.update(
        simcap_version=__version__,
        method="open-loop Poisson (or the scenario's gamma) arrivals per rate against the live "
        "server, replicate r uses seed + r at every rate, prefix cache reset before each run, "
        "every request completed; the same search and rules as simcap capacity",
        predicted_with=sim.profile.model_dump(mode="json") if sim.profile is not None else None,
        endpoint=endpoint,
    )
    return LiveCapacity(
        measured=measured, predicted=predicted, comparison=compare_capacity(measured, predicted),
        server=server, live_time_s=round(tally["live_s"], 3), runs_made=tally["made"],
        runs_resumed=tally["resumed"], out_dir=str(store.dir), notes=notes, provenance=prov,
    )


def _verdict(point: CapacityPoint) -> str:
    mark = "" if not point.live or point.live["rate_reached"] else " (rate not reached)"
    return (f"measured {point.measured_rate:.4g} req/s{mark}, "
            + ", ".join(f"{k} {'-' if v is None else f'{v * 1e3:.1f} ms'}" for k, v in point.values.items())
            + f", {'pass' if point.passed else 'FAIL'}{', saturated' if point.saturated else ''}")


# --------------------------------------------------------------------------- rendering


def render_live_capacity(result: LiveCapacity, console: Any) -> None:
    """The measured runs and rates (as ``simcap capacity``), then the prediction beside them."""
    from rich.table import Table

    from simcap.studies.capacity import render_capacity

    render_capacity(result.measured, console)
    table = Table(title="measured vs predicted (req/s)", title_justify="left")
    for col in ("", "measured", "bracket", "predicted", "error", "in bracket"):
        table.add_column(col, justify="right" if col else "left")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for key, row in result.comparison.items():
        lo, hi = row["bracket"]
        err = row["rel_error"]
        table.add_row(
            key.replace("_", " "), num(row["measured"]), f"{num(lo)} - {num(hi)}",
            num(row["predicted"]), "-" if err is None else f"{err * 100:+.1f}%",
            {True: "yes", False: "NO", None: "-"}[row["in_bracket"]],
        )
    console.print(table)
    console.print(f"live time {result.live_time_s:.1f} s over {result.runs_made} run(s)"
                  + (f"; {result.runs_resumed} run(s) kept from before" if result.runs_resumed else "")
                  + f"; records in {result.out_dir}")
    for note in result.notes:
        console.print(f"note: {note}", style="dim")
