"""Simulation-based fit of benchmark results: ``least_squares`` on log(simulated / measured),
every point re-simulated, with a wild residual bootstrap for the intervals."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from simcap.calibrate.core import TYPICAL, CalibrationError, Form, _fmt
from simcap.calibrate.metrics import _is_fraction, metric_value
from simcap.calibrate.readers import BenchmarkPoint
from simcap.calibrate.result import Fit, _percentile_ci, _quality
from simcap.errors import ScenarioError
from simcap.scenario import StepTimeConfig, parse_scenario
from simcap.simulator import SimulationError, simulate


class _Objective:
    """Simulates every point at given coefficients (cached) and forms log-ratio residuals."""

    def __init__(self, points, form, fixed, metrics, smooth):
        self.points, self.form, self.fixed = points, form, fixed
        self.metrics = metrics  # per point: list of (metric, weight)
        self.smooth = smooth
        self.scale = np.array([fixed.get(t) or TYPICAL[t] for t in form.free], dtype=float)
        self.scenarios = []
        for pt in points:
            try:
                self.scenarios.append(parse_scenario({**pt.scenario, "step_time": {}}))
            except ScenarioError as exc:
                raise CalibrationError(f"{pt.source['file']} ({pt.label}): {exc}") from None
        self.cache: dict[tuple, list[dict[str, float]]] = {}
        self.evaluations = 0

    def coefficients(self, x: np.ndarray) -> dict[str, float]:
        return self.form.coefficients(np.maximum(x, 0.0) * self.scale, self.fixed)

    def simulate(self, x: np.ndarray) -> list[dict[str, float]]:
        key = tuple(np.round(x, 12))
        if key in self.cache:
            return self.cache[key]
        coeffs = self.coefficients(x)
        step_time = StepTimeConfig(**coeffs, host_overhead=self.fixed.get("host_overhead") or 0.0)
        out = []
        for pt, sc, mets in zip(self.points, self.scenarios, self.metrics):
            try:
                res = simulate(sc.model_copy(update={"step_time": step_time}))
            except SimulationError as exc:
                raise CalibrationError(f"{pt.label}: simulation failed at {coeffs}: {exc}") from None
            itl: list = []
            values = {}
            for m in pt.measured:
                values[m] = metric_value(m, res, steady_state=pt.steady_state, _itl=itl)
                if _is_fraction(m):
                    values["~" + m] = metric_value(m, res, smooth=self.smooth, _itl=itl)
            out.append(values)
        self.evaluations += 1
        self.cache[key] = out
        return out

    def residuals(self, x: np.ndarray) -> np.ndarray:
        sims = self.simulate(x)
        r = []
        for pt, sim, mets in zip(self.points, sims, self.metrics):
            for m, w in mets:
                value = sim.get("~" + m, sim[m])
                eps = 0.02 if _is_fraction(m) else 1e-12
                r.append(w * (math.log(max(value, 0.0) + eps) - math.log(pt.measured[m] + eps)))
        return np.asarray(r)


def default_benchmark_form(points: Sequence[BenchmarkPoint]) -> Form:
    terms = ["base", "per_decode_token"]
    if any({"ttft_mean", "ttft_p50", "input_throughput"} & set(p.measured) for p in points):
        terms.insert(1, "per_prefill_token")
    if any(p.scenario.get("speculative") for p in points):
        terms += ["draft_per_pass", "draft_per_request"]
    return Form.parse(terms)


def fit_benchmarks(
    points: Sequence[BenchmarkPoint],
    form: Form | None = None,
    *,
    fixed: dict[str, float] | None = None,
    fit_metrics: Sequence[str] | None = None,
    weights: dict[str, float] | None = None,
    bootstrap: int = 40,
    iterations: int = 2,
    level: float = 0.9,
    seed: int = 0,
    warn_above: float = 0.1,
    smooth: float = 0.03,
    max_nfev: int | None = None,
) -> Fit:
    """Fit the free terms so that simulating each point reproduces its measured aggregates.

    Objective: ``sum (w_m log(simulated / measured))^2`` over points and fitted metrics
    (``fit_metrics``, default every measured one except ``request_throughput`` where
    ``output_throughput`` is measured too: with fixed output lengths they carry the same
    information). ITL fractions use ``log((x + 0.02) / (y + 0.02))`` and smoothed edges
    (``smooth``, width in log seconds). ``fixed`` holds the start values of free terms and the
    values of the others. Intervals: residual bootstrap (see module docstring).
    """
    if not points:
        raise CalibrationError("calibrate: no benchmark points")
    fixed = dict(fixed or {})
    form = form or default_benchmark_form(points)
    weights = dict(weights or {})
    metrics = []
    for pt in points:
        names = [m for m in pt.measured if fit_metrics is None or m in fit_metrics]
        if fit_metrics is None and "output_throughput" in names and "request_throughput" in names:
            names.remove("request_throughput")
        metrics.append([(m, weights.get(m, 1.0)) for m in names if weights.get(m, 1.0) > 0])
    n = sum(len(m) for m in metrics)
    p = len(form.free)
    if n < p:
        raise CalibrationError(
            f"calibrate: {n} fitted measurements are too few for {p} free terms ({', '.join(form.free)})"
        )
    obj = _Objective(points, form, fixed, metrics, smooth)
    x0 = np.ones(p)
    res = least_squares(obj.residuals, x0, bounds=(0.0, np.inf), method="trf", diff_step=0.02,
                        x_scale=1.0, xtol=1e-4, ftol=1e-5, max_nfev=max_nfev or 30 * p)
    if res.status < 0 or not np.all(np.isfinite(res.x)):
        raise CalibrationError(f"calibrate: the fit failed: {res.message}")
    if res.status == 0:
        files = ", ".join(sorted({pt.source["file"] for pt in points}))
        raise CalibrationError(
            f"{files}: the fit did not converge within {res.nfev} evaluations (free terms "
            f"{', '.join(form.free)}); fix a term with --form or give better start values"
        )
    warnings: list[str] = []
    notes = [f"least_squares: {res.nfev} evaluations ({obj.evaluations} distinct), {res.message}"]
    x_hat = res.x
    J = res.jac
    coeffs = obj.coefficients(x_hat)
    # identifiability: a near-null direction of the scaled Jacobian means terms trade off.
    active = x_hat > 1e-6
    if p > 1 and active.sum() > 1:
        Ja = J[:, active]
        sv = np.linalg.svd(Ja, compute_uv=True)
        if sv[1][-1] < 1e-3 * sv[1][0]:
            names = [t for t, a in zip(form.free, active) if a]
            null = sv[2][-1]
            pair = [names[j] for j in np.argsort(-np.abs(null))[:2]]
            warnings.append(
                f"WARNING: {' and '.join(pair)} are not separately identified by these points "
                "(one can be traded for the other); their intervals are wide or meaningless"
            )
    # Wild residual bootstrap. Data y* = simulated-at-fit x exp(e*/w) with e*_i = +-r_i (random
    # signs, Rademacher), so each measurement keeps its own misfit (metrics differ in kind: a
    # structural miss on one must not be dealt to another) and r*(x) = r(x) - r_hat - e*. Each
    # resample is refitted by Gauss-Newton steps with the Jacobian frozen at the fit (the chord
    # method), every step re-simulating all points; 0 iterations keeps the first, linearised step.
    r_hat = obj.residuals(x_hat)
    dof = max(n - p, 1)
    pool = r_hat * math.sqrt(n / dof)
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(bootstrap):
        e = pool * rng.choice([-1.0, 1.0], size=n)
        x = x_hat + lsq_linear(J, e, bounds=(-x_hat, np.inf)).x
        best, best_cost = x, math.inf
        for _ in range(iterations):
            r_star = obj.residuals(x) - r_hat - e
            cost = float(r_star @ r_star)
            if cost < best_cost:
                best, best_cost = x, cost
            x = x + lsq_linear(J, -r_star, bounds=(-x, np.inf)).x
        sets.append(obj.coefficients(best if iterations else x))
    terms = [*form.free, *form.tied]
    sets = [{t: _fmt(s[t]) for t in terms} for s in sets]
    method = (f"refitted by up to {iterations} Gauss-Newton steps with the Jacobian frozen at the "
              "fit, each re-simulating every point" if iterations else "one linearised "
              "Gauss-Newton step with the simulator's finite-difference Jacobian at the fit")
    sims = obj.simulate(x_hat)
    rows = []
    for pt, sim, mets in zip(points, sims, metrics):
        fitted_names = {m for m, _ in mets}
        for m, meas in pt.measured.items():
            value = sim[m]
            rel = (value - meas) / meas if meas else None
            rows.append({
                "point": pt.label, "metric": m, "measured": _fmt(meas), "fitted": _fmt(value),
                "rel_error": None if rel is None else round(rel, 4),
                "fitted_in_objective": m in fitted_names,
            })
    quality = _quality(rows, warn_above, warnings)
    quality["rms_log_error"] = round(float(np.sqrt(np.mean(r_hat**2))), 4) if n else None
    coeffs_all = {**coeffs, "host_overhead": float(fixed.get("host_overhead") or 0.0)}
    return Fit(
        kind="benchmarks",
        method=("simulation-based: scipy.optimize.least_squares (trf, bounds >= 0) on "
                "log(simulated / measured) of the fitted aggregates, every point re-simulated"),
        form=form, coefficients=coeffs_all, fixed=fixed, ci=_percentile_ci(sets, terms, level),
        bootstrap=sets,
        bootstrap_method=f"wild bootstrap (random signs) of the {n} log-ratio residuals "
                         f"(scaled by sqrt(n/(n-p))), {bootstrap} resamples, seed {seed}: {method}",
        level=level, residuals=rows,
        sources=_merge_sources(points), warnings=warnings, notes=notes, quality=quality,
    )


def _merge_sources(points: Sequence[BenchmarkPoint]) -> list[dict[str, Any]]:
    merged: dict[tuple, dict[str, Any]] = {}
    for pt in points:
        src = pt.source
        key = (src["file"], src.get("select"))
        entry = merged.setdefault(key, {**{k: v for k, v in src.items() if k != "row"}, "rows": [],
                                        "points": []})
        if src.get("row") is not None:
            entry["rows"].append(src["row"])
        entry["points"].append({"label": pt.label, "workload": pt.scenario["workload"],
                                "speculative": pt.scenario.get("speculative") is not None})
    return list(merged.values())
