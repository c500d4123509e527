"""Showing a fit: Rich tables of coefficients and fitted vs measured, the interval table of
``simcap simulate --ci``, and the residual plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from simcap.calibrate.core import CalibrationError
from simcap.calibrate.metric_keys import _DISTS, _THROUGHPUTS
from simcap.calibrate.result import Fit


def render_fit(fit: Fit, console: Any) -> None:
    """Rich tables: coefficients with intervals, then fitted vs measured, then warnings."""
    from rich.table import Table
    from rich.text import Text

    pct = f"{fit.level:.0%}"
    table = Table(title=f"step-time coefficients ({fit.kind}; {pct} intervals)", title_justify="left")
    for col, justify in (("term", "left"), ("value", "right"), (f"{pct} low", "right"),
                         (f"{pct} high", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    ties = fit.form.ties(fit.fixed)
    for key, value in fit.coefficients.items():
        if value is None:
            continue
        lo, hi = fit.ci.get(key, (None, None))
        status = ("free" if key in fit.form.free else f"= {ties[key]}" if key in ties
                  else "given" if key == "host_overhead" else "fixed")
        cells = [f"{value:.4g}", "-" if lo is None else f"{lo:.4g}", "-" if hi is None else f"{hi:.4g}"]
        table.add_row(key, *cells, status)
    console.print(table)
    rows = fit.residuals
    if fit.kind == "step_samples" and len(rows) > 30:
        q = fit.quality
        console.print(f"{q['n']} step samples: RMSE {q['rmse_s']:.4g} s, R^2 {q['r2']}, median |error| "
                      f"{q['median_abs_rel_error']:.1%}, p95 |error| {q['p95_abs_rel_error']:.1%}")
    else:
        res = Table(title="fitted vs measured", title_justify="left")
        for col, justify in (("point", "left"), ("metric", "left"), ("measured", "right"),
                             ("fitted", "right"), ("error", "right"), ("", "left")):
            res.add_column(col, justify=justify)
        for r in rows:
            err = "-" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
            bad = r["rel_error"] is not None and abs(r["rel_error"]) > fit.quality.get("warn_above", 0.1)
            res.add_row(r["point"], r["metric"], f"{r['measured']:.4g}", f"{r['fitted']:.4g}",
                        Text(err, style="bold red") if bad else err,
                        "" if r["fitted_in_objective"] else "reported only")
        console.print(res)
    if fit.noise_report:
        noise = Table(title=f"step-time noise: ratio measured / fitted per step ({fit.noise_report['family']} "
                            f"written; KS of each family against the ratios)", title_justify="left")
        for col in ("kind", "steps", "p5", "p50", "p95", "CV", "KS empirical", "KS lognormal", "sigma"):
            noise.add_column(col, justify="left" if col == "kind" else "right")
        for kind, e in fit.noise_report["kinds"].items():
            cells = [str(e.get(c, "-")) for c in ("p5", "p50", "p95", "cv", "ks_empirical", "ks_lognormal",
                                                  "lognormal_sigma")]
            noise.add_row(kind, str(e["samples"]), *cells)
        console.print(noise)
    for note in fit.notes:
        console.print(f"note: {note}", highlight=False)


def render_intervals(data: dict[str, Any], intervals: dict[str, tuple[float, float]], console: Any) -> None:
    """One table: each metric's central value and its interval over the bootstrap re-runs."""
    from rich.table import Table

    table = Table(title="90% intervals (profile bootstrap sets)", title_justify="left")
    for col, justify in (("metric", "left"), ("value", "right"), ("low", "right"), ("high", "right")):
        table.add_column(col, justify=justify)
    for name, (lo, hi) in intervals.items():
        metric, _, stat = name.partition("_")
        if name in _THROUGHPUTS:
            value, unit = data["throughput"][_THROUGHPUTS[name]], ""
        else:
            value, unit = (data.get(_DISTS[metric]) or {}).get(stat), "ms"
        scale = 1e3 if unit else 1.0
        cells = ["-" if v is None else f"{v * scale:,.1f}" for v in (value, lo, hi)]
        table.add_row(f"{name}{' (ms)' if unit else ''}", *cells)
    console.print(table)


def residual_plot(fit: Fit, path: str | Path) -> None:
    """Fitted vs measured (log-log, with the identity line) and relative errors, as a PNG/SVG/PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in fit.residuals if r["rel_error"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    if fit.kind == "step_samples":
        meas = np.array([r["measured"] for r in rows])
        fitted = np.array([r["fitted"] for r in rows])
        ax1.scatter(meas, fitted, s=6, alpha=0.5)
        lo, hi = max(min(meas.min(), fitted.min()), 1e-6), max(meas.max(), fitted.max())
        ax1.plot([lo, hi], [lo, hi], "k--", lw=1)
        ax1.set(xlabel="measured step time (s)", ylabel="fitted step time (s)", xscale="log", yscale="log")
        ax2.scatter(meas, 100 * np.array([r["rel_error"] for r in rows]), s=6, alpha=0.5)
        ax2.set(xlabel="measured step time (s)", ylabel="relative error (%)", xscale="log")
    else:
        metrics = sorted({r["metric"] for r in rows})
        for m in metrics:
            sub = [r for r in rows if r["metric"] == m]
            ax1.scatter([r["measured"] for r in sub], [r["fitted"] for r in sub], label=m,
                        marker="o" if sub[0]["fitted_in_objective"] else "x")
        allv = [v for r in rows for v in (r["measured"], r["fitted"]) if v > 0]
        if allv:
            ax1.plot([min(allv), max(allv)], [min(allv), max(allv)], "k--", lw=1)
        ax1.set(xlabel="measured", ylabel="simulated with fitted coefficients", xscale="log", yscale="log")
        ax1.legend(fontsize=7)
        labels = [f"{r['point']} {r['metric']}" for r in rows]
        errs = [100 * r["rel_error"] for r in rows]
        limit = 100 * fit.quality.get("warn_above", 0.1)
        colors = ["tab:red" if abs(e) > limit else "tab:blue" for e in errs]
        ax2.barh(range(len(rows)), errs, color=colors)
        ax2.set_yticks(range(len(rows)), labels, fontsize=6)
        ax2.axvline(0, color="k", lw=0.8)
        ax2.set(xlabel="relative error (%)")
        ax2.invert_yaxis()
    ax1.set_title("fitted vs measured")
    ax2.set_title(f"max |error| {fit.quality.get('max_rel_error', 0):.1%}")
    save_figure(fig, path, "the residual plot")


def save_figure(fig: Any, path: str | Path, what: str) -> None:
    """Lay out, write and close a figure; a path that cannot be written is one line."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: cannot write {what}: {exc}") from None
    finally:
        plt.close(fig)
