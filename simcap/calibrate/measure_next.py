"""What to measure next: the load point that would narrow a prediction's interval most.

A roofline fit to benchmark points (:func:`simcap.calibrate.fit_bench.fit_benchmarks_roofline`)
leaves some terms held by their priors, not by the data; a prediction that leans on them has
a wide interval, and one more measured point at the right load would narrow it. This module
says which, and by how much, in the fit's own Laplace approximation:

- **Information.** At the fitted coefficients ``x`` (variables as the fit's: log efficiency,
  seconds over their scale) the Jacobian ``J`` of the fit's residuals, data rows and prior
  rows together, by forward differences (each free term moved by ``step``, every fitted point
  re-simulated). ``H = J^T J``; the coefficients' covariance is ``data_sigma^2 H^-1`` (a data
  row's residual is a log ratio with noise ``data_sigma``, a prior row is scaled to the same
  units), so a term the data do not pin keeps its prior's spread.
- **Predictions.** A query is a point (its scenario: a row, or a row's arm at another
  concurrency or rate) and a metric. Its log sensitivity ``g``
  (forward differences again) gives ``var(log value) = data_sigma^2 g H^-1 g^T`` and the
  interval ``value x exp(+-z sd)``.
- **A candidate** is a point to measure and the metrics such a run gives (a closed-loop run
  measures throughput and latency together). Measured, it would add its rows ``j`` to ``H``;
  each target's interval then shrinks by ``sqrt(g (H + j^T j)^-1 g^T / g H^-1 g^T)``. The
  advice is the candidate that most lowers the targets' summed variance (A-optimal design).

- **The model form** (``form_error``, ``simcap measure-next --model-form``): each target's
  model-form interval (:mod:`simcap.accuracy.model_form`) at its distance past the fitted rows
  of its arm, and each candidate's shrink of it once the candidate's load is among them: the
  doubt a bootstrap and this approximation leave out, and the measurement that answers it.

What it leaves out: a term held at its physical floor is treated as free on both sides (the
truncation would narrow it further), and the approximation is linear around the fit, so it
ranks candidates; it does not promise the width a new fit will have.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from simcap.calibrate.core import CalibrationError
from simcap.calibrate.readers import BenchmarkPoint


@dataclass(frozen=True)
class Query:
    """A figure at a load point: ``point`` (its scenario; what it measured is not read) and
    the metrics (``output_throughput``, ``e2e_mean``, ...). As a target the first metric is
    predicted; as a candidate every metric is a row the measurement would add."""

    point: BenchmarkPoint
    metrics: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.point.label} {'+'.join(self.metrics)}"


def _arm(label: str) -> str:
    """A row label without its load: ``eagle3 c=4`` -> ``eagle3``, ``knee rate=6`` -> ``knee``."""
    for key in (" c=", " rate="):
        if key in label:
            return label.rpartition(key)[0].strip()
    return label.strip()


def at_concurrency(point: BenchmarkPoint, concurrency: int, *, label: str | None = None) -> BenchmarkPoint:
    """``point`` run as a closed loop of ``concurrency`` clients (``max(20, 8 x concurrency)``
    requests, steady-state throughput as the point's), labelled ``label`` or ``ARM c=N``."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise CalibrationError(f"concurrency: a whole number >= 1 (got {concurrency!r})")
    workload = dict(point.scenario["workload"])
    if (workload.get("arrival") or {}).get("process") != "closed":
        raise CalibrationError(f"{point.label}: not a closed loop; no concurrency to change")
    workload["arrival"] = {**workload["arrival"], "concurrency": concurrency}
    workload["num_requests"] = max(20, 8 * concurrency)
    return dataclasses.replace(point, label=label or f"{_arm(point.label)} c={concurrency}",
                               scenario={**point.scenario, "workload": workload}, measured={})


def at_rate(point: BenchmarkPoint, rate: float, *, label: str | None = None) -> BenchmarkPoint:
    """``point`` (an open loop) at ``rate`` requests/s, its arrival process otherwise kept and
    its duration too (requests scaled with the rate, at least 20), labelled ``label`` or
    ``ARM rate=R``."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate < math.inf:
        raise CalibrationError(f"rate: a number > 0 (got {rate!r})")
    workload = dict(point.scenario["workload"])
    arrival = workload.get("arrival") or {}
    if not arrival.get("rate"):
        raise CalibrationError(f"{point.label}: not an open loop at a rate; no rate to change")
    n = workload.get("num_requests")
    if n:
        workload["num_requests"] = max(20, round(n * rate / float(arrival["rate"])))
    workload["arrival"] = {**arrival, "rate": float(rate)}
    return dataclasses.replace(point, label=label or f"{_arm(point.label)} rate={rate:g}",
                               scenario={**point.scenario, "workload": workload}, measured={})


def measure_next(
    points: Sequence[BenchmarkPoint],
    step_time: dict[str, Any],
    form: Any,
    *,
    targets: Sequence[Query],
    candidates: Sequence[Query],
    prior: dict[str, Any] | None = None,
    fit_metrics: Sequence[str] | None = None,
    weights: dict[str, float] | None = None,
    starts: int = 1,
    seed: int = 0,
    level: float = 0.9,
    step: float = 0.02,
    form_error: Any = None,
) -> dict[str, Any]:
    """Fit the roofline form to ``points`` (as :func:`fit_benchmarks_roofline`, no
    bootstrap), then give each target its value and Laplace interval, and each candidate (none:
    the intervals alone) the factor by which measuring it would shrink every target's interval;
    ``advice``: the best candidate (None without candidates). See the module docstring.

    ``form_error``: a model-form error (:class:`simcap.accuracy.model_form.FormError`): each
    target also gets its model-form interval, at its distance past the fitted rows of its arm
    (with or without speculation; requests running), and each candidate the factor by which
    that interval would shrink once the candidate's load is among the fitted rows
    (``advice["model_form"]``: the candidate that most lowers the targets' summed squared
    half-widths)."""
    from scipy.stats import norm

    from simcap.calibrate.fit_bench import (
        RooflineForm, _fitted_metrics, _roofline_priors, _RooflineObjective, fit_benchmarks_roofline)

    if not targets:
        raise CalibrationError("measure next: no target to predict")
    if not 0.0 < level < 1.0:
        raise CalibrationError(f"level: a number in (0, 1) (got {level!r})")
    form = form if isinstance(form, RooflineForm) else RooflineForm.parse(form)
    fit = fit_benchmarks_roofline(points, step_time, form, prior=prior, fit_metrics=fit_metrics,
                                  weights=weights, bootstrap=0, iterations=0, seed=seed, starts=starts)
    fitted = fit.step_time
    priors, data_sigma = _roofline_priors(form, prior, step_time)
    metrics = _fitted_metrics(points, fit_metrics, weights)
    obj = _RooflineObjective(points, form, fitted, metrics, 0.03, priors, data_sigma)
    x = obj.x0()
    p = len(x)
    moved = [x + step * np.eye(p)[j] for j in range(p)]

    r0 = obj.residuals(x)
    J = np.column_stack([(obj.residuals(xj) - r0) / step for xj in moved])
    H = J.T @ J
    H_inv = np.linalg.pinv(H)

    queries = [*targets, *candidates]
    qpoints = [dataclasses.replace(q.point, measured={m: 1.0 for m in q.metrics}) for q in queries]
    qobj = _RooflineObjective(qpoints, form, fitted, [[(m, 1.0) for m in q.metrics] for q in queries],
                              0.03, priors, data_sigma)
    base = qobj.simulate(x)
    shifted = [qobj.simulate(xj) for xj in moved]

    def log_value(sims: list[dict[str, float]], i: int, m: str) -> float:
        v = sims[i][m]
        if not v > 0:
            raise CalibrationError(f"measure next: {queries[i].label}: {m} is {v} (needs a positive figure)")
        return math.log(v)

    def rows(i: int, q: Query) -> np.ndarray:
        """Log sensitivities of the query's metrics to the free terms, one row each."""
        return np.array([[(log_value(s, i, m) - log_value(base, i, m)) / step for s in shifted]
                         for m in q.metrics])

    z = float(norm.ppf(0.5 + level / 2))
    g = np.vstack([rows(i, q)[:1] for i, q in enumerate(targets)])  # each target's first metric
    var = data_sigma ** 2 * np.einsum("ij,jk,ik->i", g, H_inv, g)
    out_targets = []
    for i, q in enumerate(targets):
        m = q.metrics[0]
        value, sd = base[i][m], math.sqrt(max(var[i], 0.0))
        out_targets.append({"point": q.point.label, "metric": m, "value": value,
                            "interval": [value * math.exp(-z * sd), value * math.exp(z * sd)],
                            "log_sd": sd})
    out_candidates = []
    for k, q in enumerate(candidates):
        j = rows(len(targets) + k, q)
        Hk_inv = np.linalg.pinv(H + j.T @ j)
        var_k = data_sigma ** 2 * np.einsum("ij,jk,ik->i", g, Hk_inv, g)
        shrink = np.sqrt(np.divide(var_k, var, out=np.ones_like(var), where=var > 0))
        out_candidates.append({"point": q.point.label, "metrics": list(q.metrics),
                               "shrink": {t["point"] + " " + t["metric"]: float(s)
                                          for t, s in zip(out_targets, shrink)},
                               "summed_variance_ratio": float(var_k.sum() / var.sum()) if var.sum() > 0 else 1.0})
    model_form = None
    if form_error is not None:
        model_form = _model_form(form_error, points, obj.simulate(x), targets, candidates, base,
                                 out_targets, out_candidates)
    advice = None
    if candidates:
        best = out_candidates[min(range(len(candidates)),
                                  key=lambda k: out_candidates[k]["summed_variance_ratio"])]
        widest = out_targets[max(range(len(targets)), key=lambda i: var[i])]
        key = widest["point"] + " " + widest["metric"]
        advice = {"measure": best["point"], "metrics": best["metrics"], "widest_target": key,
                  "its_interval_shrinks_to": best["shrink"][key]}
        if model_form is not None:
            advice["model_form"] = model_form
    return {
        "fit": {"coefficients": {t: fit.coefficients[t] for t in form.free},
                "notes": [n for n in fit.notes if "floor" in n or "pinned" in n]},
        "method": (f"Laplace approximation at the fit: covariance data_sigma^2 (J^T J)^-1 over the data "
                   f"and prior rows (data_sigma {data_sigma:g}), forward differences of step {step:g} in "
                   f"the fit's variables; {level:.0%} intervals; advice: the candidate that most lowers "
                   "the targets' summed variance"),
        "targets": out_targets,
        "candidates": out_candidates,
        "advice": advice,
    }


def _model_form(form_error: Any, points: Sequence[BenchmarkPoint], fitted_sims: list[dict[str, float]],
                targets: Sequence[Query], candidates: Sequence[Query], sims: list[dict[str, float]],
                out_targets: list[dict[str, Any]], out_candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The targets' model-form intervals and each candidate's shrink of them (in place), and
    the candidate that most lowers their summed squared half-widths (None without candidates)."""
    from simcap.calibrate.fit_bench import RUNNING, fit_loads

    loads = fit_loads(points, fitted_sims)

    def arm(q: Query) -> str:
        return "speculative" if q.point.scenario.get("speculative") else "plain"

    def fitted(fit: dict[str, float | None], q: Query) -> float | None:
        return fit.get(arm(q)) or fit.get("all")

    def width(h: float) -> float:
        return math.exp(h) - math.exp(-h)

    now = []
    for i, (q, t) in enumerate(zip(targets, out_targets)):
        h = form_error.half_width(q.metrics[0], sims[i][RUNNING], fitted(loads, q))
        now.append(h)
        t["model_form_interval"] = [t["value"] * math.exp(-h), t["value"] * math.exp(h)]
    best = None
    for k, (q, c) in enumerate(zip(candidates, out_candidates)):
        load = sims[len(targets) + k][RUNNING]
        grown = dict(loads)
        for key in (arm(q), "all"):
            grown[key] = max(v for v in (grown.get(key), load) if v is not None)
        after = [form_error.half_width(t.metrics[0], sims[i][RUNNING], fitted(grown, t)) for i, t in enumerate(targets)]
        c["model_form_shrink"] = {o["point"] + " " + o["metric"]: (width(a) / width(h) if h > 0 else 1.0)
                                  for o, a, h in zip(out_targets, after, now)}
        total = sum(a * a for a in after)
        if best is None or total < best[0]:
            best = (total, q.point.label)
    return None if best is None else {"measure": best[1],
                                      "summed_half_width_ratio": best[0] / sum(h * h for h in now) if any(now) else 1.0}


def point_at(points: Sequence[BenchmarkPoint], label: str) -> BenchmarkPoint:
    """The point ``label`` names: a row of ``points`` with that label, ``ARM c=N`` (a closed
    loop of N clients run as the first row of that arm, :func:`at_concurrency`) or ``ARM
    rate=R`` (an open loop at R requests/s, :func:`at_rate`). A row's arm is its label
    without its load (``eagle3 c=4`` -> ``eagle3``; ``high-generation`` is its own)."""
    for pt in points:
        if pt.label == label:
            return pt
    arms = sorted({_arm(p.label) for p in points})
    arm = _arm(label)
    load = label.strip()[len(arm):].strip()
    kind, _, value = load.partition("=")
    try:
        if kind == "c" and value.isdigit() and int(value) >= 1:
            make = lambda pt: at_concurrency(pt, int(value))  # noqa: E731
        elif kind == "rate" and 0.0 < float(value) < math.inf:
            make = lambda pt: at_rate(pt, float(value))  # noqa: E731
        else:
            raise ValueError
    except ValueError:
        raise CalibrationError(f"{label!r}: a row label, ARM c=N (N clients) or ARM rate=R (R requests/s); "
                               f"arms: {', '.join(arms) or 'none'}") from None
    for pt in points:
        if _arm(pt.label) == arm:
            return make(pt)
    raise CalibrationError(f"{label!r}: no row of arm {arm!r} (arms: {', '.join(arms) or 'none'})")


def measure_next_recipe(recipe_path: str | Any, targets: Sequence[str], candidates: Sequence[str],
                        metrics: Sequence[str] = ("output_throughput", "e2e_mean"),
                        level: float = 0.9, form_error: Any = None) -> dict[str, Any]:
    """:func:`measure_next` on a roofline recipe's data: targets and candidates by label
    (:func:`point_at`), each target predicted in ``metrics[0]``, each candidate measuring all
    of ``metrics``."""
    from pathlib import Path

    from simcap.calibrate.pipeline import check_fit_metrics, read_inputs
    from simcap.calibrate.recipe import Recipe

    if not metrics:
        raise CalibrationError("--metrics: at least one metric")
    metrics = tuple(check_fit_metrics(metrics, "--metrics"))
    recipe = Recipe.load(Path(recipe_path))
    if (recipe.step_time or {}).get("form") != "roofline" or not recipe.datasets:
        raise CalibrationError(f"{recipe_path}: a roofline recipe with datasets is needed (its step_time "
                               "says form: roofline; its priors hold the terms the data leave free)")
    _, points = read_inputs(recipe.datasets, recipe.path.parent, recipe, None, 0)
    report = measure_next(
        points, recipe.step_time, recipe.form, prior=recipe.prior, fit_metrics=recipe.fit_metrics,
        weights=recipe.weights, starts=recipe.starts, seed=recipe.seed, level=level, form_error=form_error,
        targets=[Query(point_at(points, t), metrics[:1]) for t in targets],
        candidates=[Query(point_at(points, c), metrics) for c in candidates])
    report["recipe"] = str(recipe_path)
    return report
