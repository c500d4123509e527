"""Each benchmark row predicted by the fit on all the other rows (``simcap calibrate
--leave-one-out``).

A fit to a handful of published rows says how well it reproduces them, not whether they agree
with each other. Leaving one row out at a time, refitting the same form on the rest (no
bootstrap) and simulating the row left out gives each row's *prediction* error: a row the
others cannot predict disagrees with them (a one-run outlier, or a load the form cannot reach
from the rest), and a fit that leans on it extrapolates from it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from simcap.calibrate.core import CalibrationError
from simcap.calibrate.metric_keys import metric_value
from simcap.calibrate.readers import BenchmarkPoint
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError, SimulationError
from simcap.fleet.run import simulate


def leave_one_out(points: Sequence[BenchmarkPoint], refit: Callable[[list[str]], dict[str, Any]],
                  metrics: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """For each row of ``points``: ``refit`` on the labels of all the others (it returns the
    fitted ``step_time`` section), then the row simulated with it; one result per measured
    figure (those in ``metrics`` when given): measured, predicted, relative error. Where the
    other rows cannot be fitted (too few figures for the free terms, say), the row's results
    carry no prediction and ``unfitted``, the reason. Rows whose labels repeat are refused (a
    label must name one row)."""
    labels = [p.label for p in points]
    if len(set(labels)) != len(labels):
        raise CalibrationError("--leave-one-out: row labels repeat; give each row its own label")
    if len(points) < 2:
        raise CalibrationError("--leave-one-out: needs at least two benchmark rows")
    out = []
    for pt in points:
        wanted = [m for m in pt.measured if metrics is None or m in metrics]
        try:
            step_time = refit([label for label in labels if label != pt.label])
        except CalibrationError as exc:
            out += [{"point": pt.label, "metric": m, "measured": pt.measured[m], "predicted": None,
                     "rel_error": None, "unfitted": str(exc)} for m in wanted]
            continue
        try:
            res = simulate(parse_scenario({**pt.scenario, "step_time": step_time}))
        except (ScenarioError, SimulationError) as exc:
            raise CalibrationError(f"--leave-one-out: {pt.label}: {exc}") from None
        for m in wanted:
            measured = pt.measured[m]
            predicted = metric_value(m, res, steady_state=pt.steady_state)
            out.append({"point": pt.label, "metric": m, "measured": measured, "predicted": predicted,
                        "rel_error": (predicted - measured) / measured if measured else None})
    return out


def disagreeing(rows: Sequence[dict[str, Any]], above: float) -> list[str]:
    """The rows with a figure the others predict more than ``above`` off (relative)."""
    seen: list[str] = []
    for r in rows:
        if r["rel_error"] is not None and abs(r["rel_error"]) > above and r["point"] not in seen:
            seen.append(r["point"])
    return seen


def of_calibration(inputs: Sequence[str], recipe: Any, *, rows: Sequence[str] | None = None,
                   fit_metrics: Sequence[str] | None = None, workload: dict[str, Any] | None = None,
                   num_speculative_tokens: int = 0, table: Any = None,
                   **calibrate_kwargs: Any) -> list[dict[str, Any]]:
    """:func:`leave_one_out` over the benchmark rows ``simcap calibrate`` fits (the same
    inputs or recipe, ``rows`` and options), each refit by
    :func:`simcap.calibrate.pipeline.calibrate` without bootstrap."""
    from simcap.calibrate.pipeline import calibrate, pick_rows, read_all
    from simcap.calibrate.profile_io import profile_dict

    step_inputs, points = read_all(inputs, recipe, workload, num_speculative_tokens, table)
    if step_inputs:
        raise CalibrationError("--leave-one-out: benchmark rows only (step samples are fitted as one log)")
    points = pick_rows(points, rows)
    metrics = list(fit_metrics or recipe.fit_metrics or []) or None

    def refit(labels: list[str]) -> dict[str, Any]:
        fit = calibrate(inputs, recipe, rows=labels, bootstrap=0, fit_metrics=fit_metrics, workload=workload,
                        num_speculative_tokens=num_speculative_tokens, table=table, **calibrate_kwargs)
        return profile_dict(fit, recipe, noise=False)["step_time"]

    return leave_one_out(points, refit, metrics)
