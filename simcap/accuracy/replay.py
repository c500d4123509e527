"""Replay the corpus: fit each case on its fit part with the shipped calibration path, predict
its held-out part, and give every prediction's error beside the measurement's own spread.

- A **live** case's fit part is a recorded calibration workload: its server step-log lines
  and client records go through :func:`simcap.live.calibration.fit_calibration_log` (what
  ``simcap live calibrate --log`` runs on a live server: host overhead from the records, then
  the linear or the roofline form, no bootstrap), the speculative section through
  :func:`~simcap.live.calibration.speculative_section` from the fit runs' ``/metrics``, and
  the profile through :func:`simcap.calibrate.profile_dict`, and the front end through
  :func:`simcap.live.frontend_fit.fit_frontend` (none when the fit runs lack the server's
  request histograms or a run with one request in flight). Each held-out run is then
  simulated on exactly its own trace (:func:`simcap.live.validate.replay_run`: as a closed
  loop, at its send times or as its sessions) with the point's scenario, the fitted engine,
  step time, speculative settings and front end (a fleet's replicas without one): the
  acceptance is the one measured while calibrating, never the held-out run's own.
- A **table** case is fitted by :func:`simcap.calibrate.pipeline.calibrate` on its fit rows
  (no bootstrap) and each held-out row simulated as the recipe reads it.

Per figure: ``measured`` is the median over the point's runs (a table row: the published
value; runs in which the load generator paused :data:`~simcap.live.client.PAUSE_DISTURBS_S` or
longer are left out while another run of the point remains, as ``simcap live validate`` leaves
them out), ``predicted`` the median over the runs' replays, ``error`` = predicted / measured - 1,
and ``spread`` the range of the server instances' medians relative to ``measured`` (None with
one instance or a table): the noise a prediction cannot be asked to beat. ``load`` is the
point's requests in the engine's batch as predicted (Little's law on its simulation: completed
requests x mean time from first scheduled to finished / duration, per replica for a fleet,
the median over its runs)
and ``fit_load`` the most any run or row of the fit part had (a live case's as measured, a
table's fit rows as simulated with the fitted profile, the fit's own ``fit_load``): how far past
its data the prediction reached (:mod:`simcap.accuracy.model_form`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from simcap.accuracy.corpus import LIVE_METRICS, Case, LiveCase, TableCase
from simcap.metrics.summary import requests_running

Figure = dict[str, Any]


@dataclass
class CaseReplay:
    """One case in one step-time form: its figures and the fit behind them."""

    case: str
    form: str
    figures: list[Figure]
    fitted: dict[str, Any]  # the fitted step_time (speculative, frontend) sections
    fit_load: float | None = None  # the fit part's most requests running (see the module doc)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rel(pred: float | None, ref: float | None) -> float | None:
    if pred is None or ref is None or not ref:
        return None
    return float(pred / ref - 1.0)


def _figure(case: str, form: str, point: str, metric: str, measured: float | None, predicted: float | None,
            spread: float | None, runs: int, load: float | None = None,
            fit_load: float | None = None) -> Figure:
    return {"key": f"{case}/{form}/{point}/{metric}", "case": case, "form": form, "point": point,
            "metric": metric, "measured": measured, "predicted": predicted,
            "error": _rel(predicted, measured), "spread": spread, "runs": runs,
            "load": load, "fit_load": fit_load}


def fit_live(case: LiveCase, form: str, notes: list[str] | None = None,
             load: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """The profile (``engine``, ``step_time``, ``speculative``, ``frontend``) a live case's fit
    part gives, and the most requests running in its runs (``fit_load``, as the fit records it).
    ``load``: reads a run file of the case by its relative name (default: from disk)."""
    from simcap.calibrate import Recipe, log_step_samples, profile_dict
    from simcap.live.calibration import fit_calibration_log, speculative_section
    from simcap.live.frontend_fit import fit_frontend
    from simcap.live.prom import metrics_delta

    notes = notes if notes is not None else []
    runs = [(load or _loader(case))(f) for f in case.fit.runs]
    lines = [line for r in runs for line in r.iteration_lines]
    records = [rec for r in runs for rec in r.run.records]
    after = runs[-1].run.last_metrics
    k = (after.num_speculative_tokens if after is not None else None) or 0
    samples = log_step_samples(lines, k, where=f"{case.name}: fit runs")
    roofline = dict(case.fit.roofline or {}) if form == "roofline" else None
    fitted = fit_calibration_log(samples, lines, records, k, roofline=roofline, bootstrap=0, seed=0,
                                 runs=[(r.run, r.iteration_lines) for r in runs],
                                 noise="empirical", notes=notes)
    speculative = None
    if k:
        delta = metrics_delta(runs[0].run.metrics_before, after)
        speculative = speculative_section(case.name, delta, k, case.fit.speculative_method or "ngram",
                                          fitted, notes)
    profile = profile_dict(fitted.fit, Recipe(name=case.name, engine=dict(case.fit.engine),
                                              speculative=speculative))
    frontend = fit_frontend([(r.run, r.iteration_lines) for r in runs])
    notes += frontend.notes
    return {"engine": profile["engine"], "step_time": profile["step_time"],
            "speculative": profile.get("speculative"), "frontend": frontend.config,
            "fit_load": (fitted.fit.extra.get("fit_load") or {}).get("all")}


def _replay_live(case: LiveCase, form: str, load: Callable[[str], Any]) -> CaseReplay:
    from simcap.config.scenario import parse_scenario
    from simcap.live.client import PAUSE_DISTURBS_S
    from simcap.live.validate import instance_spread, replay_run, speed_of, used_mask

    notes: list[str] = []
    profile = fit_live(case, form, notes, load)
    fit_load = profile["fit_load"]
    figures: list[Figure] = []
    for point in case.points:
        data = dict(point.scenario)
        data["engine"] = {**(data.get("engine") or {}), **profile["engine"]}
        data["step_time"] = profile["step_time"]
        data["speculative"] = profile["speculative"] if data.get("speculative") else None
        if not data.get("deployment"):  # (a fleet's router stands in front of its replicas)
            data["frontend"] = profile["frontend"]
        data.pop("profile", None)
        scenario = parse_scenario(data)
        live, pred, instance, loads, speeds, at_speed = [], [], [], [], [], []
        one_server = not data.get("deployment")
        recorded_runs = [load(ref.file) for ref in point.runs]
        used = used_mask([r.run.paused for r in recorded_runs])  # as live validate (see the module doc)
        if not all(used):
            notes.append(f"{point.name}: {used.count(False)} of {len(used)} run(s) left out, the load generator "
                         f"paused {PAUSE_DISTURBS_S * 1e3:.0f} ms or more in them")
        for ref, recorded, ok in zip(point.runs, recorded_runs, used):
            if not ok:
                continue
            sim = replay_run(scenario, recorded.run, point.replay, steps=one_server)
            delta = recorded.run.server_delta()
            live.append(_values(recorded.run.summary(), recorded.run.records, delta.get("prefix_cache_hit_rate"),
                                delta.get("num_preemptions")))
            pred.append(_sim_values(sim))
            instance.append(ref.instance)
            running = requests_running(sim.summary)  # a fleet's: per replica, each its own engine
            loads.append(running if one_server or running is None else running / len(sim.replica_steps))
            speed, fast = speed_of(scenario, recorded.run, point.replay, recorded.iteration_lines, sim) \
                if one_server else (None, None)
            speeds.append(speed and speed["ratio"])
            at_speed.append(fast and _sim_values(fast))
        metrics = list(LIVE_METRICS)
        if scenario.workload.prefix is not None or scenario.workload.sessions is not None:
            metrics.append("prefix_hit_rate")
        if scenario.workload.sessions is not None:
            metrics.append("later_turns_ttft_p50")
        if any(v["preemptions"] for v in live):  # the server preempted: how often, predicted
            metrics.append("preemptions")
        for metric in metrics:
            lv = [v[metric] for v in live]
            pv = [v[metric] for v in pred]
            if any(v is None for v in lv + pv):
                continue
            by: dict[int, list[float]] = {}
            for i, v in zip(instance, lv):
                by.setdefault(i, []).append(v)
            known = [v for v in loads if v is not None]
            figure = _figure(case.name, form, point.name, metric, float(np.median(lv)), float(np.median(pv)),
                             instance_spread(by)["between_instances"], len(lv),
                             float(np.median(known)) if known else None, fit_load)
            if all(s is not None for s in speeds):  # the engine's speed, and the replays at it
                at = [v[metric] for v in at_speed]
                figure["engine_speed"] = float(np.median(speeds))
                figure["predicted_at_speed"] = None if None in at else float(np.median(at))
                figure["error_at_speed"] = _rel(figure["predicted_at_speed"], figure["measured"])
            figures.append(figure)
    return CaseReplay(case.name, form, figures, profile, fit_load, notes)


def _sim_values(sim: Any) -> dict[str, float | None]:
    """A replay's figures, as :func:`_values` gives a live run's."""
    pc = sim.prefix_cache
    return _values(sim.summary, sim.records, pc["hits"] / pc["queries"] if pc and pc["queries"] else None,
                   float(sim.summary.preemptions))


def _values(summary: Any, records: Sequence[Any], prefix_hit_rate: float | None,
            preemptions: float | None) -> dict[str, float | None]:
    """One run's figures: the summary's (:func:`simcap.live.validate.metric_value`), the
    prefix-cache hit rate (hits over queries), the TTFT median of sessions' later turns, and
    the run's preemptions."""
    from simcap.live.validate import metric_value

    later = [r.chunk_times[0] - r.arrival_time for r in records if r.succeeded and (r.turn or 0) > 0]
    return {**{m: metric_value(summary, m) for m in LIVE_METRICS}, "prefix_hit_rate": prefix_hit_rate,
            "later_turns_ttft_p50": float(np.median(later)) if later else None, "preemptions": preemptions}


def _replay_table(case: TableCase, form: str) -> CaseReplay:
    from simcap.calibrate import Recipe, profile_dict
    from simcap.calibrate.metric_keys import metric_value
    from simcap.calibrate.pipeline import benchmark_points, calibrate
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate

    recipe = Recipe.load(case.dir / case.recipes[form])  # type: ignore[index]
    fit = calibrate([], recipe, bootstrap=0, rows=case.fit_rows)
    profile = profile_dict(fit, recipe)
    points = {p.label: p for p in benchmark_points(recipe)}

    fit_load = fit.extra["fit_load"]["all"]  # the fitted rows' most requests running, at the fit
    figures: list[Figure] = []
    notes: list[str] = []
    for row in case.held_out:
        pt = points.get(row.row)
        if pt is None:
            notes.append(f"{row.row}: not a row of {case.recipes[form]}")  # type: ignore[index]
            continue
        result = simulate(parse_scenario({**pt.scenario, "step_time": profile["step_time"]}))
        for metric in row.metrics:
            if metric not in pt.measured:
                continue
            value = metric_value(metric, result, steady_state=pt.steady_state)
            figures.append(_figure(case.name, form, row.row, metric, float(pt.measured[metric]),
                                   float(value), None, 1, requests_running(result.summary), fit_load))
    return CaseReplay(case.name, form, figures, {"step_time": profile["step_time"]}, fit_load, notes)


def _loader(case: LiveCase) -> Callable[[str], Any]:
    """Reads each of the case's recorded runs once, however many forms replay it."""
    from simcap.live.recording import load_run

    return functools.cache(lambda name: load_run(case.dir / name))


def replay_case(case: Case, forms: Sequence[str] | None = None) -> list[CaseReplay]:
    """Every form of ``case`` (``forms`` picks some), fitted and predicted."""
    out = []
    load = _loader(case) if isinstance(case, LiveCase) else None
    for form in case.forms:
        if forms and form not in forms:
            continue
        start = time.perf_counter()
        one = _replay_live(case, form, load) if isinstance(case, LiveCase) else _replay_table(case, form)
        one.wall_s = time.perf_counter() - start
        out.append(one)
    return out


def replay_corpus(cases: Sequence[Case], forms: Sequence[str] | None = None) -> list[CaseReplay]:
    return [r for case in cases for r in replay_case(case, forms)]
