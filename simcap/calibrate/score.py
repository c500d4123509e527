""":func:`score_profile`: a fixed profile against benchmark tables, row by row (``simcap score``).

Each row of the tables (read as ``simcap calibrate`` reads them: ``vllm bench serve`` JSON,
JSON or CSV tables, ``--column``/``--where``/``--gpus``) is simulated with the profile's
deployment and step time, and every figure it measured is set beside the prediction. A row
is *fitted* where the profile's provenance lists it among the data it was fitted on (the same
file bytes, table and row), else *held out*: the errors of held-out rows are the profile's
prediction errors, those of fitted rows its fit residuals.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Sequence

from simcap.calibrate.core import CalibrationError
from simcap.calibrate.fit_report import save_figure
from simcap.calibrate.metric_keys import metric_value
from simcap.calibrate.pipeline import check_fit_metrics, pick_rows, read_inputs
from simcap.calibrate.readers import TableReading
from simcap.calibrate.recipe import base_from_profile
from simcap.config.profiles import load_profile
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError, SimulationError
from simcap.fleet.run import simulate


@dataclass
class Score:
    """Predicted vs measured for every figure of every row; summaries by fitted / held out."""

    profile: str
    profile_sha256: str
    rows: list[dict[str, Any]]
    sources: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Per part (fitted, held_out): figures, median and max |relative error|."""
        out: dict[str, Any] = {}
        for part, fitted in (("fitted", True), ("held_out", False)):
            errors = [abs(r["rel_error"]) for r in self.rows if r["fitted"] == fitted and r["rel_error"] is not None]
            out[part] = {"figures": len(errors),
                         "median_abs_rel_error": statistics.median(errors) if errors else None,
                         "max_abs_rel_error": max(errors) if errors else None}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "profile_sha256": self.profile_sha256, "summary": self.summary(),
                "rows": self.rows, "sources": self.sources, "notes": self.notes}


def _fitted_rows(provenance: dict[str, Any]) -> dict[tuple[str, str | None, int | None], dict[str, Any]]:
    """(file sha256, table selector, row) -> how the fit ran it (its ``points`` entry: label,
    workload, speculative or not), for every row the profile was fitted on."""
    fitted = {}
    for entry in provenance.get("data") or []:
        if not isinstance(entry, dict) or "sha256" not in entry:
            continue
        rows = entry.get("rows") or [None]
        points = entry.get("points") or []
        for i, row in enumerate(rows):
            fitted[(entry["sha256"], entry.get("select"), row)] = points[i] if i < len(points) else {}
    return fitted


def score_profile(
    profile: str | Path, inputs: Sequence[str], *, table: TableReading | None = None,
    workload: dict[str, Any] | None = None, rows: Collection[str] | None = None,
    metrics: Sequence[str] | None = None, speculative: bool | None = None,
    overrides: Sequence[str] = (),
) -> Score:
    """Simulate every row of ``inputs`` with ``profile`` and compare with what it measured.

    ``rows``: only the rows with these labels; ``metrics``: only these figures (simcap names or
    measurement keys, :func:`~simcap.calibrate.pipeline.check_fit_metrics`); ``workload``:
    ``input_len`` / ``output_len`` where a table lacks them (assumptions). ``speculative``:
    False where the rows ran without speculative decoding (the profile's ``speculative``
    section left out); by default a fitted row runs as the fit ran it, the others with the
    profile's. ``overrides``: ``dotted.key=value`` changes to the profile (``--set``), e.g.
    ``step_time.hardware=mi300x``: the profile moved to other hardware by its datasheet."""
    wanted = set(check_fit_metrics(metrics, "--metrics")) if metrics is not None else None
    try:
        prof, digest = load_profile(profile, list(overrides))
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    recipe = base_from_profile(profile, prof)
    # Several tables: each row's label names its table (``no_spec c=4``), as a recipe's datasets do.
    datasets = [{"input": i, **({"label": _table_name(i)} if len(inputs) > 1 else {})} for i in inputs]
    step_inputs, points = read_inputs(datasets, Path("."), recipe, workload, 0, table)
    if step_inputs:
        raise CalibrationError("score: compares a profile with benchmark results (tables, vllm bench JSON), "
                               "not step samples")
    points = pick_rows(points, rows)
    fitted_rows = _fitted_rows(prof.provenance)
    out_rows: list[dict[str, Any]] = []
    sources: list[dict[str, Any]] = []
    for pt in points:
        src = pt.source
        as_fitted = fitted_rows.get((src["sha256"], src.get("select"), src.get("row")))
        fitted = as_fitted is not None
        with_spec = speculative if speculative is not None else (as_fitted or {}).get("speculative", True)
        run = {**pt.scenario, "name": f"score {pt.label}", "step_time": recipe.step_time}
        if not with_spec:
            run["speculative"] = None
        sources.append({"point": pt.label, "file": src["file"], "sha256": src["sha256"],
                        "select": src.get("select"), "row": src.get("row"), "fitted": fitted,
                        "workload": pt.scenario["workload"], "speculative": run.get("speculative") is not None})
        names = [m for m in pt.measured if wanted is None or m in wanted]
        if not names:
            continue
        try:
            scenario = parse_scenario(run)
            result = simulate(scenario)
        except (ScenarioError, SimulationError) as exc:
            raise CalibrationError(f"{src['file']} ({pt.label}): {exc}") from None
        itl: list = []
        for m in names:
            measured = pt.measured[m]
            predicted = metric_value(m, result, steady_state=pt.steady_state, _itl=itl)
            rel = (predicted - measured) / measured if measured and math.isfinite(predicted) else None
            out_rows.append({"point": pt.label, "metric": m, "measured": measured, "predicted": predicted,
                             "rel_error": rel, "fitted": fitted})
    if not out_rows:
        raise CalibrationError("score: no measured figure to compare"
                               + (f" among --metrics {', '.join(sorted(wanted))}" if wanted else ""))
    notes = []
    if overrides:
        notes.append("the profile as changed by --set " + ", ".join(overrides) + " (its fit did not see the change)")
    if not fitted_rows:
        notes.append("the profile names no fitted table rows (provenance.data): every row counts as held out")
    return Score(str(profile), digest, out_rows, sources, notes)


def _table_name(text: str) -> str:
    """``FILE#a.runs.no_spec`` -> ``no_spec``; ``dir/FILE.csv`` -> ``FILE``."""
    file, _, selector = text.partition("#")
    return selector.rsplit(".", 1)[-1] if selector else Path(file).stem


def render_score(score: Score, console: Any) -> None:
    """The rows as a table, then the summary by part."""
    from rich.table import Table

    table = Table(title=f"{score.profile}: predicted vs measured (latencies in ms)")
    for col in ("row", "metric", "part", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if col in ("row", "metric", "part") else "right")
    for r in score.rows:
        scale = 1.0 if "throughput" in r["metric"] or r["metric"].startswith(("itl_frac", "per_user")) else 1e3
        err = "n/a" if r["rel_error"] is None else f"{r['rel_error'] * 100:+.1f}%"
        table.add_row(r["point"], r["metric"], "fitted" if r["fitted"] else "held out",
                      f"{r['measured'] * scale:,.2f}", f"{r['predicted'] * scale:,.2f}", err)
    console.print(table)
    for part, s in score.summary().items():
        if s["figures"]:
            console.print(f"{part.replace('_', ' ')}: {s['figures']} figures, median |error| "
                          f"{s['median_abs_rel_error']:.1%}, max {s['max_abs_rel_error']:.1%}")
    for note in score.notes:
        console.print(f"note: {note}")


def score_plot(score: Score, path: str | Path) -> None:
    """Predicted vs measured (log-log, identity line; fitted rows as dots, held-out as crosses)
    and each figure's relative error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in score.rows if r["rel_error"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for metric in sorted({r["metric"] for r in rows}):
        for fitted, marker in ((True, "o"), (False, "x")):
            sub = [r for r in rows if r["metric"] == metric and r["fitted"] == fitted]
            if sub:
                ax1.scatter([r["measured"] for r in sub], [r["predicted"] for r in sub], marker=marker,
                            label=f"{metric} ({'fitted' if fitted else 'held out'})")
    values = [v for r in rows for v in (r["measured"], r["predicted"]) if v > 0]
    if values:
        ax1.plot([min(values), max(values)], [min(values), max(values)], "k--", lw=1)
    ax1.set(xlabel="measured", ylabel="predicted by the profile", xscale="log", yscale="log",
            title="predicted vs measured")
    ax1.legend(fontsize=7)
    ax2.barh(range(len(rows)), [100 * r["rel_error"] for r in rows],
             color=["tab:blue" if r["fitted"] else "tab:orange" for r in rows])
    ax2.set_yticks(range(len(rows)), [f"{r['point']} {r['metric']}" for r in rows], fontsize=6)
    ax2.axvline(0, color="k", lw=0.8)
    ax2.invert_yaxis()
    held = score.summary()["held_out"]
    ax2.set(xlabel="relative error (%)  (blue: fitted, orange: held out)",
            title="held out: median |error| " + (f"{held['median_abs_rel_error']:.1%}" if held["figures"] else "n/a"))
    save_figure(fig, path, "the score plot")
