#!/usr/bin/env python
"""Leave-high-out on the field data, both step-time forms (and roofline sum vs max).

    PYTHONPATH=. python experiments/leave-high-out/run.py [--only a800|910b4] [--intervals N]
    PYTHONPATH=. python experiments/leave-high-out/run.py --rows   # A800: leave each row out
    PYTHONPATH=. python experiments/leave-high-out/run.py --skew   # A800: routing skew on a grid,
                                                                   # and without the odd low row
    PYTHONPATH=. python experiments/leave-high-out/run.py --experts   # A800: the experts' term
                                                                      # pinned from elsewhere

Each shipped recipe is refitted (no bootstrap) on a LOW subset of its published figures and
the fitted profile PREDICTS the held-out figures, which the fit never saw; the table reports
prediction errors, not fit errors.

- A800 (deployment A): fit no-spec concurrency 1, 2, 4 and EAGLE3 1, 2; predict no-spec 8, 16
  and EAGLE3 4 (throughput, mean and p50 latency).
- 910B4 (deployment B): fit the long-context run (input throughput, ITL median and fractions:
  a 16-request batch at ~33K context) and predict the high-generation run (output throughput
  at 32 requests, 1-3K context) and, for the roofline form, the knee TPOT p95 (capacity
  workload). The high-generation run is the larger batch, so this is a leave-high-out in batch
  size. The field has no second capacity run with figures: both capacity runs gave only the
  one TPOT range, so no split by capacity run is possible.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from simcap.accuracy.model_form import FormError  # noqa: E402
from simcap.metrics.summary import requests_running  # noqa: E402
from simcap.calibrate import Recipe  # noqa: E402
from simcap.calibrate.metric_keys import metric_value  # noqa: E402
from simcap.calibrate.readers import read_benchmarks  # noqa: E402
from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402

RECIPES = ROOT / "calibration" / "recipes"
MODEL_FORM = ROOT / "calibration" / "model_form.json"
# The corpus's cases of these very splits: their errors must not size the intervals that
# are checked on them.
FIELD_CASES = ("field-a800-leave-high-out", "field-910b4-leave-high-out")
A800_FIT = {"no-spec": {1, 2, 4}, "eagle3": {1, 2}}
A800_HELD = {"no-spec": {8, 16}, "eagle3": {4}}
# Routing skews tried by --skew (the recipe assumes 0, uniform routing); the grid of
# experiments/cpu-extrapolation's skew fits.
SKEW_GRID = (0.0, 0.25, 0.5, 0.625, 0.75, 0.85)


def points_of(recipe: Recipe):
    pts = []
    for d in recipe.datasets:
        spec = recipe.speculative
        if "speculative" in d:
            spec = None if d["speculative"] in (False, None) else recipe.speculative
        pts += read_benchmarks(recipe.path.parent / d["file"], d.get("select"),
                               engine=recipe.engine, speculative=spec,
                               workload=d.get("workload") or {}, seed=recipe.seed,
                               label=d.get("label"))
    return pts


def fitted_step_time(fit, recipe: Recipe) -> dict:
    if fit.step_time is not None:
        return fit.step_time
    return {k: v for k, v in fit.coefficients.items() if v is not None}


def bootstrap_step_times(fit, recipe: Recipe) -> list[dict]:
    """The step_time of each of the fit's bootstrap coefficient sets."""
    from simcap.calibrate.fit_bench import apply_coefficients

    base = fitted_step_time(fit, recipe)
    if fit.step_time is not None:
        return [apply_coefficients(base, s) for s in fit.bootstrap]
    return [{**base, **{k: v for k, v in s.items() if v is not None}} for s in fit.bootstrap]


def add_intervals(rows: list[dict], points, step_times: list[dict], metrics, level: float = 0.9) -> None:
    """Each prediction row gets the bootstrap's central ``level`` interval (the held-out
    figure simulated with every bootstrap coefficient set) and whether it holds the measured
    figure."""
    import numpy as np

    draws = [{(r["point"], r["metric"]): r["predicted"] for r in predict(points, st, metrics)}
             for st in step_times]
    for r in rows:
        values = np.array([d[(r["point"], r["metric"])] for d in draws])
        lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
        r["interval"] = [float(lo), float(hi)]
        r["covered"] = bool(lo <= r["measured"] <= hi)


def add_laplace(rows: list[dict], recipe: Recipe, fit_pts, held) -> None:
    """Roofline form: each prediction row gets its 90% interval in the fit's Laplace
    approximation (the priors' spread over terms the low rows leave free included;
    simcap.calibrate.measure_next) and whether it holds the measured figure."""
    from simcap.calibrate.measure_next import Query, measure_next

    wanted = sorted({r["metric"] for r in rows})
    targets = [Query(p, (m,)) for p in held for m in wanted if m in p.measured]
    rep = measure_next(fit_pts, recipe.step_time, recipe.form, prior=recipe.prior,
                       fit_metrics=recipe.fit_metrics, weights=recipe.weights, starts=recipe.starts,
                       seed=recipe.seed, targets=targets, candidates=())
    by = {(t["point"], t["metric"]): t["interval"] for t in rep["targets"]}
    for r in rows:
        lo, hi = by[(r["point"], r["metric"])]
        r["laplace_interval"] = [lo, hi]
        r["laplace_covered"] = bool(lo <= r["measured"] <= hi)


def predict(points, step_time: dict, metrics) -> list[dict]:
    rows = []
    for pt in points:
        sc = parse_scenario({**pt.scenario, "step_time": step_time})
        res = simulate(sc)
        for m in metrics:
            if m not in pt.measured:
                continue
            v = metric_value(m, res, steady_state=pt.steady_state)
            rows.append({"point": pt.label, "metric": m, "measured": pt.measured[m],
                         "predicted": v, "error_pct": (v / pt.measured[m] - 1) * 100,
                         "load": requests_running(res.summary)})
    return rows


def add_model_form(rows: list[dict], fit_load: float) -> None:
    """Each held-out figure's model-form interval (simcap.accuracy.model_form), learned from
    the corpus without the field cases, at its distance past the fit rows (``fit_load``: the
    fit's own record of their most requests running)."""
    model = FormError.read(MODEL_FORM, leave_out=FIELD_CASES)
    for r in rows:
        lo, hi = model.interval(r["predicted"], r["metric"], r["load"], fit_load)
        r["model_form_interval"] = [lo, hi]
        r["model_form_covered"] = bool(lo <= r["measured"] <= hi)


def fit_on(recipe: Recipe, fit_pts, bootstrap: int = 0):
    """The recipe's fit (its form, priors, metrics) on ``fit_pts`` only."""
    from simcap.calibrate.core import Form
    from simcap.calibrate.fit_bench import fit_benchmarks, fit_benchmarks_roofline

    if recipe.step_time.get("form") == "roofline":
        return fit_benchmarks_roofline(fit_pts, recipe.step_time, recipe.form, prior=recipe.prior,
                                       fit_metrics=recipe.fit_metrics, weights=recipe.weights,
                                       bootstrap=bootstrap, seed=recipe.seed, starts=recipe.starts)
    fixed = {k: v for k, v in recipe.step_time.items() if v is not None}
    return fit_benchmarks(fit_pts, Form.parse(recipe.form), fixed=fixed, fit_metrics=recipe.fit_metrics,
                          weights=recipe.weights, bootstrap=bootstrap, seed=recipe.seed)


def leave_one_row_out(recipe_file: str, metrics) -> list[dict]:
    """Each of the recipe's rows predicted by the recipe's fit on all the OTHER rows
    (simcap.calibrate.leave_one_out, as ``simcap calibrate --leave-one-out``)."""
    from simcap.calibrate.leave_one_out import leave_one_out

    recipe = Recipe.load(RECIPES / recipe_file)
    pts = points_of(recipe)
    rows = leave_one_out(
        pts, lambda labels: fitted_step_time(fit_on(recipe, [p for p in pts if p.label in labels]), recipe),
        metrics)
    return [{**r, "error_pct": r["rel_error"] * 100} for r in rows]


def load_variant(recipe_file: str, variant: str) -> Recipe:
    """The shipped recipe, its roofline combined by max for ``roofline-max``."""
    recipe = Recipe.load(RECIPES / recipe_file)
    if variant == "roofline-max":
        recipe.step_time = {**recipe.step_time, "combine": "max"}
    return recipe


def run_case(recipe_file: str, variant: str, fit_filter, held_filter, metrics, intervals: int = 0) -> dict:
    recipe = load_variant(recipe_file, variant)
    pts = points_of(recipe)
    fit_pts = [p for p in pts if fit_filter(p)]
    held = [p for p in pts if held_filter(p)]
    started = time.perf_counter()
    fit = fit_on(recipe, fit_pts, intervals)
    st = fitted_step_time(fit, recipe)
    rows = predict(held, st, metrics)
    if intervals:
        add_model_form(rows, fit.extra["fit_load"]["all"])
        add_intervals(rows, held, bootstrap_step_times(fit, recipe), metrics)
        if recipe.step_time.get("form") == "roofline":
            add_laplace(rows, recipe, fit_pts, held)
    errs = [abs(r["error_pct"]) for r in rows]
    out = {
        "recipe": recipe_file, "variant": variant,
        "fitted_on": [p.label for p in fit_pts], "held_out": [p.label for p in held],
        "coefficients": fit.coefficients, "fit_quality": fit.quality,
        "predictions": rows,
        "mean_abs_error_pct": sum(errs) / len(errs) if errs else None,
        "max_abs_error_pct": max(errs) if errs else None,
        "wall_s": time.perf_counter() - started,
    }
    if intervals:
        out["intervals"] = {"bootstrap": intervals, "level": 0.9,
                            "covered": sum(r["covered"] for r in rows), "held_out": len(rows),
                            "model_form_covered": sum(r["model_form_covered"] for r in rows),
                            "model_form_median_width": float(np.median(
                                [(r["model_form_interval"][1] - r["model_form_interval"][0]) / r["predicted"]
                                 for r in rows]))}
        if rows and "laplace_covered" in rows[0]:
            out["intervals"]["laplace_covered"] = sum(r["laplace_covered"] for r in rows)
    return out


def a800_arm(p) -> tuple[str, int]:
    """The A800 point's arm (no-spec or eagle3) and concurrency."""
    arm = "eagle3" if p.scenario.get("speculative") else "no-spec"
    return arm, p.scenario["workload"]["arrival"]["concurrency"]


def a800_fitted(p) -> bool:
    return a800_arm(p)[1] in A800_FIT[a800_arm(p)[0]]


def a800_held(p) -> bool:
    return a800_arm(p)[1] in A800_HELD[a800_arm(p)[0]]


A800_METRICS = ["output_throughput", "e2e_mean", "e2e_p50"]


def a800_recipe(variant: str) -> str:
    return "a800-minimax-m3.yaml" if variant == "linear" else "a800-minimax-m3.roofline.yaml"


def a800(variant: str, intervals: int = 0) -> dict:
    return run_case(a800_recipe(variant), variant, a800_fitted, a800_held, A800_METRICS, intervals)


def held_out_summary(held: list[dict]) -> dict:
    """The held-out rows' errors as the trials record them, and their largest."""
    return {"held_out": [{k: r[k] for k in ("point", "metric", "error_pct")} for r in held],
            "max_abs_error_pct": max(abs(r["error_pct"]) for r in held)}


def a800_low_fit(recipe: Recipe):
    """The recipe's points and the step time its fit on the A800 split's low rows gives."""
    pts = points_of(recipe)
    return pts, fitted_step_time(fit_on(recipe, [p for p in pts if a800_fitted(p)]), recipe)


def errors_line(rows: list[dict]) -> str:
    return ", ".join(f"{r['error_pct']:+.1f}" for r in rows)


def a800_drop_worst(variant: str) -> dict:
    """The A800 split refitted without the low row the other low rows predict worst (their
    leave-one-out, as ``simcap calibrate --leave-one-out``): a fit that trusts the rows which
    agree with each other. The rule reads the fitted rows only."""
    from simcap.calibrate.leave_one_out import leave_one_out

    recipe = load_variant(a800_recipe(variant), variant)
    pts = points_of(recipe)
    low = [p for p in pts if a800_fitted(p)]
    loo = leave_one_out(low, lambda labels: fitted_step_time(fit_on(recipe, [p for p in low if p.label in labels]),
                                                             recipe), ["output_throughput", "e2e_mean"])
    worst = max(loo, key=lambda r: abs(r["rel_error"]))["point"]
    st = fitted_step_time(fit_on(recipe, [p for p in low if p.label != worst]), recipe)
    held = predict([p for p in pts if a800_held(p)], st, A800_METRICS)
    return {"left_out": worst, "low_rows_leave_one_out": loo, **held_out_summary(held)}


def a800_skew_grid(combine: str) -> list[dict]:
    """The A800 roofline split at each routing skew of ``SKEW_GRID``: the low rows' own fit
    error (what a fit could choose the skew by) and the held-out errors."""
    out = []
    for skew in SKEW_GRID:
        recipe = Recipe.load(RECIPES / a800_recipe("roofline"))
        recipe.step_time = {**recipe.step_time, "routing_skew": skew, "combine": combine}
        pts, st = a800_low_fit(recipe)
        fitted = predict([p for p in pts if a800_fitted(p)], st, A800_METRICS)
        held = predict([p for p in pts if a800_held(p)], st, A800_METRICS)
        out.append({"routing_skew": skew,
                    "fit_rms_error_pct": float(np.sqrt(np.mean([r["error_pct"] ** 2 for r in fitted]))),
                    "experts_efficiency": st["efficiency"]["experts"], **held_out_summary(held)})
    return out


def a800_experts() -> list[dict]:
    """The A800 roofline split (sum) with the experts' efficiency pinned from outside the low
    rows: by the catalog's only class of MoE kernels on NVIDIA (``hopper-vllm-mxfp4-moe``,
    centre and sigma as published there), and held at the shipped profile's value, which the
    full table (held-out rows included) fitted: a diagnosis of where the split's error sits,
    not a prediction."""
    import yaml

    from simcap.catalog import resolve_kernel_class

    name = "hopper-vllm-mxfp4-moe"
    hopper = resolve_kernel_class(name, "kernel class")
    full = yaml.safe_load((ROOT / "calibration" / "profiles" / "a800-minimax-m3.roofline.yaml").read_text())
    full_experts = float(full["step_time"]["efficiency"]["experts"])
    trials = (("low rows alone (the recipe's prior, 1, sd 0.7)", None, None),
              (f"prior {name} ({hopper.efficiency['experts']:g}, sd {hopper.sigma:g})",
               {"value": hopper.efficiency["experts"], "sigma": hopper.sigma}, None),
              ("prior at the class's centre, sd 0.1 (a third of its spread)",
               {"value": hopper.efficiency["experts"], "sigma": 0.1}, None),
              (f"held at the full table's fit ({full_experts:.3g})", None, full_experts))
    out = []
    for label, prior, fixed in trials:
        recipe = Recipe.load(RECIPES / a800_recipe("roofline"))
        if prior:
            recipe.prior = {**recipe.prior, "terms": {**(recipe.prior.get("terms") or {}), "efficiency.experts": prior}}
        if fixed:
            recipe.form = ",".join(t for t in recipe.form.split(",") if t != "efficiency.experts")
            recipe.step_time = {**recipe.step_time,
                                "efficiency": {**recipe.step_time["efficiency"], "experts": fixed}}
        pts, st = a800_low_fit(recipe)
        held = predict([p for p in pts if a800_held(p)], st, A800_METRICS)
        out.append({"experts": label, "experts_efficiency": st["efficiency"]["experts"], **held_out_summary(held)})
    return out


def b4(variant: str, intervals: int = 0) -> dict:
    recipe = {"linear": "ascend910b4-minimax-m2.7.yaml"}.get(
        variant, "ascend910b4-minimax-m2.7.roofline.yaml")
    return run_case(recipe, variant, lambda p: p.label.startswith("long-context"),
                    lambda p: not p.label.startswith("long-context"),
                    ["output_throughput", "tpot_p95"], intervals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("a800", "910b4"))
    ap.add_argument("--rows", action="store_true",
                    help="A800 only: leave each row out in turn (fit on the others, predict it), both forms")
    ap.add_argument("--intervals", type=int, default=0, metavar="N",
                    help="bootstrap the fit N times and give each held-out figure its 90%% interval "
                         "and whether it holds the measurement (slower: N re-simulations)")
    ap.add_argument("--skew", action="store_true",
                    help="A800 only: the roofline split at each routing skew of a grid (sum and max), "
                         "and each form without the low row the other low rows predict worst")
    ap.add_argument("--experts", action="store_true",
                    help="A800 only: the roofline split with the experts' efficiency pinned from outside "
                         "its low rows (a kernel class's prior; the full table's fit)")
    args = ap.parse_args()
    out_path = HERE / "results.json"
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.experts:
        out["a800_experts"] = a800_experts()
        for r in out["a800_experts"]:
            errs = errors_line(r["held_out"])
            print(f"a800 experts {r['experts']}: fitted {r['experts_efficiency']:.2f}  held out {errs}  "
                  f"max {r['max_abs_error_pct']:.1f}%")
        out_path.write_text(json.dumps(out, indent=2) + "\n")
        return
    if args.skew:
        out["a800_routing_skew"] = {}
        for combine in ("sum", "max"):
            grid = out["a800_routing_skew"][f"roofline-{combine}"] = a800_skew_grid(combine)
            print("a800 routing skew, roofline", combine)
            for g in grid:
                errs = errors_line(g["held_out"])
                print(f"   skew {g['routing_skew']:<5} fit rms {g['fit_rms_error_pct']:.2f}%  experts "
                      f"{g['experts_efficiency']:.2f}  held out {errs}  max {g['max_abs_error_pct']:.1f}%")
        out["a800_drop_worst"] = {}
        for variant in ("linear", "roofline-sum", "roofline-max"):
            r = out["a800_drop_worst"][variant] = a800_drop_worst(variant)
            errs = errors_line(r["held_out"])
            print(f"a800 without {r['left_out']} ({variant}): held out {errs}  max {r['max_abs_error_pct']:.1f}%")
        out_path.write_text(json.dumps(out, indent=2) + "\n")
        return
    if args.rows:
        out["a800_leave_one_row_out"] = {}
        for variant, recipe in (("linear", "a800-minimax-m3.yaml"), ("roofline-sum", "a800-minimax-m3.roofline.yaml")):
            rows = leave_one_row_out(recipe, ["output_throughput", "e2e_mean"])
            out["a800_leave_one_row_out"][variant] = rows
            print("a800 leave one row out", variant)
            for row in rows:
                print(f"   {row['point']:24s} {row['metric']:18s} {row['measured']:.4g} -> "
                      f"{row['predicted']:.4g} ({row['error_pct']:+.1f}%)")
        out_path.write_text(json.dumps(out, indent=2) + "\n")
        return
    for dep, fn in (("a800", a800), ("910b4", b4)):
        if args.only and dep != args.only:
            continue
        out[dep] = {v: fn(v, args.intervals) for v in ("linear", "roofline-sum", "roofline-max")}
        for v, r in out[dep].items():
            cover = (f"  covered {r['intervals']['covered']}/{r['intervals']['held_out']}"
                     + (f" (Laplace {r['intervals']['laplace_covered']})" if "laplace_covered" in r["intervals"] else "")
                     + f" (model form {r['intervals']['model_form_covered']},"
                       f" median width {r['intervals']['model_form_median_width']:.2f})"
                     if "intervals" in r else "")
            print(dep, v, f"mean |err| {r['mean_abs_error_pct']:.1f}%  max {r['max_abs_error_pct']:.1f}%{cover}")
            for row in r["predictions"]:
                band = (f"  90% [{row['interval'][0]:.4g}, {row['interval'][1]:.4g}]"
                        f"{'' if row['covered'] else ' misses'}"
                        f"  model form [{row['model_form_interval'][0]:.4g}, {row['model_form_interval'][1]:.4g}]"
                        f"{'' if row['model_form_covered'] else ' misses'}" if "interval" in row else "")
                print(f"   {row['point']:24s} {row['metric']:18s} {row['measured']:.4g} -> "
                      f"{row['predicted']:.4g} ({row['error_pct']:+.1f}%){band}")
        out_path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
